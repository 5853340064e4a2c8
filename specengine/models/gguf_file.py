"""A GGUF file's metadata and tensors, parsed straight from the mapped file.

The `gguf` package's GGUFReader makes a numpy view for every part of every field, which for a
tokenizer of 49,152 tokens and as many merges is about a million views: 3 s of a 5.5 s load of
the default pair. Here the header is read with `struct` from one buffer and each tensor's data is
a single view of the mapped file, of the dtype and shape GGUFReader gives it (so `gguf.quants`
reads it alike); tests/test_gguf_file.py holds the two readers to the same fields and tensors on
every test file. Layout (little-endian; versions 2 and 3):

  header    magic "GGUF", version u32, tensor count u64, field count u64
  fields    key (string), value type u32, value (an array: item type u32, count u64, items)
  tensors   name (string), dims u32, each dim u64 (fastest first), type u32, offset u64
  data      from the header's end rounded up to general.alignment (default 32); offsets count
            from there

A string is a u64 byte count and UTF-8 bytes.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .config import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Scalar value types: struct format (little-endian).
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
# Tensor types that GGUFReader views element by element (every other type: as bytes, blocks per row).
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}


class GGUFError(CheckpointError):
    """A GGUF file is unreadable, truncated, or holds something this engine does not run."""


@dataclass(frozen=True)
class GGUFField:
    name: str
    value_type: GGUFValueType
    item_type: GGUFValueType | None  # an array's item type; None for a scalar or a string
    value: object  # int, float, bool, str, or a list of them


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # in the file
    data: np.ndarray  # a read-only view of the mapped file: elements for F32/F16/..., else row bytes


class GGUFFile:
    """The fields (by name, in file order) and tensors (in file order) of a GGUF file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        self._mapped = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buffer = memoryview(self._mapped)
        self._offset = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, ValueError) as e:
            raise GGUFError(f"{self.path} is not a readable GGUF file (truncated or corrupt?): {e}") from None

    def get(self, key: str, default=None):
        """A field's value, or `default` when the file has no such field."""
        field = self.fields.get(key)
        return default if field is None else field.value

    def _parse(self):
        if bytes(self._buffer[:4]) != MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (its first bytes are not {MAGIC!r})")
        self._offset = 4
        version = self._scalar("<I")
        if version not in VERSIONS:
            swapped = struct.unpack("<I", struct.pack(">I", version))[0]
            what = "big-endian, which this engine does not read" if swapped in VERSIONS else f"version {version}"
            raise GGUFError(f"{self.path}: GGUF {what}; readable: little-endian versions {VERSIONS}")
        tensor_count, field_count = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, GGUFField] = {}
        for _ in range(field_count):
            name = self._string()
            value_type = GGUFValueType(self._scalar("<I"))
            item_type = None
            if value_type == GGUFValueType.ARRAY:
                item_type = GGUFValueType(self._scalar("<I"))
                value = self._array(item_type, self._scalar("<Q"))
            else:
                value = self._value(value_type)
            if name in self.fields:
                raise GGUFError(f"{self.path}: field {name} appears twice")
            self.fields[name] = GGUFField(name, value_type, item_type, value)
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
            raw_type, offset = self._scalar("<I"), self._scalar("<Q")
            try:
                tensor_type = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name} has type {raw_type}, which no GGUF reader knows") from None
            infos.append((name, dims, tensor_type, offset))
        alignment = int(self.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment {alignment} is not a power of two")
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise GGUFError(f"{self.path}: tensor {next(n for n in names if names.count(n) > 1)} appears twice")

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], tensor_type, offset: int) -> GGUFTensor:
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if not dims or dims[0] % block:
            raise GGUFError(f"{self.path}: tensor {name} of type {tensor_type.name} has rows of "
                            f"{dims[0] if dims else 0} weights, not a multiple of its {block}-weight blocks")
        n_bytes = n_elements // block * block_bytes
        begin = start + offset
        if begin + n_bytes > len(self._mapped):
            raise GGUFError(f"{self.path} is truncated: tensor {name} ends at byte {begin + n_bytes} "
                            f"of a {len(self._mapped)}-byte file")
        raw = self._mapped[begin:begin + n_bytes]
        shape = tuple(reversed(dims))
        dtype = _ELEMENT_DTYPES.get(tensor_type)
        if dtype is None:  # block formats: each row as its bytes
            data = raw.reshape(*shape[:-1], shape[-1] // block * block_bytes)
        else:
            data = raw.view(dtype).reshape(shape)
        return GGUFTensor(name, tensor_type, dims, n_elements, n_bytes, begin, data)

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        end = self._offset + length
        if end > len(self._buffer):
            raise GGUFError(f"{self.path} is truncated: a {length}-byte string runs past its end")
        text = str(self._buffer[self._offset:end], "utf-8")
        self._offset = end
        return text

    def _value(self, value_type: GGUFValueType):
        if value_type == GGUFValueType.STRING:
            return self._string()
        return self._scalar(_SCALARS[value_type])

    def _array(self, item_type: GGUFValueType, count: int) -> list:
        if item_type == GGUFValueType.STRING:
            return [self._string() for _ in range(count)]
        if item_type == GGUFValueType.ARRAY:  # each item: its own item type, count and items
            return [self._array(GGUFValueType(self._scalar("<I")), self._scalar("<Q")) for _ in range(count)]
        fmt = _SCALARS[item_type]
        size = struct.calcsize(fmt)
        end = self._offset + size * count
        if end > len(self._buffer):
            raise GGUFError(f"{self.path} is truncated: an array of {count} {item_type.name} runs past its end")
        values = list(struct.unpack_from(f"<{count}{fmt[1]}", self._buffer, self._offset))
        self._offset = end
        return values
