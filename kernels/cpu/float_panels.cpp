// Float products at prefill (PANEL_MIN_TOKENS tokens or more), x as given: PANEL_ROWS weight
// rows decoded to floats, a slice of PANEL_SLICE values of each at a time, once per group of
// PANEL_GROUP_TOKENS tokens, then multiplied as a matrix product with each PANEL_TOKENS-token
// chunk of the group: for each k, x[k] for the chunk's tokens (two vectors, from x laid out
// [k][token] per chunk) times each row's value broadcast, into PANEL_ROWS x 2 vector
// accumulators, added to the output after the first slice. Every instruction of the inner loop
// but two loads is a multiply-add. The group's x slices (PANEL_GROUP_TOKENS x PANEL_SLICE
// floats, 1 MB) stay in L2 across its row blocks.
//
// Grid: the output's PANEL_ROWS-row blocks in TASKS_PER_THREAD x `threads` contiguous ranges,
// claimed in turn by `threads` threads (thread_pool.h).
// Bytes per call: each weight byte once per group of PANEL_GROUP_TOKENS tokens; x copied once
// into its [chunk][k][token] layout; out once per slice.
// Bounds: in_features must be whole blocks (the op checks); the last row block and token chunk
// may be short (padding tokens are zero, short row blocks their own instantiations).

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "arch.h"
#include "formats.h"
#include "product_strategies.h"
#include "thread_pool.h"
#include "vectors.h"

namespace muser::cpu {

namespace {

// Panels of PANEL_ROWS rows, multiplied by PANEL_TOKENS tokens at a time: PANEL_ROWS x 2
// vector accumulators.
constexpr int PANEL_TOKENS = 32;
constexpr int PANEL_ROWS = 8;
// Each row slice is decoded once for this many tokens (it was once per PANEL_TOKENS: 20 % of
// the 1.5B qwen2's prefill samples decoded rows), in slices of at most this many values.
constexpr int PANEL_GROUP_TOKENS = 128;

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
constexpr int PANEL_ROWS_AT_ONCE = REGISTER_FLOATS == 16 ? PANEL_ROWS : 2;

// out[t * out_stride + r] = result(r, t), or += where `add`, for r < R and t < tokens.
template <int R, class Result>
inline void store_rows(Result result, int tokens, float* out, int64_t out_stride, bool add) {
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < tokens; ++t) {
      float& o = out[t * out_stride + r];
      o = add ? o + result(r, t) : result(r, t);
    }
  }
}

template <int R>
void panel_rows(const float* panel, const float* x_t, int64_t length, int tokens, float* out,
                int64_t out_stride, bool add) {
  if constexpr (REGISTER_FLOATS == 16) {
    f32x16 acc[R][2] = {};
    for (int64_t k = 0; k < length; ++k) {
      f32x16 x0 = load<f32x16>(x_t + k * PANEL_TOKENS), x1 = load<f32x16>(x_t + k * PANEL_TOKENS + 16);
      for (int r = 0; r < R; ++r) {
        float w = panel[r * length + k];
        acc[r][0] += w * x0;
        acc[r][1] += w * x1;
      }
    }
    store_rows<R>([&](int r, int t) { return acc[r][t / 16][t % 16]; }, tokens, out, out_stride, add);
  } else {
    // 8-float vectors: GCC builds a scalar's splat into a 16-float vector through the stack
    // where that is not one register (AVX2: ~5 GFLOP/s).
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
    store_rows<R>([&](int r, int t) { return acc[r][t / 8][t % 8]; }, tokens, out, out_stride, add);
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

} // namespace

void linear_float_panels(const float* x, const uint8_t* weight, float* out, int ggml_type,
                         int64_t tokens, int64_t in_features, int64_t out_features, int threads) {
  with_format(ggml_type, [&](auto format) {
    linear_panels<decltype(format)>(x, weight, out, tokens, in_features, out_features, threads);
    return 0;
  }, 0);
}

} // namespace muser::cpu
