"""Sentencepiece tokenizer: train one on a sample of the corpus, or load and check one."""

import hashlib
import io
import os
import random
import re

import sentencepiece as spm

from training.errors import DataError

# Llama's layout for the first ids, plus a dedicated padding id that is never a real token.
UNK_ID, BOS_ID, EOD_ID, PAD_ID = 0, 1, 2, 3
VOCAB_MULTIPLE = 16
# A document longer than this is encoded piece by piece: sentencepiece needs ~45 bytes per character
# of its input (a 50 MB line took 2.4 GB), so memory is bounded by the piece, not by the document.
ENCODE_PIECE_CHARS = 1 << 18
_WORD_START = " \u2581"  # sentencepiece's whitespace (a space, or its escape U+2581 written as text)


def train_tokenizer(documents: list, vocab_size: int, model_prefix: str, sample_lines: int = 200_000,
                    seed: int = 0, corpus: str = "the corpus") -> str:
    """Train a byte-fallback BPE model on a deterministic sample of lines; returns the .model path.

    Normalisation is off and whitespace is kept as-is so that decoding gives back the
    cleaned text exactly (code indentation included). Character coverage 0.9995 is
    sentencepiece's setting for CJK-sized alphabets; byte fallback spells out the rarest
    characters as UTF-8 bytes, so no text ever becomes <unk>. Training reads from memory
    and writes to memory, so the model records no scratch paths: the same documents give
    a byte-identical model wherever it is built. `corpus` names the user's input in messages.
    """
    if vocab_size % VOCAB_MULTIPLE:
        raise DataError(f"tokenizer vocab_size {vocab_size} is not a multiple of {VOCAB_MULTIPLE}",
                        hint=f"use {-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE}")
    lines = [line for doc in documents for line in doc.split("\n") if line.strip()]
    random.Random(seed).shuffle(lines)
    model = io.BytesIO()
    try:
        _train(lines[:sample_lines], vocab_size, model)
    except RuntimeError as err:  # sentencepiece reports bad settings for this corpus as RuntimeError
        raise _training_error(str(err), vocab_size, len(documents), corpus) from None
    path = model_prefix + ".model"
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


def _training_error(reason: str, vocab_size: int, documents: int, corpus: str) -> DataError:
    """sentencepiece's complaint about --vocab-size, turned into the value to use."""
    where = f"a tokenizer of {vocab_size} pieces cannot be trained on {corpus} ({documents} documents)"
    too_high = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", reason)
    if too_high:
        limit = int(too_high.group(1))
        fit = limit // VOCAB_MULTIPLE * VOCAB_MULTIPLE
        return DataError(f"{where}: the text holds enough distinct pieces for at most {limit}",
                         hint=f"lower --vocab-size to at most {fit}, give more text, or pass a trained --tokenizer")
    too_low = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", reason)
    if too_low:
        needed = int(too_low.group(1))
        return DataError(f"{where}: sentencepiece needs {needed} pieces for its special and byte pieces and every "
                         "character it must cover (CJK text has thousands)",
                         hint=f"raise --vocab-size to at least {-(-needed // VOCAB_MULTIPLE) * VOCAB_MULTIPLE}, or "
                              "pass a trained --tokenizer")
    return DataError(f"{where}: {reason.splitlines()[0]}", hint="change --vocab-size, or pass a trained --tokenizer")


def _train(lines: list, vocab_size: int, model: io.BytesIO) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, split_digits=True,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOD_ID, pad_id=PAD_ID,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, shuffle_input_sentence=False, max_sentence_length=16384,
        num_threads=os.cpu_count() or 1, minloglevel=2)


def load_tokenizer(path: str) -> spm.SentencePieceProcessor:
    """Load a .model and insist on the special ids the packed data relies on."""
    try:
        sp = spm.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as err:
        raise DataError(f"tokenizer {path}: cannot be loaded ({err})") from None
    found = {"unk": sp.unk_id(), "bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id()}
    wanted = {"unk": UNK_ID, "bos": BOS_ID, "eos": EOD_ID, "pad": PAD_ID}
    if found != wanted:
        raise DataError(f"tokenizer {path}: special ids {found} differ from the expected {wanted}",
                        hint="train it with data.tokenizer.train_tokenizer, or one with the same special ids")
    return sp


def check_vocab_size(path: str, vocab_size: int, model_vocab_size: int = 0, model_key: str = "") -> None:
    """A tokenizer's vocabulary must be 16-aligned and fit the model's embedding table (when one is named)."""
    if vocab_size % VOCAB_MULTIPLE:
        raise DataError(f"tokenizer {path}: vocabulary of {vocab_size} is not a multiple of {VOCAB_MULTIPLE} "
                        "(embedding and output matmuls would be padded on Ascend)",
                        hint=f"train one with --vocab-size {-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE}")
    if model_vocab_size and vocab_size > model_vocab_size:
        raise DataError(f"tokenizer {path}: vocabulary of {vocab_size} does not fit {model_key} "
                        f"{model_vocab_size}: token ids up to {vocab_size - 1} would index past the embedding table",
                        hint=f"use a tokenizer of at most {model_vocab_size} pieces (--vocab-size "
                             f"{model_vocab_size}), or raise {model_key}")


def continuation_processor(sp: spm.SentencePieceProcessor) -> spm.SentencePieceProcessor:
    """The same model without the dummy prefix, to encode text that continues a document."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    proto.normalizer_spec.add_dummy_prefix = False
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def encode_long(sp: spm.SentencePieceProcessor, continuation: spm.SentencePieceProcessor, text: str,
                piece_chars: int = ENCODE_PIECE_CHARS):
    """Yield the token ids of `text`, encoded in pieces of at most `piece_chars` characters.

    Pieces are cut before a space that follows a non-space: there a new sentencepiece word
    begins (our models split by whitespace), and no piece spans two words, so the ids are
    those of encoding the whole text. A stretch of `piece_chars` without such a space (e.g.
    unspaced CJK text) is cut where it ends; only the tokens at that cut may differ.
    """
    start, processor = 0, sp
    while start < len(text):
        end = min(start + piece_chars, len(text))
        if end < len(text):
            end = _word_start(text, start, end) or end
        yield processor.encode(text[start:end])
        start, processor = end, continuation


def _word_start(text: str, start: int, end: int) -> int:
    """The last position in (start, end] where a sentencepiece word begins, or 0."""
    pos = end + 1
    while True:
        pos = max(text.rfind(" ", start + 1, pos), text.rfind("\u2581", start + 1, pos))
        if pos < 0:
            return 0
        if text[pos - 1] not in _WORD_START:
            return pos


def describe(sp: spm.SentencePieceProcessor, path: str) -> dict:
    """The manifest's tokenizer entry (without the file name it is stored under)."""
    return {"sha256": file_sha256(path), "vocab_size": sp.get_piece_size(), "unk_id": UNK_ID, "bos_id": BOS_ID,
            "eod_id": EOD_ID, "pad_id": PAD_ID}


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
