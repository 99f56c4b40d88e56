"""Pack tokenised documents end to end into fixed-length training samples.

Documents are joined with an EOD token into one stream. Sample i holds stream tokens
[i*S, i*S + S + 1): the model reads the first S and predicts the last S, and the next
sample starts where this one's inputs ended, so every token is predicted exactly once
and no position is wasted. Only the corpus tail is padded, with a dedicated pad id that
the loss ignores.
"""

from dataclasses import dataclass

import numpy as np


@dataclass
class PackStats:
    documents: int = 0
    tokens: int = 0          # real tokens, EOD separators included
    samples: int = 0
    slots: int = 0           # token positions stored: samples x (seq_length + 1)
    padding_tokens: int = 0  # pad ids written into samples (corpus tail only)

    @property
    def padding_rate(self) -> float:
        return self.padding_tokens / self.slots if self.slots else 0.0


def pack_documents(token_docs, seq_length: int, eod_id: int, pad_id: int, stats: PackStats):
    """Yield int32 arrays of seq_length + 1 tokens from an iterable of token-id lists."""
    buffer = np.empty(0, dtype=np.int32)
    for ids in token_docs:
        stats.documents += 1
        stats.tokens += len(ids) + 1
        buffer = np.concatenate([buffer, np.asarray(ids, dtype=np.int32), np.array([eod_id], np.int32)])
        while len(buffer) >= seq_length + 1:
            stats.samples += 1
            stats.slots += seq_length + 1
            yield buffer[:seq_length + 1].copy()
            buffer = buffer[seq_length:]
    if len(buffer) > 1:  # a lone leftover token was already predicted by the previous sample
        tail = np.full(seq_length + 1, pad_id, dtype=np.int32)
        tail[:len(buffer)] = buffer
        stats.samples += 1
        stats.slots += seq_length + 1
        stats.padding_tokens += seq_length + 1 - len(buffer)
        yield tail
