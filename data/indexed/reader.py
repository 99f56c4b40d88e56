"""Read Megatron's indexed token corpora (PREFIX.bin + PREFIX.idx) with numpy memmaps, checking the format.

The format is megatron-core's MMapIndexedDataset, as written by `IndexedDatasetBuilder.finalize` and read
by `_IndexReader` in megatron/core/datasets/indexed_dataset.py (megatron-core 0.16.1: `_INDEX_HEADER`,
`DType`, `_IndexWriter.write`); Megatron-LM's and MindSpeed-LLM's preprocess_data.py, NeMo and
MindFormers 1.9's BlendedMegatronDatasetDataLoader/GPTDataset read and write the same files.

PREFIX.idx, little-endian:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    8 bytes   version, uint64 (1)
    1 byte    dtype code of the tokens in .bin: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
              7 float32, 8 uint16 (preprocess_data.py writes uint16 below 65,500 ids, int32 above)
    8 bytes   S, sequences, uint64
    8 bytes   D, document_indices entries, uint64 (documents + 1)
    S int32   sequence lengths, in tokens
    S int64   sequence pointers, byte offsets into .bin
    D int64   document_indices: sequence index where each document starts, [0, ..., S]
    (S int8   sequence modes, only in multimodal datasets)

PREFIX.bin holds the tokens of every sequence back to back. A document is the sequences
document_indices[d] .. document_indices[d + 1] (several when preprocess_data.py split sentences);
with --append-eod its last token is the tokenizer's end-of-document id.
"""

import os
import struct
from dataclasses import dataclass

import numpy as np

from ascend_llm_recipes.common.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"  # the older non-mmap IndexedDataset (fairseq / early Megatron)
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
FLOAT_CODES = {6: "float64", 7: "float32"}
HINT = ("pass the PREFIX of a Megatron indexed dataset (PREFIX.bin and PREFIX.idx, as written by Megatron-LM's or "
        "MindSpeed-LLM's tools/preprocess_data.py)")


@dataclass
class IndexedCorpus:
    """One PREFIX: its token dtype, and per document its token range in the .bin (in tokens, not bytes)."""

    prefix: str
    dtype: np.dtype
    starts: np.ndarray    # int64, first token of each document in .bin
    lengths: np.ndarray   # int64, tokens of each document

    @property
    def documents(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def bin_path(self) -> str:
        return self.prefix + ".bin"

    def tokens_memmap(self) -> np.ndarray:
        """The whole .bin as a read-only array of tokens (pages are read only when touched)."""
        if not os.path.getsize(self.bin_path):
            return np.zeros(0, self.dtype)
        return np.memmap(self.bin_path, dtype=self.dtype, mode="r")


def open_indexed(prefix: str) -> IndexedCorpus:
    """Read and check PREFIX.idx against PREFIX.bin; raises DataError naming the file and what is wrong."""
    for suffix in (".idx", ".bin"):
        if prefix.endswith(suffix) and not os.path.exists(prefix + suffix):
            prefix = prefix[:-len(suffix)]  # PREFIX.bin or PREFIX.idx given: the prefix was meant
    idx, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_path):
        if not os.path.isfile(path):
            raise DataError(f"--from-megatron-indexed {prefix}: {path} does not exist"
                            + (" (a broken link)" if os.path.islink(path) else ""),
                            hint=HINT + "; both files must sit side by side")
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        header = f.read(HEADER_BYTES)
    if header.startswith(LEGACY_MAGIC):
        raise DataError(f"{idx}: the legacy (non-mmap) IndexedDataset format, magic {LEGACY_MAGIC!r}",
                        hint="convert it to the mmap format (MMIDIDX) with Megatron's tools, e.g. re-save it with "
                             "megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder, then pass that prefix")
    if not header.startswith(MAGIC):
        raise DataError(f"{idx}: not a Megatron indexed-dataset index (magic {header[:len(MAGIC)]!r}, expected "
                        f"{MAGIC!r})", hint=HINT)
    if len(header) < HEADER_BYTES:
        raise DataError(f"{idx}: truncated header ({size} bytes, the header alone is {HEADER_BYTES})",
                        hint="copy the file again from its source")
    version, code, sequences, entries = struct.unpack("<QBQQ", header[len(MAGIC):])
    if version != VERSION:
        raise DataError(f"{idx}: index version {version}, this reader knows version {VERSION} (megatron-core "
                        "0.16.1's)", hint=HINT)
    if code in FLOAT_CODES:
        raise DataError(f"{idx}: dtype code {code} ({FLOAT_CODES[code]}) holds floating-point values, not token ids",
                        hint="only token corpora (integer dtypes, e.g. uint16 or int32) can be packed")
    if code not in DTYPES:
        raise DataError(f"{idx}: unknown dtype code {code} (megatron-core knows "
                        f"{', '.join(f'{c} {np.dtype(t).name}' for c, t in sorted(DTYPES.items()))})", hint=HINT)
    dtype = np.dtype(DTYPES[code])
    expected = HEADER_BYTES + sequences * (4 + 8) + entries * 8
    if size == expected + sequences:
        raise DataError(f"{idx}: a multimodal indexed dataset (it holds sequence modes)",
                        hint="only text token corpora can be packed")
    if size != expected:
        raise DataError(f"{idx}: {size} bytes, but its header ({sequences} sequences, {entries} document indices) "
                        f"needs {expected}: the file is truncated or damaged",
                        hint="copy the file again from its source")
    raw = np.memmap(idx, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    at = HEADER_BYTES
    seq_lengths = raw[at:at + 4 * sequences].view(np.int32).astype(np.int64)
    at += 4 * sequences
    pointers = raw[at:at + 8 * sequences].view(np.int64)
    at += 8 * sequences
    doc_index = np.asarray(raw[at:at + 8 * entries].view(np.int64))
    del raw
    if entries < 1 or doc_index[0] != 0 or doc_index[-1] != sequences or np.any(np.diff(doc_index) < 0):
        raise DataError(f"{idx}: document indices do not run from 0 to the {sequences} sequences in increasing order",
                        hint="the index is damaged: copy it again or rebuild it with preprocess_data.py")
    if np.any(seq_lengths < 0):
        raise DataError(f"{idx}: negative sequence lengths", hint="the index is damaged: copy it again")
    # Megatron's writer stores sequences back to back; we read documents as one contiguous range each.
    ends = np.cumsum(seq_lengths) * dtype.itemsize
    if sequences and (pointers[0] != 0 or np.any(pointers[1:] != ends[:-1])):
        raise DataError(f"{idx}: sequences are not stored back to back in {bin_path} (pointers do not follow the "
                        "lengths)", hint="the index is damaged, or was not written by Megatron's builder")
    needed = int(ends[-1]) if sequences else 0
    actual = os.path.getsize(bin_path)
    if actual < needed:
        raise DataError(f"{bin_path}: {actual:,} bytes, but {idx} describes {needed:,} ({needed // dtype.itemsize:,} "
                        f"{dtype.name} tokens): the .bin is truncated", hint="copy the file again from its source")
    if actual > needed:
        raise DataError(f"{bin_path}: {actual:,} bytes, {idx} describes only {needed:,}: the two files do not belong "
                        "together (or the .idx is stale)", hint="pass the .bin and .idx written together")
    token_starts = np.concatenate([[0], np.cumsum(seq_lengths)])
    return IndexedCorpus(prefix, dtype, token_starts[doc_index[:-1]], token_starts[doc_index[1:]]
                         - token_starts[doc_index[:-1]])
