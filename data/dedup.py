"""Exact and near-duplicate detection across all inputs.

Exact: a 64-bit hash of each cleaned document (`data.clean.doc_digest`); the first copy
is kept. Near: MinHash over character 5-grams of the lower-cased, whitespace-collapsed
text, with locality-sensitive hashing in 14 bands of 8 rows. Two documents collide in a
band with probability ~J^8 (J = Jaccard similarity of their 5-gram sets), so a document is
dropped with probability 1 - (1 - J^8)^14: ~50% at J = 0.70, 92% at 0.80, >99.9% at 0.90.
Character n-grams work the same for code, English and CJK text (no word splitting).

Both indexes keep one integer per key in memory (~60 bytes each; near-dup stores 14 keys
per kept document) and append every new key to a file, so an interrupted run restores
them exactly (see data/pipeline.py).
"""

import os
import re

import numpy as np

SHINGLE = 5
BANDS, ROWS = 14, 8
_WHITESPACE = re.compile(r"\s+")
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_PERM_A = (np.random.default_rng(20240917).integers(1, 2**63, size=BANDS * ROWS, dtype=np.uint64)
           | np.uint64(1))  # odd multipliers
_PERM_B = np.random.default_rng(20240918).integers(0, 2**63, size=BANDS * ROWS, dtype=np.uint64)
_COLUMNS = 4096  # shingles per step: bounds the (permutations x shingles) temporary to ~3.5 MB


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: spreads the bits of a uint64 array (wrapping arithmetic is intended)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shingle_hashes(text: str) -> np.ndarray:
    """Distinct 64-bit hashes of the text's character 5-grams (after lower-casing and collapsing spaces)."""
    norm = _WHITESPACE.sub(" ", text.lower()).strip()
    codes = np.frombuffer(norm.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    if len(codes) < SHINGLE:
        codes = np.concatenate([codes, np.zeros(SHINGLE - len(codes), np.uint64)])
    count = len(codes) - SHINGLE + 1
    h = codes[:count].copy()
    with np.errstate(over="ignore"):
        for k in range(1, SHINGLE):
            h = h * np.uint64(0x100000001B3) + codes[k:k + count]
        return np.unique(_mix64(h))


def band_keys(text: str) -> np.ndarray:
    """The document's 14 LSH band keys (uint64); equal keys in any band mark a near-duplicate candidate."""
    shingles = shingle_hashes(text)
    signature = np.full(BANDS * ROWS, np.iinfo(np.uint64).max, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for start in range(0, len(shingles), _COLUMNS):
            block = shingles[None, start:start + _COLUMNS]
            values = (_PERM_A[:, None] * block + _PERM_B[:, None]) >> np.uint64(32)
            np.minimum(signature, values.min(axis=1), out=signature)
        rows = signature.reshape(BANDS, ROWS)
        keys = np.arange(BANDS, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        for r in range(ROWS):
            keys = _mix64(keys ^ rows[:, r])
    return keys


class KeyIndex:
    """A set of uint64 keys mirrored to an append-only file, so it can be restored to any earlier size."""

    def __init__(self, path: str, restore_count: int = 0):
        self.path = path
        self.keys: set = set()
        if restore_count:
            restored = np.fromfile(path, dtype=np.uint64, count=restore_count)
            if len(restored) != restore_count:
                raise OSError(f"{path}: holds {len(restored)} keys, expected {restore_count}")
            self.keys.update(restored.tolist())
        with open(path, "ab") as f:
            f.truncate(restore_count * 8)
        self.count = restore_count
        self._file = open(path, "ab")

    def __contains__(self, key: int) -> bool:
        return key in self.keys

    def add_many(self, keys: np.ndarray) -> None:
        self.keys.update(keys.tolist())
        self._file.write(np.ascontiguousarray(keys, dtype=np.uint64).tobytes())
        self.count += len(keys)

    def sync(self) -> None:
        """Make every key added so far durable (called before a snapshot refers to `count`)."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()
