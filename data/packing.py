"""Pack tokenised documents into fixed-length training samples of seq_length + 1 tokens.

Stream packing (the default): documents are joined with an EOD token into one stream.
Sample i holds stream tokens [i*S, i*S + S + 1): the model reads the first S and predicts
the last S, and the next sample starts where this one's inputs ended, so every token is
predicted exactly once and no position is wasted. Long documents simply continue in the
next sample. Only the corpus tail is padded (with a dedicated pad id that the loss
ignores), or dropped.

Best-fit packing never cuts a document that fits in a sample: each sample holds whole
documents (each with its EOD) and is padded at its end. A document longer than a sample
fills whole samples and only its remainder is packed. Up to OPEN_SAMPLES partly filled
samples stay open; each document goes into the open sample it fills most tightly, and when
too many are open the fullest is closed. Its padding is reported, never hidden.

Both packers carry their state (tokens not yet in a sample) in a form the pipeline saves
with each shard, so an interrupted run continues with exactly the same samples.
"""

import bisect
from dataclasses import asdict, dataclass

import numpy as np

PACKINGS = ("stream", "best_fit")
TAILS = ("pad", "drop")
OPEN_SAMPLES = 64


@dataclass
class PackStats:
    documents: int = 0
    tokens: int = 0          # real tokens, EOD separators included
    samples: int = 0
    slots: int = 0           # token positions stored: samples x (seq_length + 1)
    padding_tokens: int = 0  # pad ids written into samples
    dropped_tokens: int = 0  # tail tokens left out (tail "drop")
    split_documents: int = 0  # best-fit: documents longer than a sample, cut into whole samples

    @property
    def padding_rate(self) -> float:
        return self.padding_tokens / self.slots if self.slots else 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class StreamPacker:
    """Overlap-by-one stream packing; `add` takes any number of EOD-terminated documents at once."""

    def __init__(self, seq_length: int, pad_id: int, tail: str = "pad"):
        self.seq_length, self.pad_id, self.tail = seq_length, pad_id, tail
        self.stats = PackStats()
        self.buffer = np.zeros(0, np.int32)

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Append documents (tokens concatenated, each ending in EOD); returns the completed samples (n, S+1)."""
        self.stats.documents += len(lengths)
        self.stats.tokens += len(tokens)
        stream = np.concatenate([self.buffer, tokens]) if len(self.buffer) else np.asarray(tokens, np.int32)
        s = self.seq_length
        n = (len(stream) - 1) // s if len(stream) > s else 0
        if n:
            rows = np.lib.stride_tricks.sliding_window_view(stream, s + 1)[::s][:n].copy()
        else:
            rows = np.zeros((0, s + 1), np.int32)
        self.buffer = stream[n * s:].copy()
        self._count(rows, 0)
        return rows

    def finish(self) -> np.ndarray:
        """The padded (or dropped) tail; a lone leftover token was already predicted by the previous sample."""
        rows = np.zeros((0, self.seq_length + 1), np.int32)
        if len(self.buffer) > 1:
            if self.tail == "pad":
                rows = np.full((1, self.seq_length + 1), self.pad_id, np.int32)
                rows[0, :len(self.buffer)] = self.buffer
                self._count(rows, self.seq_length + 1 - len(self.buffer))
            else:
                self.stats.dropped_tokens += len(self.buffer) - 1
        self.buffer = np.zeros(0, np.int32)
        return rows

    def _count(self, rows: np.ndarray, padding: int) -> None:
        self.stats.samples += len(rows)
        self.stats.slots += rows.size
        self.stats.padding_tokens += padding

    def state(self) -> tuple:
        return {"stats": self.stats.as_dict()}, {"buffer": self.buffer}

    def restore(self, meta: dict, arrays: dict) -> None:
        self.stats = PackStats(**meta["stats"])
        self.buffer = arrays["buffer"].astype(np.int32)


class BestFitPacker:
    """Whole documents per sample (best fit among OPEN_SAMPLES open samples), padded at the end."""

    def __init__(self, seq_length: int, pad_id: int, tail: str = "pad"):
        self.width, self.pad_id, self.tail = seq_length + 1, pad_id, tail
        self.stats = PackStats()
        self.bins: list = []   # open samples: lists of token arrays
        self.free: list = []   # sorted (free space, bin serial)
        self.serial = 0
        self.by_serial: dict = {}

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Pack documents (tokens concatenated, `lengths` each including EOD); returns completed samples."""
        self.stats.documents += len(lengths)
        self.stats.tokens += int(lengths.sum())
        out = []
        for doc in np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else []:
            whole = len(doc) // self.width
            if len(doc) > self.width:
                self.stats.split_documents += 1
                out.extend(doc[i * self.width:(i + 1) * self.width] for i in range(whole))
                doc = doc[whole * self.width:]
            if len(doc):
                out.extend(self._place(doc))
        rows = np.stack(out).astype(np.int32) if out else np.zeros((0, self.width), np.int32)
        self._count(rows)
        return rows

    def _place(self, doc: np.ndarray) -> list:
        """Put one piece (<= width) into the tightest open sample; returns samples it completed or evicted."""
        done = []
        at = bisect.bisect_left(self.free, (len(doc), -1))
        if at < len(self.free):
            space, serial = self.free.pop(at)
        else:
            space, serial = self.width, self.serial
            self.serial += 1
            self.by_serial[serial] = []
        self.by_serial[serial].append(doc)
        space -= len(doc)
        if space == 0:
            done.append(np.concatenate(self.by_serial.pop(serial)))
        else:
            bisect.insort(self.free, (space, serial))
        if len(self.free) > OPEN_SAMPLES:
            _, fullest = self.free.pop(0)
            done.append(self._padded(self.by_serial.pop(fullest)))
        return done

    def _padded(self, parts: list) -> np.ndarray:
        row = np.full(self.width, self.pad_id, np.int32)
        filled = np.concatenate(parts)
        row[:len(filled)] = filled
        return row

    def finish(self) -> np.ndarray:
        """Close every open sample, in order of their creation: padded, or dropped with tail "drop"."""
        parts = [self.by_serial[serial] for _, serial in sorted(self.free, key=lambda f: f[1])]
        self.free, self.by_serial = [], {}
        if self.tail == "drop":
            self.stats.dropped_tokens += sum(len(p) for ps in parts for p in ps)
            return np.zeros((0, self.width), np.int32)
        rows = np.stack([self._padded(p) for p in parts]) if parts else np.zeros((0, self.width), np.int32)
        self._count(rows)
        return rows

    def _count(self, rows: np.ndarray) -> None:
        self.stats.samples += len(rows)
        self.stats.slots += rows.size
        self.stats.padding_tokens += int((rows == self.pad_id).sum())

    def state(self) -> tuple:
        order = sorted(self.free, key=lambda f: f[1])
        parts = [self.by_serial[serial] for _, serial in order]
        lengths = np.array([len(p) for ps in parts for p in ps], np.int64)
        counts = np.array([len(ps) for ps in parts], np.int64)
        tokens = np.concatenate([p for ps in parts for p in ps]) if len(lengths) else np.zeros(0, np.int32)
        meta = {"stats": self.stats.as_dict(), "serials": [serial for _, serial in order], "serial": self.serial}
        return meta, {"tokens": tokens, "lengths": lengths, "counts": counts}

    def restore(self, meta: dict, arrays: dict) -> None:
        self.stats = PackStats(**meta["stats"])
        self.serial = meta["serial"]
        pieces = np.split(arrays["tokens"].astype(np.int32), np.cumsum(arrays["lengths"])[:-1]) \
            if len(arrays["lengths"]) else []
        self.by_serial, self.free, at = {}, [], 0
        for serial, count in zip(meta["serials"], arrays["counts"].tolist()):
            self.by_serial[serial] = list(pieces[at:at + count])
            at += count
            self.free.append((self.width - sum(len(p) for p in self.by_serial[serial]), serial))
        self.free.sort()


def make_packer(packing: str, seq_length: int, pad_id: int, tail: str):
    return StreamPacker(seq_length, pad_id, tail) if packing == "stream" else BestFitPacker(seq_length, pad_id, tail)
