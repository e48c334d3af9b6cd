// The products x @ W.T from raw GGUF blocks, on the CPU.
//
// Every format is brought to one shape before its products, ggml's idea with our own layout:
//   weight rows -> codes  uint8 [K]      unsigned (Q8_0 stores q + 128)
//                  scale  float [K / 4]  one per int32 lane of a 32-value dot: lanes 0-3 sum
//                                        values 0-15 of the group, lanes 4-7 values 16-31
//                  bias   float [K / 16] one per 16 values: value = scale * code + bias
//   x rows      -> xq     int8  [K]      x rounded per 32 values (q8: d = max|x| / 127)
//                  xd     float [K / 4]  d, once per lane
//                  xs     float [K / 16] d * (sum of the 16 codes): what a bias multiplies
// so that out = sum over lanes of (codes . xq)_lane * scale_lane * xd_lane + sum of bias * xs,
// the integer dots done 64 values at a time (AVX-512 VNNI: one vpdpbusd).
//
// Grid: `threads` threads (the caller one of them) take contiguous ranges of TILE_ROWS-row
// tiles of the output. For each chunk of tokens a thread decodes a tile's rows into a buffer
// of its own (codes, scales, biases: 1.3 bytes per weight, L1/L2-resident), then multiplies
// it by TILE_TOKENS tokens at a time into TILE_ROWS x TILE_TOKENS accumulators.
// Bytes per call: each weight byte once per token chunk (one chunk unless x's int8 form
// passes X_CHUNK_BYTES, i.e. prefill of long rows), x and out once.
// Bounds: in_features must be whole blocks (the op checks); K = in_features rounded up to 64
// values, the padding zero codes, scales and x; the last row tile and token tile may be short.

#include "products.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "thread_pool.h"

namespace muser::cpu {

namespace {

constexpr int GROUP = 32;  // values per x scale and per weight scale pair
constexpr int STEP = 64;  // values per vector step; K is a multiple of it
constexpr int TILE_ROWS = 4;
constexpr int TILE_TOKENS = 4;
constexpr int64_t X_CHUNK_BYTES = 1 << 20;  // x's int8 form kept in L2 across a chunk's tiles

// ---------------------------------------------------------------------------------------------
// Block fields
// ---------------------------------------------------------------------------------------------

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: value = mantissa * 2^-24
    float value = std::ldexp(static_cast<float>(mantissa), -24);
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

// One 32-value group's scale (lanes 0-3 for values 0-15, 4-7 for 16-31) and bias.
inline void group_scale(float* scale, float* bias, float scale_low, float scale_high,
                        float bias_low, float bias_high) {
  for (int lane = 0; lane < 4; ++lane) {
    scale[lane] = scale_low;
    scale[lane + 4] = scale_high;
  }
  bias[0] = bias_low;
  bias[1] = bias_high;
}

// ---------------------------------------------------------------------------------------------
// Decoders: one block -> its codes [block values], scale [values / 4], bias [values / 16].
// ---------------------------------------------------------------------------------------------

// 32-value blocks: 16 bytes of nibbles, value j in the low nibble of byte j, j + 16 in the
// high one; Q5 adds bit j of a little-endian u32 as bit 4 of value j.
inline void nibbles32(const uint8_t* qs, uint8_t* codes) {
  for (int j = 0; j < 16; ++j) {
    codes[j] = qs[j] & 15;
    codes[j + 16] = qs[j] >> 4;
  }
}

inline void fifth_bits32(uint32_t qh, uint8_t* codes) {
  for (int j = 0; j < 32; ++j) {
    codes[j] |= ((qh >> j) & 1) << 4;
  }
}

void decode_q4_0(const uint8_t* b, uint8_t* codes, float* scale, float* bias) {
  float d = f16(b);
  nibbles32(b + 2, codes);
  group_scale(scale, bias, d, d, -8 * d, -8 * d);
}

void decode_q4_1(const uint8_t* b, uint8_t* codes, float* scale, float* bias) {
  float d = f16(b), m = f16(b + 2);
  nibbles32(b + 4, codes);
  group_scale(scale, bias, d, d, m, m);
}

void decode_q5_0(const uint8_t* b, uint8_t* codes, float* scale, float* bias) {
  float d = f16(b);
  nibbles32(b + 6, codes);
  fifth_bits32(u32(b + 2), codes);
  group_scale(scale, bias, d, d, -16 * d, -16 * d);
}

void decode_q5_1(const uint8_t* b, uint8_t* codes, float* scale, float* bias) {
  float d = f16(b), m = f16(b + 2);
  nibbles32(b + 8, codes);
  fifth_bits32(u32(b + 4), codes);
  group_scale(scale, bias, d, d, m, m);
}

void decode_q8_0(const uint8_t* b, uint8_t* codes, float* scale, float* bias) {
  float d = f16(b);
  for (int j = 0; j < 32; ++j) {
    codes[j] = b[2 + j] ^ 0x80;  // int8 q -> q + 128
  }
  group_scale(scale, bias, d, d, -128 * d, -128 * d);
}

// Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes (sub-blocks
// 0-3 in the low 6 bits of bytes 0-3 / 4-7, sub-blocks 4-7 in the nibbles of bytes 8-11 plus
// the top 2 bits of bytes 0-7); value = d * scale * q - dmin * min.
void k4_groups(const uint8_t* b, float* scale, float* bias) {
  float d = f16(b), dmin = f16(b + 2);
  const uint8_t* packed = b + 4;
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    if (j < 4) {
      sc = packed[j] & 63;
      mn = packed[j + 4] & 63;
    } else {
      sc = (packed[j + 4] & 15) | ((packed[j - 4] >> 6) << 4);
      mn = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
    }
    group_scale(scale + 8 * j, bias + 2 * j, d * sc, d * sc, -dmin * mn, -dmin * mn);
  }
}

// Sub-blocks 2i and 2i+1 are the low and high nibbles of bytes 32i..32i+31.
inline void k4_nibbles(const uint8_t* qs, uint8_t* codes) {
  for (int i = 0; i < 4; ++i) {
    for (int l = 0; l < 32; ++l) {
      codes[64 * i + l] = qs[32 * i + l] & 15;
      codes[64 * i + 32 + l] = qs[32 * i + l] >> 4;
    }
  }
}

void decode_q4_k(const uint8_t* b, uint8_t* codes, float* scale, float* bias) {
  k4_groups(b, scale, bias);
  k4_nibbles(b + 16, codes);
}

void decode_q5_k(const uint8_t* b, uint8_t* codes, float* scale, float* bias) {
  k4_groups(b, scale, bias);
  k4_nibbles(b + 48, codes);
  const uint8_t* qh = b + 16;  // bit j of byte l: the fifth bit of value l of sub-block j
  for (int j = 0; j < 8; ++j) {
    for (int l = 0; l < 32; ++l) {
      codes[32 * j + l] |= ((qh[l] >> j) & 1) << 4;
    }
  }
}

// Q6_K: two halves of 128 values, each from 64 bytes of low 4 bits (ql) and 32 bytes of top
// 2 bits (qh). Group p of a half takes the low nibbles of ql[0:32], of ql[32:64], then the
// high nibbles of each, and bits 2p..2p+1 of qh[0:32]. Scales are int8 per 16 values;
// value = d * scale * (q - 32).
void decode_q6_k(const uint8_t* b, uint8_t* codes, float* scale, float* bias) {
  float d = f16(b + 208);
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b + 64 * half;
    const uint8_t* qh = b + 128 + 32 * half;
    uint8_t* out = codes + 128 * half;
    for (int l = 0; l < 32; ++l) {
      out[l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
      out[32 + l] = (ql[32 + l] & 15) | (((qh[l] >> 2) & 3) << 4);
      out[64 + l] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
      out[96 + l] = (ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4);
    }
  }
  for (int g = 0; g < 8; ++g) {
    float low = d * scales[2 * g], high = d * scales[2 * g + 1];
    group_scale(scale + 8 * g, bias + 2 * g, low, high, -32 * low, -32 * high);
  }
}

using Decoder = void (*)(const uint8_t*, uint8_t*, float*, float*);

struct Format {
  int values;  // per block
  int bytes;  // per block
  Decoder decode;
};

bool format_of(int ggml_type, Format* format) {
  switch (ggml_type) {
    case Q4_0: *format = {32, 18, decode_q4_0}; return true;
    case Q4_1: *format = {32, 20, decode_q4_1}; return true;
    case Q5_0: *format = {32, 22, decode_q5_0}; return true;
    case Q5_1: *format = {32, 24, decode_q5_1}; return true;
    case Q8_0: *format = {32, 34, decode_q8_0}; return true;
    case Q4_K: *format = {256, 144, decode_q4_k}; return true;
    case Q5_K: *format = {256, 176, decode_q5_k}; return true;
    case Q6_K: *format = {256, 210, decode_q6_k}; return true;
    default: return false;
  }
}

// A row of blocks decoded; the padding up to K zeroed.
void decode_row(const Format& format, const uint8_t* row, int64_t blocks, int64_t padded,
                uint8_t* codes, float* scale, float* bias) {
  for (int64_t i = 0; i < blocks; ++i) {
    format.decode(row + i * format.bytes, codes + i * format.values,
                  scale + i * format.values / 4, bias + i * format.values / 16);
  }
  int64_t end = blocks * format.values;
  std::memset(codes + end, 0, padded - end);
  std::fill(scale + end / 4, scale + padded / 4, 0.0f);
  std::fill(bias + end / 16, bias + padded / 16, 0.0f);
}

// x's q8 form: per 32 values d = max|x| / 127 and q = round-to-even(x / d).
void quantize_row(const float* x, int64_t in_features, int64_t padded, int8_t* xq, float* xd,
                  float* xs) {
  for (int64_t g = 0; g < in_features / GROUP; ++g) {
    const float* v = x + g * GROUP;
    float amax = 0.0f;
    for (int j = 0; j < GROUP; ++j) {
      amax = std::max(amax, std::fabs(v[j]));
    }
    float d = amax / 127.0f;
    float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    int sums[2] = {0, 0};
    for (int j = 0; j < GROUP; ++j) {
      int q = static_cast<int>(std::nearbyint(v[j] * inverse));
      xq[g * GROUP + j] = static_cast<int8_t>(q);
      sums[j / 16] += q;
    }
    for (int lane = 0; lane < 8; ++lane) {
      xd[g * 8 + lane] = d;
    }
    xs[2 * g] = d * sums[0];
    xs[2 * g + 1] = d * sums[1];
  }
  std::memset(xq + in_features, 0, padded - in_features);
  std::fill(xd + in_features / 4, xd + padded / 4, 0.0f);
  std::fill(xs + in_features / 16, xs + padded / 16, 0.0f);
}

// ---------------------------------------------------------------------------------------------
// One vector step: 64 values of one weight row against one token, into an accumulator.
// ---------------------------------------------------------------------------------------------

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MUSER_ISA "avx512-vnni"
struct Step {
  using Codes = __m512i;
  using Scales = __m512;
  using Acc = __m512;
  static Codes load(const void* p) { return _mm512_loadu_si512(p); }
  static Scales load_scales(const float* p) { return _mm512_loadu_ps(p); }
  static Acc zero() { return _mm512_setzero_ps(); }
  static void add(Acc& acc, Codes w, Codes x, Scales w_scale, Scales x_scale) {
    __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);  // 16 lanes of 4 values
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(w_scale, x_scale), acc);
  }
  static float total(Acc acc) { return _mm512_reduce_add_ps(acc); }
};
#elif defined(__AVX2__)
#if defined(__AVXVNNI__)
#define MUSER_ISA "avx2-vnni"
inline __m256i dot32(__m256i w, __m256i x) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
}
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MUSER_ISA "avx2-vnni"
inline __m256i dot32(__m256i w, __m256i x) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
}
#else
#define MUSER_ISA "avx2"
// u8 x i8 in 16-bit products (exact: _mm256_maddubs_epi16 would saturate on Q8_0's codes),
// summed to 8 lanes of 4 values with lanes 0-3 over values 0-15.
inline __m256i dot32(__m256i w, __m256i x) {
  __m256i low = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(w)),
                                  _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x)));
  __m256i high = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1)),
                                   _mm256_cvtepi8_epi16(_mm256_extracti128_si256(x, 1)));
  // hadd pairs within 128-bit halves: [l01 l23 h01 h23 | l45 l67 h45 h67]; reorder the 64-bit
  // quarters to [l01 l23 l45 l67 | h01 h23 h45 h67].
  return _mm256_permute4x64_epi64(_mm256_hadd_epi32(low, high), 0xD8);
}
#endif
struct Step {
  struct Codes { __m256i low, high; };
  struct Scales { __m256 low, high; };
  using Acc = __m256;
  static Codes load(const void* p) {
    const __m256i* v = static_cast<const __m256i*>(p);
    return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
  }
  static Scales load_scales(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Acc zero() { return _mm256_setzero_ps(); }
  static void add(Acc& acc, Codes w, Codes x, Scales w_scale, Scales x_scale) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(w.low, x.low)),
                          _mm256_mul_ps(w_scale.low, x_scale.low), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(w.high, x.high)),
                          _mm256_mul_ps(w_scale.high, x_scale.high), acc);
  }
  static float total(Acc acc) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
  }
};
#else
#define MUSER_ISA "scalar"
// Portable: integer dots per 16 values, each times its lane scale (lane 4 * half).
struct Step {
  struct Codes { const uint8_t* p; };
  struct Scales { const float* p; };
  using Acc = float;
  static Codes load(const void* p) { return {static_cast<const uint8_t*>(p)}; }
  static Scales load_scales(const float* p) { return {p}; }
  static Acc zero() { return 0.0f; }
  static void add(Acc& acc, Codes w, Codes x, Scales w_scale, Scales x_scale) {
    const int8_t* xq = reinterpret_cast<const int8_t*>(x.p);
    for (int half = 0; half < STEP / 16; ++half) {
      int dot = 0;
      for (int j = 0; j < 16; ++j) {
        dot += static_cast<int>(w.p[16 * half + j]) * xq[16 * half + j];
      }
      acc += dot * (w_scale.p[4 * half] * x_scale.p[4 * half]);
    }
  }
  static float total(Acc acc) { return acc; }
};
#endif

// ---------------------------------------------------------------------------------------------
// Tiles
// ---------------------------------------------------------------------------------------------

struct Rows {  // decoded weight rows: codes [rows, K], scale [rows, K / 4], bias [rows, K / 16]
  const uint8_t* codes;
  const float* scale;
  const float* bias;
};

struct Tokens {  // x in q8 form: xq [tokens, K], xd [tokens, K / 4], xs [tokens, K / 16]
  const int8_t* xq;
  const float* xd;
  const float* xs;
};

// out[c * out_stride + r] for ROWS rows x TOKENS tokens.
template <int ROWS, int TOKENS>
void tile(Rows w, Tokens x, int64_t padded, float* out, int64_t out_stride) {
  typename Step::Acc acc[ROWS][TOKENS];
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < TOKENS; ++c) {
      acc[r][c] = Step::zero();
    }
  }
  for (int64_t k = 0; k < padded; k += STEP) {
    typename Step::Codes xq[TOKENS];
    typename Step::Scales xd[TOKENS];
    for (int c = 0; c < TOKENS; ++c) {
      xq[c] = Step::load(x.xq + c * padded + k);
      xd[c] = Step::load_scales(x.xd + (c * padded + k) / 4);
    }
    for (int r = 0; r < ROWS; ++r) {
      typename Step::Codes codes = Step::load(w.codes + r * padded + k);
      typename Step::Scales scale = Step::load_scales(w.scale + (r * padded + k) / 4);
      for (int c = 0; c < TOKENS; ++c) {
        Step::add(acc[r][c], codes, xq[c], scale, xd[c]);
      }
    }
  }
  int64_t halves = padded / 16;
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < TOKENS; ++c) {
      const float* bias = w.bias + r * halves;
      const float* xs = x.xs + c * halves;
      float offset = 0.0f;
      for (int64_t h = 0; h < halves; ++h) {
        offset += bias[h] * xs[h];
      }
      out[c * out_stride + r] = Step::total(acc[r][c]) + offset;
    }
  }
}

using TileFn = void (*)(Rows, Tokens, int64_t, float*, int64_t);

template <int ROWS, int... TOKENS>
constexpr void fill_row(TileFn* row, std::integer_sequence<int, TOKENS...>) {
  ((row[TOKENS] = tile<ROWS, TOKENS + 1>), ...);
}

// TILES[r - 1][c - 1]: the tile of r rows and c tokens, for the short edge tiles.
struct TileTable {
  TileFn fn[TILE_ROWS][TILE_TOKENS];
  constexpr TileTable() : fn{} {
    fill_row<1>(fn[0], std::make_integer_sequence<int, TILE_TOKENS>{});
    fill_row<2>(fn[1], std::make_integer_sequence<int, TILE_TOKENS>{});
    fill_row<3>(fn[2], std::make_integer_sequence<int, TILE_TOKENS>{});
    fill_row<4>(fn[3], std::make_integer_sequence<int, TILE_TOKENS>{});
  }
};
static_assert(TILE_ROWS == 4, "TileTable fills 4 rows");
constexpr TileTable TILES;

} // namespace

bool has_product(int ggml_type) {
  Format format;
  return format_of(ggml_type, &format);
}

int block_values(int ggml_type) {
  Format format{};
  format_of(ggml_type, &format);
  return format.values;
}

int block_bytes(int ggml_type) {
  Format format{};
  format_of(ggml_type, &format);
  return format.bytes;
}

const char* instruction_set() {
  return MUSER_ISA;
}

void linear_from_blocks(const float* x, const uint8_t* weight, float* out, int ggml_type,
                        int64_t tokens, int64_t in_features, int64_t out_features,
                        int threads) {
  Format format;
  format_of(ggml_type, &format);
  int64_t blocks = in_features / format.values;
  int64_t row_bytes = blocks * format.bytes;
  int64_t padded = (in_features + STEP - 1) / STEP * STEP;

  // x in q8 form, the threads taking tokens in turn.
  std::vector<int8_t> xq(tokens * padded);
  std::vector<float> xd(tokens * padded / 4), xs(tokens * padded / 16);
  int quantize_threads = static_cast<int>(std::min<int64_t>(threads, tokens));
  ThreadPool::instance().run(quantize_threads, [&](int thread) {
    for (int64_t t = thread; t < tokens; t += quantize_threads) {
      quantize_row(x + t * in_features, in_features, padded, xq.data() + t * padded,
                   xd.data() + t * padded / 4, xs.data() + t * padded / 16);
    }
  });

  int64_t tiles = (out_features + TILE_ROWS - 1) / TILE_ROWS;
  int workers = static_cast<int>(std::min<int64_t>(threads, tiles));
  int64_t chunk = std::max<int64_t>(TILE_TOKENS, X_CHUNK_BYTES / padded / TILE_TOKENS * TILE_TOKENS);
  ThreadPool::instance().run(workers, [&](int thread) {
    std::vector<uint8_t> codes(TILE_ROWS * padded);
    std::vector<float> scale(TILE_ROWS * padded / 4), bias(TILE_ROWS * padded / 16);
    int64_t first = tiles * thread / workers, last = tiles * (thread + 1) / workers;
    for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
      int64_t chunk_tokens = std::min(chunk, tokens - t0);
      for (int64_t tile_index = first; tile_index < last; ++tile_index) {
        int64_t row0 = tile_index * TILE_ROWS;
        int rows = static_cast<int>(std::min<int64_t>(TILE_ROWS, out_features - row0));
        for (int r = 0; r < rows; ++r) {
          decode_row(format, weight + (row0 + r) * row_bytes, blocks, padded,
                     codes.data() + r * padded, scale.data() + r * padded / 4,
                     bias.data() + r * padded / 16);
        }
        Rows w{codes.data(), scale.data(), bias.data()};
        for (int64_t t = t0; t < t0 + chunk_tokens; t += TILE_TOKENS) {
          int count = static_cast<int>(std::min<int64_t>(TILE_TOKENS, t0 + chunk_tokens - t));
          Tokens xt{xq.data() + t * padded, xd.data() + t * padded / 4, xs.data() + t * padded / 16};
          TILES.fn[rows - 1][count - 1](w, xt, padded, out + t * out_features + row0, out_features);
        }
      }
    }
  });
}

} // namespace muser::cpu
