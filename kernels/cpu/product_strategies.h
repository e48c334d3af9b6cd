// The four strategies of the CPU products (products.cpp picks one by the number of tokens and
// whether x is rounded), and what they share. Each takes every format of formats.h.
//   float_tiles.cpp     float x, fewer than PANEL_MIN_TOKENS tokens: decode tiles
//   float_panels.cpp    float x, PANEL_MIN_TOKENS tokens or more: rows decoded to float panels
//   rounded_tiles.cpp   x rounded to int8, at most rounded_tile_tokens (<= ROUNDED_MAX_TOKENS)
//                       tokens: integer tiles
//   rounded_panels.cpp  x rounded to int8, more tokens: integer panels
// Each is called as linear_from_blocks is (products.h): x float32 [tokens, in_features], weight
// uint8 [out_features, row_bytes] of ggml_type's blocks, out float32 [tokens, out_features].
#pragma once

#include <cstdint>

namespace muser::cpu {

// From this many tokens on, float products decode their weight rows to float panels.
constexpr int PANEL_MIN_TOKENS = 16;
// Tiles hold this many weight rows (the rows of each weight chunk decoded once for all tokens).
constexpr int DECODE_ROWS = 4;
// Panels decode each row in slices of at most this many values.
constexpr int64_t PANEL_SLICE = 2048;
// Tiles and panels ask for each weight row's bytes this far ahead of the block they read: the
// hardware prefetcher alone left each block's first load waiting on memory. Against no
// prefetch, 0.5-16 KB measured best at 4-8 KB (decode products with x rounded, 2 threads:
// SmolLM2's 14.1 -> 9.4 ms a step; bench/RESULTS.md, issue 13).
constexpr int64_t PREFETCH_BYTES = 8192;
// Products of fewer multiply-adds than this run on the calling thread (~10 us of work: waking
// a worker would cost a good part of it).
constexpr int64_t SMALL_PRODUCT = 1 << 17;
// Each thread's share of a product is split this many times, so that threads claim the
// pieces as they come free (a worker the OS has descheduled leaves its pieces to the others).
constexpr int TASKS_PER_THREAD = 4;

// Every 64-byte line a block of F spans (a K-quant's 144-210 bytes span 3-4: one request a
// block skipped lines, which then waited on memory).
template <class F>
inline void prefetch_block(const uint8_t* p) {
  for (int offset = 0; offset < F::BYTES; offset += 64) {
    __builtin_prefetch(p + offset);
  }
}

void linear_float_tiles(const float* x, const uint8_t* weight, float* out, int ggml_type,
                        int64_t tokens, int64_t in_features, int64_t out_features, int threads);

void linear_float_panels(const float* x, const uint8_t* weight, float* out, int ggml_type,
                         int64_t tokens, int64_t in_features, int64_t out_features, int threads);

void linear_rounded_tiles(const float* x, const uint8_t* weight, float* out, int ggml_type,
                          int64_t tokens, int64_t in_features, int64_t out_features, int threads);

void linear_rounded_panels(const float* x, const uint8_t* weight, float* out, int ggml_type,
                           int64_t tokens, int64_t in_features, int64_t out_features,
                           int threads);

}  // namespace muser::cpu
