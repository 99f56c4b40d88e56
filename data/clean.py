"""Document cleaning and exact deduplication, with counts for the dataset report."""

import hashlib
import re
import unicodedata
from dataclasses import dataclass, field

# C0/C1 control characters except tab and newline, plus DEL; terminal escape sequences first.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@dataclass
class CleanStats:
    read: int = 0
    kept: int = 0
    invalid_utf8: int = 0
    too_short: int = 0
    duplicates: int = 0
    seen: set = field(default_factory=set, repr=False)

    def as_dict(self) -> dict:
        return {"read": self.read, "kept": self.kept, "invalid_utf8": self.invalid_utf8,
                "too_short": self.too_short, "duplicates": self.duplicates,
                "duplicate_ratio": round(self.duplicates / self.read, 6) if self.read else 0.0}


def clean_text(text: str) -> str:
    """NFKC-normalise, unify newlines, drop terminal escapes and control characters."""
    text = unicodedata.normalize("NFKC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _ANSI_ESCAPE.sub("", text)
    return _CONTROL.sub("", text)


def clean_documents(raw_docs, stats: CleanStats, min_chars: int = 32):
    """Yield cleaned, deduplicated document texts from (name, bytes) pairs, counting what is dropped."""
    for _name, raw in raw_docs:
        stats.read += 1
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats.invalid_utf8 += 1
            continue
        text = clean_text(text).strip()
        if len(text) < min_chars:
            stats.too_short += 1
            continue
        digest = hashlib.sha1(text.encode("utf-8")).digest()
        if digest in stats.seen:
            stats.duplicates += 1
            continue
        stats.seen.add(digest)
        stats.kept += 1
        yield text
