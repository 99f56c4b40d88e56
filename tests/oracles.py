"""Sequential reference versions of what the data pipeline does in parallel: test oracles, not product code."""

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ascend_llm_recipes.data.text.clean import (TOO_LONG, TOO_SHORT, CleanOptions, clean_document, decode_utf8,
                                                doc_digest)
from ascend_llm_recipes.data.packing import PackStats, StreamPacker


@dataclass
class CleanStats:
    read: int = 0
    kept: int = 0
    invalid_utf8: int = 0
    too_short: int = 0
    too_long: int = 0
    duplicates: int = 0
    near_duplicates: int = 0
    seen: set = field(default_factory=set, repr=False)

    def as_dict(self) -> dict:
        return {"read": self.read, "kept": self.kept, "invalid_utf8": self.invalid_utf8,
                "too_short": self.too_short, "too_long": self.too_long, "duplicates": self.duplicates,
                "near_duplicates": self.near_duplicates,
                "duplicate_ratio": round((self.duplicates + self.near_duplicates) / self.read, 6) if self.read else 0.0}


def read_documents(paths):
    """Yield (path, bytes) for each file: one file is one document; decoding is cleaning's job."""
    for path in paths:
        yield str(path), Path(path).read_bytes()


def clean_documents(raw_docs, stats: CleanStats, min_chars: int = 32, options: CleanOptions = None):
    """Yield cleaned, exactly deduplicated texts from (name, bytes) pairs: the pipeline's per-document rule in order."""
    options = options or CleanOptions(min_chars=min_chars)
    for _name, raw in raw_docs:
        stats.read += 1
        text, bad_line = decode_utf8(raw, options.invalid_utf8)
        if bad_line:
            stats.invalid_utf8 += 1
            if text is None:
                continue
        status, text = clean_document(text, options)
        if status == TOO_SHORT:
            stats.too_short += 1
            continue
        if status == TOO_LONG:
            stats.too_long += 1
            continue
        digest = doc_digest(text)
        if digest in stats.seen:
            stats.duplicates += 1
            continue
        stats.seen.add(digest)
        stats.kept += 1
        yield text


def pack_documents(token_docs, seq_length: int, eod_id: int, pad_id: int, stats: PackStats):
    """Yield int32 arrays of seq_length + 1 tokens from an iterable of token-id lists (stream packing)."""
    packer = StreamPacker(seq_length, pad_id)
    for ids in token_docs:
        doc = np.asarray(list(ids) + [eod_id], np.int32)
        yield from packer.add(doc, np.array([len(doc)]))
    yield from packer.finish()
    for name, value in packer.stats.as_dict().items():
        setattr(stats, name, value)
