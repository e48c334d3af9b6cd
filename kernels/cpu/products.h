// x @ W.T for W kept as raw GGUF blocks, on the CPU (products.cpp). No MLX types here:
// primitives.cpp wraps this in an MLX primitive.

#pragma once

#include <cstdint>

namespace muser::cpu {

// ggml type numbers of the formats with a product here.
enum GGMLType : int {
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
};

bool has_product(int ggml_type);

// Values per block and bytes per block of a format with a product.
int block_values(int ggml_type);
int block_bytes(int ggml_type);

// The vector instructions the products were compiled for: "avx512", "avx2", "neon" or
// "scalar".
const char* instruction_set();

// out[t, o] = sum_i x[t, i] * W[o, i].
//   x:      float32 [tokens, in_features], rows contiguous
//   weight: uint8 [out_features, row_bytes], GGUF blocks of `ggml_type`, rows contiguous
//   out:    float32 [tokens, out_features]
// float32 throughout, x as given; `threads` threads share the output rows.
void linear_from_blocks(const float* x, const uint8_t* weight, float* out, int ggml_type,
                        int64_t tokens, int64_t in_features, int64_t out_features,
                        int threads);

// Rounded products of at most rounded_tile_tokens(ggml_type) rows of x (at most
// ROUNDED_MAX_TOKENS) run as decode tiles; more as integer panels (products.cpp says why).
constexpr int ROUNDED_MAX_TOKENS = 8;
int rounded_tile_tokens(int ggml_type);

// As linear_from_blocks for in_features a multiple of 32,
// with x rounded first: each block of x to int8 codes round(x / d), half away from zero, with
// d = max |x| / 127 of the block (0 where d is 0); blocks of 32 values for the 32-value formats
// (muser_mlx.formats.quantize_activations, llama.cpp's q8_0), of 256 for Q4_K, Q5_K and Q6_K
// (formats.quantize_activations_super, llama.cpp's q8_K); then integer dot products of the
// codes with the weights' codes. Each value of x is off by at most d / 2.
void linear_rounded_from_blocks(const float* x, const uint8_t* weight, float* out,
                                int ggml_type, int64_t tokens, int64_t in_features,
                                int64_t out_features, int threads);

} // namespace muser::cpu
