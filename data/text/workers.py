"""The per-document work, run in worker processes: parse, decode, clean, hash, tokenize.

A worker receives a chunk's pieces (data/text/corpus.py) and returns compact numpy arrays:
one status per raw document (for counts and the first offending file:line), then, for
the documents that passed the filters, their digests and their tokens with EOD appended.
Deduplication, the validation split and packing need the whole stream in order, so they
happen in the main process. This module never imports MindSpore (workers are spawned).
"""

import ctypes
import itertools
import json
import os
import signal
from array import array
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ascend_llm_recipes.data.text.clean import (INVALID_UTF8, KEPT, TOO_LONG, TOO_SHORT, CleanOptions, clean_document,
                                                decode_utf8, doc_digest)
from ascend_llm_recipes.data.text.dedup import BANDS, band_keys, shingle_hashes, shingle_set
from ascend_llm_recipes.data.tokenizer import (ENCODE_PIECE_CHARS, HF, continuation_processor, encode_long,
                                               tokenizer_kind)

# Statuses beyond data.text.clean's: problems with the input itself rather than its text.
MALFORMED_JSON, MISSING_FIELD = 4, 5
STATUS_NAMES = {INVALID_UTF8: "invalid_utf8", TOO_SHORT: "too_short", TOO_LONG: "too_long",
                MALFORMED_JSON: "malformed_json", MISSING_FIELD: "missing_field"}
BAD_STATUSES = (INVALID_UTF8, MALFORMED_JSON, MISSING_FIELD)  # bad input: reported, and --strict stops
ENCODE_BATCH = 64  # documents per tokenizer call


@dataclass(frozen=True)
class WorkerConfig:
    clean: CleanOptions
    text_field: str = "text"
    tokenizer_path: Optional[str] = None  # None: clean and hash only (the tokenizer-sample pass)
    eod_id: int = 2
    near_dedup: bool = False
    sample_below: int = 0                 # sample pass: return the text of documents whose digest is below this
    threads: int = 1                      # tokenizer threads (inline mode uses every core)


@dataclass
class ChunkResult:
    status: np.ndarray          # uint8 per raw document
    file: np.ndarray            # int32 per raw document
    line: np.ndarray            # int64 per raw document (for a whole-file document: the line of its problem)
    detail: dict                # status -> what was wrong with the first such document of the chunk
    replaced: np.ndarray        # bool per raw document: kept after replacing invalid UTF-8
    digest: np.ndarray          # uint64 per KEPT document
    lengths: np.ndarray = None  # int64 per KEPT document: tokens including the EOD
    tokens: np.ndarray = None   # int32: the KEPT documents' tokens, each followed by EOD
    bands: np.ndarray = None    # uint64 (KEPT, BANDS) when near_dedup
    shingles: np.ndarray = None  # uint32: each KEPT document's 5-gram set (data.text.dedup.shingle_set), concatenated
    shingle_counts: np.ndarray = None  # int64 per KEPT document
    texts: list = field(default_factory=list)   # sample pass: (kept index, digest, text) below sample_below


_config: Optional[WorkerConfig] = None
_sp = None
_sp_continue = None  # the model without its dummy prefix: encodes the later pieces of a long document
_hf = None           # an HF tokenizers.Tokenizer instead of _sp


def pin_mmap_threshold() -> None:
    """Stop glibc from raising its mmap threshold each time a large buffer is freed (its default).

    Otherwise, after the first few chunks, MB-sized buffers come from the heap and fragment
    it, and resident memory creeps up with corpus size; pinned at glibc's initial 128 KB,
    freed buffers go back to the OS and memory stays flat however long the run.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to pin
    libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD


def init_worker(config: WorkerConfig) -> None:
    """Pool initializer (and inline setup): remember the options, load the tokenizer once."""
    global _config, _sp, _sp_continue, _hf
    pin_mmap_threshold()
    _config = config
    _sp = _sp_continue = _hf = None
    if config.tokenizer_path and tokenizer_kind(config.tokenizer_path) == HF:
        # tokenizers sizes its thread pool once, from this variable, at the first batch it encodes.
        os.environ["RAYON_NUM_THREADS"] = str(config.threads)
        from tokenizers import Tokenizer
        _hf = Tokenizer.from_file(config.tokenizer_path)
        _hf.encode_special_tokens = True  # a literal "</s>" in a document is text, not a document end
    elif config.tokenizer_path:
        import sentencepiece as spm
        _sp = spm.SentencePieceProcessor(model_file=config.tokenizer_path)
        _sp_continue = continuation_processor(_sp)


def init_pool_worker(config: WorkerConfig) -> None:
    """Pool initializer: Ctrl-C reaches the whole process group; only the main process answers it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init_worker(config)


def process_chunk(pieces: list) -> ChunkResult:
    """Everything per-document for one chunk, in document order."""
    config = _config
    status, files, lines, replaced, detail, texts = array("B"), array("i"), array("q"), array("B"), {}, []
    for piece in pieces:
        for line, doc_status, text, problem, was_replaced in _documents(piece, config):
            status.append(doc_status)
            files.append(piece.file)
            lines.append(line)
            replaced.append(was_replaced)
            if doc_status == KEPT:
                texts.append(text)
            elif doc_status not in detail:
                detail[doc_status] = problem
    digests = np.fromiter((doc_digest(t) for t in texts), dtype=np.uint64, count=len(texts))
    result = ChunkResult(np.frombuffer(status, np.uint8), np.frombuffer(files, np.int32),
                         np.frombuffer(lines, np.int64), detail, np.frombuffer(replaced, np.uint8).astype(bool),
                         digests)
    if _sp is None and _hf is None:
        result.texts = [(i, d, t) for i, (d, t) in enumerate(zip(digests.tolist(), texts)) if d < config.sample_below]
        return result
    if config.near_dedup:
        bands, sets = [], []
        for text in texts:
            hashes = shingle_hashes(text)
            bands.append(band_keys(text, hashes))
            sets.append(shingle_set(hashes))
        result.bands = np.array(bands, dtype=np.uint64).reshape(len(texts), BANDS)
        result.shingle_counts = np.array([len(s) for s in sets], np.int64)
        result.shingles = np.concatenate(sets) if sets else np.zeros(0, np.uint32)
    tokens, lengths = array("i"), array("q")
    for batch in _batches(texts):  # batches keep the Python lists of ids small
        if _hf is not None:  # long documents go whole: the piecewise path is sentencepiece's
            ids = [e.ids for e in _hf.encode_batch(batch, add_special_tokens=False)]
            for doc in ids:
                doc.append(config.eod_id)
                lengths.append(len(doc))
            tokens.extend(itertools.chain.from_iterable(ids))
            continue
        if len(batch) == 1 and len(batch[0]) > ENCODE_PIECE_CHARS:
            before = len(tokens)
            for ids in encode_long(_sp, _sp_continue, batch[0]):
                tokens.extend(ids)
            tokens.append(config.eod_id)
            lengths.append(len(tokens) - before)
            continue
        ids = _sp.encode(batch, num_threads=config.threads)
        for doc in ids:
            doc.append(config.eod_id)
            lengths.append(len(doc))
        tokens.extend(itertools.chain.from_iterable(ids))
    result.lengths = np.frombuffer(lengths, dtype=np.int64)
    result.tokens = np.frombuffer(tokens, dtype=np.int32)
    return result


def _batches(texts: list):
    """Up to ENCODE_BATCH documents and about ENCODE_PIECE_CHARS characters at a time; a longer document alone."""
    batch, chars = [], 0
    for text in texts:
        if batch and (len(batch) == ENCODE_BATCH or chars + len(text) > ENCODE_PIECE_CHARS):
            yield batch
            batch, chars = [], 0
        batch.append(text)
        chars += len(text)
    if batch:
        yield batch


def _documents(piece, config: WorkerConfig):
    """Yield (line, status, cleaned text, problem, invalid UTF-8 replaced) for each raw document of a piece."""
    if piece.kind == "file":
        yield _text_document(piece.data, 1, config)
    elif piece.kind == "rows":
        for row, value in enumerate(piece.data, start=piece.line):
            if isinstance(value, str):
                yield (row,) + _cleaned(value, config, False)
            else:
                yield row, MISSING_FIELD, "", f"row has no {config.text_field!r} value", False
    else:
        parse = _json_document if piece.kind == "jsonl" else _text_document
        for line, raw in enumerate(piece.data.split(b"\n"), start=piece.line):
            raw = raw.rstrip(b"\r")
            if raw.strip():  # blank lines separate nothing and are not documents
                yield parse(raw, line, config)


def _text_document(raw: bytes, line: int, config: WorkerConfig) -> tuple:
    text, bad_line = decode_utf8(raw, config.clean.invalid_utf8)
    if text is None:
        return line + bad_line - 1, INVALID_UTF8, "", "invalid UTF-8", False
    return (line,) + _cleaned(text, config, bool(bad_line))


def _json_document(raw: bytes, line: int, config: WorkerConfig) -> tuple:
    text, bad_line = decode_utf8(raw, config.clean.invalid_utf8)
    if text is None:
        return line, INVALID_UTF8, "", "invalid UTF-8", False
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        return line, MALFORMED_JSON, "", f"malformed JSON ({err.msg} at column {err.colno})", False
    value = obj.get(config.text_field) if isinstance(obj, dict) else None
    if not isinstance(value, str):
        if not isinstance(obj, dict):
            problem = "the line is not a JSON object"
        elif config.text_field not in obj:
            problem = f"no {config.text_field!r} field (fields: {', '.join(list(obj)[:8])})"
        else:
            problem = f"field {config.text_field!r} is {type(value).__name__}, not a string"
        return line, MISSING_FIELD, "", problem, False
    return (line,) + _cleaned(value, config, bool(bad_line))


def _cleaned(text: str, config: WorkerConfig, replaced: bool) -> tuple:
    status, text = clean_document(text, config.clean)
    return status, text, STATUS_NAMES.get(status, ""), replaced and status == KEPT


def default_workers(total_bytes: int) -> int:
    """Worker processes for a corpus: none (inline) below 8 MB, where starting them costs more than they save."""
    return 0 if total_bytes < 8 << 20 else (os.cpu_count() or 1)
