// The GGUF block formats the CPU products read, as types: a format is a row of constants
// (VALUES and BYTES per block, GROUP values per scale) and the functions that read one block.
// Every strategy (product_strategies.h) takes a format as a template parameter.
//   scales(block, d, m)  the block's VALUES / GROUP scales d and offsets m (value = d * code + m)
//   codes(block, j)      16-value chunk j's codes as floats (the float tiles and panels)
//   codes32(block)       a 32-value block's codes as bytes (the rounded paths)
//   super_scales(block), codes64<P>(block), halves<P>(block)
//                        a K-quant's integer scales and 64 codes at a time (the rounded paths)
// A product then sums d * (codes . x) per chunk and m * (sum of x) per group.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "arch.h"
#include "products.h"
#include "vectors.h"

namespace muser::cpu {

const i32x16 LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 32-value blocks keep value i in the low nibble of byte i, value 16 + i in the high one.
inline u8x16 nibbles(const uint8_t* qs, int chunk) {
  u8x16 q = load<u8x16>(qs);
  return chunk ? q >> 4 : q & 15;
}

// Q5: bit i of the little-endian u32 qh is bit 4 of value i.
inline f32x16 with_fifth_bits(u8x16 low, uint32_t qh, int chunk) {
  i32x16 high = ((static_cast<int32_t>(qh >> (16 * chunk)) >> LANE) & 1) << 4;
  return __builtin_convertvector(__builtin_convertvector(low, i32x16) | high, f32x16);
}

// The q8_0 path (linear_rounded_from_blocks, 32-value formats) reads a block's 32 codes as
// bytes: codes32(block).
// Byte i of 16 low nibbles then 16 high nibbles: a 32-value block's codes in value order.
inline u8x32 nibbles32(const uint8_t* qs) {
  u8x16 q = load<u8x16>(qs);
  u8x16 low = q & 15, high = q >> 4;
  return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

struct Q4_0Format {
  static constexpr int VALUES = 32, BYTES = 18, GROUP = 32;
  static constexpr bool OFFSET = true, SIGNED = false;
  static void scales(const uint8_t* b, float* d, float* m) {
    d[0] = f16(b);
    m[0] = -8 * d[0];
  }
  static f32x16 codes(const uint8_t* b, int j) { return to_float(nibbles(b + 2, j)); }
  static u8x32 codes32(const uint8_t* b) { return nibbles32(b + 2); }
};

struct Q4_1Format {
  static constexpr int VALUES = 32, BYTES = 20, GROUP = 32;
  static constexpr bool OFFSET = true, SIGNED = false;
  static void scales(const uint8_t* b, float* d, float* m) {
    d[0] = f16(b);
    m[0] = f16(b + 2);
  }
  static f32x16 codes(const uint8_t* b, int j) { return to_float(nibbles(b + 4, j)); }
  static u8x32 codes32(const uint8_t* b) { return nibbles32(b + 4); }
};

struct Q5_0Format {
  static constexpr int VALUES = 32, BYTES = 22, GROUP = 32;
  static constexpr bool OFFSET = true, SIGNED = false;
  static u8x32 codes32(const uint8_t* b) { return nibbles32(b + 6) | fifth_bits32(b + 2); }
  static void scales(const uint8_t* b, float* d, float* m) {
    d[0] = f16(b);
    m[0] = -16 * d[0];
  }
  static f32x16 codes(const uint8_t* b, int j) {
    return with_fifth_bits(nibbles(b + 6, j), u32(b + 2), j);
  }
};

struct Q5_1Format {
  static constexpr int VALUES = 32, BYTES = 24, GROUP = 32;
  static constexpr bool OFFSET = true, SIGNED = false;
  static u8x32 codes32(const uint8_t* b) { return nibbles32(b + 8) | fifth_bits32(b + 4); }
  static void scales(const uint8_t* b, float* d, float* m) {
    d[0] = f16(b);
    m[0] = f16(b + 2);
  }
  static f32x16 codes(const uint8_t* b, int j) {
    return with_fifth_bits(nibbles(b + 8, j), u32(b + 4), j);
  }
};

struct Q8_0Format {
  static constexpr int VALUES = 32, BYTES = 34, GROUP = 32;
  static constexpr bool OFFSET = false, SIGNED = true;  // codes32: int8 codes as bytes
  static u8x32 codes32(const uint8_t* b) { return load<u8x32>(b + 2); }
  static void scales(const uint8_t* b, float* d, float*) { d[0] = f16(b); }
  static f32x16 codes(const uint8_t* b, int j) { return int8_to_float(b + 2 + 16 * j); }
};

// Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins in 12 bytes (sub-blocks 0-3 in
// the low 6 bits of bytes 0-3 / 4-7, sub-blocks 4-7 in the nibbles of bytes 8-11 plus the top
// 2 bits of bytes 0-7); value = d * scale * q - dmin * min. The 12 bytes, as u32 words w0-w2,
// are rearranged in one vector into 8 scale bytes then 8 min bytes: (w0 & 0x3f.., w2's low
// nibbles | w0's top bits, w1 & 0x3f.., w2's high nibbles | w1's top bits). In registers: four
// u32 stores read back as one vector would miss store forwarding (~30 % of a Q4_K product's
// time, perf).
inline u8x16 k4_scale_bytes(const uint8_t* b) {
  u32x4 w = load<u32x4>(b + 4);  // w0-w2, then the first 4 code bytes (unused)
  const u32x4 shifts = {0, 0, 0, 4};
  const u32x4 low_masks = {0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f};
  const u32x4 top_masks = {0, 0x30303030, 0, 0x30303030};
  u32x4 low = (__builtin_shufflevector(w, w, 0, 2, 1, 2) >> shifts) & low_masks;
  u32x4 top = (__builtin_shufflevector(w, w, 0, 0, 1, 1) >> 2) & top_masks;
  return (u8x16)(low | top);
}

inline void k4_scales(const uint8_t* b, float* d, float* m) {
  float super_d = f16(b), super_min = -f16(b + 2);
  f32x16 factor = {super_d, super_d, super_d, super_d, super_d, super_d, super_d, super_d,
                   super_min, super_min, super_min, super_min, super_min, super_min, super_min,
                   super_min};
  f32x16 values = to_float(k4_scale_bytes(b)) * factor;
  std::memcpy(d, &values, 32);
  std::memcpy(m, reinterpret_cast<const float*>(&values) + 8, 32);
}

// The super-block path (tile_super, below) reads a K-quant block as: its integer scales per
// 16 values (scales16) and offset weights per 16 values (offsets16), with value = d * scale *
// code + o * offset weight; and 64 codes at a time, values 64p .. 64p + 63 (codes64<p>).
struct SuperScales {
  i16x16 scales16, offsets16;
  float d, o;
};

inline SuperScales k4_super_scales(const uint8_t* b) {
  u8x16 packed = k4_scale_bytes(b);
  u8x16 scales = __builtin_shufflevector(packed, packed, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  u8x16 mins = __builtin_shufflevector(packed, packed, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13,
                                       14, 14, 15, 15);
  return {__builtin_convertvector(scales, i16x16), __builtin_convertvector(mins, i16x16), f16(b),
          -f16(b + 2)};
}

// q's 32 bytes twice, the first time shifted right by LOW bits, the second by HIGH: q in both
// halves, each half's 16-bit words shifted (one variable shift, no lane-crossing shuffle).
// Bits of a word's upper byte enter its lower byte from the top: mask the result to at most
// 8 - max(LOW, HIGH) low bits.
// (BYTE_OPS_WIDTH 64 builds; elsewhere the formats' halves<P> stand in for codes64<P>.)
template <int LOW, int HIGH>
inline u8x64 shifted_halves(u8x32 q) {
  u8x64 both = __builtin_shufflevector(q, q, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                       16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30,
                                       31, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                       17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
  const u16x32 shifts = {LOW, LOW, LOW, LOW, LOW, LOW, LOW, LOW, LOW, LOW, LOW,
                         LOW, LOW, LOW, LOW, LOW, HIGH, HIGH, HIGH, HIGH, HIGH, HIGH,
                         HIGH, HIGH, HIGH, HIGH, HIGH, HIGH, HIGH, HIGH, HIGH, HIGH};
  return (u8x64)((u16x32)both >> shifts);
}

// Below BYTE_OPS_WIDTH 64 (AVX2) a 64-byte vector is two registers, and GCC lowered the
// 64-byte shuffles and byte shifts of codes64 / pair_scales element by element through the
// stack (a Q4_K decode tile: 3,179 instructions, 512 of them vpextrb; 5-9x slower than
// AVX-512's). There the super-block path takes 64 codes as two 32-byte halves (values 64p ..
// 64p + 31, then the next 32), each made with 32-byte operations only.
struct Halves {
  u8x32 lo, hi;
};

// q's 16-bit words shifted right by S, as bytes: bits of a word's upper byte enter its lower
// byte from the top (mask the result to its low 8 - S bits).
template <int S>
inline u8x32 word_shift(u8x32 q) {
  return (u8x32)((u16x16)q >> S);
}

// 16 x each byte of q (every byte at most 15): a 16-bit shift, which carries no bit across bytes.
inline u8x32 times16(u8x32 q) {
  return (u8x32)((u16x16)q << 4);
}

// Sub-blocks 2i and 2i+1: the low and high nibbles of bytes 32i..32i+31; chunk j is half j % 2
// of sub-block j / 2.
inline u8x16 k4_nibbles(const uint8_t* qs, int j) {
  int sub_block = j / 2;
  u8x16 q = load<u8x16>(qs + 32 * (sub_block / 2) + 16 * (j % 2));
  return sub_block % 2 ? q >> 4 : q & 15;
}

struct Q4_KFormat {
  static constexpr int VALUES = 256, BYTES = 144, GROUP = 32;
  static constexpr bool OFFSET = true, SIGNED = false;
  static void scales(const uint8_t* b, float* d, float* m) { k4_scales(b, d, m); }
  static f32x16 codes(const uint8_t* b, int j) { return to_float(k4_nibbles(b + 16, j)); }
  static SuperScales super_scales(const uint8_t* b) { return k4_super_scales(b); }
  // Sub-blocks 2p and 2p + 1: the low and high nibbles of qs[32p .. 32p + 31].
  template <int P>
  static u8x64 codes64(const uint8_t* b) {
    return shifted_halves<0, 4>(load<u8x32>(b + 16 + 32 * P)) & 15;
  }
  template <int P>
  static Halves halves(const uint8_t* b) {  // codes64<P> as two halves
    u8x32 q = load<u8x32>(b + 16 + 32 * P);
    return {q & 15, word_shift<4>(q) & 15};
  }
};

struct Q5_KFormat {
  static constexpr int VALUES = 256, BYTES = 176, GROUP = 32;
  static constexpr bool OFFSET = true, SIGNED = false;
  static void scales(const uint8_t* b, float* d, float* m) { k4_scales(b, d, m); }
  static f32x16 codes(const uint8_t* b, int j) {
    // Bit s of qh[l] is bit 4 of value l of sub-block s.
    u8x16 fifth = (load<u8x16>(b + 16 + 16 * (j % 2)) >> (j / 2)) & 1;
    return to_float(k4_nibbles(b + 48, j) | (fifth << 4));
  }
  static SuperScales super_scales(const uint8_t* b) { return k4_super_scales(b); }
  template <int P>
  static u8x64 codes64(const uint8_t* b) {
    u8x64 low = shifted_halves<0, 4>(load<u8x32>(b + 48 + 32 * P)) & 15;
    return low | ((shifted_halves<2 * P, 2 * P + 1>(load<u8x32>(b + 16)) & 1) << 4);
  }
  template <int P>
  static Halves halves(const uint8_t* b) {
    u8x32 q = load<u8x32>(b + 48 + 32 * P), qh = load<u8x32>(b + 16);
    return {(q & 15) | times16(word_shift<2 * P>(qh) & 1), (word_shift<4>(q) & 15) | times16(word_shift<2 * P + 1>(qh) & 1)};
  }
};

// Q6_K: two halves of 128 values, each from 64 bytes of low 4 bits (ql) and 32 of top 2 bits
// (qh). 32-value group p of a half takes the low nibbles of ql[0:32], of ql[32:64], then the
// high nibbles of each, and bits 2p..2p+1 of qh[0:32]. int8 scales per 16 values;
// value = d * scale * (q - 32).
struct Q6_KFormat {
  static constexpr int VALUES = 256, BYTES = 210, GROUP = 16;
  static constexpr bool OFFSET = true, SIGNED = false;
  static void scales(const uint8_t* b, float* d, float* m) {
    f32x16 scale = int8_to_float(b + 192) * f16(b + 208);
    f32x16 offset = scale * -32.0f;
    std::memcpy(d, &scale, 64);
    std::memcpy(m, &offset, 64);
  }
  static f32x16 codes(const uint8_t* b, int j) {
    int half = j / 8, group = (j % 8) / 2, part = j % 2;
    u8x16 ql = load<u8x16>(b + 64 * half + 32 * (group % 2) + 16 * part);
    u8x16 qh = load<u8x16>(b + 128 + 32 * half + 16 * part);
    u8x16 low = group < 2 ? ql & 15 : ql >> 4;
    return to_float(low | (((qh >> (2 * group)) & 3) << 4));
  }
  static SuperScales super_scales(const uint8_t* b) {
    i16x16 scales = __builtin_convertvector(load<i8x16>(b + 192), i16x16);
    float d = f16(b + 208);
    return {scales, scales, d, -32 * d};
  }
  // Groups 2k and 2k + 1 of half p / 2 (k = p % 2): the low (k = 0) or high nibbles of
  // ql[0:64] of the half, bits 4k .. 4k + 3 of its qh[0:32] on top.
  template <int P>
  static u8x64 codes64(const uint8_t* b) {
    constexpr int half = P / 2, k = P % 2;
    u8x64 ql = load<u8x64>(b + 64 * half);
    u8x64 low = k ? ql >> 4 : ql & 15;
    return low | ((shifted_halves<4 * k, 4 * k + 2>(load<u8x32>(b + 128 + 32 * half)) & 3) << 4);
  }
  template <int P>
  static Halves halves(const uint8_t* b) {
    constexpr int half = P / 2, k = P % 2;
    u8x32 ql0 = load<u8x32>(b + 64 * half), ql1 = load<u8x32>(b + 64 * half + 32);
    u8x32 qh = load<u8x32>(b + 128 + 32 * half);
    u8x32 low0 = k ? word_shift<4>(ql0) & 15 : ql0 & 15, low1 = k ? word_shift<4>(ql1) & 15 : ql1 & 15;
    return {low0 | times16(word_shift<4 * k>(qh) & 3), low1 | times16(word_shift<4 * k + 2>(qh) & 3)};
  }
};

template <class Fn, int... P>
inline void each_quarter(Fn&& fn, std::integer_sequence<int, P...>) {
  (fn(std::integral_constant<int, P>{}), ...);
}

// Calls f with a value of the format type of ggml_type (Q4_0Format{}, ...) and returns what it
// returns; `none` for a type without a product.
template <class F, class R>
R with_format(int ggml_type, F&& f, R none) {
  switch (ggml_type) {
    case Q4_0: return f(Q4_0Format{});
    case Q4_1: return f(Q4_1Format{});
    case Q5_0: return f(Q5_0Format{});
    case Q5_1: return f(Q5_1Format{});
    case Q8_0: return f(Q8_0Format{});
    case Q4_K: return f(Q4_KFormat{});
    case Q5_K: return f(Q5_KFormat{});
    case Q6_K: return f(Q6_KFormat{});
    default: return none;
  }
}

}  // namespace muser::cpu
