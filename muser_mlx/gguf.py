"""GGUF reader: header, metadata, tensor infos; each tensor's raw bytes as a uint8 mx.array.

The file is memory-mapped. `read()` parses and validates everything it can without touching
tensor data: magic, version, every metadata value, every tensor info, the alignment, each
tensor's byte range (inside the file, aligned, exactly blocks x bytes-per-block). A tensor's
bytes become an `mx.array` the first time `.data` is asked for: one copy, tensor by tensor,
so peak memory stays near the file's size. Every failure is a `GGUFError` subclass whose
message names the key, tensor or byte offset involved.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from muser_mlx.formats import UnsupportedFormatError, block_format

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS


class GGUFError(ValueError):
    """Base of every error raised while reading a GGUF file."""


class BadMagicError(GGUFError):
    pass


class UnsupportedVersionError(GGUFError):
    pass


class TruncatedFileError(GGUFError):
    pass


class BadMetadataError(GGUFError):
    pass


class UnknownTensorTypeError(GGUFError):
    pass


class TensorLayoutError(GGUFError):
    """A tensor's byte range is outside the file, misaligned, or the wrong size."""


# Metadata value types (gguf_type) and the numpy dtype of each fixed-size one.
_SCALAR_DTYPES = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("<u1"),  # bool
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


@dataclass
class GGUFTensor:
    name: str
    ggml_type: GGMLType
    shape: tuple[int, ...]  # GGUF order: shape[0] is the contiguous row length
    offset: int  # absolute byte offset in the file
    nbytes: int
    _file: "GGUFFile" = field(repr=False)
    _data: mx.array | None = field(default=None, repr=False)

    @property
    def data(self) -> mx.array:
        """The tensor's raw GGUF bytes, uint8 [rows, row_bytes], created on first use.

        Two dimensions, not one: MLX shapes are 32-bit, and a table can exceed 2 GiB
        (an F16 Muse Glimmer output.weight is 2.69 GB)."""
        if self._data is None:
            self._data = mx.array(self.numpy().reshape(self.rows, self.row_bytes))
            self._file._release(self.offset, self.nbytes)
        return self._data

    def numpy(self) -> np.ndarray:
        """A read-only numpy view of the raw bytes inside the memory map (no copy)."""
        return self._file._view(self.offset, self.nbytes)

    @property
    def row_length(self) -> int:
        return self.shape[0]

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        return block_format(self.ggml_type).row_bytes(self.row_length)


@dataclass
class StackedRows:
    """Several 2-D tensors of one format and one row length, their rows stacked in one uint8
    array (still raw GGUF blocks): one product serves them all (stack_rows). Quacks like a
    GGUFTensor for ops.linear: name, ggml_type, GGUF shape [row_length, total rows], data."""
    name: str
    ggml_type: GGMLType
    shape: tuple[int, int]
    data: mx.array

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def stack_rows(tensors: list[GGUFTensor]) -> StackedRows:
    """Stack the rows of `tensors` (same ggml type and row length) into one array. Each tensor's
    `data` becomes a view of its rows in the stack, so the bytes are held once."""
    first = tensors[0]
    for tensor in tensors:
        if len(tensor.shape) != 2 or tensor.ggml_type != first.ggml_type or tensor.shape[0] != first.shape[0]:
            raise ValueError(f"cannot stack {tensor.name!r} ({tensor.ggml_type.name} {list(tensor.shape)}) "
                             f"with {first.name!r} ({first.ggml_type.name} {list(first.shape)})")
    if any(t._data is not None for t in tensors):
        stacked = mx.concatenate([t.data for t in tensors], axis=0)
    else:  # straight from the map: one copy into MLX memory, as .data would make
        stacked = mx.array(np.concatenate([t.numpy().reshape(t.rows, t.row_bytes) for t in tensors]))
        for t in tensors:
            t._file._release(t.offset, t.nbytes)
    mx.eval(stacked)
    start = 0
    for t in tensors:
        t._data = stacked[start : start + t.rows]
        start += t.rows
    return StackedRows("+".join(t.name for t in tensors), first.ggml_type, (first.shape[0], start), stacked)


class GGUFFile:
    """An open GGUF file. Use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd = open(self.path, "rb")
        size = os.fstat(self._fd.fileno()).st_size
        if size == 0:
            self._fd.close()
            raise TruncatedFileError(f"{self.path}: empty file, no GGUF header")
        self._map = mmap.mmap(self._fd.fileno(), 0, access=mmap.ACCESS_READ)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.size = size
        self.metadata: dict[str, object] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        self.on_copy = None  # called with the byte count of each range copied out of the map
        try:
            self._parse()
        except Exception:
            self.close()
            raise

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        self._bytes = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a numpy view still refers to it; the OS unmaps when that goes
            self._map = None
        self._fd.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- summaries ------------------------------------------------------------------------

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def bytes_by_type(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for tensor in self.tensors.values():
            totals[tensor.ggml_type.name] = totals.get(tensor.ggml_type.name, 0) + tensor.nbytes
        return totals

    # -- parsing --------------------------------------------------------------------------

    def _release(self, offset: int, length: int) -> None:
        """Drop the map's resident pages of a range just copied into MLX memory, so that a
        loaded model costs its size once in resident memory, not twice (file pages + copy).
        The map stays valid: a later read faults the pages back in from the file. The copy
        is reported to on_copy (a loader's progress)."""
        if self.on_copy is not None:
            self.on_copy(length)
        page = mmap.PAGESIZE
        start = -(-offset // page) * page
        end = (offset + length) // page * page
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _view(self, offset: int, length: int) -> np.ndarray:
        if self._bytes is None:
            raise GGUFError(f"{self.path}: file is closed")
        return self._bytes[offset : offset + length]

    def _need(self, pos: int, length: int, what: str) -> None:
        if length < 0 or pos + length > self.size:
            raise TruncatedFileError(
                f"{self.path}: {what} needs {length} bytes at offset {pos}, "
                f"but the file ends at {self.size}"
            )

    def _scalar(self, pos: int, dtype: np.dtype, what: str):
        self._need(pos, dtype.itemsize, what)
        value = np.frombuffer(self._map, dtype=dtype, count=1, offset=pos)[0]
        return value.item(), pos + dtype.itemsize

    def _string(self, pos: int, what: str) -> tuple[str, int]:
        length, pos = self._scalar(pos, _SCALAR_DTYPES[10], f"{what} (string length)")
        self._need(pos, length, f"{what} (string of {length} bytes)")
        text = bytes(self._map[pos : pos + length]).decode("utf-8", errors="replace")
        return text, pos + length

    def _value(self, pos: int, value_type: int, key: str):
        if value_type in _SCALAR_DTYPES:
            value, pos = self._scalar(pos, _SCALAR_DTYPES[value_type], f"metadata {key!r}")
            return (bool(value) if value_type == _BOOL else value), pos
        if value_type == _STRING:
            return self._string(pos, f"metadata {key!r}")
        if value_type == _ARRAY:
            item_type, pos = self._scalar(pos, _SCALAR_DTYPES[4], f"metadata {key!r} (array type)")
            count, pos = self._scalar(pos, _SCALAR_DTYPES[10], f"metadata {key!r} (array length)")
            if item_type in _SCALAR_DTYPES:
                dtype = _SCALAR_DTYPES[item_type]
                # Check the declared size against the file before allocating anything.
                self._need(pos, count * dtype.itemsize, f"metadata {key!r} ({count} items)")
                items = np.frombuffer(self._map, dtype=dtype, count=count, offset=pos)
                values = items.astype(bool).tolist() if item_type == _BOOL else items.tolist()
                return values, pos + count * dtype.itemsize
            if item_type == _STRING:
                # Each string takes at least its 8-byte length.
                self._need(pos, count * 8, f"metadata {key!r} ({count} strings)")
                values = []
                for index in range(count):
                    text, pos = self._string(pos, f"metadata {key!r}[{index}]")
                    values.append(text)
                return values, pos
            if item_type == _ARRAY:
                self._need(pos, count * 12, f"metadata {key!r} ({count} nested arrays)")
                values = []
                for index in range(count):
                    nested, pos = self._value(pos, _ARRAY, f"{key}[{index}]")
                    values.append(nested)
                return values, pos
            raise BadMetadataError(f"{self.path}: metadata {key!r} has array items of unknown type {item_type}")
        raise BadMetadataError(f"{self.path}: metadata {key!r} has unknown value type {value_type}")

    def _parse(self) -> None:
        self._need(0, 4, "magic")
        magic = bytes(self._map[0:4])
        if magic != MAGIC:
            raise BadMagicError(f"{self.path}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
        version, pos = self._scalar(4, _SCALAR_DTYPES[4], "version")
        if version not in SUPPORTED_VERSIONS:
            raise UnsupportedVersionError(
                f"{self.path}: GGUF version {version} is not supported (supported: {SUPPORTED_VERSIONS})"
            )
        tensor_count, pos = self._scalar(pos, _SCALAR_DTYPES[10], "tensor count")
        kv_count, pos = self._scalar(pos, _SCALAR_DTYPES[10], "metadata count")
        # Every key-value pair takes at least 12 bytes, every tensor info at least 24.
        self._need(pos, kv_count * 12, f"{kv_count} metadata entries")
        self._need(pos, tensor_count * 24, f"{tensor_count} tensor infos")

        for _ in range(kv_count):
            key, pos = self._string(pos, "metadata key")
            value_type, pos = self._scalar(pos, _SCALAR_DTYPES[4], f"metadata {key!r} (type)")
            if key in self.metadata:
                raise BadMetadataError(f"{self.path}: metadata key {key!r} appears twice")
            self.metadata[key], pos = self._value(pos, value_type, key)

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise BadMetadataError(
                f"{self.path}: general.alignment = {alignment!r} is not a positive power of two"
            )
        self.alignment = alignment

        infos = []
        seen: set[str] = set()
        for index in range(tensor_count):
            name, pos = self._string(pos, f"tensor info {index} (name)")
            n_dims, pos = self._scalar(pos, _SCALAR_DTYPES[4], f"tensor {name!r} (dims)")
            if not 1 <= n_dims <= MAX_DIMS:
                raise TensorLayoutError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS})")
            self._need(pos, 8 * n_dims + 12, f"tensor {name!r} (shape, type, offset)")
            shape = tuple(int(n) for n in np.frombuffer(self._map, "<u8", n_dims, pos))
            pos += 8 * n_dims
            type_id, pos = self._scalar(pos, _SCALAR_DTYPES[4], f"tensor {name!r} (type)")
            offset, pos = self._scalar(pos, _SCALAR_DTYPES[10], f"tensor {name!r} (offset)")
            if name in seen:
                raise TensorLayoutError(f"{self.path}: tensor name {name!r} appears twice")
            seen.add(name)
            infos.append((name, shape, type_id, offset))

        # Refuse unknown types before any tensor is read.
        for name, shape, type_id, offset in infos:
            try:
                fmt = block_format(type_id)
            except UnsupportedFormatError as error:
                raise UnknownTensorTypeError(f"{self.path}: tensor {name!r}: {error}") from None

        data_start = -(-pos // alignment) * alignment
        self.data_offset = data_start
        for name, shape, type_id, offset in infos:
            fmt = block_format(type_id)
            if any(n == 0 for n in shape) or any(n >= 1 << 40 for n in shape):
                raise TensorLayoutError(f"{self.path}: tensor {name!r} has an invalid shape {list(shape)}")
            if shape[0] % fmt.block_size:
                raise TensorLayoutError(
                    f"{self.path}: tensor {name!r} ({fmt.name}) has rows of {shape[0]} elements, "
                    f"not a whole number of {fmt.block_size}-element blocks"
                )
            elements = int(np.prod(shape, dtype=object))
            nbytes = elements // fmt.block_size * fmt.type_size
            if offset % alignment:
                raise TensorLayoutError(
                    f"{self.path}: tensor {name!r} data offset {offset} is not aligned to {alignment}"
                )
            start = data_start + offset
            if start + nbytes > self.size:
                raise TensorLayoutError(
                    f"{self.path}: tensor {name!r} ({fmt.name} {list(shape)}) needs bytes "
                    f"{start}..{start + nbytes}, but the file ends at {self.size}"
                )
            self.tensors[name] = GGUFTensor(name, fmt.ggml_type, shape, start, nbytes, self)


def read(path: str | os.PathLike) -> GGUFFile:
    """Open and validate a GGUF file. Tensor bytes are read lazily through `.data`."""
    return GGUFFile(path)
