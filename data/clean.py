"""Document cleaning and exact deduplication, with counts for the dataset report.

`clean_document` is the one per-document rule (decode, normalise, strip control
characters and terminal escapes, length filters); the parallel pipeline runs it in its
worker processes and `clean_documents` is the same rule as a simple sequential generator.
"""

import hashlib
import re
import unicodedata
from dataclasses import dataclass, field

# C0/C1 control characters except tab and newline, plus DEL; terminal escape sequences first.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")

NORMALIZATIONS = ("NFKC", "NFC", "none")
INVALID_UTF8_POLICIES = ("drop", "replace")

# What happened to one raw document (worker processes report these per document).
KEPT, INVALID_UTF8, TOO_SHORT, TOO_LONG = 0, 1, 2, 3


@dataclass(frozen=True)
class CleanOptions:
    normalization: str = "NFKC"   # one of NORMALIZATIONS
    min_chars: int = 32
    max_chars: int = 0            # 0 = no upper limit
    invalid_utf8: str = "drop"    # drop the document, or "replace" bad bytes with U+FFFD and keep it


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


def clean_text(text: str, normalization: str = "NFKC") -> str:
    """Normalise (NFKC by default), unify newlines, drop terminal escapes and control characters."""
    if normalization != "none" and not unicodedata.is_normalized(normalization, text):
        text = unicodedata.normalize(normalization, text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _ANSI_ESCAPE.sub("", text)
    return _CONTROL.sub("", text)


def decode_utf8(raw: bytes, policy: str = "drop") -> tuple:
    """(text or None, line of the first invalid byte or 0); with policy "replace" the text is always returned."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        return (raw.decode("utf-8", errors="replace") if policy == "replace" else None), line


def clean_document(text: str, options: CleanOptions) -> tuple:
    """(status, cleaned text) for one decoded document: KEPT, TOO_SHORT or TOO_LONG."""
    text = clean_text(text, options.normalization).strip()
    if len(text) < options.min_chars:
        return TOO_SHORT, text
    if options.max_chars and len(text) > options.max_chars:
        return TOO_LONG, text
    return KEPT, text


def doc_digest(text: str) -> int:
    """64-bit hash of a cleaned document: the exact-duplicate key and the validation-split coin."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def clean_documents(raw_docs, stats: CleanStats, min_chars: int = 32, options: CleanOptions = None):
    """Yield cleaned, deduplicated document texts from (name, bytes) pairs, counting what is dropped."""
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
