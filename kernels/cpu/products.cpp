// The products x @ W.T from raw GGUF blocks, on the CPU, in float32 like the reference: the
// entry points of products.h, each choosing one of four strategies (product_strategies.h) by
// the number of tokens. Formats are formats.h's; instruction-set helpers arch.h's. Vectors are
// GCC/Clang vector extensions: with -march=native they become AVX-512 (or AVX2, NEON)
// instructions; elsewhere scalar code.

#include "products.h"

#include "arch.h"
#include "formats.h"
#include "product_strategies.h"

namespace muser::cpu {

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
  return INSTRUCTION_SET;
}

// A tile reads each weight block once for its tokens but does each token's work apart (a dot
// product, a conversion and a scaling per block and token); a panel decodes and transposes each
// block once a call (~2 ns a block here), then multiplies it by 12 tokens at a time with one
// weight row per lane. Panels win from a few tokens on where a block's tile work is dear (the
// 4-bit codes' unpacking), later where it is cheap (Q8_0's bytes as they are; a K-quant's 256
// values in integer sums), and Q6_K's panels (16-value groups) not within 8 tokens. Tiles
// against panels, 2 .. 8 tokens, AVX-512 VNNI, 2 threads (bench/cpu_products.cpp,
// bench/RESULTS.md "CPU products for B rows").
int rounded_tile_tokens(int ggml_type) {
  switch (ggml_type) {
    case Q4_0:
    case Q4_1:
    case Q5_1:
      return 4;
    case Q5_0:
      return 5;
    case Q6_K:
      return ROUNDED_MAX_TOKENS;
    default:  // Q8_0, Q4_K, Q5_K
      return 7;
  }
}

void linear_rounded_from_blocks(const float* x, const uint8_t* weight, float* out,
                                int ggml_type, int64_t tokens, int64_t in_features,
                                int64_t out_features, int threads) {
  if (tokens > rounded_tile_tokens(ggml_type)) {
    linear_rounded_panels(x, weight, out, ggml_type, tokens, in_features, out_features, threads);
  } else {
    linear_rounded_tiles(x, weight, out, ggml_type, tokens, in_features, out_features, threads);
  }
}

void linear_from_blocks(const float* x, const uint8_t* weight, float* out, int ggml_type,
                        int64_t tokens, int64_t in_features, int64_t out_features,
                        int threads) {
  if (tokens >= PANEL_MIN_TOKENS) {
    linear_float_panels(x, weight, out, ggml_type, tokens, in_features, out_features, threads);
  } else {
    linear_float_tiles(x, weight, out, ggml_type, tokens, in_features, out_features, threads);
  }
}

} // namespace muser::cpu
