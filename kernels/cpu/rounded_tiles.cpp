// Rounded products at decode (at most rounded_tile_tokens(format) tokens, products.cpp):
// integer tiles. Weights are
// read as unsigned byte codes (value = d * code + m; Q8_0's signed) and multiplied by x's int8
// codes with integer dot products (arch.h: dot_unsigned, dot_signed, dot_scaled, dot_scaled8).
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
//
// Grid: as the float tiles' (float_tiles.cpp): DECODE_ROWS-row blocks of the output in
// TASKS_PER_THREAD x `threads` ranges; x rounded once per call on the calling thread.
// Bytes per call: each weight byte once, x's codes once per tile (from cache), out once.
// Bounds: in_features must be whole blocks (the op checks); a short last row block takes
// one-row tiles.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "arch.h"
#include "formats.h"
#include "product_strategies.h"
#include "rounded_rows.h"
#include "thread_pool.h"
#include "vectors.h"

namespace muser::cpu {

namespace {

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

// out[c * out_stride + r] = x[c] (rounded per 256) . W[r] for R rows and C tokens (K-quants),
// 64 codes at a time where the widest byte operation (W) is 64 bytes, else as two halves.
template <class F, int R, int C, int W = BYTE_OPS_WIDTH>
void tile_super(const uint8_t* weight, int64_t row_bytes, const SuperRows& x, float* out,
                int64_t out_stride) {
  static_assert(F::VALUES == 256);
  const int64_t in = x.in_features, blocks = in / 256;
  std::conditional_t<W == 64, f32x16, f32x8> acc[R][C] = {};
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
    if constexpr (W == 64) {
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
    } else {
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
    }
  }
  for (int c = 0; c < C; ++c) {
    f32x8 rows[R];
    for (int r = 0; r < R; ++r) {
      if constexpr (W == 64) {
        rows[r] = offsets[r][c] + __builtin_shufflevector(acc[r][c], acc[r][c], 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(acc[r][c], acc[r][c], 8, 9, 10, 11, 12, 13, 14, 15);
      } else {
        rows[r] = offsets[r][c] + acc[r][c];
      }
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

template <class F>
void linear_tiles(const float* x, const uint8_t* weight, float* out, int64_t tokens,
                  int64_t in_features, int64_t out_features, int threads) {
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

} // namespace

void linear_rounded_tiles(const float* x, const uint8_t* weight, float* out, int ggml_type,
                          int64_t tokens, int64_t in_features, int64_t out_features, int threads) {
  with_format(ggml_type, [&](auto format) {
    linear_tiles<decltype(format)>(x, weight, out, tokens, in_features, out_features, threads);
    return 0;
  }, 0);
}

} // namespace muser::cpu
