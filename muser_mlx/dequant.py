"""The block formats as MLX array ops: the path every kernel takes where there is no GPU.

Where the numpy reference (formats.py) and the kernels derive each element's address from
its index, these work on a block's structure: slice the fields, split the nibbles and bit
planes with shifts and masks, and lay the planes out in element order with reshapes. A
different route to the same numbers, which is why the tests can hold one against the other.

Every function takes rows [R, row_bytes] uint8 and returns [R, row_length] float32.
"""

from __future__ import annotations

import mlx.core as mx
from gguf import GGMLQuantizationType as GGMLType

from muser_mlx.formats import IQ4_VALUES, block_format

_IQ4 = mx.array(IQ4_VALUES)


def _f16(blocks: mx.array, start: int) -> mx.array:
    """The f16 field at byte `start` of every block: [R, nb, 1] float32."""
    return blocks[..., start : start + 2].view(mx.float16).astype(mx.float32)


def _shifts(count: int, step: int) -> mx.array:
    return mx.arange(0, count * step, step, dtype=mx.uint8)


def _nibbles32(qs: mx.array) -> mx.array:
    """[R, nb, 16] bytes -> [R, nb, 32]: low nibbles are elements 0-15, high ones 16-31."""
    return mx.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits32(qh: mx.array) -> mx.array:
    """[R, nb, 4] bytes of a little-endian u32 -> [R, nb, 32] bits, bit w for element w."""
    bits = (mx.expand_dims(qh, -1) >> _shifts(8, 1)) & 1
    return bits.reshape(*qh.shape[:-1], 32)


def _per16(scale: mx.array, values: mx.array) -> mx.array:
    """Multiply [R, nb, 256] values by one scale per 16 elements ([R, nb, 16])."""
    grouped = values.reshape(*values.shape[:-1], 16, 16) * mx.expand_dims(scale, -1)
    return grouped.reshape(values.shape)


def _iq4_nl(b):
    return _IQ4[_nibbles32(b[..., 2:18])] * _f16(b, 0)


def _planes_2bit(qs: mx.array) -> mx.array:
    """[R, nb, 64] bytes -> [R, nb, 256] 2-bit values: two halves x four planes x 32 bytes."""
    halves = mx.expand_dims(qs.reshape(*qs.shape[:-1], 2, 32), -2)  # [R, nb, 2, 1, 32]
    planes = (halves >> mx.expand_dims(_shifts(4, 2), -1)) & 3  # [R, nb, 2, 4, 32]
    return planes.reshape(*qs.shape[:-1], 256)


def _q2_k(b):
    packed = b[..., 0:16]
    q = _planes_2bit(b[..., 16:80]).astype(mx.float32)
    scaled = _per16((packed & 15).astype(mx.float32) * _f16(b, 80), q)
    return scaled - mx.repeat((packed >> 4).astype(mx.float32) * _f16(b, 82), 16, axis=-1)


def _q3_k(b):
    hmask = mx.expand_dims(b[..., 0:32], -2)  # [R, nb, 1, 32]
    high_bit = ((hmask >> mx.expand_dims(_shifts(8, 1), -1)) & 1).reshape(*b.shape[:-1], 256)
    q = _planes_2bit(b[..., 32:96]).astype(mx.float32) - 4.0 * (1 - high_bit).astype(mx.float32)
    packed = b[..., 96:108]
    low = mx.concatenate([packed[..., 0:8] & 15, packed[..., 0:8] >> 4], axis=-1)
    top = (mx.expand_dims(packed[..., 8:12], -2) >> mx.expand_dims(_shifts(4, 2), -1)) & 3
    scale = (low | (top.reshape(*b.shape[:-1], 16) << 4)).astype(mx.float32) - 32.0
    return _per16(scale * _f16(b, 108), q)


def _k4_scales(packed: mx.array) -> tuple[mx.array, mx.array]:
    """12 packed bytes -> 8 six-bit scales and 8 six-bit mins, [R, nb, 8] each."""
    first, second, tail = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = mx.concatenate([first & 63, (tail & 15) | ((first >> 6) << 4)], axis=-1)
    minimum = mx.concatenate([second & 63, (tail >> 4) | ((second >> 6) << 4)], axis=-1)
    return scale.astype(mx.float32), minimum.astype(mx.float32)


def _k4_nibbles(qs: mx.array) -> mx.array:
    """[R, nb, 128] -> [R, nb, 8, 32]: each 32-byte group gives a low then a high sub-block."""
    groups = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return mx.concatenate([groups & 15, groups >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _q6_k(b):
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 64)
    qh = mx.expand_dims(b[..., 128:192].reshape(*lead, 2, 32), -2)  # [R, nb, 2, 1, 32]
    low, high_half = ql[..., 0:32], ql[..., 32:64]
    low4 = mx.stack([low & 15, high_half & 15, low >> 4, high_half >> 4], axis=-2)
    top2 = (qh >> mx.expand_dims(_shifts(4, 2), -1)) & 3
    q = (low4 | (top2 << 4)).astype(mx.float32).reshape(*lead, 256) - 32.0
    scale = b[..., 192:208].view(mx.int8).astype(mx.float32) * _f16(b, 208)
    return _per16(scale, q)


def _iq4_xs(b):
    lead = b.shape[:-1]
    scales_low = (mx.expand_dims(b[..., 4:8], -1) >> _shifts(2, 4)) & 15  # [R, nb, 4, 2]
    scales_high = b[..., 2:4].view(mx.uint16).astype(mx.uint32)  # [R, nb, 1]
    top = (scales_high >> mx.arange(0, 16, 2, dtype=mx.uint32)) & 3  # [R, nb, 8]
    scale = (scales_low.reshape(*lead, 8).astype(mx.uint32) | (top << 4)).astype(mx.float32) - 32
    qs = b[..., 8:136].reshape(*lead, 8, 16)
    values = _IQ4[mx.concatenate([qs & 15, qs >> 4], axis=-1)]  # [R, nb, 8, 32]
    d = mx.expand_dims(scale * _f16(b, 0), -1)
    return (values * d).reshape(*lead, 256)


_DECODERS = {
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q6_K: _q6_k,
    GGMLType.IQ4_NL: _iq4_nl,
    GGMLType.IQ4_XS: _iq4_xs,
}


# ---------------------------------------------------------------------------------------------
# Formats with one scale and bias per 32 values, as affine codes: value = scale * code + bias.
# dequantize_rows applies them; the CPU matvec hands them to MLX's quantized_matmul at 8 bits.
# (The formats above have 16-value scales or a lookup table.)
# ---------------------------------------------------------------------------------------------


def _offset(scale: mx.array, codes: float) -> tuple[mx.array, mx.array]:
    """A format centred on `codes` (value = scale * (code - codes)) as (scale, bias)."""
    return scale, scale * -codes


def _codes_q4_0(b):
    return _nibbles32(b[..., 2:18]), *_offset(_f16(b, 0), 8.0)


def _codes_q4_1(b):
    return _nibbles32(b[..., 4:20]), _f16(b, 0), _f16(b, 2)


def _codes_q5_0(b):
    return _nibbles32(b[..., 6:22]) | (_bits32(b[..., 2:6]) << 4), *_offset(_f16(b, 0), 16.0)


def _codes_q5_1(b):
    return _nibbles32(b[..., 8:24]) | (_bits32(b[..., 4:8]) << 4), _f16(b, 0), _f16(b, 2)


def _codes_q8_0(b):
    return b[..., 2:34] ^ 128, *_offset(_f16(b, 0), 128.0)


def _codes_k4(b, q):
    """q [R, nb, 8, 32] -> codes [R, nb*8, 32] with d*scale and -dmin*min per sub-block."""
    scale, minimum = _k4_scales(b[..., 4:16])
    lead = b.shape[:-2]
    groups = b.shape[-2] * 8
    return (q.reshape(*lead, groups, 32), (_f16(b, 0) * scale).reshape(*lead, groups, 1),
            (-_f16(b, 2) * minimum).reshape(*lead, groups, 1))


def _codes_q4_k(b):
    return _codes_k4(b, _k4_nibbles(b[..., 16:144]))


def _codes_q5_k(b):
    qh = mx.expand_dims(b[..., 16:48], -2)
    fifth = (qh >> mx.expand_dims(_shifts(8, 1), -1)) & 1
    return _codes_k4(b, _k4_nibbles(b[..., 48:176]) | (fifth << 4))


_CODERS = {
    GGMLType.Q4_0: _codes_q4_0,
    GGMLType.Q4_1: _codes_q4_1,
    GGMLType.Q5_0: _codes_q5_0,
    GGMLType.Q5_1: _codes_q5_1,
    GGMLType.Q8_0: _codes_q8_0,
    GGMLType.Q4_K: _codes_q4_k,
    GGMLType.Q5_K: _codes_q5_k,
}
AFFINE_CODE_TYPES = frozenset(_CODERS)


def affine_codes(rows: mx.array, ggml_type) -> tuple[mx.array, mx.array, mx.array]:
    """rows [R, row_bytes] uint8 (raw GGUF) of a format in AFFINE_CODE_TYPES ->
    codes uint8 [R, row_length] (0..255), scale and bias float32 [R, row_length / 32],
    such that value = scale[g] * code + bias[g] for the 32 values of group g."""
    fmt = block_format(ggml_type)
    count, row_bytes = rows.shape
    blocks = rows.reshape(count, row_bytes // fmt.type_size, fmt.type_size)
    codes, scale, bias = _CODERS[fmt.ggml_type](blocks)
    return codes.reshape(count, -1), scale.reshape(count, -1), bias.reshape(count, -1)


def dequantize_rows(rows: mx.array, ggml_type) -> mx.array:
    """rows [R, row_bytes] uint8 (raw GGUF) -> [R, row_length] float32."""
    fmt = block_format(ggml_type)
    count, row_bytes = rows.shape
    if fmt.ggml_type == GGMLType.F32:
        return rows.view(mx.float32)
    if fmt.ggml_type == GGMLType.F16:
        return rows.view(mx.float16).astype(mx.float32)
    if fmt.ggml_type == GGMLType.BF16:
        return (rows.view(mx.uint16).astype(mx.uint32) << 16).view(mx.float32)
    blocks = rows.reshape(count, row_bytes // fmt.type_size, fmt.type_size)
    if fmt.ggml_type in _CODERS:
        codes, scale, bias = _CODERS[fmt.ggml_type](blocks)  # [R, groups, 32], [R, groups, 1] x2
        return (codes.astype(mx.float32) * scale + bias).reshape(count, -1)
    return _DECODERS[fmt.ggml_type](blocks).reshape(count, -1)
