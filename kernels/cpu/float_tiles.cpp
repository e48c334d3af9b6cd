// Float products at decode (fewer than PANEL_MIN_TOKENS tokens), x as given: decode tiles.
//
// Every format is read the same way: 16 values at a time, each 16-value chunk of a block
// having one scale d and one offset m (value = d * code + m: Q4_0's m is -8 d, Q4_K's is
// -dmin * min of the sub-block, Q6_K's is -32 d), so x . row = sum of d * (codes . x) over
// chunks + sum of m * (sum of x) over scale groups, the sums of x taken once per call. A tile
// of R weight rows x C rows of x decodes a chunk of each weight row once into a 16-float
// vector (codes * d) and multiplies it into C accumulators, so a weight byte is decoded once
// per C tokens and x is loaded once per R rows.
//
// Grid: the output's DECODE_ROWS-row blocks in TASKS_PER_THREAD x `threads` contiguous ranges,
// which `threads` threads (the caller one of them) claim in turn (thread_pool.h). Each walks x
// in chunks (X_CHUNK_BYTES, kept in L2) and, inside a chunk, every block of its range (the
// block's weight rows stay in L1/L2 across the chunk's tokens).
// Bytes per call: each weight byte once per token chunk (one chunk unless tokens x in x 4
// bytes passes X_CHUNK_BYTES), x once per tile (from cache), out once.
// Bounds: in_features must be whole blocks (the op checks); the last row tile and token tile
// may be short (their own instantiations).

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "formats.h"
#include "product_strategies.h"
#include "thread_pool.h"
#include "vectors.h"

namespace muser::cpu {

namespace {

// Tile shapes (rows x tokens): a product of fewer than PREFILL_TOKENS tokens decodes each
// weight chunk once for DECODE_ROWS rows; with more, each decoded chunk is multiplied into
// PREFILL_ROWS x PREFILL_TOKENS accumulators (16 of the 32 AVX-512 registers).
constexpr int PREFILL_ROWS = 2;
constexpr int PREFILL_TOKENS = 8;
static_assert(DECODE_ROWS % PREFILL_ROWS == 0);
// Tiles of at most this many (row, token) pairs sum each scale group before scaling it (two
// accumulators per pair); larger ones scale each decoded chunk (one per pair).
constexpr int GROUP_ACCUMULATORS = 8;
constexpr int64_t X_CHUNK_BYTES = 1 << 20;

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

template <class F>
void linear_tiles(const float* x, const uint8_t* weight, float* out, int64_t tokens,
                  int64_t in_features, int64_t out_features, int threads) {
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

} // namespace

void linear_float_tiles(const float* x, const uint8_t* weight, float* out, int ggml_type,
                        int64_t tokens, int64_t in_features, int64_t out_features, int threads) {
  with_format(ggml_type, [&](auto format) {
    linear_tiles<decltype(format)>(x, weight, out, tokens, in_features, out_features, threads);
    return 0;
  }, 0);
}

} // namespace muser::cpu
