"""A fast reader for the GGUF container: metadata and raw tensor bytes, nothing interpreted.

`gguf.GGUFReader` keeps every element of every metadata array as a numpy part, which takes
seconds for a 49k-token vocabulary; this reader parses the same layout in one pass and
memory-maps the tensor data. Constants (tensor types and their block sizes) come from the
`gguf` package.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf.GGUFValueType) -> struct format of one scalar.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_DTYPES = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_KNOWN_TYPES = {int(t) for t in GGML_QUANT_SIZES}
_U64 = struct.Struct("<Q")
# Arrays of arrays nest at most this deep; llama.cpp reads no nested arrays at all.
MAX_ARRAY_DEPTH = 4


class GGUFError(ValueError):
    """A GGUF file that cannot be read: not GGUF, truncated, corrupt, or describing something unsupported."""


@dataclass
class GGUFTensorInfo:
    """One tensor's entry: its name, its shape in PyTorch order (outermost first), its ggml type
    and where its bytes lie in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """The ggml type's name (``Q4_K``), or ``type <n>`` for a number the gguf package does not know."""
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type {self.ggml_type}"


@dataclass
class GGUFFile:
    """A parsed GGUF file: metadata values (arrays as lists or numpy arrays), tensor entries in file
    order, and the memory-mapped bytes."""

    path: Path
    version: int
    metadata: dict[str, object]
    tensors: dict[str, GGUFTensorInfo]
    data: np.ndarray = field(repr=False)

    def tensor_bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        """The raw bytes of one tensor as a read-only uint8 array (a view of the memory map)."""
        return self.data[info.offset : info.offset + info.nbytes]


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(
                f"GGUF file {self.path} is truncated or corrupt: reading {what} needs {n} bytes at offset "
                f"{self.pos}, but the file has {len(self.buf)} bytes"
            )

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        self.need(size, what)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        # Some vocabularies hold tokens that are not valid UTF-8 on their own; keep their bytes.
        return raw.decode("utf-8", errors="surrogateescape")

    def strings(self, count: int, what: str) -> list[str]:
        """`count` length-prefixed strings (the hot loop of a vocabulary: kept lean)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = _U64.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, what)
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                self.pos = pos
                self.need(n, what)
            out.append(str(buf[pos : pos + n], "utf-8", "surrogateescape"))
            pos += n
        self.pos = pos
        return out

    def value(self, value_type: int, what: str, depth: int = 0):
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type], what)
        if value_type == _STRING:
            return self.string(what)
        if value_type == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFError(
                    f"GGUF file {self.path} is corrupt: {what} nests arrays more than {MAX_ARRAY_DEPTH} deep; "
                    f"at most {MAX_ARRAY_DEPTH} levels are accepted"
                )
            item_type = self.scalar("I", what)
            count = self.scalar("Q", what)
            if item_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[item_type])
                self.need(count * dtype.itemsize, what)
                out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos += count * dtype.itemsize
                return out
            if count > len(self.buf):
                raise GGUFError(f"GGUF file {self.path} is corrupt: {what} claims {count} elements")
            if item_type == _STRING:
                return self.strings(count, what)
            return [self.value(item_type, what, depth + 1) for _ in range(count)]
        raise GGUFError(f"GGUF file {self.path} is corrupt: {what} has unknown value type {value_type}")


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor table; map its tensor data.

    Raises `GGUFError` (a ValueError) for a file that is not GGUF, a version other than 2 or 3,
    a truncated or corrupt header (arrays nested too deep, a bad `general.alignment`, duplicate
    tensor names, misaligned tensor offsets), or tensor data that runs past the end of the file.
    """
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"model file {str(path)!r} does not exist or is not a file")
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"GGUF file {path} is truncated: {size} bytes, a GGUF header alone needs 24")
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mapped), path)
    magic = bytes(cur.buf[:4])
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file: it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r}")
    cur.pos = 4
    version = cur.scalar("I", "the version")
    if version not in (2, 3):
        raise GGUFError(f"GGUF file {path} has version {version}; supported versions are 2 and 3 (little-endian)")
    tensor_count = cur.scalar("Q", "the tensor count")
    kv_count = cur.scalar("Q", "the metadata count")
    if tensor_count > size or kv_count > size:
        raise GGUFError(f"GGUF file {path} is corrupt: it claims {tensor_count} tensors and {kv_count} metadata keys")

    metadata: dict[str, object] = {}
    for i in range(kv_count):
        key = cur.string(f"metadata key #{i}")
        value_type = cur.scalar("I", f"the type of {key!r}")
        metadata[key] = cur.value(value_type, f"metadata {key!r}")

    infos = []
    for i in range(tensor_count):
        name = cur.string(f"tensor name #{i}")
        n_dims = cur.scalar("I", f"the rank of tensor {name!r}")
        if n_dims > 8:
            raise GGUFError(f"GGUF file {path} is corrupt: tensor {name!r} claims {n_dims} dimensions")
        dims = [cur.scalar("Q", f"the shape of tensor {name!r}") for _ in range(n_dims)]
        ggml_type = cur.scalar("I", f"the type of tensor {name!r}")
        offset = cur.scalar("Q", f"the offset of tensor {name!r}")
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))

    alignment = _alignment(metadata, path)
    data_start = -(-cur.pos // alignment) * alignment
    data = mapped[data_start:]

    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, ggml_type, offset in infos:
        info = GGUFTensorInfo(name, shape, ggml_type, offset, 0)
        if name in tensors:
            raise GGUFError(f"GGUF file {path} is corrupt: it holds two tensors named {name!r}; names must be unique")
        if offset % alignment:
            raise GGUFError(
                f"GGUF file {path} is corrupt: tensor {name!r} starts at data offset {offset}, "
                f"not a multiple of the alignment {alignment}"
            )
        if ggml_type not in _KNOWN_TYPES:
            raise GGUFError(f"GGUF file {path}: tensor {name!r} has unknown ggml type number {ggml_type}")
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        n = math.prod(shape)  # a Python int: numpy's int64 product would wrap for absurd shapes
        if shape and shape[-1] % block:
            raise GGUFError(
                f"GGUF file {path} is corrupt: tensor {name!r} of type {info.type_name} has rows of "
                f"{shape[-1]} elements, not a multiple of its block size {block}"
            )
        info.nbytes = n // block * block_bytes
        if offset + info.nbytes > len(data):
            raise GGUFError(
                f"GGUF file {path} is truncated or corrupt: tensor {name!r} of shape {shape} ends at byte "
                f"{data_start + offset + info.nbytes}, but the file has {size} bytes"
            )
        tensors[name] = info
    return GGUFFile(path, version, metadata, tensors, data)


def _alignment(metadata: dict[str, object], path: Path) -> int:
    """The file's `general.alignment`: a positive power of two (the spec stores it as a u32), else GGUFError."""
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(
            f"GGUF file {path} is corrupt: general.alignment is {alignment!r}; "
            f"it must be an integer power of two (a u32 such as {DEFAULT_ALIGNMENT})"
        )
    return alignment
