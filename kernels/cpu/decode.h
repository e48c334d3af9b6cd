// The glue of a one-token decode step on the CPU, between its products: the residual seams
// (norm.cpp) and one token's attention from its projections (attention.cpp). No MLX types
// here: primitives.cpp wraps them in MLX primitives, so that a compiled decode step is a few
// graph nodes a layer (MLX's CPU runs each of its ops alone, at 3-30 us each).

#pragma once

#include <cstdint>
#include <vector>

#include "vectors.h"

namespace muser::cpu {

// The seam between two branches of a decoder layer, for `rows` rows of `hidden` values:
//   b      = branch_weight ? rms(branch, branch_eps) * branch_weight : branch
//   sum    = residual ? residual + b : b
//   normed = next_weight ? rms(sum, next_eps) * next_weight : sum
// with rms(x, eps) = x / sqrt(mean(x^2) + eps). residual, branch_weight and next_weight may be
// null (no next_weight: the next branch reads the stream unnormed, OLMo 2's).
void residual_norm(const float* residual, const float* branch, const float* branch_weight,
                   const float* next_weight, float* sum, float* normed, int64_t rows,
                   int64_t hidden, float branch_eps, float next_eps);

// The gated activation between a feed-forward's products, for `rows` rows of n values:
//   out = act(gate) * up, act(x) = x sigmoid(x) (SiLU) or, gelu, x sigmoid(2 sqrt(2/pi) (x +
//   0.044715 x^3)) (GELU's tanh form: 0.5 (1 + tanh u) = sigmoid(2u)).
// gate and up rows are gate_stride / up_stride floats apart (slices of one product's output),
// out's n apart.
void gated_activation(const float* gate, const float* up, float* out, int64_t rows, int64_t n,
                      int64_t gate_stride, int64_t up_stride, bool gelu);

// One decode token's attention, from its projections to the output projection's input.
struct DecodeHeads {
  int64_t heads, kv_heads, head_dim;  // heads a multiple of kv_heads, head_dim of 16
  int64_t capacity;  // cache slots: position p goes to slot p % capacity
  int64_t q_off, k_off, v_off;  // where q, k and v start in the projections' output y
  int64_t gate_off;  // where the attention gate's input starts in y; < 0: no gate
  int64_t rotary_dim;  // leading channels of each head RoPE rotates; 0: no rotation
  bool traditional;  // rotate pairs (2i, 2i+1) rather than (i, i + rotary_dim / 2)
  float rope_base, eps, scale;
  // RoPE's angle per position of pair i: inv_freq[i] (rotary_dim / 2 values: scaled or
  // factored frequencies, Llama 3's and others'); empty: rope_base^(-2i / rotary_dim).
  std::vector<double> inv_freq;
  // The q and k norms each over its whole projection (heads * head_dim, kv_heads * head_dim
  // weights: OLMo 2's) rather than per head ([head_dim] weights).
  bool qk_norm_whole;
  float softcap;  // attention scores s -> softcap * tanh(s / softcap) (Gemma 2's); 0: none
};

// y: float32 [width], the q/k/v (and gate) projections of the token at `position`;
// bias: float32 [(heads + 2 kv_heads) head_dim], q, k then v biases, or null.
// write_cache: the token's keys (key: biased, normed by `norm` unless null: [head_dim] per
// head, or [kv_heads * head_dim] over the whole projection where qk_norm_whole, then rotated) or values (biased) into slot position % capacity of `cache` [kv_heads, capacity,
// head_dim].
// C: the cache's element type, float or half (below).
template <class C>
void write_cache(const float* y, const float* bias, const float* norm, int64_t position,
                 C* cache, const DecodeHeads& shape, bool key);

// attention_decode: the token's q heads (biased, normed by q_norm unless null, as write_cache's
// keys, rotated) attend slots 0 .. min(position + 1, capacity) - 1 of keys and values (written first by
// write_cache); out: float32 [heads * head_dim], times sigmoid(gate) if gated.
template <class C>
void attention_decode(const float* y, const float* bias, const float* q_norm, int64_t position,
                      const C* keys, const C* values, float* out,
                      const DecodeHeads& shape, int threads);

// One decoder layer of a one-token decode step (layer.cpp): the phases of the ~10 graph nodes
// of models/cpu_decode.py's layer (products, cache writes, attention, residual seams, gated
// activation) called back to back, the same functions in the same order, so the pool's
// workers stay hot between phases and MLX pays for one node.
struct LayerProduct {
  const uint8_t* weight;  // [out_features, row_bytes], GGUF blocks of ggml_type, rows contiguous
  int ggml_type;
  int64_t out_features;
};

struct DecodeLayer {
  DecodeHeads heads;  // capacity: the caches'
  int64_t hidden;
  std::vector<LayerProduct> attention_in;  // q/k/v(/gate) groups: y = their outputs in order
  LayerProduct attention_out;              // [hidden, heads * head_dim]
  std::vector<LayerProduct> ffn_in;        // gate|up stacked (one), or gate then up (two)
  LayerProduct ffn_out;                    // [hidden, ffn]
  const float* bias;                 // q, k, v biases or null
  const float* q_norm;               // [head_dim] (or the whole q's: qk_norm_whole) or null
  const float* k_norm;               // [head_dim] (or the whole k's: qk_norm_whole) or null
  const float* post_attention_norm;  // [hidden] or null (no sandwich norm)
  const float* ffn_norm;             // [hidden] or null (no pre-norm: the branch reads the stream)
  const float* post_ffw_norm;        // [hidden] or null
  const float* next_norm;            // [hidden]: the next layer's attention norm or the output
                                     // norm; null: the next layer has no pre-norm
  float eps, post_eps;               // the norms', the post-norms'
  bool gelu;     // GELU's tanh form, else SiLU
  bool rounded;  // products on x rounded to int8 (linear_rounded_from_blocks)
  int threads;
};

// x, h: float32 [rows, hidden], the residual stream and its normed copy entering the layer,
// row r the token at positions[r]; keys, values: [at least rows, kv_heads, capacity, head_dim],
// row r's written at slot positions[r] % capacity; x_out, h_out: float32 [rows, hidden] leaving
// it (h_out normed by next_norm, or x_out's copy).
template <class C>
void decode_layer(const float* x, const float* h, const int32_t* positions, int64_t rows, C* keys,
                  C* values, const DecodeLayer& layer, float* x_out, float* h_out);

// A prompt's heads as attention takes them: rows of y (row r of `rows` = batch x tokens at
// y + r * stride, head h at offset + h * head_dim) into out [batch, heads, tokens, head_dim],
// each head normed by `norm` [head_dim] unless null, then its first rotary_dim channels rotated
// (pairs as DecodeHeads.traditional) by position start + t (t = r % tokens). The angles are
// write_cache's, p * inv_freq[i] (null: base^(-2i / rotary_dim)) in double; cos and sin are computed directly every
// 32 positions and by rotation in between.
void norm_rope_heads(const float* y, int64_t stride, int64_t offset, const float* norm,
                     float* out, int64_t batch, int64_t tokens, int64_t heads, int64_t head_dim,
                     float eps, int64_t start, int64_t rotary_dim, float base, bool traditional,
                     const double* inv_freq);

} // namespace muser::cpu
