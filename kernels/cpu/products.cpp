// The products x @ W.T from raw GGUF blocks, on the CPU, in float32 like the reference.
//
// Every format is read the same way: 16 values at a time, each 16-value chunk of a block
// having one scale d and one offset m (value = d * code + m: Q4_0's m is -8 d, Q4_K's is
// -dmin * min of the sub-block, Q6_K's is -32 d), so x . row = sum of d * (codes . x) over
// chunks + sum of m * (sum of x) over scale groups, the sums of x taken once per call. A tile
// of R weight rows x C rows of x decodes a chunk of each weight row once into a 16-float
// vector (codes * d) and multiplies it into C accumulators, so a weight byte is decoded once
// per C tokens and x is loaded once per R rows. Vectors are GCC/Clang vector extensions:
// with -march=native they become AVX-512 (or AVX2, NEON) instructions; elsewhere scalar code.
//
// From PANEL_MIN_TOKENS tokens on (prefill), rows are instead decoded to float panels and
// multiplied as a matrix product (linear_panels, below).
//
// Grid: the output's DECODE_ROWS-row (PANEL_ROWS for panels) blocks in TASKS_PER_THREAD x
// `threads` contiguous ranges, which `threads` threads (the caller one of them) claim in turn
// (thread_pool.h). Each walks x in chunks (X_CHUNK_BYTES, kept in L2; PANEL_TOKENS tokens for
// panels) and, inside a chunk, every block of its range (the block's weight rows or panel
// stay in L1/L2 across the chunk's tokens).
// Bytes per call: each weight byte once per token chunk (one chunk unless tokens x in x 4
// bytes passes X_CHUNK_BYTES: prefill), x once per tile (from cache), out once.
// Bounds: in_features must be whole blocks (the op checks); the last row tile and token tile
// may be short (their own instantiations).

#include "products.h"
#include "vectors.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "thread_pool.h"

namespace muser::cpu {

namespace {

// Tile shapes (rows x tokens): a decode product (fewer than PREFILL_TOKENS tokens) decodes
// each weight chunk once for DECODE_ROWS rows; a prefill product multiplies each decoded
// chunk into PREFILL_ROWS x PREFILL_TOKENS accumulators (16 of the 32 AVX-512 registers).
constexpr int DECODE_ROWS = 4;
constexpr int PREFILL_ROWS = 2;
constexpr int PREFILL_TOKENS = 8;
static_assert(DECODE_ROWS % PREFILL_ROWS == 0);
// From this many tokens on, a product decodes its weight rows to float panels and multiplies
// them by PANEL_TOKENS tokens at a time (linear_panels): PANEL_ROWS x 2 vector accumulators.
constexpr int PANEL_MIN_TOKENS = 16;
constexpr int PANEL_TOKENS = 32;
constexpr int PANEL_ROWS = 8;
// Each row slice is decoded once for this many tokens (it was once per PANEL_TOKENS: 20 % of
// the 1.5B qwen2's prefill samples decoded rows), in slices of at most this many values.
constexpr int PANEL_GROUP_TOKENS = 128;
constexpr int64_t PANEL_SLICE = 2048;
// Tiles of at most this many (row, token) pairs sum each scale group before scaling it (two
// accumulators per pair); larger ones scale each decoded chunk (one per pair).
constexpr int GROUP_ACCUMULATORS = 8;
constexpr int64_t X_CHUNK_BYTES = 1 << 20;
// Decode tiles ask for each weight row's bytes this far ahead of the block they read: the
// hardware prefetcher alone left each block's first load waiting on memory. Against no
// prefetch, 0.5-16 KB measured best at 4-8 KB (decode products with x rounded, 2 threads:
// SmolLM2's 14.1 -> 9.4 ms, Gemma 3's 28.8 -> 15.2 ms, the 1.5B qwen2's ~117 -> 88 ms;
// bench/RESULTS.md, issue 13, session 8).
constexpr int64_t PREFETCH_BYTES = 8192;
// Products of fewer multiply-adds than this run on the calling thread (~10 us of work: waking
// a worker would cost a good part of it).
constexpr int64_t SMALL_PRODUCT = 1 << 17;
// Each thread's share of a product is split this many times, so that threads claim the
// pieces as they come free (a worker the OS has descheduled leaves its pieces to the others).
constexpr int TASKS_PER_THREAD = 4;

// Byte codes to floats. GCC turns a direct u8 -> float vector conversion into 16 scalar
// ones, and an int8 one into lane inserts: AVX-512 gets the two instructions by name.
inline f32x16 to_float(u8x16 codes) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)codes));
#elif defined(__AVX2__)
  __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32((__m128i)codes)),
                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128((__m128i)codes, 8)))};
  f32x16 out;
  std::memcpy(&out, halves, 64);
  return out;
#else
  return __builtin_convertvector(__builtin_convertvector(codes, i32x16), f32x16);
#endif
}

inline f32x16 int8_to_float(const uint8_t* p) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
                      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
  f32x16 out;
  std::memcpy(&out, halves, 64);
  return out;
#else
  return __builtin_convertvector(__builtin_convertvector(load<i8x16>(p), i32x16), f32x16);
#endif
}

const i32x16 LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
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
#endif
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Formats: VALUES and BYTES per block, GROUP values per scale; scales(block, d, m) fills the
// block's VALUES / GROUP scales d and offsets m (value = d * code + m); codes(block, j) returns
// 16-value chunk j's codes as floats. A product then sums d * (codes . x) per chunk and
// m * (sum of x) per group, the sums of x taken once per call.
// ---------------------------------------------------------------------------------------------

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

// 16 where bit i of the little-endian u32 at qh is set, else 0 (Q5's fifth bits).
inline u8x32 fifth_bits32(const uint8_t* qh) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return (u8x32)_mm256_maskz_set1_epi8(u32(qh), 16);
#elif defined(__AVX2__)
  // Byte i: byte i / 8 of qh (the 4 bytes in every 32-bit lane, picked by an in-lane shuffle),
  // then whether its bit i % 8 is set. (GCC built the generic version below through the stack:
  // a store-forwarding stall each block, Q5_0 decode 7x slower than AVX-512's.)
  const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(u32(qh))), which);
  return (u8x32)_mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(16));
#else
  // Byte i holds byte i / 8 of qh, all of whose bits but i % 8 are then set by `others`.
  u8x4 bytes;
  std::memcpy(&bytes, qh, 4);
  u8x32 spread = __builtin_shufflevector(bytes, bytes, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1,
                                         1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const u8x32 others = {0xfe, 0xfd, 0xfb, 0xf7, 0xef, 0xdf, 0xbf, 0x7f, 0xfe, 0xfd, 0xfb,
                        0xf7, 0xef, 0xdf, 0xbf, 0x7f, 0xfe, 0xfd, 0xfb, 0xf7, 0xef, 0xdf,
                        0xbf, 0x7f, 0xfe, 0xfd, 0xfb, 0xf7, 0xef, 0xdf, 0xbf, 0x7f};
  return (u8x32)((spread | others) == 0xff) & 16;
#endif
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
// (AVX-512BW builds; elsewhere the formats' halves<P> stand in for codes64<P>.)
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

// Without AVX-512BW a 64-byte vector is two registers, and GCC lowered the 64-byte shuffles
// and byte shifts of codes64 / pair_scales element by element through the stack (a Q4_K decode
// tile: 3,179 instructions, 512 of them vpextrb; 5-9x slower than AVX-512's). There the
// super-block path takes 64 codes as two 32-byte halves (values 64p .. 64p + 31, then the
// next 32), each made with 32-byte operations only.
struct Halves {
  u8x32 lo, hi;
};

typedef uint16_t u16x16 __attribute__((vector_size(32)));

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

// ---------------------------------------------------------------------------------------------
// Tiles
// ---------------------------------------------------------------------------------------------

// Every 64-byte line a block of F spans (a K-quant's 144-210 bytes span 3-4: one request a
// block skipped lines, which then waited on memory).
template <class F>
inline void prefetch_block(const uint8_t* p) {
  for (int offset = 0; offset < F::BYTES; offset += 64) {
    __builtin_prefetch(p + offset);
  }
}

// out[c * out_stride + r] = x[c] . W[r] for R rows (rows row_bytes apart) and C tokens;
// sums[c * groups + g]: the sum of x[c] over scale group g (groups = in_features / GROUP).
template <class F, int R, int C>
void tile(const uint8_t* weight, int64_t row_bytes, const float* x, const float* sums,
          int64_t in_features, float* out, int64_t out_stride) {
  constexpr int CHUNKS = F::VALUES / 16, GROUPS = F::VALUES / F::GROUP;
  int64_t groups = in_features / F::GROUP;
  f32x16 acc[R][C] = {};
  float offset[R][C] = {};
  for (int64_t block = 0; block < in_features / F::VALUES; ++block) {
    float d[R][GROUPS], m[R][GROUPS];
    const uint8_t* blocks[R];
    for (int r = 0; r < R; ++r) {
      blocks[r] = weight + r * row_bytes + block * F::BYTES;
      prefetch_block<F>(blocks[r] + PREFETCH_BYTES);
      F::scales(blocks[r], d[r], m[r]);
    }
    if constexpr (F::OFFSET) {
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
          for (int g = 0; g < GROUPS; ++g) {
            offset[r][c] += m[r][g] * sums[c * groups + block * GROUPS + g];
          }
        }
      }
    }
    const float* xb = x + block * F::VALUES;
    if constexpr (R * C <= GROUP_ACCUMULATORS) {
      // Few accumulators: sum codes . x over a scale group, then scale the sum once
      // (a multiply per group instead of one per chunk; decode's instruction count).
#pragma GCC unroll 16  // chunk j's byte offsets, shifts and scale index become constants
      for (int g = 0; g < GROUPS; ++g) {
        f32x16 group[R][C] = {};
        for (int j = g * F::GROUP / 16; j < (g + 1) * F::GROUP / 16; ++j) {
          for (int r = 0; r < R; ++r) {
            f32x16 codes = F::codes(blocks[r], j);
            for (int c = 0; c < C; ++c) {
              group[r][c] += codes * load<f32x16>(xb + c * in_features + 16 * j);
            }
          }
        }
        for (int r = 0; r < R; ++r) {
          for (int c = 0; c < C; ++c) {
            acc[r][c] += group[r][c] * d[r][g];
          }
        }
      }
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < CHUNKS; ++j) {
        f32x16 xv[C];
        for (int c = 0; c < C; ++c) {
          xv[c] = load<f32x16>(xb + c * in_features + 16 * j);
        }
        for (int r = 0; r < R; ++r) {
          f32x16 w = F::codes(blocks[r], j) * d[r][16 * j / F::GROUP];
          for (int c = 0; c < C; ++c) {
            acc[r][c] += w * xv[c];
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float sum = offset[r][c];
      for (int lane = 0; lane < 16; ++lane) {
        sum += acc[r][c][lane];
      }
      out[c * out_stride + r] = sum;
    }
  }
}

using TileFn = void (*)(const uint8_t*, int64_t, const float*, const float*, int64_t, float*,
                        int64_t);

// The tiles a product uses, [rows][tokens]: DECODE_ROWS rows (or 1, for a short last block)
// by 1..PREFILL_TOKENS-1 tokens, and PREFILL_ROWS rows (or 1) by PREFILL_TOKENS tokens.
template <class F>
struct Tiles {
  TileFn decode[2][PREFILL_TOKENS - 1];  // [0]: 1 row, [1]: DECODE_ROWS rows
  TileFn prefill[2];  // [0]: 1 row, [1]: PREFILL_ROWS rows
  template <int... C>
  constexpr Tiles(std::integer_sequence<int, C...>)
      : decode{{tile<F, 1, C + 1>...}, {tile<F, DECODE_ROWS, C + 1>...}},
        prefill{tile<F, 1, PREFILL_TOKENS>, tile<F, PREFILL_ROWS, PREFILL_TOKENS>} {}
  constexpr Tiles() : Tiles(std::make_integer_sequence<int, PREFILL_TOKENS - 1>{}) {}
};

// ---------------------------------------------------------------------------------------------
// Prefill panels: PANEL_ROWS weight rows decoded to floats, a slice of PANEL_SLICE values of
// each at a time, once per group of PANEL_GROUP_TOKENS tokens, then multiplied as a matrix
// product with each PANEL_TOKENS-token chunk of the group: for each k, x[k] for the chunk's
// tokens (two vectors, from x laid out [k][token] per chunk) times each row's value
// broadcast, into PANEL_ROWS x 2 vector accumulators, added to the output after the first
// slice. Every instruction of the inner loop but two loads is a multiply-add. The group's x
// slices (PANEL_GROUP_TOKENS x PANEL_SLICE floats, 1 MB) stay in L2 across its row blocks.
// ---------------------------------------------------------------------------------------------

// The row's values, d * code + m, into panel_row [in_features].
template <class F>
void decode_row(const uint8_t* row, int64_t in_features, float* panel_row) {
  constexpr int GROUPS = F::VALUES / F::GROUP;
  for (int64_t block = 0; block < in_features / F::VALUES; ++block) {
    const uint8_t* b = row + block * F::BYTES;
    float d[GROUPS], m[GROUPS] = {};
    F::scales(b, d, m);
#pragma GCC unroll 16
    for (int j = 0; j < F::VALUES / 16; ++j) {
      f32x16 values = F::codes(b, j) * d[16 * j / F::GROUP] + m[16 * j / F::GROUP];
      std::memcpy(panel_row + block * F::VALUES + 16 * j, &values, 64);
    }
  }
}

// out[t * out_stride + r] (+= if `add`) for R rows of `panel` [R, length] and the chunk's
// PANEL_TOKENS tokens of x_t [length, PANEL_TOKENS]; tokens >= `tokens` are padding.
// Rows whose accumulators (2 vectors of 16 floats a row) the registers hold at once: all of a
// panel's with AVX-512's 32 registers; two elsewhere (AVX2 or NEON, where a 16-float vector
// takes two or four registers: 8 rows spilled every accumulator, ~4 GFLOP/s).
#if defined(__AVX512F__)
constexpr int PANEL_ROWS_AT_ONCE = PANEL_ROWS;
#else
constexpr int PANEL_ROWS_AT_ONCE = 2;
#endif

template <int R>
void panel_rows(const float* panel, const float* x_t, int64_t length, int tokens, float* out,
                int64_t out_stride, bool add) {
#if defined(__AVX512F__)
  f32x16 acc[R][2] = {};
  for (int64_t k = 0; k < length; ++k) {
    f32x16 x0 = load<f32x16>(x_t + k * PANEL_TOKENS), x1 = load<f32x16>(x_t + k * PANEL_TOKENS + 16);
    for (int r = 0; r < R; ++r) {
      float w = panel[r * length + k];
      acc[r][0] += w * x0;
      acc[r][1] += w * x1;
    }
  }
  auto result = [&](int r, int t) { return acc[r][t / 16][t % 16]; };
#else
  // 8-float vectors: GCC builds a scalar's splat into a 16-float vector through the stack where
  // that is not one register (AVX2: ~5 GFLOP/s).
  f32x8 acc[R][4] = {};
  for (int64_t k = 0; k < length; ++k) {
    f32x8 x[4];
    for (int q = 0; q < 4; ++q) {
      x[q] = load<f32x8>(x_t + k * PANEL_TOKENS + 8 * q);
    }
    for (int r = 0; r < R; ++r) {
      f32x8 w = f32x8{} + panel[r * length + k];
      for (int q = 0; q < 4; ++q) {
        acc[r][q] += w * x[q];
      }
    }
  }
  auto result = [&](int r, int t) { return acc[r][t / 8][t % 8]; };
#endif
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < tokens; ++t) {
      float& o = out[t * out_stride + r];
      o = add ? o + result(r, t) : result(r, t);
    }
  }
}

template <int R>
void panel_product(const float* panel, const float* x_t, int64_t length, int tokens, float* out,
                   int64_t out_stride, bool add) {
  constexpr int WHOLE = R / PANEL_ROWS_AT_ONCE * PANEL_ROWS_AT_ONCE;
  for (int r = 0; r < WHOLE; r += PANEL_ROWS_AT_ONCE) {
    panel_rows<PANEL_ROWS_AT_ONCE>(panel + r * length, x_t, length, tokens, out + r, out_stride, add);
  }
  if constexpr (R > WHOLE) {
    panel_rows<R - WHOLE>(panel + WHOLE * length, x_t, length, tokens, out + WHOLE, out_stride, add);
  }
}

using PanelFn = void (*)(const float*, const float*, int64_t, int, float*, int64_t, bool);

template <int... R>
constexpr std::array<PanelFn, sizeof...(R)> panel_products(std::integer_sequence<int, R...>) {
  return {panel_product<R + 1>...};
}

// PANEL_FNS[r - 1]: r rows (the last block of a product may be short).
constexpr auto PANEL_FNS = panel_products(std::make_integer_sequence<int, PANEL_ROWS>{});

template <class F>
void linear_panels(const float* x, const uint8_t* weight, float* out, int64_t tokens,
                   int64_t in_features, int64_t out_features, int threads) {
  int64_t row_bytes = in_features / F::VALUES * F::BYTES;
  int64_t chunks = (tokens + PANEL_TOKENS - 1) / PANEL_TOKENS;
  // x laid out [chunk][k][token of the chunk], the padding tokens zero.
  std::vector<float> x_t(chunks * in_features * PANEL_TOKENS, 0.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    float* column = x_t.data() + t / PANEL_TOKENS * in_features * PANEL_TOKENS + t % PANEL_TOKENS;
    for (int64_t k = 0; k < in_features; ++k) {
      column[k * PANEL_TOKENS] = x[t * in_features + k];
    }
  }
  int64_t row_blocks = (out_features + PANEL_ROWS - 1) / PANEL_ROWS;
  int tasks = static_cast<int>(std::min<int64_t>(row_blocks, TASKS_PER_THREAD * threads));
  constexpr int64_t GROUP_CHUNKS = PANEL_GROUP_TOKENS / PANEL_TOKENS;
  const int64_t slice = std::min(in_features, PANEL_SLICE / F::VALUES * F::VALUES);
  ThreadPool::instance().run(tasks, threads, [&](int task) {
    std::vector<float> panel(PANEL_ROWS * slice);
    int64_t first = row_blocks * task / tasks, last = row_blocks * (task + 1) / tasks;
    for (int64_t group = 0; group < chunks; group += GROUP_CHUNKS) {
      for (int64_t k0 = 0; k0 < in_features; k0 += slice) {
        int64_t length = std::min(slice, in_features - k0);
        for (int64_t block = first; block < last; ++block) {
          int64_t row0 = block * PANEL_ROWS;
          int rows = static_cast<int>(std::min<int64_t>(PANEL_ROWS, out_features - row0));
          for (int r = 0; r < rows; ++r) {
            decode_row<F>(weight + (row0 + r) * row_bytes + k0 / F::VALUES * F::BYTES, length,
                          panel.data() + r * length);
          }
          for (int64_t chunk = group; chunk < std::min(chunks, group + GROUP_CHUNKS); ++chunk) {
            int count = static_cast<int>(std::min<int64_t>(PANEL_TOKENS, tokens - chunk * PANEL_TOKENS));
            PANEL_FNS[rows - 1](panel.data(), x_t.data() + (chunk * in_features + k0) * PANEL_TOKENS,
                                length, count, out + chunk * PANEL_TOKENS * out_features + row0,
                                out_features, k0 > 0);
          }
        }
      }
    }
  });
}

template <class F>
void linear_format(const float* x, const uint8_t* weight, float* out, int64_t tokens,
                   int64_t in_features, int64_t out_features, int threads) {
  if (tokens >= PANEL_MIN_TOKENS) {
    return linear_panels<F>(x, weight, out, tokens, in_features, out_features, threads);
  }
  static constexpr Tiles<F> tiles;
  int64_t row_bytes = in_features / F::VALUES * F::BYTES;
  int64_t row_blocks = (out_features + DECODE_ROWS - 1) / DECODE_ROWS;
  // Small products (a decode step's norms-sized ones) stay on the calling thread.
  bool parallel = tokens * in_features * out_features >= SMALL_PRODUCT;
  int tasks = static_cast<int>(std::min<int64_t>(row_blocks, parallel ? TASKS_PER_THREAD * threads : 1));
  int64_t chunk = std::max<int64_t>(
      PREFILL_TOKENS, X_CHUNK_BYTES / (4 * in_features) / PREFILL_TOKENS * PREFILL_TOKENS);
  int64_t groups = in_features / F::GROUP;
  std::vector<float> sums(F::OFFSET ? tokens * groups : 0);  // [tokens, groups]
  for (int64_t g = 0; g < static_cast<int64_t>(sums.size()); ++g) {
    const float* values = x + g * F::GROUP;
    float sum = 0;
    for (int i = 0; i < F::GROUP; ++i) {
      sum += values[i];
    }
    sums[g] = sum;
  }
  // Rows [row0, row0 + rows) times tokens [t, t + count).
  auto multiply = [&](TileFn fn, int64_t row0, int64_t t) {
    fn(weight + row0 * row_bytes, row_bytes, x + t * in_features, sums.data() + t * groups,
       in_features, out + t * out_features + row0, out_features);
  };
  ThreadPool::instance().run(tasks, threads, [&](int task) {
    int64_t first = row_blocks * task / tasks, last = row_blocks * (task + 1) / tasks;
    for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
      int64_t t_end = std::min(tokens, t0 + chunk);
      for (int64_t block = first; block < last; ++block) {
        int64_t row0 = block * DECODE_ROWS;
        bool whole = row0 + DECODE_ROWS <= out_features;
        int64_t t = t0;
        for (; t + PREFILL_TOKENS <= t_end; t += PREFILL_TOKENS) {
          if (whole) {
            for (int r = 0; r < DECODE_ROWS; r += PREFILL_ROWS) {
              multiply(tiles.prefill[1], row0 + r, t);
            }
          } else {
            for (int64_t r = row0; r < out_features; ++r) {
              multiply(tiles.prefill[0], r, t);
            }
          }
        }
        if (t < t_end) {
          int count = static_cast<int>(t_end - t);
          if (whole) {
            multiply(tiles.decode[1][count - 1], row0, t);
          } else {
            for (int64_t r = row0; r < out_features; ++r) {
              multiply(tiles.decode[0][count - 1], r, t);
            }
          }
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The rounded paths (decode, T <= 8). Weights are read as unsigned byte codes (value = d *
// code + m; Q8_0's signed) and multiplied by x's int8 codes with integer dot products.
// - 32-value formats: x rounded to int8 blocks of 32 values with one scale each (llama.cpp's
//   q8_0; formats.quantize_activations); each block's dot product (AVX-512 VNNI dpbusd, AVX2
//   maddubs + madd, or scalar code) into 8 int32 lanes, converted and scaled once: d_weight *
//   d_x. The offsets m through the blocks' sums of the rounded x.
// - K-quants (tile_super): x rounded to int8 blocks of 256 values with one scale each
//   (llama.cpp's q8_K; formats.quantize_activations_super), so that a whole super-block sums
//   in integers: 64 values at a time, maddubs (code * x, pairs summed to int16) then madd (or
//   VNNI dpwssd) with each 16 values' integer scale, into 16 int32 lanes; converted and scaled
//   once per super-block, d_weight * d_x. The offsets (Q4_K/Q5_K's mins, Q6_K's -32) through
//   per-16 integer sums of x's codes, one 16-lane madd per super-block.
// ---------------------------------------------------------------------------------------------

// Lane k: the sum over values 4k .. 4k + 3 of w * x (w unsigned, at most 128 with x's sign
// folded in, so AVX2's 16-bit pair sums cannot saturate: 2 * 128 * 127 < 2^15).
inline i32x8 dot_unsigned(u8x32 w, i8x32 x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return (i32x8)_mm256_dpbusd_epi32(_mm256_setzero_si256(), (__m256i)w, (__m256i)x);
#elif defined(__AVXVNNI__)
  return (i32x8)_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (__m256i)w, (__m256i)x);
#elif defined(__AVX2__)
  return (i32x8)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)w, (__m256i)x),
                                  _mm256_set1_epi16(1));
#else
  i32x8 sum = {};
  for (int i = 0; i < 32; ++i) {
    sum[i / 4] += static_cast<int32_t>(w[i]) * static_cast<int32_t>(x[i]);
  }
  return sum;
#endif
}

// The same for signed w (Q8_0): |w| times x with w's sign.
inline i32x8 dot_signed(u8x32 w, i8x32 x) {
#if defined(__AVX2__)
  return dot_unsigned((u8x32)_mm256_abs_epi8((__m256i)w), (i8x32)_mm256_sign_epi8((__m256i)x, (__m256i)w));
#else
  i32x8 sum = {};
  for (int i = 0; i < 32; ++i) {
    sum[i / 4] += static_cast<int32_t>(static_cast<int8_t>(w[i])) * static_cast<int32_t>(x[i]);
  }
  return sum;
#endif
}

#if defined(__AVX512BW__)
// acc + lane k: the sum over values 4k .. 4k + 3 of scales[value / 2] * w * x. w unsigned, at
// most 63 (a 6-bit code), so the int16 pair sums of maddubs, at most 2 * 63 * 127, cannot
// saturate; |scales| <= 128, so a lane gains at most 4 * 63 * 127 * 128 < 2^23 a call.
// (Without AVX-512BW the super-block path takes halves: dot_scaled8.)
inline i32x16 dot_scaled(i32x16 acc, u8x64 w, i8x64 x, i16x32 scales) {
  __m512i pairs = _mm512_maddubs_epi16((__m512i)w, (__m512i)x);
#if defined(__AVX512VNNI__)
  return (i32x16)_mm512_dpwssd_epi32((__m512i)acc, pairs, (__m512i)scales);
#else
  return acc + (i32x16)_mm512_madd_epi16(pairs, (__m512i)scales);
#endif
}
#endif

// dot_scaled for one 32-byte half (Halves): acc + lane k: the sum over values 4k .. 4k + 3 of
// scales[value / 2] * w * x (the same bounds).
inline i32x8 dot_scaled8(i32x8 acc, u8x32 w, i8x32 x, i16x16 scales) {
#if defined(__AVX2__)
  __m256i pairs = _mm256_maddubs_epi16((__m256i)w, (__m256i)x);
#if defined(__AVXVNNI__)
  return (i32x8)_mm256_dpwssd_avx_epi32((__m256i)acc, pairs, (__m256i)scales);
#else
  return acc + (i32x8)_mm256_madd_epi16(pairs, (__m256i)scales);
#endif
#else
  for (int i = 0; i < 32; ++i) {
    acc[i / 4] += static_cast<int32_t>(scales[i / 2]) * static_cast<int32_t>(w[i]) *
                  static_cast<int32_t>(x[i]);
  }
  return acc;
#endif
}

// Lane k: a[2k] * b[2k] + a[2k + 1] * b[2k + 1].
inline i32x8 madd16(i16x16 a, i16x16 b) {
#if defined(__AVX2__)
  return (i32x8)_mm256_madd_epi16((__m256i)a, (__m256i)b);
#else
  i32x8 sum = {};
  for (int i = 0; i < 16; ++i) {
    sum[i / 2] += static_cast<int32_t>(a[i]) * static_cast<int32_t>(b[i]);
  }
  return sum;
#endif
}

// Rounds `values` [count] to codes round(x / d), half away from zero, with d = max |x| / 127
// (0 where d is 0), as formats.quantize_activations (x / d, not x * (1 / d)); returns d.
inline float round_block(const float* values, int count, int8_t* codes) {
#if defined(__AVX512F__)
  if (count % 16 == 0) {  // the same float operations, 16 values at a time
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
#endif
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

// x rounded per block of `x_block` values: codes [tokens, in], scales [tokens, in / x_block]
// (max |x| / 127 of each block), offsets [tokens, in / g] (the scale times the sum of each g
// codes: the rounded x's sums over a weight format's group), rounded by `threads` threads,
// tokens split among them. The decode tiles of the 32-value formats read it per 32 (q8_0, one
// thread: x_block = g = 32); the integer panels per 32 or 256 (q8_K) with the format's group.
struct RoundedRows {
  std::vector<int8_t> codes;
  std::vector<float> scales, offsets;
  int64_t in_features, block;

  RoundedRows(const float* x, int64_t tokens, int64_t in, int64_t x_block, int64_t g, int threads)
      : codes(tokens * in), scales(tokens * in / x_block), offsets(tokens * in / g),
        in_features(in), block(x_block) {
    int tasks = static_cast<int>(std::min<int64_t>(tokens, threads));
    ThreadPool::instance().run(tasks, threads, [&](int task) {
      for (int64_t t = tokens * task / tasks; t < tokens * (task + 1) / tasks; ++t) {
        for (int64_t b = t * in / x_block; b < (t + 1) * in / x_block; ++b) {
          scales[b] = round_block(x + x_block * b, static_cast<int>(x_block), codes.data() + x_block * b);
        }
        for (int64_t j = t * in / g; j < (t + 1) * in / g; ++j) {
          int32_t sum = 0;
          for (int i = 0; i < g; ++i) {
            sum += codes[g * j + i];
          }
          offsets[j] = scales[g * j / x_block] * static_cast<float>(sum);
        }
      }
    });
  }
  // The decode tiles' x (32-value formats): per 32, one thread.
  RoundedRows(const float* x, int64_t tokens, int64_t in) : RoundedRows(x, tokens, in, 32, 32, 1) {}
};

// x rounded per 256 (q8_K): codes [tokens, in], scales [tokens, in / 256], sums16 [tokens,
// in / 16] (the sum of each 16 codes, at most 16 * 127).
struct SuperRows {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  std::vector<int16_t> sums16;
  int64_t in_features;

  SuperRows(const float* x, int64_t tokens, int64_t in) :
      codes(tokens * in), scales(tokens * in / 256), sums16(tokens * in / 16), in_features(in) {
    for (int64_t block = 0; block < tokens * in / 256; ++block) {
      scales[block] = round_block(x + 256 * block, 256, codes.data() + 256 * block);
    }
    for (int64_t group = 0; group < tokens * in / 16; ++group) {
      int32_t sum = 0;
      for (int i = 0; i < 16; ++i) {
        sum += codes[16 * group + i];
      }
      sums16[group] = static_cast<int16_t>(sum);
    }
  }
};

inline f32x4 fold(f32x8 v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
}

// out[r] = the sum of rows[r]'s lanes for r < R. Four rows are summed as one transposition of
// adds and stored together (a decode tile's rows are adjacent outputs): for rows of a few
// blocks (the 1.5B qwen2's 1536-value rows: 6 super-blocks), lane by lane sums cost as much as
// a block.
template <int R>
inline void store_sums(const f32x8 (&rows)[R], float* out) {
  if constexpr (R == 4) {
    f32x4 a = fold(rows[0]), b = fold(rows[1]), c = fold(rows[2]), d = fold(rows[3]);
    f32x4 ab = __builtin_shufflevector(a, b, 0, 2, 4, 6) + __builtin_shufflevector(a, b, 1, 3, 5, 7);
    f32x4 cd = __builtin_shufflevector(c, d, 0, 2, 4, 6) + __builtin_shufflevector(c, d, 1, 3, 5, 7);
    store(out, __builtin_shufflevector(ab, cd, 0, 2, 4, 6) + __builtin_shufflevector(ab, cd, 1, 3, 5, 7));
  } else {
    for (int r = 0; r < R; ++r) {
      float sum = 0;
      for (int lane = 0; lane < 8; ++lane) {
        sum += rows[r][lane];
      }
      out[r] = sum;
    }
  }
}

// out[c * out_stride + r] = x[c] (rounded) . W[r] for R rows and C tokens (32-value formats).
template <class F, int R, int C>
void tile_rounded(const uint8_t* weight, int64_t row_bytes, const RoundedRows& x, float* out,
                  int64_t out_stride) {
  static_assert(F::VALUES == 32 && F::GROUP == 32);
  const int64_t in = x.in_features, blocks = in / 32;
  f32x8 acc[R][C] = {};
  float offsets[R][C] = {};
  for (int64_t block = 0; block < blocks; ++block) {
    float d[R], m[R];
    const uint8_t* b[R];
    for (int r = 0; r < R; ++r) {
      b[r] = weight + r * row_bytes + block * F::BYTES;
      prefetch_block<F>(b[r] + PREFETCH_BYTES);
      F::scales(b[r], &d[r], &m[r]);
    }
    i8x32 xv[C];
    float xd[C];
    for (int c = 0; c < C; ++c) {
      int64_t x_block = c * blocks + block;
      xv[c] = load<i8x32>(x.codes.data() + 32 * x_block);
      xd[c] = x.scales[x_block];
      if constexpr (F::OFFSET) {
        for (int r = 0; r < R; ++r) {
          offsets[r][c] += m[r] * x.offsets[x_block];
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      u8x32 w = F::codes32(b[r]);
      for (int c = 0; c < C; ++c) {
        i32x8 dot = F::SIGNED ? dot_signed(w, xv[c]) : dot_unsigned(w, xv[c]);
        acc[r][c] += __builtin_convertvector(dot, f32x8) * (d[r] * xd[c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    f32x8 rows[R];
    for (int r = 0; r < R; ++r) {
      rows[r] = acc[r][c];
      rows[r][0] += offsets[r][c];
    }
    store_sums<R>(rows, out + c * out_stride);
  }
}

// Word w of the result: scales16[4p + w / 8] (the scale of each 16 of values 64p .. 64p + 63).
template <int P>
inline i16x32 pair_scales(i16x16 s) {
  return __builtin_shufflevector(s, s, 4 * P, 4 * P, 4 * P, 4 * P, 4 * P, 4 * P, 4 * P, 4 * P,
                                 4 * P + 1, 4 * P + 1, 4 * P + 1, 4 * P + 1, 4 * P + 1, 4 * P + 1,
                                 4 * P + 1, 4 * P + 1, 4 * P + 2, 4 * P + 2, 4 * P + 2, 4 * P + 2,
                                 4 * P + 2, 4 * P + 2, 4 * P + 2, 4 * P + 2, 4 * P + 3, 4 * P + 3,
                                 4 * P + 3, 4 * P + 3, 4 * P + 3, 4 * P + 3, 4 * P + 3, 4 * P + 3);
}

// pair_scales' half: words 0-7 scales16[A], words 8-15 scales16[A + 1] (A even).
template <int A>
inline i16x16 scale_pair(i16x16 s) {
  static_assert(A % 2 == 0 && A < 16);
#if defined(__AVX2__)
  // Both in one 128-bit half of s: broadcast it to both lanes, then pick one word a lane.
  __m128i part = A < 8 ? _mm256_castsi256_si128((__m256i)s) : _mm256_extracti128_si256((__m256i)s, 1);
  constexpr int a = A % 8, b = (A + 1) % 8;
  const __m256i pick = _mm256_set_m128i(_mm_set1_epi16(static_cast<short>((2 * b) | ((2 * b + 1) << 8))),
                                        _mm_set1_epi16(static_cast<short>((2 * a) | ((2 * a + 1) << 8))));
  return (i16x16)_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(part), pick);
#else
  i16x16 out;
  for (int w = 0; w < 16; ++w) {
    out[w] = s[A + w / 8];
  }
  return out;
#endif
}

template <class Fn, int... P>
inline void each_quarter(Fn&& fn, std::integer_sequence<int, P...>) {
  (fn(std::integral_constant<int, P>{}), ...);
}

// out[c * out_stride + r] = x[c] (rounded per 256) . W[r] for R rows and C tokens (K-quants).
template <class F, int R, int C>
void tile_super(const uint8_t* weight, int64_t row_bytes, const SuperRows& x, float* out,
                int64_t out_stride) {
  static_assert(F::VALUES == 256);
  const int64_t in = x.in_features, blocks = in / 256;
#if defined(__AVX512BW__)
  f32x16 acc[R][C] = {};
#else
  f32x8 acc[R][C] = {};
#endif
  f32x8 offsets[R][C] = {};
  for (int64_t block = 0; block < blocks; ++block) {
    const uint8_t* b[R];
    SuperScales s[R];
    for (int r = 0; r < R; ++r) {
      b[r] = weight + r * row_bytes + block * F::BYTES;
      prefetch_block<F>(b[r] + PREFETCH_BYTES);
      s[r] = F::super_scales(b[r]);
    }
    const int8_t* xc[C];
    float xd[C];
    for (int c = 0; c < C; ++c) {
      xc[c] = x.codes.data() + c * in + 256 * block;
      xd[c] = x.scales[c * blocks + block];
      i16x16 sums = load<i16x16>(x.sums16.data() + c * (in / 16) + 16 * block);
      for (int r = 0; r < R; ++r) {
        offsets[r][c] += __builtin_convertvector(madd16(s[r].offsets16, sums), f32x8) * (s[r].o * xd[c]);
      }
    }
#if defined(__AVX512BW__)
    i32x16 dots[R][C] = {};
    each_quarter([&](auto p) {
      constexpr int P = decltype(p)::value;
      i8x64 xv[C];
      for (int c = 0; c < C; ++c) {
        xv[c] = load<i8x64>(xc[c] + 64 * P);
      }
      for (int r = 0; r < R; ++r) {
        u8x64 w = F::template codes64<P>(b[r]);
        i16x32 scales = pair_scales<P>(s[r].scales16);
        for (int c = 0; c < C; ++c) {
          dots[r][c] = dot_scaled(dots[r][c], w, xv[c], scales);
        }
      }
    }, std::make_integer_sequence<int, 4>{});
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        acc[r][c] += __builtin_convertvector(dots[r][c], f32x16) * (s[r].d * xd[c]);
      }
    }
#else
    // Halves: 32-byte operations only (see Halves); both halves sum into one int32 vector.
    i32x8 dots[R][C] = {};
    each_quarter([&](auto p) {
      constexpr int P = decltype(p)::value;
      i8x32 lo[C], hi[C];
      for (int c = 0; c < C; ++c) {
        lo[c] = load<i8x32>(xc[c] + 64 * P);
        hi[c] = load<i8x32>(xc[c] + 64 * P + 32);
      }
      for (int r = 0; r < R; ++r) {
        Halves w = F::template halves<P>(b[r]);
        i16x16 scales_lo = scale_pair<4 * P>(s[r].scales16), scales_hi = scale_pair<4 * P + 2>(s[r].scales16);
        for (int c = 0; c < C; ++c) {
          dots[r][c] = dot_scaled8(dot_scaled8(dots[r][c], w.lo, lo[c], scales_lo), w.hi, hi[c], scales_hi);
        }
      }
    }, std::make_integer_sequence<int, 4>{});
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        acc[r][c] += __builtin_convertvector(dots[r][c], f32x8) * (s[r].d * xd[c]);
      }
    }
#endif
  }
  for (int c = 0; c < C; ++c) {
    f32x8 rows[R];
    for (int r = 0; r < R; ++r) {
#if defined(__AVX512BW__)
      rows[r] = offsets[r][c] + __builtin_shufflevector(acc[r][c], acc[r][c], 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(acc[r][c], acc[r][c], 8, 9, 10, 11, 12, 13, 14, 15);
#else
      rows[r] = offsets[r][c] + acc[r][c];
#endif
    }
    store_sums<R>(rows, out + c * out_stride);
  }
}

template <class Rows>
using RoundedTileFn = void (*)(const uint8_t*, int64_t, const Rows&, float*, int64_t);

// Tiles of DECODE_ROWS rows (or 1, for a short last block) by 1..ROUNDED_MAX_TOKENS tokens:
// tile_super for K-quants (x as SuperRows), tile_rounded for the rest (x as RoundedRows per 32).
template <class F>
struct RoundedTiles {
  static constexpr bool SUPER = F::VALUES == 256;
  using Rows = std::conditional_t<SUPER, SuperRows, RoundedRows>;
  RoundedTileFn<Rows> tiles[2][ROUNDED_MAX_TOKENS];
  template <int R, int C>
  static constexpr RoundedTileFn<Rows> tile() {
    if constexpr (SUPER) {
      return tile_super<F, R, C>;
    } else {
      return tile_rounded<F, R, C>;
    }
  }
  template <int... C>
  constexpr RoundedTiles(std::integer_sequence<int, C...>)
      : tiles{{tile<1, C + 1>()...}, {tile<DECODE_ROWS, C + 1>()...}} {}
  constexpr RoundedTiles() : RoundedTiles(std::make_integer_sequence<int, ROUNDED_MAX_TOKENS>{}) {}
};

// ---------------------------------------------------------------------------------------------
// Rounded panels (prefill, more than ROUNDED_MAX_TOKENS tokens): x rounded as the decode tiles
// round it (per 32 values, per 256 for the K-quants), weights as unsigned byte codes, and the
// products as integer dot products with one weight row per int32 lane: a panel of
// IPANEL_ROWS rows holds a slice of their codes as [slice / 4][row][4 bytes], so one 64-byte
// load and, per token, one broadcast of 4 of x's codes make 64 multiply-adds (AVX-512 VNNI
// dpbusd: u8 x s8 summed by 4 into int32, no saturation). Each scale group's int32 sums are
// converted and scaled once per (token, group): d_weight (a vector over rows) * d_x, plus the
// group's offset m_weight * (d_x * the sum of x's codes in the group).
// A row slice's panel is built once per IPANEL_GROUP_TOKENS tokens.
// ---------------------------------------------------------------------------------------------

constexpr int IPANEL_ROWS = 16;
// Tokens per tile: each takes two vectors of accumulators (int32 sums, float32 results), 2
// registers with AVX-512, 4 elsewhere.
#if defined(__AVX512F__)
constexpr int IPANEL_TOKENS = 12;
#else
constexpr int IPANEL_TOKENS = 3;
#endif
// Where the dot products multiply unsigned weight codes (VNNI dpbusd), Q8_0's codes enter the
// panels + 128 (m = -128 d); elsewhere signed (AVX2's maddubs would saturate on codes above
// 128: its int16 pair sums hold 2 x 128 x 127 at most, so a code's magnitude is taken, its sign
// moved onto x).
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
constexpr bool PANEL_SIGNED_CODES = false;
#else
constexpr bool PANEL_SIGNED_CODES = true;
#endif
// A panel serves this many tokens (x's codes for them, 512 KB of a 2048-value slice, stay in L2).
constexpr int IPANEL_GROUP_TOKENS = 256;

// out [16 words][16 rows]: word w of line `line` (bytes 64 line .. 64 line + 63) of each row's
// codes, i.e. the 16 x 16 matrix of 4-byte words transposed.
template <size_t UNIT>
inline void transpose_words(const uint8_t (&rows)[IPANEL_ROWS][UNIT], int64_t line, uint8_t* out) {
#if defined(__AVX512F__)
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
#else
  for (int r = 0; r < IPANEL_ROWS; ++r) {
    for (int w = 0; w < 16; ++w) {
      std::memcpy(out + (w * IPANEL_ROWS + r) * 4, rows[r] + 64 * line + 4 * w, 4);
    }
  }
#endif
}

// A block's codes in value order as bytes, unsigned (Q8_0's code + 128), and its VALUES / GROUP
// scales d and offsets m: value = d * code + m.
template <class F>
inline void block_codes(const uint8_t* b, uint8_t* codes, float* d, float* m) {
  if constexpr (F::VALUES == 32) {
    u8x32 c = F::codes32(b);
    m[0] = 0;
    F::scales(b, d, m);
    if constexpr (F::SIGNED && !PANEL_SIGNED_CODES) {
      c ^= 0x80;
      m[0] = -128 * d[0];
    }
    std::memcpy(codes, &c, 32);
  } else {
    F::scales(b, d, m);
    each_quarter([&](auto p) {
      constexpr int P = decltype(p)::value;
#if defined(__AVX512BW__)
      u8x64 c = F::template codes64<P>(b);
      std::memcpy(codes + 64 * P, &c, 64);
#else
      Halves c = F::template halves<P>(b);
      std::memcpy(codes + 64 * P, &c.lo, 32);
      std::memcpy(codes + 64 * P + 32, &c.hi, 32);
#endif
    }, std::make_integer_sequence<int, 4>{});
  }
}

// acc + lane r: weight row r's 4 codes (bytes 4r .. 4r + 3 of w; unsigned, or signed where
// SIGNED) dotted with x's 4 codes (x4). Unsigned codes are at most 63 where maddubs takes
// them (Q8_0's + 128 codes only meet VNNI: PANEL_SIGNED_CODES).
template <bool SIGNED>
inline i32x16 dot4(i32x16 acc, u8x64 w, int32_t x4) {
#if defined(__AVX512VNNI__)
  static_assert(!SIGNED);
  return (i32x16)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x4));
#elif defined(__AVX2__)
  __m256i halves[2], w2[2];
  std::memcpy(halves, &acc, 64);
  std::memcpy(w2, &w, 64);
  const __m256i x = _mm256_set1_epi32(x4);
  for (int h = 0; h < 2; ++h) {
#if defined(__AVXVNNI__)
    static_assert(!SIGNED);
    halves[h] = _mm256_dpbusd_avx_epi32(halves[h], w2[h], x);
#else
    __m256i pairs = SIGNED ? _mm256_maddubs_epi16(_mm256_abs_epi8(w2[h]), _mm256_sign_epi8(x, w2[h]))
                           : _mm256_maddubs_epi16(w2[h], x);
    halves[h] = _mm256_add_epi32(halves[h], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
  }
  std::memcpy(&acc, halves, 64);
  return acc;
#else
  i8x64 x = (i8x64)(i32x16{} + x4);
  for (int i = 0; i < 64; ++i) {
    int32_t code = SIGNED ? static_cast<int8_t>(w[i]) : w[i];
    acc[i / 4] += code * static_cast<int32_t>(x[i]);
  }
  return acc;
#endif
}

// dot4 of two consecutive 4-value steps, (w0, x0) then (w1, x1), for unsigned codes where
// PAIRED_DOT4 (AVX2 without VNNI): codes are at most 63 there, so a maddubs pair sum is at
// most 2 * 63 * 127 = 16,002 and two of them 32,004 < 2^15; both steps' int16 pair sums are
// added before one widening madd, three multiply-port operations per 32-byte half instead of
// four (AVX2 prompt products 10-20 % faster). Signed codes (|w| up to 128) keep dot4.
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
constexpr bool PAIRED_DOT4 = false;
inline i32x16 dot4x2(i32x16 acc, u8x64, u8x64, int32_t, int32_t) {  // not called
  return acc;
}
#endif

// out[t * out_stride + r] (+= if `add`) for the panel's rows r < rows and tokens t < T of x
// (codes, scales, offsets already at the slice's start), over `length` values.
template <int T, int G, bool SIGNED>
void ipanel_product(const uint8_t* codes, const float* d, const float* m, const RoundedRows& x,
                    int64_t token0, int64_t k0, int64_t length, float* out, int64_t out_stride,
                    int rows, bool add) {
  const int64_t in = x.in_features;
  const int8_t* xc[T];
  const float* xd[T];
  const float* xo[T];
  for (int t = 0; t < T; ++t) {
    xc[t] = x.codes.data() + (token0 + t) * in + k0;
    xd[t] = x.scales.data() + ((token0 + t) * in + k0) / x.block;
    xo[t] = x.offsets.data() + ((token0 + t) * in + k0) / G;
  }
  const int shift = x.block == 256 ? 8 : 5;  // value -> x block
  f32x16 acc[T] = {};
  for (int64_t g = 0; g < length / G; ++g) {
    i32x16 sums[T] = {};
    if constexpr (PAIRED_DOT4 && !SIGNED) {
#pragma GCC unroll 4
      for (int q = 0; q < G / 4; q += 2) {  // G / 4 is even (G: 16, 32 or 256)
        u8x64 w0 = load<u8x64>(codes + (g * (G / 4) + q) * 64);
        u8x64 w1 = load<u8x64>(codes + (g * (G / 4) + q + 1) * 64);
        for (int t = 0; t < T; ++t) {
          int32_t x8[2];
          std::memcpy(x8, xc[t] + g * G + 4 * q, 8);
          sums[t] = dot4x2(sums[t], w0, w1, x8[0], x8[1]);
        }
      }
    } else {
#pragma GCC unroll 8
      for (int q = 0; q < G / 4; ++q) {
        u8x64 w = load<u8x64>(codes + (g * (G / 4) + q) * 64);
        for (int t = 0; t < T; ++t) {
          int32_t x4;
          std::memcpy(&x4, xc[t] + g * G + 4 * q, 4);
          sums[t] = dot4<SIGNED>(sums[t], w, x4);
        }
      }
    }
    f32x16 dv = load<f32x16>(d + g * IPANEL_ROWS), mv = load<f32x16>(m + g * IPANEL_ROWS);
    for (int t = 0; t < T; ++t) {
      acc[t] += __builtin_convertvector(sums[t], f32x16) * (dv * xd[t][(g * G) >> shift]) + mv * xo[t][g];
    }
  }
  for (int t = 0; t < T; ++t) {
    float* o = out + t * out_stride;
    for (int r = 0; r < rows; ++r) {
      o[r] = add ? o[r] + acc[t][r] : acc[t][r];
    }
  }
}

using IPanelFn = void (*)(const uint8_t*, const float*, const float*, const RoundedRows&, int64_t,
                          int64_t, int64_t, float*, int64_t, int, bool);

template <int G, bool SIGNED, int... T>
constexpr std::array<IPanelFn, sizeof...(T)> ipanel_products(std::integer_sequence<int, T...>) {
  return {ipanel_product<T + 1, G, SIGNED>...};
}

template <class F>
void linear_rounded_panels(const float* x, const uint8_t* weight, float* out, int64_t tokens,
                           int64_t in_features, int64_t out_features, int threads) {
  constexpr int G = F::GROUP, BLOCK_GROUPS = F::VALUES / G;
  static constexpr auto fns = ipanel_products<G, F::SIGNED && PANEL_SIGNED_CODES>(
      std::make_integer_sequence<int, IPANEL_TOKENS>{});
  RoundedRows rows_x(x, tokens, in_features, F::VALUES == 256 ? 256 : 32, G, threads);
  int64_t row_bytes = in_features / F::VALUES * F::BYTES;
  int64_t row_blocks = (out_features + IPANEL_ROWS - 1) / IPANEL_ROWS;
  int tasks = static_cast<int>(std::min<int64_t>(row_blocks, TASKS_PER_THREAD * threads));
  const int64_t slice = std::min(in_features, PANEL_SLICE / F::VALUES * F::VALUES);
  ThreadPool::instance().run(tasks, threads, [&](int task) {
    // Rows are decoded UNIT values at a time into `rows_codes` [row][UNIT] (UNIT: whole blocks
    // and whole 64-byte lines), then moved into the panel as 16 x 16 transpositions of 4-byte
    // words; the panel is padded to whole units.
    constexpr int64_t UNIT = F::VALUES > 64 ? F::VALUES : 64, UNIT_BLOCKS = UNIT / F::VALUES;
    const int64_t padded = (slice + UNIT - 1) / UNIT * UNIT;
    std::vector<uint8_t> codes(IPANEL_ROWS * padded, 0);
    std::vector<float> d(slice / G * IPANEL_ROWS, 0.0f), m(slice / G * IPANEL_ROWS, 0.0f);
    alignas(64) uint8_t rows_codes[IPANEL_ROWS][UNIT] = {};
    float bd[BLOCK_GROUPS], bm[BLOCK_GROUPS];
    int64_t first = row_blocks * task / tasks, last = row_blocks * (task + 1) / tasks;
    for (int64_t t0 = 0; t0 < tokens; t0 += IPANEL_GROUP_TOKENS) {
      int64_t t_end = std::min(tokens, t0 + IPANEL_GROUP_TOKENS);
      for (int64_t k0 = 0; k0 < in_features; k0 += slice) {
        int64_t length = std::min(slice, in_features - k0), blocks = length / F::VALUES;
        for (int64_t rb = first; rb < last; ++rb) {
          int64_t row0 = rb * IPANEL_ROWS;
          int rows = static_cast<int>(std::min<int64_t>(IPANEL_ROWS, out_features - row0));
          if (rows < IPANEL_ROWS) {  // the lanes of missing rows: zero codes and scales
            std::memset(rows_codes, 0, sizeof rows_codes);
            std::fill(d.begin(), d.end(), 0.0f);
            std::fill(m.begin(), m.end(), 0.0f);
          }
          for (int64_t unit = 0; unit * UNIT_BLOCKS < blocks; ++unit) {
            for (int r = 0; r < rows; ++r) {
              const uint8_t* row = weight + (row0 + r) * row_bytes + k0 / F::VALUES * F::BYTES;
              for (int64_t u = 0; u < UNIT_BLOCKS; ++u) {
                int64_t b = unit * UNIT_BLOCKS + u;
                if (b >= blocks) {  // a slice of an odd number of 32-value blocks
                  std::memset(rows_codes[r] + u * F::VALUES, 0, F::VALUES);
                  continue;
                }
                block_codes<F>(row + b * F::BYTES, rows_codes[r] + u * F::VALUES, bd, bm);
                for (int j = 0; j < BLOCK_GROUPS; ++j) {
                  d[(b * BLOCK_GROUPS + j) * IPANEL_ROWS + r] = bd[j];
                  m[(b * BLOCK_GROUPS + j) * IPANEL_ROWS + r] = bm[j];
                }
              }
            }
            for (int64_t line = 0; line < UNIT / 64; ++line) {
              transpose_words(rows_codes, line, codes.data() + (unit * UNIT / 64 + line) * 16 * 64);
            }
          }
          for (int64_t t = t0; t < t_end; t += IPANEL_TOKENS) {
            int count = static_cast<int>(std::min<int64_t>(IPANEL_TOKENS, t_end - t));
            fns[count - 1](codes.data(), d.data(), m.data(), rows_x, t, k0, length,
                           out + t * out_features + row0, out_features, rows, k0 > 0);
          }
        }
      }
    }
  });
}

template <class F>
void linear_rounded_format(const float* x, const uint8_t* weight, float* out, int64_t tokens,
                           int64_t in_features, int64_t out_features, int threads) {
  if (tokens > ROUNDED_MAX_TOKENS) {
    return linear_rounded_panels<F>(x, weight, out, tokens, in_features, out_features, threads);
  }
  static constexpr RoundedTiles<F> tiles;
  typename RoundedTiles<F>::Rows rounded(x, tokens, in_features);
  int64_t row_bytes = in_features / F::VALUES * F::BYTES;
  int64_t row_blocks = (out_features + DECODE_ROWS - 1) / DECODE_ROWS;
  bool parallel = tokens * in_features * out_features >= SMALL_PRODUCT;
  int tasks = static_cast<int>(std::min<int64_t>(row_blocks, parallel ? TASKS_PER_THREAD * threads : 1));
  ThreadPool::instance().run(tasks, threads, [&](int task) {
    int64_t first = row_blocks * task / tasks, last = row_blocks * (task + 1) / tasks;
    for (int64_t block = first; block < last; ++block) {
      int64_t row0 = block * DECODE_ROWS;
      if (row0 + DECODE_ROWS <= out_features) {
        tiles.tiles[1][tokens - 1](weight + row0 * row_bytes, row_bytes, rounded, out + row0,
                                   out_features);
      } else {
        for (int64_t r = row0; r < out_features; ++r) {
          tiles.tiles[0][tokens - 1](weight + r * row_bytes, row_bytes, rounded, out + r,
                                     out_features);
        }
      }
    }
  });
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

} // namespace

bool has_product(int ggml_type) {
  return block_values(ggml_type) != 0;
}

int block_values(int ggml_type) {
  return with_format(ggml_type, [](auto format) { return int(decltype(format)::VALUES); }, 0);
}

int block_bytes(int ggml_type) {
  return with_format(ggml_type, [](auto format) { return int(decltype(format)::BYTES); }, 0);
}

const char* instruction_set() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#elif defined(__ARM_NEON)
  return "neon";
#else
  return "scalar";
#endif
}

void linear_rounded_from_blocks(const float* x, const uint8_t* weight, float* out,
                                int ggml_type, int64_t tokens, int64_t in_features,
                                int64_t out_features, int threads) {
  with_format(ggml_type, [&](auto format) {
    linear_rounded_format<decltype(format)>(x, weight, out, tokens, in_features, out_features,
                                            threads);
    return 0;
  }, 0);
}

void linear_from_blocks(const float* x, const uint8_t* weight, float* out, int ggml_type,
                        int64_t tokens, int64_t in_features, int64_t out_features,
                        int threads) {
  with_format(ggml_type, [&](auto format) {
    linear_format<decltype(format)>(x, weight, out, tokens, in_features, out_features, threads);
    return 0;
  }, 0);
}

} // namespace muser::cpu
