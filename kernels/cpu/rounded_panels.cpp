// Rounded products of batched decode steps and prefill (more than rounded_tile_tokens(format)
// tokens, products.cpp), integer panels: x rounded as the decode tiles
// round it (per 32 values, per 256 for the K-quants), weights as unsigned byte codes, and the
// products as integer dot products with one weight row per int32 lane: a panel of
// IPANEL_ROWS rows holds a slice of their codes as [slice / 4][row][4 bytes], so one 64-byte
// load and, per token, one broadcast of 4 of x's codes make 64 multiply-adds (AVX-512 VNNI
// dpbusd: u8 x s8 summed by 4 into int32, no saturation). Each scale group's int32 sums are
// converted and scaled once per (token, group): d_weight (a vector over rows) * d_x, plus the
// group's offset m_weight * (d_x * the sum of x's codes in the group).
// A row slice's panel is built once per IPANEL_GROUP_TOKENS tokens.
//
// Grid: the output's IPANEL_ROWS-row blocks in TASKS_PER_THREAD x `threads` contiguous ranges,
// claimed in turn by `threads` threads (thread_pool.h); x rounded first by all of them.
// Bytes per call: each weight byte once per IPANEL_GROUP_TOKENS tokens, x's codes once per row
// block (from L2), out once per slice.
// Bounds: in_features must be whole blocks (the op checks); a short last row block has zero
// codes and scales in its missing rows' lanes.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "arch.h"
#include "formats.h"
#include "product_strategies.h"
#include "rounded_rows.h"
#include "thread_pool.h"
#include "vectors.h"

namespace muser::cpu {

namespace {

constexpr int IPANEL_ROWS = 16;  // transpose_words' 16 x 16
// Tokens per tile: each takes two vectors of accumulators (int32 sums, float32 results), 2
// registers with AVX-512, 4 elsewhere.
constexpr int IPANEL_TOKENS = REGISTER_FLOATS == 16 ? 12 : 3;
// Where the dot products multiply unsigned weight codes only (VNNI dpbusd), Q8_0's codes enter
// the panels + 128 (m = -128 d); elsewhere signed (AVX2's maddubs would saturate on codes
// above 128: its int16 pair sums hold 2 x 128 x 127 at most, so a code's magnitude is taken,
// its sign moved onto x).
constexpr bool PANEL_SIGNED_CODES = DOT4_SIGNED;
// A panel serves this many tokens (x's codes for them, 512 KB of a 2048-value slice, stay in L2).
constexpr int IPANEL_GROUP_TOKENS = 256;

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
      if constexpr (BYTE_OPS_WIDTH == 64) {
        u8x64 c = F::template codes64<P>(b);
        std::memcpy(codes + 64 * P, &c, 64);
      } else {
        Halves c = F::template halves<P>(b);
        std::memcpy(codes + 64 * P, &c.lo, 32);
        std::memcpy(codes + 64 * P + 32, &c.hi, 32);
      }
    }, std::make_integer_sequence<int, 4>{});
  }
}

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
void linear_panels(const float* x, const uint8_t* weight, float* out, int64_t tokens,
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
                // As the tiles do: without it the build waited on memory for each of the 16
                // rows (SmolLM2's products for 8 tokens, one thread: 21.3 -> 13.4 ms).
                prefetch_block<F>(row + b * F::BYTES + PREFETCH_BYTES);
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

} // namespace

void linear_rounded_panels(const float* x, const uint8_t* weight, float* out, int ggml_type,
                           int64_t tokens, int64_t in_features, int64_t out_features,
                           int threads) {
  with_format(ggml_type, [&](auto format) {
    linear_panels<decltype(format)>(x, weight, out, tokens, in_features, out_features, threads);
    return 0;
  }, 0);
}

} // namespace muser::cpu
