// x rounded to int8 blocks for the rounded products (rounded_tiles.cpp, rounded_panels.cpp):
// round_block (arch.h) per block of x, the scales and sums beside the codes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "arch.h"
#include "thread_pool.h"

namespace muser::cpu {


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

}  // namespace muser::cpu
