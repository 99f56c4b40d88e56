"""Checkpoint files read and written one tensor at a time, so memory stays near the largest tensor.

Three formats meet in conversion: safetensors (HuggingFace's, and the one MindFormers 1.9's
Trainer loads for `load_checkpoint`), `pytorch_model.bin` (HuggingFace, legacy) and MindSpore's
`.ckpt` (what training runs save). Each reader lists names, dtypes and shapes from the file's
header without touching tensor data, then reads one tensor on request; the writer streams
tensors into a file whose header is fixed up front.

Why not the libraries' own loaders: `safetensors.safe_open` maps the whole file, and every page
it touches stays resident for as long as the handle is open (a 400 MB file read tensor by tensor
peaks at ~460 MB RSS), and its numpy backend has no bfloat16; `mindspore.load_checkpoint` parses
the whole `.ckpt` at once. The formats are simple enough to read by offset with `os.pread`.
"""

import ctypes
import functools
import json
import mmap
import os
import struct
import sys
from dataclasses import dataclass

import numpy as np

from ascend_llm_recipes.common.errors import ConversionError


# safetensors dtype codes this converter reads as weights; all are widened to float32 exactly.
SAFETENSORS_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
# Every dtype of the format, to validate headers (a training checkpoint also holds integer counters).
SAFETENSORS_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                     "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
# MindSpore .ckpt tensor_type strings, mapped to the same codes.
CKPT_DTYPES = {"Float32": "F32", "Float16": "F16", "BFloat16": "BF16"}
HEADER_ALIGN = 8


def to_float32(raw: np.ndarray, code: str) -> np.ndarray:
    """Widen a tensor read as `code` (F32, F16 or BF16 bit patterns) to float32, exactly."""
    if code == "F32":
        return raw.astype(np.float32, copy=False)
    if code == "F16":
        return raw.astype(np.float32)
    # bfloat16 is the upper half of a float32: shift the 16 bits into place (in place: one copy).
    wide = raw.astype(np.uint32)
    wide <<= 16
    return wide.view(np.float32)


class SafetensorsFile:
    """One .safetensors file: header validated on open, tensors read by offset on demand."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._read_header(path)
        except OSError as err:
            raise ConversionError(f"{path}: cannot be read ({err.strerror or err})") from None

    def _read_header(self, path: str) -> None:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ConversionError(f"{path}: not a safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise ConversionError(f"{path}: truncated: the header alone needs {header_len} bytes, "
                                      f"the file holds {size - 8} after the length prefix",
                                      hint="download or copy the file again")
            try:
                header = json.loads(f.read(header_len))
                if not isinstance(header, dict):
                    raise ValueError(f"a JSON {type(header).__name__}, not an object")
            except (UnicodeDecodeError, ValueError) as err:
                raise ConversionError(f"{path}: unreadable safetensors header ({err})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + header_len
        self.tensors = {}  # name -> (dtype code, shape, begin, end), offsets relative to data_start
        data_end = 0
        for name, info in header.items():
            try:
                code, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise ConversionError(f"{path}: tensor {name}: malformed header entry {info!r} (corrupt header)",
                                      hint="download or copy the file again") from None
            if code not in SAFETENSORS_SIZES:
                raise ConversionError(f"{path}: tensor {name} has unknown dtype {code} (corrupt header?)")
            if end - begin != int(np.prod(shape, dtype=np.int64)) * SAFETENSORS_SIZES[code]:
                raise ConversionError(f"{path}: tensor {name}: {end - begin} bytes do not hold a {code} "
                                      f"tensor of shape {shape} (corrupt header)")
            self.tensors[name] = (code, shape, begin, end)
            data_end = max(data_end, end)
        if self.data_start + data_end > size:
            raise ConversionError(f"{path}: truncated: the header describes {data_end} bytes of tensor data, "
                                  f"the file holds {size - self.data_start}",
                                  hint="download or copy the file again")

    def read(self, name: str) -> np.ndarray:
        """A floating-point tensor as float32 (read into memory, not a view of the file)."""
        code, shape, begin, end = self.tensors[name]
        if code not in SAFETENSORS_DTYPES:
            raise ConversionError(f"{self.path}: tensor {name} has dtype {code}; only "
                                  f"{', '.join(SAFETENSORS_DTYPES)} convert")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = os.pread(fd, end - begin, self.data_start + begin)
        finally:
            os.close(fd)
        if len(data) != end - begin:
            raise ConversionError(f"{self.path}: truncated while reading tensor {name}")
        return to_float32(np.frombuffer(data, SAFETENSORS_DTYPES[code]).reshape(shape), code)


def torch_to_float32(tensor) -> np.ndarray:
    """A torch tensor as a float32 array of its own (widened exactly from float16 / bfloat16)."""
    import torch

    return tensor.detach().to(torch.float32).contiguous().numpy().copy()


LINUX_MADV_PAGEOUT = 21  # include/uapi/asm-generic/mman-common.h; Python's mmap names it only if built with it


@functools.lru_cache(maxsize=None)
def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def read_mapped(tensor) -> np.ndarray:
    """torch_to_float32 of a tensor of a torch.load(mmap=True) file, then its file pages handed back to the kernel.

    A mapped file keeps every page read through it resident for as long as it stays loaded (the readers keep
    each file loaded for a whole conversion, so that it is unpickled once), so once the tensor is copied the
    pages it was read from are paged out (madvise MADV_PAGEOUT, Linux 5.4+). The mapping is private and
    never written: the pages are clean, dropped rather than swapped, and a later read faults them in again.
    Elsewhere (no MADV_PAGEOUT, an older kernel refusing it) they stay mapped until the file is released.
    """
    array = torch_to_float32(tensor)
    advice = getattr(mmap, "MADV_PAGEOUT", LINUX_MADV_PAGEOUT if sys.platform == "linux" else None)
    storage = tensor.untyped_storage()
    if advice is not None and storage.nbytes():
        start = storage.data_ptr() & ~(mmap.PAGESIZE - 1)
        _madvise()(start, storage.data_ptr() + storage.nbytes() - start, advice)
    return array


class TorchBinFile:
    """One pytorch_model.bin (torch's zip format), memory-mapped; torch is imported only here.

    Loaded (unpickled) once and kept for the reader's life; each tensor read is a copy whose file pages
    are released (read_mapped), so memory holds the tensor, not the file.
    """

    def __init__(self, path: str):
        self.path = path
        self._state = state = self._load()
        self.tensors = {}  # name -> (dtype code, shape)
        codes = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16"}
        for name, tensor in state.items():
            if str(tensor.dtype) not in codes:
                raise ConversionError(f"{path}: tensor {name} has dtype {tensor.dtype}; only float32, "
                                      "float16 and bfloat16 are supported")
            self.tensors[name] = (codes[str(tensor.dtype)], tuple(tensor.shape))

    def _load(self) -> dict:
        import torch

        try:
            state = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # torch raises RuntimeError, pickle and zip errors alike
            raise ConversionError(f"{self.path}: cannot be read by torch.load ({type(err).__name__}: {err})",
                                  hint="a .bin must be torch's zip format (torch >= 1.6); re-save it or use "
                                       "safetensors") from None
        if not isinstance(state, dict):
            raise ConversionError(f"{self.path}: holds a {type(state).__name__}, not a state dict")
        return state

    def read(self, name: str) -> np.ndarray:
        return read_mapped(self._state[name])


def read_varint(f) -> int:
    shift = result = 0
    while True:
        byte = f.read(1)
        if not byte:
            raise EOFError("varint runs past the end of the file")
        result |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return result
        shift += 7


def proto_fields(f, end: int):
    """Yield (field number, wire type, value) of the protobuf message in f up to `end`.

    Varints are yielded as ints; length-delimited fields as (offset, length), and the
    reader continues after the field whatever the caller read meanwhile.
    """
    while f.tell() < end:
        key = read_varint(f)
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, wire, read_varint(f)
        elif wire == 2:
            length = read_varint(f)
            start = f.tell()
            yield number, wire, (start, length)
            f.seek(start + length)
        elif wire in (1, 5):
            f.seek(8 if wire == 1 else 4, 1)
        else:
            raise EOFError(f"wire type {wire} at offset {f.tell()}")


class CkptFile:
    """A MindSpore .ckpt read tensor by tensor.

    The file is a protobuf `Checkpoint { repeated Value value = 1; }` with
    `Value { string tag = 1; TensorProto tensor = 2; }` and
    `TensorProto { repeated int64 dims = 1; string tensor_type = 2; bytes tensor_content = 3; }`;
    large tensors are split over consecutive values with the same tag. Only the framing is
    parsed here: tensor contents are located, not read.
    """

    def __init__(self, path: str):
        self.path = path
        self.tensors = {}  # name -> (tensor_type, shape, [(offset, length), ...])
        self._last_tag = None
        try:
            self._index(path)
        except OSError as err:
            raise ConversionError(f"{path}: cannot be read ({err.strerror or err})") from None

    def _index(self, path: str) -> None:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            f.seek(max(0, size - 17))
            end = size - 17 if f.read(7) == b"crc_num" else size  # optional CRC trailer of save_checkpoint
            f.seek(0)
            try:
                for number, wire, (start, length) in proto_fields(f, end):
                    if number != 1 or wire != 2 or start + length > end:
                        raise EOFError(f"unexpected field {number} at offset {start}")
                    self._index_value(f, start + length)
            except (EOFError, UnicodeDecodeError) as err:
                raise ConversionError(f"{path}: not a readable MindSpore checkpoint ({err})",
                                      hint="the file may be truncated, encrypted or not a .ckpt") from None

    def _index_value(self, f, end: int) -> None:
        tag, tensor_type, dims, chunk = None, None, [], None
        for number, wire, value in proto_fields(f, end):
            if number == 1:
                f.seek(value[0])
                tag = f.read(value[1]).decode("utf-8")
            elif number == 2:
                for t_number, t_wire, t_value in proto_fields(f, value[0] + value[1]):
                    if t_number == 1 and t_wire == 0:
                        dims.append(t_value)
                    elif t_number == 1:  # packed dims
                        f.seek(t_value[0])
                        packed_end = t_value[0] + t_value[1]
                        while f.tell() < packed_end:
                            dims.append(read_varint(f))
                    elif t_number == 2:
                        f.seek(t_value[0])
                        tensor_type = f.read(t_value[1]).decode("utf-8")
                    elif t_number == 3:
                        chunk = t_value
            elif number == 3:
                raise ConversionError(f"{self.path}: {tag}: map tensors (embedding caches) are not supported")
        shape = () if dims == [0] else tuple(dims)
        if tag == self._last_tag:  # the next slice of a large tensor
            self.tensors[tag][2].append(chunk or (0, 0))
        elif tag in self.tensors:
            raise ConversionError(f"{self.path}: tensor {tag} is stored twice")
        else:
            self.tensors[tag] = (tensor_type, shape, [chunk or (0, 0)])
        self._last_tag = tag

    def read(self, name: str) -> np.ndarray:
        """A floating-point tensor as float32."""
        tensor_type, shape, chunks = self.tensors[name]
        if tensor_type not in CKPT_DTYPES:
            raise ConversionError(f"{self.path}: tensor {name} has type {tensor_type}; expected one of "
                                  f"{', '.join(CKPT_DTYPES)}")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = b"".join(os.pread(fd, length, offset) for offset, length in chunks)
        finally:
            os.close(fd)
        code = CKPT_DTYPES[tensor_type]
        raw = np.frombuffer(data, SAFETENSORS_DTYPES[code])
        if raw.size != int(np.prod(shape, dtype=np.int64)):
            raise ConversionError(f"{self.path}: tensor {name}: {len(data)} bytes do not fill shape {shape}")
        return to_float32(raw.reshape(shape), code)


class SafetensorsWriter:
    """Streams float32 tensors into a .safetensors file whose header is written first.

    The names and shapes are known before any data is read (they follow from the model
    config), so the header with every offset goes first and tensors follow in that order.
    """

    def __init__(self, path: str, shapes: dict, metadata: dict):
        self.path = path
        self.order = list(shapes)
        header, offset = {}, 0
        for name, shape in shapes.items():
            nbytes = int(np.prod(shape, dtype=np.int64)) * 4
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = dict(metadata)
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % HEADER_ALIGN)
        self.shapes = shapes
        self.written = 0
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, name: str, array: np.ndarray) -> None:
        # The header is already on disk: anything but the announced tensor would leave a file whose
        # offsets lie, so this is checked even under `python -O`, and the file is removed.
        expected = self.order[self.written] if self.written < len(self.order) else None
        if name != expected or tuple(array.shape) != tuple(self.shapes[name]) or array.dtype != np.float32:
            self._abandon()
            announced = (f"{expected} {tuple(self.shapes[expected])} float32" if expected is not None
                         else "no more tensors")
            raise ConversionError(f"{self.path}: tensor {name} {tuple(array.shape)} {array.dtype} written where the "
                                  f"header announces {announced}; the file was removed",
                                  hint="this is a converter bug: report it with the command that was run")
        self.file.write(memoryview(np.ascontiguousarray(array)).cast("B"))
        self.written += 1

    def close(self) -> None:
        if self.written != len(self.order):
            self._abandon()
            raise ConversionError(f"{self.path}: closed after {self.written} of the {len(self.order)} tensors its "
                                  f"header announces (next: {self.order[self.written]}); the file was removed",
                                  hint="this is a converter bug: report it with the command that was run")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def _abandon(self) -> None:
        self.file.close()
        os.remove(self.path)


def tensor_shapes(path: str) -> dict:
    """{tensor name: shape} of a .ckpt or .safetensors file, from its framing or header alone."""
    return {name: shape for name, (shape, _) in tensor_layouts(path).items()}


def tensor_layouts(path: str) -> dict:
    """{tensor name: (shape, bytes per element)} of a .ckpt or .safetensors file (None: not a float type)."""
    reader = CkptFile(path) if path.endswith(".ckpt") else SafetensorsFile(path)
    codes = {name: CKPT_DTYPES.get(info[0]) if path.endswith(".ckpt") else info[0]
             for name, info in reader.tensors.items()}
    return {name: (tuple(info[1]), SAFETENSORS_SIZES.get(codes[name])) for name, info in reader.tensors.items()}


@dataclass
class HFWeights:
    """Where each tensor of a HuggingFace directory lives: name -> (reader, dtype code, shape)."""

    format: str
    files: list
    tensors: dict

    def read(self, name: str) -> np.ndarray:
        return self.tensors[name][0].read(name)
