"""Document cleaning and exact deduplication, with counts for the dataset report.

`clean_document` is the one per-document rule (decode, normalise, strip control
characters and terminal escapes, length filters); the parallel pipeline runs it in its
worker processes (tests/oracles.py applies it sequentially, as the tests' reference).

Normalisation defaults to NFC, which only composes characters and so keeps CJK text as
written; NFKC (opt-in) also folds compatibility forms, e.g. the full-width "，" and "："
that Chinese text uses into ASCII "," and ":". Length limits count a CJK character (Han,
kana, Hangul, full-width forms and CJK punctuation) as CJK_WEIGHT characters: a Chinese
translation of an English text has about a third of its characters, so `--min-chars 32`
keeps a Chinese sentence of 11 characters as it keeps an English one of 32.
"""

import hashlib
import re
import unicodedata
from dataclasses import dataclass

# C0/C1 control characters except tab and newline, plus DEL; terminal escape sequences first.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")

NORMALIZATIONS = ("NFC", "NFKC", "none")
CJK_WEIGHT = 3
# Hangul Jamo, CJK radicals to CJK symbols and punctuation, kana to CJK compatibility, extension A,
# unified ideographs, Yi, Hangul syllables, compatibility ideographs, vertical forms, full-width forms,
# ideographs of planes 2 and 3.
_CJK = re.compile("[\u1100-\u115f\u2e80-\u303e\u3041-\u33ff\u3400-\u4dbf\u4e00-\u9fff\ua000-\ua4cf"
                  "\uac00-\ud7a3\uf900-\ufaff\ufe30-\ufe4f\uff00-\uff60\uffe0-\uffe6"
                  "\U00020000-\U0002fffd\U00030000-\U0003fffd]")
INVALID_UTF8_POLICIES = ("drop", "replace")

# What happened to one raw document (worker processes report these per document).
KEPT, INVALID_UTF8, TOO_SHORT, TOO_LONG = 0, 1, 2, 3


@dataclass(frozen=True)
class CleanOptions:
    normalization: str = "NFC"    # one of NORMALIZATIONS
    min_chars: int = 32           # in text_length units (a CJK character counts CJK_WEIGHT)
    max_chars: int = 0            # 0 = no upper limit
    invalid_utf8: str = "drop"    # drop the document, or "replace" bad bytes with U+FFFD and keep it


def clean_text(text: str, normalization: str = "NFC") -> str:
    """Normalise (NFC by default), unify newlines, drop terminal escapes and control characters."""
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
    # text_length >= len: count the CJK characters only when the plain length does not decide.
    if len(text) < options.min_chars and text_length(text) < options.min_chars:
        return TOO_SHORT, text
    limit = options.max_chars
    if limit and (len(text) > limit or (CJK_WEIGHT * len(text) > limit and text_length(text) > limit)):
        return TOO_LONG, text
    return KEPT, text


def text_length(text: str) -> int:
    """The length the --min-chars/--max-chars limits compare: characters, a CJK one counting CJK_WEIGHT."""
    return len(text) + (CJK_WEIGHT - 1) * sum(1 for _ in _CJK.finditer(text))


def doc_digest(text: str) -> int:
    """64-bit hash of a cleaned document: the exact-duplicate key and the validation-split coin."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
