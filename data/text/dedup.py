"""Exact and near-duplicate detection across all inputs.

Exact: a 64-bit hash of each cleaned document (`data.text.clean.doc_digest`); the first copy
is kept. Near: MinHash over character 5-grams of the lower-cased, whitespace-collapsed
text, with locality-sensitive hashing in 14 bands of 8 rows. Two documents collide in a
band with probability ~J^8 (J = Jaccard similarity of their 5-gram sets), so a pair is a
candidate with probability 1 - (1 - J^8)^14: ~50% at J = 0.70, 92% at 0.80, >99.9% at 0.90.
A candidate is only a proposal: a document is dropped when the actual Jaccard similarity
of its 5-gram set with an earlier kept document's is at least JACCARD_THRESHOLD. Documents
with fewer than MIN_SHINGLES distinct 5-grams (about 60 characters) are left to exact
dedup: in so little text a shared heading or attribution line decides the similarity.
Each drop is recorded (NEAR_DUPLICATES, next to the manifest) with the document it
duplicates and their Jaccard similarity. Character n-grams work the same for code,
English and CJK text (no word splitting).

The exact index keeps one integer per key in memory (~60 bytes each); the near index 14
band keys per kept document, with the documents' 5-gram sets on disk (4 bytes per 5-gram).
Everything is appended to files, so an interrupted run restores both exactly (see
data/text/pipeline.py).
"""

import json
import os
import re

import numpy as np

from ascend_llm_recipes.common.errors import DataError

SHINGLE = 5
BANDS, ROWS = 14, 8
_WHITESPACE = re.compile(r"\s+")
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_PERM_A = (np.random.default_rng(20240917).integers(1, 2**63, size=BANDS * ROWS, dtype=np.uint64)
           | np.uint64(1))  # odd multipliers
_PERM_B = np.random.default_rng(20240918).integers(0, 2**63, size=BANDS * ROWS, dtype=np.uint64)
_COLUMNS = 4096  # shingles per step: bounds the (permutations x shingles) temporary to ~3.5 MB
_WINDOW = 1 << 20  # characters hashed at a time: bounds the temporaries for a huge document
JACCARD_THRESHOLD = 0.8
MIN_SHINGLES = 56
NEAR_DUPLICATES = "near_duplicates.jsonl"


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
    if len(norm) < SHINGLE:
        norm = norm + "\0" * (SHINGLE - len(norm))
    parts = [_window_hashes(norm[start:start + _WINDOW + SHINGLE - 1])
             for start in range(0, len(norm) - SHINGLE + 1, _WINDOW)]
    return parts[0] if len(parts) == 1 else np.unique(np.concatenate(parts))


def _window_hashes(text: str) -> np.ndarray:
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    count = len(codes) - SHINGLE + 1
    h = codes[:count].copy()
    with np.errstate(over="ignore"):
        for k in range(1, SHINGLE):
            h = h * np.uint64(0x100000001B3) + codes[k:k + count]
        return np.unique(_mix64(h))


def shingle_set(shingles: np.ndarray) -> np.ndarray:
    """The 5-gram set as sorted distinct uint32 (the high half of each hash): what Jaccard is computed on."""
    return np.unique((shingles >> np.uint64(32)).astype(np.uint32))


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sorted distinct arrays."""
    common = len(np.intersect1d(a, b, assume_unique=True))
    return common / (len(a) + len(b) - common) if len(a) + len(b) else 1.0


def band_keys(text: str, shingles: np.ndarray = None) -> np.ndarray:
    """The document's 14 LSH band keys (uint64); equal keys in any band mark a near-duplicate candidate."""
    shingles = shingle_hashes(text) if shingles is None else shingles
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
        _truncate(path, restore_count * 8)
        if restore_count:
            self.keys.update(np.fromfile(path, dtype=np.uint64, count=restore_count).tolist())
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


class NearDuplicateIndex:
    """Kept documents' band keys (memory) and 5-gram sets (disk); drops a document only on measured similarity.

    Files, all append-only and restorable to any earlier `mark()`: near_keys.u64 (BANDS keys per
    indexed document), near_docs.i64 (per indexed document: offset and length of its 5-gram set
    in near_sets.u32, its input file index and line) and the audit log `log_path`.
    """

    def __init__(self, state: str, log_path: str, files: list, restore: dict = None):
        restore = restore or {"documents": 0, "shingles": 0, "log_bytes": 0}
        self.files = files
        self.paths = {name: os.path.join(state, f"near_{name}") for name in ("keys.u64", "docs.i64", "sets.u32")}
        self.documents, self.shingles = restore["documents"], restore["shingles"]
        self.dropped = restore.get("dropped", 0)
        sizes = {"keys.u64": self.documents * BANDS * 8, "docs.i64": self.documents * 4 * 8,
                 "sets.u32": self.shingles * 4}
        for name, path in self.paths.items():
            _truncate(path, sizes[name])
        _truncate(log_path, restore["log_bytes"])
        self.records = np.fromfile(self.paths["docs.i64"], np.int64).reshape(-1, 4).tolist() \
            if self.documents else []
        self.first: dict = {}   # band key -> the first indexed document holding it
        self.more: dict = {}    # band key -> later indexed documents holding it too (rare: they were not duplicates)
        if self.documents:
            keys = np.fromfile(self.paths["keys.u64"], np.uint64).reshape(-1, BANDS)
            for doc, row in enumerate(keys.tolist()):
                self._index(doc, row)
        self.out = {name: open(path, "a+b") for name, path in self.paths.items()}  # sets are read back
        self.log = open(log_path, "ab")

    def check(self, keys: np.ndarray, shingles: np.ndarray, file: int, line: int, digest: int) -> bool:
        """True if the document duplicates an indexed one (then it is logged); otherwise index it if long enough."""
        if len(shingles) < MIN_SHINGLES:
            return False
        candidates = set()
        for key in keys.tolist():
            if key in self.first:
                candidates.add(self.first[key])
                candidates.update(self.more.get(key, ()))
        best, similarity = None, 0.0
        if candidates:
            self.out["sets.u32"].flush()
            for doc in sorted(candidates):
                value = jaccard(shingles, self._set(doc))
                if value > similarity:
                    best, similarity = doc, value
        if best is not None and similarity >= JACCARD_THRESHOLD:
            _, _, kept_file, kept_line = self.records[best]
            entry = {"dropped": {"source": self.files[file], "line": line, "digest": f"{digest:016x}"},
                     "duplicate_of": {"source": self.files[kept_file], "line": kept_line},
                     "jaccard": round(similarity, 4)}
            self.log.write((json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8"))
            self.dropped += 1
            return True
        record = [self.shingles, len(shingles), file, line]
        self.records.append(record)
        self._index(self.documents, keys.tolist())
        self.out["keys.u64"].write(np.ascontiguousarray(keys, np.uint64).tobytes())
        self.out["docs.i64"].write(np.array(record, np.int64).tobytes())
        self.out["sets.u32"].write(np.ascontiguousarray(shingles, np.uint32).tobytes())
        self.documents += 1
        self.shingles += len(shingles)
        return False

    def _index(self, doc: int, keys: list) -> None:
        for key in keys:
            if key not in self.first:
                self.first[key] = doc
            elif self.first[key] != doc:
                self.more.setdefault(key, []).append(doc)

    def _set(self, doc: int) -> np.ndarray:
        offset, length = self.records[doc][:2]
        raw = os.pread(self.out["sets.u32"].fileno(), length * 4, offset * 4)
        return np.frombuffer(raw, np.uint32)

    def mark(self) -> dict:
        """Counts that `restore` returns to (the log's size included)."""
        self.log.flush()
        return {"documents": self.documents, "shingles": self.shingles, "dropped": self.dropped,
                "log_bytes": self.log.tell()}

    def sync(self) -> None:
        """Make everything indexed and logged so far durable (before a snapshot refers to it)."""
        for f in (*self.out.values(), self.log):
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        for f in (*self.out.values(), self.log):
            f.close()


def _truncate(path: str, size: int) -> None:
    """Cut an append-only file back to `size` bytes (creating it empty); shorter than that means damaged state."""
    with open(path, "ab") as f:
        if f.tell() < size:
            raise DataError(f"{path}: holds {f.tell()} bytes, the saved state expects {size}",
                            hint="the interrupted run's state is damaged; rerun the command to start over")
        f.truncate(size)
