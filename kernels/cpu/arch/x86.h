// The x86 versions of the kernels' per-ISA helpers (AVX-512, AVX2, F16C, VNNI), each a whole
// function under the instruction set it needs; where the build's -march has none of them, the
// portable version (arch/generic.h) serves. Each returns what its generic version returns, bit
// for bit: the suite runs on a native (AVX-512) build and an x86-64-v3 (AVX2) one.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../vectors.h"
#include "generic.h"

namespace muser::cpu {

#if defined(__AVX512F__)
constexpr const char* INSTRUCTION_SET = "avx512";
constexpr int REGISTER_FLOATS = 16;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* INSTRUCTION_SET = "avx2";
using generic::REGISTER_FLOATS;
#else
using generic::INSTRUCTION_SET;
using generic::REGISTER_FLOATS;
#endif

#if defined(__AVX512BW__)
constexpr int BYTE_OPS_WIDTH = 64;
#else
using generic::BYTE_OPS_WIDTH;
#endif

// ---------------------------------------------------------------------------------------------
// Float vectors
// ---------------------------------------------------------------------------------------------

#if defined(__AVX__)
inline float hsum(f32x8 v) {  // a tree of shuffles and adds
  __m128 four = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
}
#else
using generic::hsum;
#endif

#if defined(__AVX512F__)
inline float hsum(f32x16 v) {
  // A tree of shuffles and adds (a decode step's scores at 3,000 positions: 52 -> 57 tokens/s).
  return _mm512_reduce_add_ps((__m512)v);
}
#elif defined(__AVX__)
inline float hsum(f32x16 v) {
  // Two 8-lane halves, added (on AVX2 a loop of 16 scalar adds was ~8 % of a decode).
  f32x8 halves[2];
  std::memcpy(halves, &v, 64);
  return hsum(halves[0] + halves[1]);
}
#endif

#ifdef MUSER_HALF_CACHE
#if defined(__F16C__)
inline f32x8 load8(const half* p) {
  return (f32x8)_mm256_cvtph_ps(load<__m128i>(p));
}
#else
using generic::load8;
#endif

#if defined(__AVX512F__)
inline f32x16 load16(const half* p) {
  return (f32x16)_mm512_cvtph_ps(load<__m256i>(p));  // one instruction (GCC's generic widening was scalar)
}
#elif defined(__F16C__) && defined(__AVX__)
inline f32x16 load16(const half* p) {
  // Two instructions (generic widening: 16 scalar conversions, ~10 % of an AVX2 decode).
  __m256 parts[2] = {_mm256_cvtph_ps(load<__m128i>(p)), _mm256_cvtph_ps(load<__m128i>(p + 8))};
  f32x16 out;
  std::memcpy(&out, parts, 64);
  return out;
}
#else
using generic::load16;
#endif
#endif

// Inside its scope, this thread's float arithmetic flushes subnormal results and inputs to 0
// (MXCSR's FTZ and DAZ bits; restored on exit). Attention's weighted sums multiply
// probabilities near e^-87 by values: subnormal products, which x86 computes ~100x slower, took
// ~2 of Gemma 3's 10 ms a layer of a 128-token prefill. A flushed value is below 2^-126
// (1.2e-38), invisible beside the probabilities' total, which is at least 1.
class FlushSubnormals {
 public:
  FlushSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
};

// ---------------------------------------------------------------------------------------------
// Block readers (formats.h). GCC turns a direct u8 -> float vector conversion into 16 scalar
// ones, and an int8 one into lane inserts: the instructions by name.
// ---------------------------------------------------------------------------------------------

#if defined(__F16C__)
inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
#else
using generic::f16;
#endif

#if defined(__AVX512F__)
inline f32x16 to_float(u8x16 codes) {
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)codes));
}

inline f32x16 int8_to_float(const uint8_t* p) {
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#elif defined(__AVX2__)
inline f32x16 to_float(u8x16 codes) {
  __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32((__m128i)codes)),
                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128((__m128i)codes, 8)))};
  f32x16 out;
  std::memcpy(&out, halves, 64);
  return out;
}

inline f32x16 int8_to_float(const uint8_t* p) {
  __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
                      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
  f32x16 out;
  std::memcpy(&out, halves, 64);
  return out;
}
#else
using generic::int8_to_float;
using generic::to_float;
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)
inline u8x32 fifth_bits32(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  return (u8x32)_mm256_maskz_set1_epi8(bits, 16);
}
#elif defined(__AVX2__)
inline u8x32 fifth_bits32(const uint8_t* qh) {
  // Byte i: byte i / 8 of qh (the 4 bytes in every 32-bit lane, picked by an in-lane shuffle),
  // then whether its bit i % 8 is set. (GCC built the generic version through the stack: a
  // store-forwarding stall each block, Q5_0 decode 7x slower than AVX-512's.)
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), which);
  return (u8x32)_mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(16));
}
#else
using generic::fifth_bits32;
#endif

// ---------------------------------------------------------------------------------------------
// Integer dot products of the rounded paths (rounded_tiles.cpp). AVX2's maddubs sums pairs of
// u8 x s8 products into int16 with saturation: every caller keeps 2 |w x| < 2^15.
// ---------------------------------------------------------------------------------------------

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline i32x8 dot_unsigned(u8x32 w, i8x32 x) {
  return (i32x8)_mm256_dpbusd_epi32(_mm256_setzero_si256(), (__m256i)w, (__m256i)x);
}
#elif defined(__AVXVNNI__)
inline i32x8 dot_unsigned(u8x32 w, i8x32 x) {
  return (i32x8)_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (__m256i)w, (__m256i)x);
}
#elif defined(__AVX2__)
inline i32x8 dot_unsigned(u8x32 w, i8x32 x) {
  return (i32x8)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)w, (__m256i)x),
                                  _mm256_set1_epi16(1));
}
#else
using generic::dot_unsigned;
#endif

#if defined(__AVX2__)
inline i32x8 dot_signed(u8x32 w, i8x32 x) {  // |w| times x with w's sign
  return dot_unsigned((u8x32)_mm256_abs_epi8((__m256i)w), (i8x32)_mm256_sign_epi8((__m256i)x, (__m256i)w));
}
#else
using generic::dot_signed;
#endif

#if defined(__AVX512BW__)
// acc + lane k: the sum over values 4k .. 4k + 3 of scales[value / 2] * w * x. w unsigned, at
// most 63 (a 6-bit code), so the int16 pair sums of maddubs, at most 2 * 63 * 127, cannot
// saturate; |scales| <= 128, so a lane gains at most 4 * 63 * 127 * 128 < 2^23 a call.
// (BYTE_OPS_WIDTH 64 only: elsewhere the super-block path takes halves, dot_scaled8.)
#if defined(__AVX512VNNI__)
inline i32x16 dot_scaled(i32x16 acc, u8x64 w, i8x64 x, i16x32 scales) {
  __m512i pairs = _mm512_maddubs_epi16((__m512i)w, (__m512i)x);
  return (i32x16)_mm512_dpwssd_epi32((__m512i)acc, pairs, (__m512i)scales);
}
#else
inline i32x16 dot_scaled(i32x16 acc, u8x64 w, i8x64 x, i16x32 scales) {
  __m512i pairs = _mm512_maddubs_epi16((__m512i)w, (__m512i)x);
  return acc + (i32x16)_mm512_madd_epi16(pairs, (__m512i)scales);
}
#endif
#endif

#if defined(__AVX2__) && defined(__AVXVNNI__)
inline i32x8 dot_scaled8(i32x8 acc, u8x32 w, i8x32 x, i16x16 scales) {
  __m256i pairs = _mm256_maddubs_epi16((__m256i)w, (__m256i)x);
  return (i32x8)_mm256_dpwssd_avx_epi32((__m256i)acc, pairs, (__m256i)scales);
}
#elif defined(__AVX2__)
inline i32x8 dot_scaled8(i32x8 acc, u8x32 w, i8x32 x, i16x16 scales) {
  __m256i pairs = _mm256_maddubs_epi16((__m256i)w, (__m256i)x);
  return acc + (i32x8)_mm256_madd_epi16(pairs, (__m256i)scales);
}
#else
using generic::dot_scaled8;
#endif

#if defined(__AVX2__)
inline i32x8 madd16(i16x16 a, i16x16 b) {
  return (i32x8)_mm256_madd_epi16((__m256i)a, (__m256i)b);
}

template <int A>
inline i16x16 scale_pair(i16x16 s) {
  static_assert(A % 2 == 0 && A < 16);
  // Both in one 128-bit half of s: broadcast it to both lanes, then pick one word a lane.
  __m128i part = A < 8 ? _mm256_castsi256_si128((__m256i)s) : _mm256_extracti128_si256((__m256i)s, 1);
  constexpr int a = A % 8, b = (A + 1) % 8;
  const __m256i pick = _mm256_set_m128i(_mm_set1_epi16(static_cast<short>((2 * b) | ((2 * b + 1) << 8))),
                                        _mm_set1_epi16(static_cast<short>((2 * a) | ((2 * a + 1) << 8))));
  return (i16x16)_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(part), pick);
}
#else
using generic::madd16;
using generic::scale_pair;
#endif

#if defined(__AVX512F__)
inline float round_block(const float* values, int count, int8_t* codes) {
  if (count % 16 != 0) {
    return generic::round_block(values, count, codes);
  }
  // The generic version's float operations, 16 values at a time.
  const __m512i sign = _mm512_set1_epi32(INT32_MIN);
  __m512 top16 = _mm512_setzero_ps();
  for (int i = 0; i < count; i += 16) {
    top16 = _mm512_max_ps(top16, _mm512_abs_ps(_mm512_loadu_ps(values + i)));
  }
  float d = _mm512_reduce_max_ps(top16) / 127.0f;
  if (!(d > 0)) {
    std::memset(codes, 0, count);
    return d;
  }
  const __m512 d16 = _mm512_set1_ps(d), half = _mm512_set1_ps(0.5f);
  for (int i = 0; i < count; i += 16) {
    __m512 v = _mm512_loadu_ps(values + i);
    __m512 magnitude = _mm512_roundscale_ps(
        _mm512_add_ps(_mm512_abs_ps(_mm512_div_ps(v, d16)), half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 code = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude),
                                                      _mm512_and_si512(_mm512_castps_si512(v), sign)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(code)));
  }
  return d;
}
#else
using generic::round_block;
#endif

// ---------------------------------------------------------------------------------------------
// Integer panels (rounded_panels.cpp)
// ---------------------------------------------------------------------------------------------

#if defined(__AVX512F__)
template <size_t UNIT>
inline void transpose_words(const uint8_t (&rows)[16][UNIT], int64_t line, uint8_t* out) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) {
    r[i] = _mm512_loadu_si512(rows[i] + 64 * line);
  }
  for (int i = 0; i < 16; i += 2) {  // (a0 b0 a1 b1 | a4 b4 a5 b5 | ...), (a2 b2 a3 b3 | ...)
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + k]: words k, k + 4, k + 8, k + 12 of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // 128-bit lanes: t[h + k] = (words k, k + 8 of rows h .. h + 3; the same of rows h + 4 ..
  // h + 7), t[h + 4 + k] the same for words k + 4, k + 12 (h = 0, 8; k < 4).
  for (int h = 0; h < 16; h += 8) {
    for (int k = 0; k < 4; ++k) {
      t[h + k] = _mm512_shuffle_i32x4(r[h + k], r[h + 4 + k], 0x88);
      t[h + 4 + k] = _mm512_shuffle_i32x4(r[h + k], r[h + 4 + k], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {  // words k and k + 8 of rows 0 .. 15
    _mm512_storeu_si512(out + 64 * k, _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88));
    _mm512_storeu_si512(out + 64 * (k + 8), _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd));
  }
}
#else
using generic::transpose_words;
#endif

// dot4 on VNNI takes unsigned codes only (dpbusd: u8 x s8).
#if defined(__AVX512VNNI__)
constexpr bool DOT4_SIGNED = false;

template <bool SIGNED>
inline i32x16 dot4(i32x16 acc, u8x64 w, int32_t x4) {
  static_assert(!SIGNED);
  return (i32x16)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x4));
}
#elif defined(__AVX2__) && defined(__AVXVNNI__)
constexpr bool DOT4_SIGNED = false;

template <bool SIGNED>
inline i32x16 dot4(i32x16 acc, u8x64 w, int32_t x4) {
  static_assert(!SIGNED);
  __m256i halves[2], w2[2];
  std::memcpy(halves, &acc, 64);
  std::memcpy(w2, &w, 64);
  const __m256i x = _mm256_set1_epi32(x4);
  for (int h = 0; h < 2; ++h) {
    halves[h] = _mm256_dpbusd_avx_epi32(halves[h], w2[h], x);
  }
  std::memcpy(&acc, halves, 64);
  return acc;
}
#elif defined(__AVX2__)
using generic::DOT4_SIGNED;

template <bool SIGNED>
inline i32x16 dot4(i32x16 acc, u8x64 w, int32_t x4) {
  __m256i halves[2], w2[2];
  std::memcpy(halves, &acc, 64);
  std::memcpy(w2, &w, 64);
  const __m256i x = _mm256_set1_epi32(x4);
  for (int h = 0; h < 2; ++h) {
    __m256i pairs = SIGNED ? _mm256_maddubs_epi16(_mm256_abs_epi8(w2[h]), _mm256_sign_epi8(x, w2[h]))
                           : _mm256_maddubs_epi16(w2[h], x);
    halves[h] = _mm256_add_epi32(halves[h], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  std::memcpy(&acc, halves, 64);
  return acc;
}
#else
using generic::DOT4_SIGNED;
using generic::dot4;
#endif

// dot4 of two consecutive 4-value steps, (w0, x0) then (w1, x1), for unsigned codes (AVX2
// without VNNI): codes are at most 63 there, so a maddubs pair sum is at most 2 * 63 * 127 =
// 16,002 and two of them 32,004 < 2^15; both steps' int16 pair sums are added before one
// widening madd, three multiply-port operations per 32-byte half instead of four (AVX2 prompt
// products 10-20 % faster).
#if defined(__AVX2__) && !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
constexpr bool PAIRED_DOT4 = true;

inline i32x16 dot4x2(i32x16 acc, u8x64 w0, u8x64 w1, int32_t x0, int32_t x1) {
  __m256i halves[2], a[2], b[2];
  std::memcpy(halves, &acc, 64);
  std::memcpy(a, &w0, 64);
  std::memcpy(b, &w1, 64);
  const __m256i xa = _mm256_set1_epi32(x0), xb = _mm256_set1_epi32(x1);
  for (int h = 0; h < 2; ++h) {
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(a[h], xa), _mm256_maddubs_epi16(b[h], xb));
    halves[h] = _mm256_add_epi32(halves[h], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  std::memcpy(&acc, halves, 64);
  return acc;
}
#else
using generic::PAIRED_DOT4;
using generic::dot4x2;
#endif

}  // namespace muser::cpu
