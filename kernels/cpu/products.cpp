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

void linear_rounded_from_blocks(const float* x, const uint8_t* weight, float* out,
                                int ggml_type, int64_t tokens, int64_t in_features,
                                int64_t out_features, int threads) {
  if (tokens > ROUNDED_MAX_TOKENS) {
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
