"""Sources of raw documents, read as a stream of bounded chunks.

Inputs are `.txt` (one document per file, or one per line), `.jsonl` (one JSON object per
line, text in a configurable field), `.parquet` (a text column), and gzip-compressed
`.txt.gz`/`.jsonl.gz`; any other suffix (e.g. `.py`, a file named or globbed; data/text/inputs.py
says which files a folder gives) is read as text. The reader does no per-document work: it cuts
files into ~1 MB pieces that worker processes parse, so memory stays bounded whatever the
corpus size. Every chunk records the position it starts at,
which is what an interrupted run resumes from.

The default corpus is the Python standard library's own source: real text that exists
wherever Python runs, so the demo needs no download.
"""

import gzip
import os
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}
CHUNK_BYTES = 1 << 20
SNIFF_BYTES = 8192  # a NUL byte in a file's first 8 KB marks it as binary
PARQUET_BATCH_ROWS = 1024

TEXT, JSONL, PARQUET = "text", "jsonl", "parquet"
# Bad-input kinds the reader finds (per file); workers add malformed_json, missing_field, invalid_utf8.
UNREADABLE, EMPTY_FILE, BINARY_FILE = "unreadable", "empty_file", "binary_file"


def python_stdlib_files() -> list:
    """The standard library's .py files (tests and installed packages left out), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    return sorted(files)


def input_format(path: str) -> tuple:
    """(format, gzip-compressed?) from the file name."""
    name = path.lower()
    compressed = name.endswith(".gz")
    if compressed:
        name = name[:-3]
    if name.endswith(".jsonl"):
        return JSONL, compressed
    if name.endswith(".parquet") and not compressed:
        return PARQUET, False
    return TEXT, compressed


@dataclass(frozen=True)
class BadInput:
    """One offending input: its kind, where (file index, 1-based line or row; 0 = the whole file) and why."""

    kind: str
    file: int
    line: int
    detail: str


@dataclass
class Position:
    """Where reading stands: file index, byte offset in its (decompressed) text or row index, next line."""

    file: int = 0
    offset: int = 0
    line: int = 1

    def as_dict(self) -> dict:
        return {"file": self.file, "offset": self.offset, "line": self.line}


@dataclass
class Piece:
    """Work for a worker: a whole-file document, a block of whole lines, or parquet values."""

    kind: str             # "file" (one document) | "lines" (one per line) | "jsonl" | "rows" (parquet)
    file: int
    line: int             # line (or row) number of the first document in `data`
    data: object          # bytes, or a list of values for "rows"
    disk_bytes: int = 0   # on-disk bytes this piece consumed (compressed size for .gz; progress only)


@dataclass
class Chunk:
    index: int
    start: Position
    pieces: list = field(default_factory=list)
    bad: list = field(default_factory=list)    # BadInput found while reading, in input order
    disk_bytes: int = 0                        # on-disk bytes consumed (progress)
    size: int = 0


class ChunkReader:
    """Cuts the inputs into chunks of about `chunk_bytes` of text, starting at any recorded Position."""

    def __init__(self, files: list, lines: bool, text_field: str, chunk_bytes: int = CHUNK_BYTES):
        self.files = files
        self.lines = lines
        self.text_field = text_field
        self.chunk_bytes = chunk_bytes

    def chunks(self, start: Position, first_index: int = 0, stop: Optional[Position] = None) -> Iterator[Chunk]:
        """Chunks from `start` up to `stop` (exclusive; a byte offset there must follow a newline; None: the end)."""
        index = first_index
        chunk = Chunk(index, Position(**start.as_dict()))
        last = len(self.files) if stop is None else min(len(self.files), stop.file + (1 if stop.offset else 0))
        for file_index in range(start.file, last):
            begin = start if file_index == start.file else Position(file_index)
            end = stop.offset if stop is not None and file_index == stop.file else 0
            for item, after in self._read_file(file_index, begin, end):
                if isinstance(item, BadInput):
                    chunk.bad.append(item)
                else:
                    chunk.pieces.append(item)
                    chunk.disk_bytes += item.disk_bytes
                    chunk.size += len(item.data) if item.kind != "rows" else sum(len(v or "") for v in item.data)
                if chunk.size >= self.chunk_bytes:
                    yield chunk
                    index += 1
                    chunk = Chunk(index, after)
        if chunk.pieces or chunk.bad:
            yield chunk

    def _read_file(self, file_index: int, begin: Position, end: int = 0) -> Iterator:
        """Yield (Piece or BadInput, Position after it) for one file, from `begin` to byte `end` (0: its end)."""
        path = self.files[file_index]
        fmt, compressed = input_format(path)
        try:
            if fmt == PARQUET:
                yield from self._parquet(file_index, path, begin)
            elif fmt == JSONL or self.lines:
                yield from self._line_blocks(file_index, path, compressed, begin, end)
            else:
                yield from self._whole_file(file_index, path, compressed)
        except (gzip.BadGzipFile, EOFError, zlib.error) as err:
            yield BadInput(UNREADABLE, file_index, 0, f"not a valid gzip file ({err or 'truncated'})"), \
                Position(file_index + 1)
        except OSError as err:
            yield BadInput(UNREADABLE, file_index, 0, f"cannot be read ({err.__class__.__name__}: "
                           f"{err.strerror or err})"), Position(file_index + 1)

    def _whole_file(self, file_index: int, path: str, compressed: bool) -> Iterator:
        with (gzip.open(path, "rb") if compressed else open(path, "rb")) as f:
            raw = f.read()
        after = Position(file_index + 1)
        bad = _sniff(raw[:SNIFF_BYTES], file_index)
        if bad:
            yield bad, after
            return
        yield Piece("file", file_index, 1, raw, os.path.getsize(path)), after

    def _line_blocks(self, file_index: int, path: str, compressed: bool, begin: Position, end: int = 0) -> Iterator:
        kind = "jsonl" if input_format(path)[0] == JSONL else "lines"
        with (gzip.open(path, "rb") if compressed else open(path, "rb")) as f:
            raw_file = f.fileobj if compressed else f
            if begin.offset:
                f.seek(begin.offset)
            offset, line = begin.offset, begin.line
            buffer, cut = bytearray(), 0  # cut: the end of the last whole line in buffer
            last_disk = raw_file.tell()
            while True:
                size = self.chunk_bytes // 8  # small reads: a piece overshoots the chunk size by little
                block = f.read(min(size, end - offset - len(buffer)) if end else size)
                if offset == 0 and not buffer:
                    bad = _sniff(block[:SNIFF_BYTES], file_index)
                    if bad:
                        yield bad, Position(file_index + 1)
                        return
                if block:
                    newline = block.rfind(b"\n")
                    if newline >= 0:
                        cut = len(buffer) + newline + 1
                    buffer += block
                    if cut < self.chunk_bytes:  # less than a chunk of whole lines yet: read on
                        continue
                else:
                    cut = len(buffer)  # the last line may lack its newline
                if cut:
                    disk = raw_file.tell()
                    piece = Piece(kind, file_index, line, bytes(memoryview(buffer)[:cut]), disk - last_disk)
                    del buffer[:cut]
                    offset += cut
                    line += piece.data.count(b"\n")
                    last_disk, cut = disk, 0
                    yield piece, Position(file_index, offset, line)
                if not block:
                    return

    def _parquet(self, file_index: int, path: str, begin: Position) -> Iterator:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowInvalid, pa.ArrowIOError) as err:
            yield BadInput(UNREADABLE, file_index, 0, f"not a parquet file ({err})"), Position(file_index + 1)
            return
        schema = pf.schema_arrow
        if self.text_field not in schema.names:
            yield BadInput("missing_field", file_index, 0, f"no column {self.text_field!r} (columns: "
                           f"{', '.join(schema.names)})"), Position(file_index + 1)
            return
        if not pa.types.is_string(schema.field(self.text_field).type) and \
                not pa.types.is_large_string(schema.field(self.text_field).type):
            yield BadInput("missing_field", file_index, 0, f"column {self.text_field!r} is "
                           f"{schema.field(self.text_field).type}, not text"), Position(file_index + 1)
            return
        meta = pf.metadata
        if meta.num_rows == 0:
            yield BadInput(EMPTY_FILE, file_index, 0, "no rows"), Position(file_index + 1)
            return
        # Resume inside the file: skip whole row groups, then the rows before the recorded offset.
        first_group, group_start = 0, 0
        while group_start + meta.row_group(first_group).num_rows <= begin.offset:
            group_start += meta.row_group(first_group).num_rows
            first_group += 1
        skip, row = begin.offset - group_start, begin.offset
        disk_per_row = os.path.getsize(path) / meta.num_rows
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[self.text_field],
                                     row_groups=range(first_group, meta.num_row_groups)):
            values = batch.column(0).to_pylist()[skip:]
            skip = 0
            if values:
                piece = Piece("rows", file_index, row + 1, values, int(len(values) * disk_per_row))
                row += len(values)
                yield piece, Position(file_index, row, row + 1)


def _sniff(head: bytes, file_index: int) -> Optional[BadInput]:
    if not head:
        return BadInput(EMPTY_FILE, file_index, 0, "the file is empty")
    if b"\x00" in head:
        return BadInput(BINARY_FILE, file_index, 0, "binary content (NUL bytes), not text")
    return None
