// The portable versions of the helpers the CPU kernels call where an instruction set has its own
// (arch/x86.h): GCC/Clang vector extensions and plain loops, correct on any CPU. They are the
// code of a build without SIMD (-march=x86-64) and of ARM (where GCC makes NEON of the vector
// extensions), and the reference each per-ISA version must match bit for bit.
// arch.h picks, helper by helper, the per-ISA version or this one.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../vectors.h"

namespace muser::cpu::generic {

// The vector instructions the kernels were compiled for, as products.h's instruction_set() names them.
#if defined(__ARM_NEON)
constexpr const char* INSTRUCTION_SET = "neon";
#else
constexpr const char* INSTRUCTION_SET = "scalar";
#endif

// Floats of the widest float vector the kernels keep in one register: 16 or 8 (NEON's 4-float
// registers count as 8: two of them).
constexpr int REGISTER_FLOATS = 8;

// Bytes of the widest byte operation one instruction does: 64 or 32. Below 64, a 64-byte vector
// is two or more registers and the K-quant paths take 64 codes as two 32-byte halves.
constexpr int BYTE_OPS_WIDTH = 32;

// Whether dot4 (below) takes signed weight codes (else only unsigned ones).
constexpr bool DOT4_SIGNED = true;

// Whether dot4x2 (below) serves: two 4-value steps summed before one widening.
constexpr bool PAIRED_DOT4 = false;

// The sum of v's lanes.
inline float hsum(f32x8 v) {
  float sum = 0;
  for (int lane = 0; lane < 8; ++lane) {
    sum += v[lane];
  }
  return sum;
}

inline float hsum(f32x16 v) {
  f32x8 halves[2];  // two 8-lane halves, added
  std::memcpy(halves, &v, 64);
  return hsum(halves[0] + halves[1]);
}

#ifdef MUSER_HALF_CACHE
// 8 or 16 halves widened to floats.
inline f32x8 load8(const half* p) {
  typedef half f16x8 __attribute__((vector_size(16)));
  return __builtin_convertvector(load<f16x8>(p), f32x8);
}

inline f32x16 load16(const half* p) {
  return __builtin_convertvector(load<f16x16>(p), f32x16);
}
#endif

// The IEEE half at p (any alignment) as a float.
inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: mantissa * 2^-24, exact in float32
    float value = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &value, 4);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// Byte codes to floats: unsigned codes, or the 16 int8 codes at p.
inline f32x16 to_float(u8x16 codes) {
  return __builtin_convertvector(__builtin_convertvector(codes, i32x16), f32x16);
}

inline f32x16 int8_to_float(const uint8_t* p) {
  return __builtin_convertvector(__builtin_convertvector(load<i8x16>(p), i32x16), f32x16);
}

// 16 where bit i of the little-endian u32 at qh is set, else 0 (Q5's fifth bits).
inline u8x32 fifth_bits32(const uint8_t* qh) {
  // Byte i holds byte i / 8 of qh, all of whose bits but i % 8 are then set by `others`.
  u8x4 bytes;
  std::memcpy(&bytes, qh, 4);
  u8x32 spread = __builtin_shufflevector(bytes, bytes, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1,
                                         1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const u8x32 others = {0xfe, 0xfd, 0xfb, 0xf7, 0xef, 0xdf, 0xbf, 0x7f, 0xfe, 0xfd, 0xfb,
                        0xf7, 0xef, 0xdf, 0xbf, 0x7f, 0xfe, 0xfd, 0xfb, 0xf7, 0xef, 0xdf,
                        0xbf, 0x7f, 0xfe, 0xfd, 0xfb, 0xf7, 0xef, 0xdf, 0xbf, 0x7f};
  return (u8x32)((spread | others) == 0xff) & 16;
}

// Lane k: the sum over values 4k .. 4k + 3 of w * x, w unsigned (dot_unsigned: at most 128,
// with x's sign folded in where dot_signed calls it, so AVX2's 16-bit pair sums cannot
// saturate: 2 * 128 * 127 < 2^15) or signed (dot_signed, Q8_0's codes).
inline i32x8 dot_unsigned(u8x32 w, i8x32 x) {
  i32x8 sum = {};
  for (int i = 0; i < 32; ++i) {
    sum[i / 4] += static_cast<int32_t>(w[i]) * static_cast<int32_t>(x[i]);
  }
  return sum;
}

inline i32x8 dot_signed(u8x32 w, i8x32 x) {
  i32x8 sum = {};
  for (int i = 0; i < 32; ++i) {
    sum[i / 4] += static_cast<int32_t>(static_cast<int8_t>(w[i])) * static_cast<int32_t>(x[i]);
  }
  return sum;
}

// acc + lane k: the sum over values 4k .. 4k + 3 of scales[value / 2] * w * x (w unsigned, at
// most 63; |scales| <= 128).
inline i32x8 dot_scaled8(i32x8 acc, u8x32 w, i8x32 x, i16x16 scales) {
  for (int i = 0; i < 32; ++i) {
    acc[i / 4] += static_cast<int32_t>(scales[i / 2]) * static_cast<int32_t>(w[i]) *
                  static_cast<int32_t>(x[i]);
  }
  return acc;
}

// Lane k: a[2k] * b[2k] + a[2k + 1] * b[2k + 1].
inline i32x8 madd16(i16x16 a, i16x16 b) {
  i32x8 sum = {};
  for (int i = 0; i < 16; ++i) {
    sum[i / 2] += static_cast<int32_t>(a[i]) * static_cast<int32_t>(b[i]);
  }
  return sum;
}

// Words 0-7: s[A], words 8-15: s[A + 1] (A even).
template <int A>
inline i16x16 scale_pair(i16x16 s) {
  static_assert(A % 2 == 0 && A < 16);
  i16x16 out;
  for (int w = 0; w < 16; ++w) {
    out[w] = s[A + w / 8];
  }
  return out;
}

// Rounds `values` [count] to codes round(x / d), half away from zero, with d = max |x| / 127
// (0 where d is 0), as formats.quantize_activations (x / d, not x * (1 / d)); returns d.
inline float round_block(const float* values, int count, int8_t* codes) {
  float top = 0;
  for (int i = 0; i < count; ++i) {
    top = std::max(top, std::fabs(values[i]));
  }
  float d = top / 127.0f;
  for (int i = 0; i < count; ++i) {
    float code = d > 0 ? std::copysign(std::floor(std::fabs(values[i] / d) + 0.5f), values[i]) : 0.0f;
    codes[i] = static_cast<int8_t>(code);
  }
  return d;
}

// out [16 words][16 rows]: word w of line `line` (bytes 64 line .. 64 line + 63) of each of the
// 16 rows, i.e. the 16 x 16 matrix of 4-byte words transposed.
template <size_t UNIT>
inline void transpose_words(const uint8_t (&rows)[16][UNIT], int64_t line, uint8_t* out) {
  for (int r = 0; r < 16; ++r) {
    for (int w = 0; w < 16; ++w) {
      std::memcpy(out + (w * 16 + r) * 4, rows[r] + 64 * line + 4 * w, 4);
    }
  }
}

// acc + lane r: weight row r's 4 codes (bytes 4r .. 4r + 3 of w; unsigned, or signed where
// SIGNED) dotted with x's 4 codes (x4). Unsigned codes are at most 63 where AVX2's maddubs
// takes them (Q8_0's + 128 codes only meet VNNI: DOT4_SIGNED false).
template <bool SIGNED>
inline i32x16 dot4(i32x16 acc, u8x64 w, int32_t x4) {
  i8x64 x = (i8x64)(i32x16{} + x4);
  for (int i = 0; i < 64; ++i) {
    int32_t code = SIGNED ? static_cast<int8_t>(w[i]) : w[i];
    acc[i / 4] += code * static_cast<int32_t>(x[i]);
  }
  return acc;
}

// dot4 of (w0, x0) then (w1, x1), where PAIRED_DOT4; here never called.
inline i32x16 dot4x2(i32x16 acc, u8x64, u8x64, int32_t, int32_t) {
  return acc;
}

// Inside its scope, this thread's float arithmetic flushes subnormal results and inputs to 0
// where the CPU has such a mode (arch/x86.h); here nothing.
class FlushSubnormals {};

}  // namespace muser::cpu::generic
