"""Helpers for building test data: a small GGUF writer and random valid blocks.

The writer is deliberately plain so tests can also build broken files from its pieces
(`gguf_bytes` returns the bytes; tests cut or patch them).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from muser_mlx.formats import block_format, quantize, tensor_bytes

_INT_TYPES = {"u8": 0, "i8": 1, "u16": 2, "i16": 3, "u32": 4, "i32": 5, "u64": 10, "i64": 11}
_PACK = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value_type(value) -> int:
    if isinstance(value, bool):
        return 7
    if isinstance(value, int):
        return 5 if -(2**31) <= value < 2**31 else 11
    if isinstance(value, float):
        return 6
    if isinstance(value, str):
        return 8
    if isinstance(value, (list, tuple)):
        return 9
    raise TypeError(f"cannot store {type(value).__name__} in GGUF metadata")


def _value(value, value_type: int) -> bytes:
    if value_type == 8:
        return _string(value)
    if value_type == 9:
        item_type = _value_type(value[0]) if len(value) else 5
        if item_type == 5 and any(not -(2**31) <= v < 2**31 for v in value):
            item_type = 11
        body = b"".join(_value(v, item_type) for v in value)
        return struct.pack("<IQ", item_type, len(value)) + body
    return struct.pack(_PACK[value_type], value)


def gguf_bytes(
    metadata: dict,
    tensors: dict[str, tuple[GGMLType, tuple[int, ...], np.ndarray]],
    alignment: int = 32,
    version: int = 3,
) -> bytes:
    """A GGUF file as bytes. tensors: name -> (ggml_type, GGUF shape, raw uint8 bytes).
    A metadata value given as (type_name, value), e.g. ("u32", 7), fixes its integer type."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata))
    for key, value in metadata.items():
        if isinstance(value, tuple) and len(value) == 2 and value[0] in _INT_TYPES:
            value_type = _INT_TYPES[value[0]]
            value = value[1]
        else:
            value_type = _value_type(value)
        head += _string(key) + struct.pack("<I", value_type) + _value(value, value_type)
    offset = 0
    blobs = []
    for name, (ggml_type, shape, raw) in tensors.items():
        raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
        head += _string(name) + struct.pack("<I", len(shape))
        head += struct.pack(f"<{len(shape)}Q", *shape)
        head += struct.pack("<IQ", int(ggml_type), offset)
        padded = -(-raw.size // alignment) * alignment
        blobs.append(raw.tobytes() + bytes(padded - raw.size))
        offset += padded
    head += bytes(-len(head) % alignment)
    return head + b"".join(blobs)


def write_gguf(path, metadata: dict, tensors: dict, alignment: int = 32) -> Path:
    path = Path(path)
    path.write_bytes(gguf_bytes(metadata, tensors, alignment))
    return path


def random_blocks(rng: np.random.Generator, ggml_type, rows: int, row_length: int) -> np.ndarray:
    """Valid raw bytes for a [row_length, rows] tensor: realistic values quantized the way
    llama.cpp would, or (for formats with no quantizer) random bytes with finite f16 scales.
    Values are drawn fresh from `rng`; never all zeros."""
    fmt = block_format(ggml_type)
    values = rng.standard_normal((rows, row_length)).astype(np.float32)
    values *= rng.uniform(0.01, 2.0, size=(rows, 1)).astype(np.float32)
    try:
        return quantize(values, fmt.ggml_type)
    except ValueError:
        pass
    raw = rng.integers(0, 256, size=tensor_bytes(fmt.ggml_type, (row_length, rows)), dtype=np.uint8)
    blocks = raw.reshape(-1, fmt.type_size)
    for start in _F16_FIELDS[fmt.ggml_type]:
        scale = rng.uniform(0.001, 0.1, size=blocks.shape[0]).astype(np.float16)
        blocks[:, start : start + 2] = scale.reshape(-1, 1).view(np.uint8)
    return raw.reshape(rows, -1)


# Byte offsets of the f16 scale fields of formats with no quantizer here.
_F16_FIELDS = {
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
}
