"""Tokenizers: train a sentencepiece model on a sample of the corpus, or load the user's own.

A user's tokenizer is a sentencepiece `.model` with any special-id layout (Llama 2 and
Mistral have no pad id) or a HuggingFace `tokenizer.json` (Llama 3, Qwen2: byte-level BPE),
given as the file or as the HF model directory that holds it. Documents are separated by
the tokenizer's own end-of-text token. Without a pad token, padding is written as NO_PAD
(-1): never a real token id, and masked from the loss by the model (models/llama.py).
"""

import io
import json
import os
import random
import re
from dataclasses import dataclass

import sentencepiece as spm

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.common.files import file_sha256
from ascend_llm_recipes.models.arithmetic import ALIGN, round_up

# Llama's layout for the first ids, plus a dedicated padding id that is never a real token (trained models).
UNK_ID, BOS_ID, EOD_ID, PAD_ID = 0, 1, 2, 3
NO_PAD = -1  # the padding id when the tokenizer has none: outside every vocabulary, so no real label is masked
SENTENCEPIECE, HF = "sentencepiece", "hf"
FILES = {SENTENCEPIECE: "tokenizer.model", HF: "tokenizer.json"}  # the name each kind is stored under
# HF tokenizers name their special tokens in tokenizer_config.json (absent beside a bare tokenizer.json):
# these are the pretraining end-of-text / beginning / unknown tokens of the families we convert.
END_OF_TEXT = ("</s>", "<|end_of_text|>", "<|endoftext|>")
BEGIN_OF_TEXT = ("<s>", "<|begin_of_text|>")
UNKNOWN = ("<unk>",)
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
    if vocab_size % ALIGN:
        raise DataError(f"tokenizer vocab_size {vocab_size} is not a multiple of {ALIGN}",
                        hint=f"use {round_up(vocab_size, ALIGN)}")
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
        fit = limit // ALIGN * ALIGN
        return DataError(f"{where}: the text holds enough distinct pieces for at most {limit}",
                         hint=f"lower --vocab-size to at most {fit}, give more text, or pass a trained --tokenizer")
    too_low = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", reason)
    if too_low:
        needed = int(too_low.group(1))
        return DataError(f"{where}: sentencepiece needs {needed} pieces for its special and byte pieces and every "
                         "character it must cover (CJK text has thousands)",
                         hint=f"raise --vocab-size to at least {round_up(needed, ALIGN)}, or "
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


@dataclass
class Tokenizer:
    """A loaded tokenizer of either kind, with the special ids the packed data uses (-1: absent)."""

    kind: str
    path: str
    vocab_size: int  # highest id + 1 (added tokens included)
    unk_id: int
    bos_id: int
    eod_id: int
    pad_id: int
    eod_token: str
    engine: object  # spm.SentencePieceProcessor or tokenizers.Tokenizer

    @property
    def file(self) -> str:
        return FILES[self.kind]

    def encode_batch(self, texts: list, threads: int = 1) -> list:
        """Token ids of each text, without BOS/EOS (the packer adds the EOD)."""
        if self.kind == HF:
            return [e.ids for e in self.engine.encode_batch(texts, add_special_tokens=False)]
        return self.engine.encode(texts, num_threads=threads)

    def decode(self, ids: list) -> str:
        if self.kind == HF:
            return self.engine.decode(ids, skip_special_tokens=False)
        return self.engine.decode(ids)

    def describe(self) -> dict:
        """The manifest's tokenizer entry (without the file name it is stored under)."""
        padding = ("its pad token" if self.pad_id != NO_PAD else
                   f"{NO_PAD}: the tokenizer has no pad token; the model masks these labels from the loss")
        entry = {"kind": self.kind, "sha256": file_sha256(self.path), "vocab_size": self.vocab_size,
                 "unk_id": self.unk_id, "bos_id": self.bos_id, "eod_id": self.eod_id, "eod_token": self.eod_token,
                 "pad_id": self.pad_id, "padding": padding}
        if self.vocab_size % ALIGN:
            entry["vocab_note"] = (f"{self.vocab_size} is not a multiple of {ALIGN}: the model pads its "
                                   "embedding and output tables (model.model_config.vocab_pad_multiple)")
        return entry


def resolve_tokenizer(path: str) -> str:
    """The tokenizer file a --tokenizer argument names: the file, or tokenizer.json / tokenizer.model in a directory.

    An HF model directory often holds both (Llama 2): tokenizer.json is the one transformers loads.
    """
    if not os.path.isdir(path):
        if not os.path.isfile(path):
            raise DataError(f"tokenizer {path} does not exist",
                            hint="pass a sentencepiece .model, a tokenizer.json, or the HF model directory holding it")
        return path
    for name in (FILES[HF], FILES[SENTENCEPIECE]):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise DataError(f"tokenizer {path}: the directory holds neither tokenizer.json nor tokenizer.model",
                    hint="pass the tokenizer file itself, or the HF model directory (or a conversion of it by "
                         "scripts/convert_checkpoint.py --from-hf, which copies its tokenizer files)")


def tokenizer_kind(path: str) -> str:
    return HF if path.endswith(".json") else SENTENCEPIECE


def load_tokenizer(path: str, special_ids: dict = None) -> Tokenizer:
    """Load a sentencepiece .model or an HF tokenizer.json (or the directory holding one).

    `special_ids` (a manifest's tokenizer entry) overrides what is read from the file: a
    dataset's copy of a tokenizer.json has no tokenizer_config.json beside it.
    """
    path = resolve_tokenizer(path)
    tok = _load_hf(path) if tokenizer_kind(path) == HF else _load_sentencepiece(path)
    if special_ids:
        for name in ("unk_id", "bos_id", "eod_id", "pad_id"):
            if name in special_ids:
                setattr(tok, name, special_ids[name])
    if tok.eod_id < 0:
        raise DataError(f"tokenizer {path}: has no end-of-text token to separate documents with "
                        f"(looked for {', '.join(END_OF_TEXT)} and the eos token of tokenizer_config.json)",
                        hint="use a tokenizer that defines one (the model's own tokenizer does)")
    return tok


def _load_sentencepiece(path: str) -> Tokenizer:
    try:
        sp = spm.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as err:
        raise DataError(f"tokenizer {path}: cannot be loaded as a sentencepiece model ({err})",
                        hint="pass a sentencepiece .model or an HF tokenizer.json") from None
    eod, pad = sp.eos_id(), sp.pad_id()
    if pad >= 0 and (pad in (sp.unk_id(), sp.bos_id(), eod) or not sp.is_control(pad)):
        pad = NO_PAD  # a pad id shared with another special or a text piece would mask real labels
    return Tokenizer(SENTENCEPIECE, path, sp.get_piece_size(), sp.unk_id(), sp.bos_id(), eod, pad,
                     sp.id_to_piece(eod) if eod >= 0 else "", sp)


def _load_hf(path: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        engine = HFTokenizer.from_file(path)
    except Exception as err:  # tokenizers raises a bare Exception for unreadable or malformed files
        raise DataError(f"tokenizer {path}: cannot be loaded as an HF tokenizer.json ({err})",
                        hint="pass the tokenizer.json of an HF model (or its directory), or a sentencepiece .model"
                        ) from None
    # Special tokens written in a document ("</s>" in code or markup) are text, as sentencepiece encodes them:
    # parsed as tokens they would end documents (and reset attention) in the middle of one.
    engine.encode_special_tokens = True
    vocab = engine.get_vocab(with_added_tokens=True)
    configured = _configured_tokens(os.path.dirname(path))

    def special(names: tuple, key: str) -> int:
        for name in names + ((configured[key],) if configured.get(key) else ()):
            if name in vocab:
                return vocab[name]
        return -1

    eod = special(END_OF_TEXT, "eos_token")
    # Padding is never borrowed from the vocabulary: an HF pad token is often the end-of-text token itself
    # (Qwen2), and masking it would drop every real document end from the loss.
    return Tokenizer(HF, path, max(vocab.values()) + 1, special(UNKNOWN, "unk_token"),
                     special(BEGIN_OF_TEXT, "bos_token"), eod, NO_PAD, engine.id_to_token(eod) if eod >= 0 else "",
                     engine)


def _configured_tokens(directory: str) -> dict:
    """{eos_token, bos_token, unk_token: str} from an HF directory's tokenizer_config.json, if there is one."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    tokens = {}
    for key in ("eos_token", "bos_token", "unk_token"):
        value = config.get(key)
        tokens[key] = value.get("content") if isinstance(value, dict) else value
    return tokens


def check_vocab_size(path: str, vocab_size: int, model_vocab_size: int = 0, model_key: str = "") -> None:
    """A user's tokenizer must fit the model's embedding table (when one is named); any size is accepted."""
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
