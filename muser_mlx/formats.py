"""GGUF block formats: the table, a numpy reference decoder, and reference quantizers.

A block format is a row of data (elements per block, bytes per block) plus one decode
function. Every decoder here works the way the kernels do: for each element index inside a
block it derives the byte, the bit position and the scale it needs (for Q4_K the seed's
four-level address: super-block, sub-block, byte, nibble), then applies that address to all
blocks at once. Arithmetic is float32, in ggml's order, so results match ggml to rounding.

The quantizers follow llama.cpp's reference rounding (``quantize_row_*_ref``), including the
scale search of the K-quants, so tests can build realistic files from float weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

QK_K = 256  # elements per K-quant super-block


@dataclass(frozen=True)
class BlockFormat:
    ggml_type: GGMLType
    block_size: int  # elements per block
    type_size: int  # bytes per block

    @property
    def name(self) -> str:
        return self.ggml_type.name

    def row_bytes(self, row_length: int) -> int:
        """Bytes of one row of `row_length` elements; the row must be whole blocks."""
        if row_length % self.block_size:
            raise ValueError(
                f"{self.name}: a row of {row_length} elements is not a whole number of "
                f"{self.block_size}-element blocks"
            )
        return row_length // self.block_size * self.type_size


FORMATS: dict[GGMLType, BlockFormat] = {
    fmt.ggml_type: fmt
    for fmt in [
        BlockFormat(GGMLType.F32, 1, 4),
        BlockFormat(GGMLType.F16, 1, 2),
        BlockFormat(GGMLType.BF16, 1, 2),
        BlockFormat(GGMLType.Q4_0, 32, 18),  # d f16 | 16 B nibbles
        BlockFormat(GGMLType.Q4_1, 32, 20),  # d f16 | m f16 | 16 B nibbles
        BlockFormat(GGMLType.Q5_0, 32, 22),  # d f16 | qh u32 | 16 B nibbles
        BlockFormat(GGMLType.Q5_1, 32, 24),  # d f16 | m f16 | qh u32 | 16 B nibbles
        BlockFormat(GGMLType.Q8_0, 32, 34),  # d f16 | 32 int8
        BlockFormat(GGMLType.Q2_K, QK_K, 84),  # scales[16] | qs[64] | d | dmin
        BlockFormat(GGMLType.Q3_K, QK_K, 110),  # hmask[32] | qs[64] | scales[12] | d
        BlockFormat(GGMLType.Q4_K, QK_K, 144),  # d | dmin | scales[12] | qs[128]
        BlockFormat(GGMLType.Q5_K, QK_K, 176),  # d | dmin | scales[12] | qh[32] | qs[128]
        BlockFormat(GGMLType.Q6_K, QK_K, 210),  # ql[128] | qh[64] | scales int8[16] | d
        BlockFormat(GGMLType.IQ4_NL, 32, 18),  # d f16 | 16 B nibbles into a 16-entry table
        BlockFormat(GGMLType.IQ4_XS, QK_K, 136),  # d | scales_h u16 | scales_l[4] | qs[128]
    ]
}

# The non-linear 4-bit code book of IQ4_NL / IQ4_XS (llama.cpp's kvalues_iq4nl).
IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)


class UnsupportedFormatError(ValueError):
    """A ggml type that muser_mlx has no decoder for."""


def block_format(ggml_type: GGMLType | str | int) -> BlockFormat:
    """The table row of a ggml type, given as enum, name ('Q4_K') or number (12)."""
    try:
        if isinstance(ggml_type, str):
            ggml_type = GGMLType[ggml_type.upper()]
        else:
            ggml_type = GGMLType(ggml_type)
    except (KeyError, ValueError):
        raise UnsupportedFormatError(f"unknown ggml type {ggml_type!r}") from None
    if ggml_type not in FORMATS:
        raise UnsupportedFormatError(
            f"ggml type {ggml_type.name} has no decoder in muser_mlx "
            f"(supported: {', '.join(f.name for f in FORMATS.values())})"
        )
    return FORMATS[ggml_type]


def tensor_bytes(ggml_type: GGMLType | str | int, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes of a tensor of GGUF shape [ne0, ne1, ...] (ne0 = the contiguous row length)."""
    fmt = block_format(ggml_type)
    rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    return fmt.row_bytes(int(shape[0])) * rows


# ---------------------------------------------------------------------------------------------
# Decoding: helpers shared by several formats
# ---------------------------------------------------------------------------------------------


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 (little-endian f16) -> [...] float32."""
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32)


def _u32(four_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(four_bytes).view("<u4")[..., 0]


def _k4_scale_min(scales: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 6-bit (scale, min) pair of sub-block `index` (0..7) from 12 packed bytes.

    scales: [blocks, 12] uint8; index: [n] ints. Returns two [blocks, n] uint8 arrays.
    Sub-blocks 0-3 keep 6 bits in bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7 keep their
    low 4 bits in the nibbles of bytes 8-11 and their top 2 bits in the top of bytes 0-7.
    """
    first = index < 4
    j = index % 4
    scale = np.where(
        first, scales[:, j] & 63, (scales[:, 8 + j] & 0x0F) | ((scales[:, j] >> 6) << 4)
    )
    minimum = np.where(
        first, scales[:, 4 + j] & 63, (scales[:, 8 + j] >> 4) | ((scales[:, 4 + j] >> 6) << 4)
    )
    return scale.astype(np.uint8), minimum.astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# Decoding: one function per format. Each takes blocks [n_blocks, type_size] uint8 and returns
# [n_blocks, block_size] float32.
# ---------------------------------------------------------------------------------------------


def _decode_f32(blocks):
    return blocks.view("<f4").astype(np.float32)


def _decode_f16(blocks):
    return blocks.view("<f2").astype(np.float32)


def _decode_bf16(blocks):
    return (blocks.view("<u2").astype(np.uint32) << 16).view(np.float32)


def _q4_nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 nibbles: element j is the low nibble of byte j, element j+16 the high."""
    within = np.arange(32)
    return (qs[:, within % 16] >> (4 * (within // 16))) & 0x0F


def _q5_high_bits(qh: np.ndarray) -> np.ndarray:
    """Bit j of the little-endian u32 qh is the fifth bit of element j."""
    return ((_u32(qh)[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _decode_q4_0(blocks):
    d = _f16(blocks[:, 0:2])[:, None]
    q = _q4_nibbles(blocks[:, 2:18]).astype(np.float32)
    return (q - 8.0) * d


def _decode_q4_1(blocks):
    d = _f16(blocks[:, 0:2])[:, None]
    m = _f16(blocks[:, 2:4])[:, None]
    q = _q4_nibbles(blocks[:, 4:20]).astype(np.float32)
    return q * d + m


def _decode_q5_0(blocks):
    d = _f16(blocks[:, 0:2])[:, None]
    q = _q4_nibbles(blocks[:, 6:22]) | (_q5_high_bits(blocks[:, 2:6]) << 4)
    return (q.astype(np.float32) - 16.0) * d


def _decode_q5_1(blocks):
    d = _f16(blocks[:, 0:2])[:, None]
    m = _f16(blocks[:, 2:4])[:, None]
    q = _q4_nibbles(blocks[:, 8:24]) | (_q5_high_bits(blocks[:, 4:8]) << 4)
    return q.astype(np.float32) * d + m


def _decode_q8_0(blocks):
    d = _f16(blocks[:, 0:2])[:, None]
    return blocks[:, 2:34].view(np.int8).astype(np.float32) * d


def _decode_iq4_nl(blocks):
    d = _f16(blocks[:, 0:2])[:, None]
    return IQ4_VALUES[_q4_nibbles(blocks[:, 2:18])] * d


# Element address inside a 256-element super-block, shared by Q2_K / Q3_K (2-bit planes):
# 128-element halves, each read from 32 bytes; within a half, element w picks the byte
# w % 32 and the 2-bit plane w // 32 of that byte; scales go per 16 elements.
_W = np.arange(QK_K)
_HALF = _W // 128
_PLANE = (_W % 128) // 32
_BYTE_2BIT = 32 * _HALF + _W % 32
_SCALE_16 = _W // 16


def _decode_q2_k(blocks):
    scales = blocks[:, 0:16][:, _SCALE_16]  # [n, 256]
    qs = blocks[:, 16:80]
    d = _f16(blocks[:, 80:82])[:, None]
    dmin = _f16(blocks[:, 82:84])[:, None]
    q = ((qs[:, _BYTE_2BIT] >> (2 * _PLANE)) & 3).astype(np.float32)
    return (d * (scales & 0x0F)) * q - dmin * (scales >> 4)


def _decode_q3_k(blocks):
    hmask = blocks[:, 0:32]
    qs = blocks[:, 32:96]
    packed = blocks[:, 96:108]
    d = _f16(blocks[:, 108:110])[:, None]
    # 16 six-bit scales: low 4 bits from a nibble of bytes 0-7, top 2 bits from bytes 8-11.
    j = np.arange(16)
    low = np.where(j < 8, packed[:, j % 8] & 0x0F, packed[:, j % 8] >> 4)
    high = (packed[:, 8 + j % 4] >> (2 * (j // 4))) & 3
    scale = (low | (high << 4)).astype(np.float32) - 32.0  # [n, 16]
    q = ((qs[:, _BYTE_2BIT] >> (2 * _PLANE)) & 3).astype(np.float32)
    # The high bit comes from hmask byte w % 32, bit (w // 32); a clear bit subtracts 4.
    high_bit = (hmask[:, _W % 32] >> (_W // 32)) & 1
    q = q - np.where(high_bit == 1, 0.0, 4.0)
    return (d * scale[:, _SCALE_16]) * q


# Q4_K / Q5_K element address (the seed's four levels): super-block (the row of `blocks`),
# 64-element group, low or high nibble (32-element sub-block), byte lane.
_GROUP = _W // 64
_UPPER = (_W % 64) // 32
_LANE = _W % 32
_SUB_BLOCK = 2 * _GROUP + _UPPER
_QBYTE = 32 * _GROUP + _LANE


def _decode_q4_k(blocks):
    d = _f16(blocks[:, 0:2])[:, None]
    dmin = _f16(blocks[:, 2:4])[:, None]
    scale, minimum = _k4_scale_min(blocks[:, 4:16], _SUB_BLOCK)
    q = (blocks[:, 16:144][:, _QBYTE] >> (4 * _UPPER)) & 0x0F
    return (d * scale) * q - dmin * minimum


def _decode_q5_k(blocks):
    d = _f16(blocks[:, 0:2])[:, None]
    dmin = _f16(blocks[:, 2:4])[:, None]
    scale, minimum = _k4_scale_min(blocks[:, 4:16], _SUB_BLOCK)
    qh = blocks[:, 16:48]
    q = (blocks[:, 48:176][:, _QBYTE] >> (4 * _UPPER)) & 0x0F
    q = q | (((qh[:, _LANE] >> _SUB_BLOCK) & 1) << 4)
    return (d * scale) * q - dmin * minimum


def _decode_q6_k(blocks):
    ql = blocks[:, 0:128]
    qh = blocks[:, 128:192]
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])[:, None]
    # 128-element halves; within one, element w: quarter w // 32 picks the low/high nibble of
    # ql byte (w % 64) and the 2-bit plane (w // 32) of qh byte (w % 32).
    half, w = _W // 128, _W % 128
    quarter, lane = w // 32, w % 32
    low = (ql[:, 64 * half + w % 64] >> (4 * (quarter // 2))) & 0x0F
    high = (qh[:, 32 * half + lane] >> (2 * quarter)) & 3
    q = (low | (high << 4)).astype(np.float32) - 32.0
    return (d * scales[:, _SCALE_16]) * q


def _decode_iq4_xs(blocks):
    d = _f16(blocks[:, 0:2])[:, None]
    scales_h = blocks[:, 2:4].copy().view("<u2")[:, 0].astype(np.uint32)
    scales_l = blocks[:, 4:8]
    qs = blocks[:, 8:136]
    sub = np.arange(8)
    low = (scales_l[:, sub // 2] >> (4 * (sub % 2))) & 0x0F
    high = (scales_h[:, None] >> (2 * sub)) & 3
    scale = (low | (high << 4)).astype(np.float32) - 32.0  # [n, 8]
    sub_of, within = _W // 32, _W % 32
    nibble = (qs[:, 16 * sub_of + within % 16] >> (4 * (within // 16))) & 0x0F
    return (d * scale[:, sub_of]) * IQ4_VALUES[nibble]


_DECODERS: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLType.F32: _decode_f32,
    GGMLType.F16: _decode_f16,
    GGMLType.BF16: _decode_bf16,
    GGMLType.Q4_0: _decode_q4_0,
    GGMLType.Q4_1: _decode_q4_1,
    GGMLType.Q5_0: _decode_q5_0,
    GGMLType.Q5_1: _decode_q5_1,
    GGMLType.Q8_0: _decode_q8_0,
    GGMLType.Q2_K: _decode_q2_k,
    GGMLType.Q3_K: _decode_q3_k,
    GGMLType.Q4_K: _decode_q4_k,
    GGMLType.Q5_K: _decode_q5_k,
    GGMLType.Q6_K: _decode_q6_k,
    GGMLType.IQ4_NL: _decode_iq4_nl,
    GGMLType.IQ4_XS: _decode_iq4_xs,
}


def dequantize(data: np.ndarray, ggml_type: GGMLType | str | int, shape) -> np.ndarray:
    """Decode raw GGUF bytes to float32.

    data:  uint8 bytes of the tensor (any shape; read flat)
    shape: the GGUF shape [ne0, ne1, ...], ne0 = the contiguous row length
    returns a row-major float32 array of shape reversed(shape), e.g. [vocab, hidden] for
    token_embd.weight of GGUF shape [hidden, vocab].
    """
    fmt = block_format(ggml_type)
    shape = tuple(int(n) for n in shape)
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    expected = tensor_bytes(fmt.ggml_type, shape)
    if raw.size != expected:
        raise ValueError(
            f"{fmt.name} tensor of shape {list(shape)} needs {expected} bytes, got {raw.size}"
        )
    blocks = raw.reshape(-1, fmt.type_size)
    values = _DECODERS[fmt.ggml_type](blocks).astype(np.float32, copy=False)
    return values.reshape(tuple(reversed(shape)))


# ---------------------------------------------------------------------------------------------
# Quantizing (llama.cpp's reference rounding). Each takes values [n_blocks, block_size] float32
# and returns blocks [n_blocks, type_size] uint8.
# ---------------------------------------------------------------------------------------------

GROUP_MAX_EPS = np.float32(1e-15)


def _nearest_int(x: np.ndarray) -> np.ndarray:
    # ggml rounds with the 1.5*2^23 trick: round half to even, like np.rint.
    return np.rint(x).astype(np.int32)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _safe_inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _pack_nibbles_16(q: np.ndarray) -> np.ndarray:
    """[n, 32] values 0..15 -> [n, 16] bytes: element j low nibble, element j+16 high."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _signed_absmax(values: np.ndarray) -> np.ndarray:
    """The element of largest magnitude, with its sign (first one on ties), as [n, 1]."""
    index = np.abs(values).argmax(axis=1)[:, None]
    return np.take_along_axis(values, index, axis=1)


def _quantize_q4_0(x):
    d = _signed_absmax(x) / np.float32(-8)
    q = np.minimum(15, np.trunc(x * _safe_inverse(d) + np.float32(8.5))).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _pack_nibbles_16(q)], axis=1)


def _quantize_q4_1(x):
    lo = x.min(axis=1, keepdims=True)
    hi = x.max(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    q = np.minimum(15, np.trunc((x - lo) * _safe_inverse(d) + np.float32(0.5))).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles_16(q)], axis=1)


def _q5_high_bytes(q: np.ndarray) -> np.ndarray:
    bits = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return bits.sum(axis=1, dtype=np.uint32).astype("<u4").reshape(-1, 1).view(np.uint8)


def _quantize_q5_0(x):
    d = _signed_absmax(x) / np.float32(-16)
    q = np.minimum(31, np.trunc(x * _safe_inverse(d) + np.float32(16.5))).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _q5_high_bytes(q), _pack_nibbles_16(q & 0x0F)], axis=1)


def _quantize_q5_1(x):
    lo = x.min(axis=1, keepdims=True)
    hi = x.max(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(31)
    q = np.minimum(31, np.trunc((x - lo) * _safe_inverse(d) + np.float32(0.5))).astype(np.uint8)
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(lo), _q5_high_bytes(q), _pack_nibbles_16(q & 0x0F)], axis=1
    )


def _quantize_q8_0(x):
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    scaled = x * _safe_inverse(d)
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))).astype(np.int8)  # roundf
    return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=1)


def _quantize_f16(x):
    return x.astype("<f2").view(np.uint8)


def _quantize_f32(x):
    return x.astype("<f4").view(np.uint8)


def _quantize_bf16(x):
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    quiet_nan = (bits >> 16) | 64
    return np.where(is_nan, quiet_nan, rounded).astype("<u2").view(np.uint8)


def _make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep):
    """llama.cpp's make_qkx2_quants over rows of sub-blocks: x, weights [m, n] float32.

    Finds (scale, min) minimising the weighted squared error of x ≈ scale*L - min with L in
    0..nmax, trying nstep+1 candidate scales around the plain (max-min)/nmax one.
    Returns scale [m], min [m] (as a positive number to subtract) and L [m, n] uint8.
    """
    f32 = np.float32
    lo = np.minimum(x.min(axis=1), f32(0))
    hi = x.max(axis=1)
    sum_w = weights.sum(axis=1, dtype=f32)
    sum_x = (weights * x).sum(axis=1, dtype=f32)
    flat = hi == lo
    span = np.where(flat, f32(1), hi - lo)
    iscale = f32(nmax) / span
    scale = f32(1) / iscale
    L = np.clip(_nearest_int(iscale[:, None] * (x - lo[:, None])), 0, nmax)
    diff = scale[:, None] * L + lo[:, None] - x
    best_err = (weights * diff * diff).sum(axis=1, dtype=f32)
    best_min = lo.copy()
    for step in range(nstep + 1):
        iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / span
        laux = np.clip(_nearest_int(iscale[:, None] * (x - lo[:, None])), 0, nmax).astype(f32)
        sum_l = (weights * laux).sum(axis=1, dtype=f32)
        sum_l2 = (weights * laux * laux).sum(axis=1, dtype=f32)
        sum_xl = (weights * laux * x).sum(axis=1, dtype=f32)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe_det = np.where(ok, det, f32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive_min = this_min > 0
        this_scale = np.where(
            positive_min, sum_xl / np.where(sum_l2 > 0, sum_l2, f32(1)), this_scale
        )
        this_min = np.where(positive_min, f32(0), this_min)
        diff = this_scale[:, None] * laux + this_min[:, None] - x
        err = (weights * diff * diff).sum(axis=1, dtype=f32)
        better = ok & (err < best_err)
        L = np.where(better[:, None], laux, L)
        best_err = np.where(better, err, best_err)
        scale = np.where(better, this_scale, scale)
        best_min = np.where(better, this_min, best_min)
    scale = np.where(flat, f32(0), scale)
    L = np.where(flat[:, None], 0, L)
    return scale.astype(f32), (-best_min).astype(f32), L.astype(np.uint8)


def _pack_k4_scales(scale6: np.ndarray, min6: np.ndarray) -> np.ndarray:
    """Inverse of _k4_scale_min: [n, 8] six-bit scales and mins -> [n, 12] bytes."""
    packed = np.zeros((scale6.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = scale6[:, 0:4] | ((scale6[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = min6[:, 0:4] | ((min6[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (scale6[:, 4:8] & 0x0F) | ((min6[:, 4:8] & 0x0F) << 4)
    return packed


def _quantize_k4_like(x, nmax, rmin, rdelta, nstep):
    """The shared first half of Q4_K / Q5_K: per 32-element sub-block (scale, min) search,
    then 6-bit quantization of the eight scales and mins against the super-block's d and dmin.
    Returns d, dmin [n] float16-rounded, packed scales [n, 12], and L [n, 256]."""
    f32 = np.float32
    n = x.shape[0]
    subs = x.reshape(n * 8, 32)
    av_x = np.sqrt((subs * subs).sum(axis=1, dtype=f32) / f32(32))
    weights = av_x[:, None] + np.abs(subs)
    sub_scale, sub_min, _ = _make_qkx2_quants(subs, weights, nmax, rmin, rdelta, nstep)
    sub_scale = sub_scale.reshape(n, 8)
    sub_min = sub_min.reshape(n, 8)
    max_scale = sub_scale.max(axis=1)
    max_min = sub_min.max(axis=1)
    inv_scale = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, 1), f32(0))
    inv_min = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, 1), f32(0))
    scale6 = np.minimum(63, _nearest_int(inv_scale[:, None] * sub_scale)).astype(np.uint8)
    min6 = np.minimum(63, _nearest_int(inv_min[:, None] * sub_min)).astype(np.uint8)
    d = (max_scale / f32(63)).astype(np.float16).astype(f32)
    dmin = (max_min / f32(63)).astype(np.float16).astype(f32)
    # Re-quantize each element against the scale and min the decoder will actually see.
    sub_d = (d[:, None] * scale6).astype(f32)
    sub_m = (dmin[:, None] * min6).astype(f32)
    sub_d_e = np.repeat(sub_d, 32, axis=1)
    sub_m_e = np.repeat(sub_m, 32, axis=1)
    safe = np.where(sub_d_e == 0, f32(1), sub_d_e)
    L = np.clip(_nearest_int((x + sub_m_e) / safe), 0, nmax)
    L = np.where(sub_d_e == 0, 0, L).astype(np.uint8)
    return d, dmin, _pack_k4_scales(scale6, min6), L


def _quantize_q4_k(x):
    d, dmin, scales, L = _quantize_k4_like(x, 15, -1.0, 0.1, 20)
    # 64-element groups: byte lane l of group g holds element 64g+l (low) and 64g+32+l (high).
    L = L.reshape(-1, 4, 2, 32)
    qs = (L[:, :, 0, :] | (L[:, :, 1, :] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)


def _quantize_q5_k(x):
    d, dmin, scales, L = _quantize_k4_like(x, 31, -0.5, 0.1, 15)
    groups = L.reshape(-1, 4, 2, 32)
    qs = ((groups[:, :, 0, :] & 0x0F) | ((groups[:, :, 1, :] & 0x0F) << 4)).reshape(-1, 128)
    # qh byte l, bit s: the fifth bit of element 32s+l (sub-block s).
    fifth = (L.reshape(-1, 8, 32) >> 4) & 1
    qh = (fifth << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qh, qs], axis=1)


def _make_qx_quants(x, nmax):
    """llama.cpp's make_qx_quants with rmse_type 1 (weights x²) over rows: x [m, n].
    Returns scale [m] and L [m, n] in 0..2*nmax-1 (the signed code plus nmax)."""
    f32 = np.float32
    amax_at = _signed_absmax(x)[:, 0]
    amax = np.abs(amax_at)
    tiny = amax < GROUP_MAX_EPS
    safe_max = np.where(tiny, f32(1), amax_at)
    weights = x * x

    def codes(iscale):
        return np.clip(_nearest_int(iscale[:, None] * x), -nmax, nmax - 1)

    iscale = f32(-nmax) / safe_max
    L = codes(iscale)
    sum_lx = (weights * x * L).sum(axis=1, dtype=f32)
    sum_l2 = (weights * L * L).sum(axis=1, dtype=f32)
    scale = np.where(sum_l2 > 0, sum_lx / np.where(sum_l2 > 0, sum_l2, 1), f32(0))
    best = scale * sum_lx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(f32(nmax) + f32(0.1) * f32(step)) / safe_max
        trial = codes(iscale)
        lx = (weights * x * trial).sum(axis=1, dtype=f32)
        l2 = (weights * trial * trial).sum(axis=1, dtype=f32)
        better = (l2 > 0) & (lx * lx > best * l2)
        new_scale = lx / np.where(l2 > 0, l2, f32(1))
        L = np.where(better[:, None], trial, L)
        scale = np.where(better, new_scale, scale)
        best = np.where(better, new_scale * lx, best)
    scale = np.where(tiny, f32(0), scale).astype(f32)
    L = np.where(tiny[:, None], 0, L)
    return scale, (L + nmax).astype(np.uint8)


def _quantize_q6_k(x):
    f32 = np.float32
    n = x.shape[0]
    sub_scale, _ = _make_qx_quants(x.reshape(n * 16, 16), 32)
    sub_scale = sub_scale.reshape(n, 16)
    max_scale = _signed_absmax(sub_scale)[:, 0]
    empty = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = np.where(empty, f32(0), f32(-128) / np.where(empty, f32(1), max_scale))
    d = np.where(empty, f32(0), f32(1) / np.where(empty, f32(1), iscale))
    d = d.astype(np.float16).astype(f32)
    scales = np.minimum(127, _nearest_int(iscale[:, None] * sub_scale)).astype(np.int8)
    sub_d = np.repeat(d[:, None] * scales.astype(f32), 16, axis=1)
    safe = np.where(sub_d == 0, f32(1), sub_d)
    L = np.clip(_nearest_int(x / safe), -32, 31) + 32
    L = np.where(sub_d == 0, 32, L).astype(np.uint8)  # a zero scale decodes any code to 0
    halves = L.reshape(n, 2, 4, 32)  # [block, half, quarter, lane]
    ql = np.concatenate(
        [
            (halves[:, :, 0] & 0x0F) | ((halves[:, :, 2] & 0x0F) << 4),
            (halves[:, :, 1] & 0x0F) | ((halves[:, :, 3] & 0x0F) << 4),
        ],
        axis=2,
    ).reshape(n, 128)
    qh = (
        (halves[:, :, 0] >> 4)
        | ((halves[:, :, 1] >> 4) << 2)
        | ((halves[:, :, 2] >> 4) << 4)
        | ((halves[:, :, 3] >> 4) << 6)
    ).reshape(n, 64)
    return np.concatenate(
        [ql.astype(np.uint8), qh.astype(np.uint8), scales.view(np.uint8), _f16_bytes(d)], axis=1
    )


_QUANTIZERS: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLType.F32: _quantize_f32,
    GGMLType.F16: _quantize_f16,
    GGMLType.BF16: _quantize_bf16,
    GGMLType.Q4_0: _quantize_q4_0,
    GGMLType.Q4_1: _quantize_q4_1,
    GGMLType.Q5_0: _quantize_q5_0,
    GGMLType.Q5_1: _quantize_q5_1,
    GGMLType.Q8_0: _quantize_q8_0,
    GGMLType.Q4_K: _quantize_q4_k,
    GGMLType.Q5_K: _quantize_q5_k,
    GGMLType.Q6_K: _quantize_q6_k,
}

QUANTIZABLE = tuple(_QUANTIZERS)


def quantize(values: np.ndarray, ggml_type: GGMLType | str | int) -> np.ndarray:
    """Encode float values (last axis = the row) into raw GGUF bytes, llama.cpp's way.

    values: float array [..., row]; the row length must be whole blocks.
    returns uint8 [..., row_bytes].
    """
    fmt = block_format(ggml_type)
    if fmt.ggml_type not in _QUANTIZERS:
        raise UnsupportedFormatError(
            f"no quantizer for {fmt.name} (quantizable: {', '.join(t.name for t in QUANTIZABLE)})"
        )
    values = np.asarray(values, dtype=np.float32)
    row = values.shape[-1]
    row_bytes = fmt.row_bytes(row)
    blocks = np.ascontiguousarray(values).reshape(-1, fmt.block_size)
    encoded = _QUANTIZERS[fmt.ggml_type](blocks)
    return np.ascontiguousarray(encoded, dtype=np.uint8).reshape(*values.shape[:-1], row_bytes)


# ---------------------------------------------------------------------------------------------
# Activations as int8 blocks ("q8x"): what the GPU decode products read instead of float32 x.
# ---------------------------------------------------------------------------------------------

Q8X_BLOCK = 32  # values per scale
Q8X_SUM = 8  # values per stored sum


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [..., n] (n a multiple of 32) as the kernels write it, in float32 arithmetic:
    codes int8 [..., n] = round(x / d), half away from zero (0 where d is 0);
    scales f32 [..., n/32]: d = max |x| / 127 over each 32 values;
    sums f32 [..., n/8]: d * (the sum of each 8 codes).
    Each code is off by at most d/2, so a value's error is at most max|x| / 254 of its block."""
    codes, scales = _round_blocks(x, Q8X_BLOCK)
    sums = codes.reshape(*codes.shape[:-1], -1, Q8X_SUM).sum(axis=-1, dtype=np.int32).astype(np.float32)
    sums = (sums.reshape(*scales.shape, -1) * scales[..., None]).reshape(*codes.shape[:-1], -1)
    return codes, scales, sums.astype(np.float32)


# q8x's woven layout, for a product whose lanes each read whole 64-value units (wide Q4_K):
# within each run of 32 such units (2,048 values; a row's last run may hold fewer, n), piece k
# of unit j sits at (k n + j) pieces into the run. Codes come in pieces of 16 (four a unit),
# sums in pieces of 4 (two a unit); scales stay in order. So lane j's k-th 16-byte load of a
# SIMD group's 32 units is one contiguous 512 bytes, not 16 cache lines: 6.15
# against 6.21 us for the o-projection). attention_combine writes it for the o-projection (kernel product's WOVEN).
Q8X_WOVEN_UNIT = 64  # values a unit
Q8X_WOVEN_RUN = 32  # units a run


def woven_positions(n: int, per_unit: int, per_piece: int) -> np.ndarray:
    """Where each of a row's n elements (per_unit a 64-value unit: 64 codes or 8 sums) sits in
    the woven layout, in pieces of per_piece: int64 [n], a permutation (woven[positions] = flat)."""
    if n % per_unit or per_unit % per_piece:
        raise ValueError(f"a woven row of {n} elements is not whole units of {per_unit} in pieces of {per_piece}")
    units = n // per_unit
    i = np.arange(n)
    unit, within = i // per_unit, i % per_unit
    run, j = unit // Q8X_WOVEN_RUN, unit % Q8X_WOVEN_RUN
    in_run = np.minimum(Q8X_WOVEN_RUN, units - Q8X_WOVEN_RUN * run)
    piece, element = within // per_piece, within % per_piece
    return Q8X_WOVEN_RUN * per_unit * run + per_piece * (piece * in_run + j) + element


def weave_activations(codes: np.ndarray, sums: np.ndarray, woven: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """q8x codes [..., n] and sums [..., n/8] (n a multiple of 64) in the woven layout
    (woven=False: back from it to the plain one); scales do not move."""
    n = codes.shape[-1]
    if n % Q8X_WOVEN_UNIT:
        raise ValueError(f"activations of {n} values are not whole {Q8X_WOVEN_UNIT}-value units to weave")
    code_at = woven_positions(n, Q8X_WOVEN_UNIT, 16)
    sum_at = woven_positions(n // Q8X_SUM, Q8X_WOVEN_UNIT // Q8X_SUM, 4)
    if not woven:
        return codes[..., code_at], sums[..., sum_at]
    out_codes, out_sums = np.empty_like(codes), np.empty_like(sums)
    out_codes[..., code_at] = codes
    out_sums[..., sum_at] = sums
    return out_codes, out_sums


Q8K_BLOCK = 256  # values per scale of the CPU's K-quant products' x (llama.cpp's q8_K)


def quantize_activations_super(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., n] (n a multiple of 256) as the CPU decode step's K-quant products round it
    (q8_K): codes int8 [..., n] = round(x / d), half away from zero (0 where d is 0), scales
    f32 [..., n/256]: d = max |x| / 127 over each 256 values. As quantize_activations but over
    8 times as many values: each value is off by at most max|x| / 254 of its 256."""
    return _round_blocks(x, Q8K_BLOCK)


def _round_blocks(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes int8 [..., n] and scales f32 [..., n/block] of x rounded per `block` values."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % block:
        raise ValueError(f"activations of {x.shape[-1]} values are not whole {block}-value blocks")
    blocks = x.reshape(*x.shape[:-1], -1, block)
    scales = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (blocks / scales[..., None]).astype(np.float32)
    codes = np.where(scales[..., None] > 0, np.sign(ratio) * np.floor(np.abs(ratio) + np.float32(0.5)), 0)
    return codes.astype(np.int8).reshape(x.shape), scales


def dequantize_activations(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """codes int8 [..., n], scales [..., n/block] (either function above) -> float32 [..., n]:
    code * d."""
    blocks = codes.astype(np.float32).reshape(*scales.shape, -1)
    return (blocks * np.asarray(scales, np.float32)[..., None]).reshape(codes.shape)
