"""Sentencepiece tokenizer: train one on a sample of the corpus, or load and check one."""

import hashlib
import io
import os
import random

import sentencepiece as spm

from training.errors import DataError

# Llama's layout for the first ids, plus a dedicated padding id that is never a real token.
UNK_ID, BOS_ID, EOD_ID, PAD_ID = 0, 1, 2, 3
VOCAB_MULTIPLE = 16


def train_tokenizer(documents: list, vocab_size: int, model_prefix: str, sample_lines: int = 200_000,
                    seed: int = 0) -> str:
    """Train a byte-fallback BPE model on a deterministic sample of lines; returns the .model path.

    Normalisation is off and whitespace is kept as-is so that decoding gives back the
    cleaned text exactly (code indentation included). Character coverage 0.9995 is
    sentencepiece's setting for CJK-sized alphabets; byte fallback spells out the rarest
    characters as UTF-8 bytes, so no text ever becomes <unk>. Training reads from memory
    and writes to memory, so the model records no scratch paths: the same documents give
    a byte-identical model wherever it is built.
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
        raise DataError(f"tokenizer training failed: {str(err).splitlines()[0]}",
                        hint="a byte-fallback vocabulary needs the 256 bytes plus the corpus' frequent characters: "
                             "raise --vocab-size (or pass a trained --tokenizer)") from None
    path = model_prefix + ".model"
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


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
