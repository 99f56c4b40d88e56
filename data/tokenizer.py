"""Sentencepiece tokenizer: train one on a sample of the corpus, or load and check one."""

import hashlib
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
    cleaned text exactly (code indentation included).
    """
    if vocab_size % VOCAB_MULTIPLE:
        raise DataError(f"tokenizer vocab_size {vocab_size} is not a multiple of {VOCAB_MULTIPLE}",
                        hint=f"use {-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE}")
    lines = [line for doc in documents for line in doc.split("\n") if line.strip()]
    random.Random(seed).shuffle(lines)
    sample_path = model_prefix + ".sample.txt"
    with open(sample_path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines[:sample_lines]))
    spm.SentencePieceTrainer.train(
        input=sample_path, model_prefix=model_prefix, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, split_digits=True,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOD_ID, pad_id=PAD_ID,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, shuffle_input_sentence=False, max_sentence_length=16384,
        num_threads=2, minloglevel=2)
    return model_prefix + ".model"


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


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
