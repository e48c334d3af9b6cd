// The ops and primitives of muser_mlx._cpu_kernels, in the shape of MLX's extension example
// (axpby): an op that builds the graph node, a primitive whose eval_cpu runs the kernel.
//   linear:    x @ W.T with W as raw GGUF blocks (products.cpp)
//   attention: softmax(q k^T * scale, masked) v (attention.cpp)
//   residual_norm, attention_decode, gated_activation: the glue between products (decode.h)

#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "decode.h"

namespace muser::cpu {

namespace mx = mlx::core;

// x: float [tokens, in_features] (any float dtype: cast to float32)
// weight: uint8 [out_features, row_bytes], raw blocks of `ggml_type`
// threads: threads inside the product (0: all the machine's cores)
// returns float32 [tokens, out_features]
// rounded: x rounded to int8 blocks first (products.h, linear_rounded_from_blocks)
mx::array linear(const mx::array& x, const mx::array& weight, int ggml_type, int threads,
                 bool rounded, mx::StreamOrDevice s = {});

class GGUFLinear : public mx::Primitive {
 public:
  GGUFLinear(mx::Stream stream, int ggml_type, int threads, bool rounded)
      : mx::Primitive(stream), ggml_type_(ggml_type), threads_(threads), rounded_(rounded) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "GGUFLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int ggml_type_;
  int threads_;
  bool rounded_;
};

// q: float [batch, heads, tokens, head_dim]; k, v: float [batch, kv_heads, keys, head_dim]
// (heads a multiple of kv_heads, head_dim of 16); mask: bool [tokens, keys] or none.
// returns float32 [batch, heads, tokens, head_dim]
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    const std::optional<mx::array>& mask, int threads, mx::StreamOrDevice s = {});

class Attention : public mx::Primitive {
 public:
  Attention(mx::Stream stream, float scale, bool masked, int threads)
      : mx::Primitive(stream), scale_(scale), masked_(masked), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "Attention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  bool masked_;
  int threads_;
};

// (sum, normed) of the seam in decode.h: residual (or none), branch: float [rows, hidden];
// branch_weight (or none), next_weight (or none: normed is sum): float [hidden]. Both outputs
// float32 [rows, hidden].
std::vector<mx::array> residual_norm(const std::optional<mx::array>& residual,
                                     const mx::array& branch,
                                     const std::optional<mx::array>& branch_weight,
                                     const std::optional<mx::array>& next_weight, float branch_eps,
                                     float next_eps, mx::StreamOrDevice s = {});

class ResidualNorm : public mx::Primitive {
 public:
  ResidualNorm(mx::Stream stream, bool residual, bool branch_weight, bool next_weight,
               float branch_eps, float next_eps)
      : mx::Primitive(stream), residual_(residual), branch_weight_(branch_weight),
        next_weight_(next_weight), branch_eps_(branch_eps), next_eps_(next_eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "ResidualNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  bool residual_, branch_weight_, next_weight_;
  float branch_eps_, next_eps_;
};

// act(gate) * up of decode.h's gated_activation: gate, up float [..., n] of one shape (slices
// of one product's output are read where they lie). Returns float32 of that shape.
mx::array gated_activation(const mx::array& gate, const mx::array& up, bool gelu,
                           mx::StreamOrDevice s = {});

class GatedActivation : public mx::Primitive {
 public:
  GatedActivation(mx::Stream stream, bool gelu) : mx::Primitive(stream), gelu_(gelu) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "GatedActivation"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  bool gelu_;
};

// Whether decode caches may hold float16 (the compiler has _Float16: vectors.h).
bool half_cache_supported();

// The cache `cache` float32 (or float16: half_cache_supported) [1, kv_heads, capacity, head_dim]
// with this token's keys (key) or
// values written at slot position % capacity (decode.h's write_cache): y float [1, width],
// position int32 [1], bias and norm (keys only) float or none. The output reuses the cache's
// buffer when nothing else holds it (MLX's donation), else copies it first.
mx::array write_cache(const mx::array& y, const mx::array& cache, const mx::array& position,
                      const std::optional<mx::array>& bias, const std::optional<mx::array>& norm,
                      DecodeHeads shape, bool key, mx::StreamOrDevice s = {});

class CacheWrite : public mx::Primitive {
 public:
  CacheWrite(mx::Stream stream, DecodeHeads shape, bool key, bool bias, bool norm)
      : mx::Primitive(stream), shape_(shape), key_(key), bias_(bias), norm_(norm) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "CacheWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  DecodeHeads shape_;
  bool key_, bias_, norm_;
};

// o float32 [1, heads * head_dim] of decode.h's attention_decode: y float [1, width]; keys,
// values float32 [1, kv_heads, capacity, head_dim] (written by write_cache); position int32
// [1]; bias, q_norm float or none.
mx::array attention_decode(const mx::array& y, const mx::array& keys, const mx::array& values,
                           const mx::array& position, const std::optional<mx::array>& bias,
                           const std::optional<mx::array>& q_norm, DecodeHeads shape,
                           int threads, mx::StreamOrDevice s = {});

class AttentionDecode : public mx::Primitive {
 public:
  AttentionDecode(mx::Stream stream, DecodeHeads shape, bool bias, bool q_norm, int threads)
      : mx::Primitive(stream), shape_(shape), bias_(bias), q_norm_(q_norm), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "AttentionDecode"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  DecodeHeads shape_;
  bool bias_, q_norm_;
  int threads_;
};

// One decoder layer of a decode step of B rows as one node (decode.h's decode_layer): x, h float
// [B, hidden] (the residual stream and its normed copy, a token a row); keys, values [at least B,
// kv_heads, capacity, head_dim] and position int32 [B] as attention_decode's rows; each product a weight uint8 [out, row_bytes] of GGUF blocks and its ggml
// type: attention_in the q/k/v(/gate) groups whose outputs side by side are attention_decode's y,
// ffn_in gate|up stacked or gate then up; the norm weights float [hidden] (q_norm, k_norm
// [head_dim], or their whole projections' where shape.qk_norm_whole), the optional ones none
// where the architecture has none (ffn_norm and next_norm: no pre-norm, OLMo 2's).
// Returns [x, h, keys, values]: x, h float32 [B, hidden] leaving the layer (h normed by
// next_norm), the caches with the token written (their memory reused as write_cache's).
using WeightOf = std::pair<mx::array, int>;
std::vector<mx::array> decode_layer(
    const mx::array& x, const mx::array& h, const mx::array& position, const mx::array& keys,
    const mx::array& values, const std::vector<WeightOf>& attention_in,
    const WeightOf& attention_out, const std::vector<WeightOf>& ffn_in, const WeightOf& ffn_out,
    const std::optional<mx::array>& bias, const std::optional<mx::array>& q_norm,
    const std::optional<mx::array>& k_norm, const std::optional<mx::array>& post_attention_norm,
    const std::optional<mx::array>& ffn_norm, const std::optional<mx::array>& post_ffw_norm,
    const std::optional<mx::array>& next_norm, DecodeHeads shape, float eps, float post_eps, bool gelu,
    bool rounded, int threads, bool in_place = false, mx::StreamOrDevice s = {});

class LayerDecode : public mx::Primitive {
 public:
  // types: the products' ggml types in input order (attention_in, attention_out, ffn_in, ffn_out).
  LayerDecode(mx::Stream stream, DecodeHeads shape, std::vector<int> types, int attention_in,
              int ffn_in, bool bias, bool q_norm, bool k_norm, bool post_attention_norm,
              bool ffn_norm, bool post_ffw_norm, bool next_norm, float eps, float post_eps,
              bool gelu, bool rounded, int threads, bool in_place)
      : mx::Primitive(stream), shape_(shape), types_(std::move(types)),
        attention_in_(attention_in), ffn_in_(ffn_in), bias_(bias), q_norm_(q_norm),
        k_norm_(k_norm), post_attention_norm_(post_attention_norm), ffn_norm_(ffn_norm),
        post_ffw_norm_(post_ffw_norm), next_norm_(next_norm), eps_(eps), post_eps_(post_eps), gelu_(gelu),
        rounded_(rounded), threads_(threads), in_place_(in_place) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "LayerDecode"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  DecodeHeads shape_;
  std::vector<int> types_;
  int attention_in_, ffn_in_;
  bool bias_, q_norm_, k_norm_, post_attention_norm_, ffn_norm_, post_ffw_norm_, next_norm_;
  float eps_, post_eps_;
  bool gelu_, rounded_;
  int threads_;
  bool in_place_;
};

// A prompt's heads (decode.h's norm_rope_heads): y float [batch, tokens, width] (a slice of a
// product's output is read in place), heads of head_dim values from `offset`; norm float
// [head_dim] or none; rotary_dim 0: no rotation. Returns float32 [batch, heads, tokens, head_dim].
mx::array norm_rope_heads(const mx::array& y, const std::optional<mx::array>& norm, int heads,
                          int head_dim, int offset, float eps, int start, int rotary_dim,
                          float base, bool traditional, const std::vector<double>& inv_freq = {},
                          mx::StreamOrDevice s = {});

class NormRopeHeads : public mx::Primitive {
 public:
  NormRopeHeads(mx::Stream stream, int heads, int head_dim, int offset, float eps, int start,
                int rotary_dim, float base, bool traditional, bool norm, std::vector<double> inv_freq)
      : mx::Primitive(stream), heads_(heads), head_dim_(head_dim), offset_(offset), eps_(eps),
        start_(start), rotary_dim_(rotary_dim), base_(base), traditional_(traditional),
        norm_(norm), inv_freq_(std::move(inv_freq)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "NormRopeHeads"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int heads_, head_dim_, offset_;
  float eps_;
  int start_, rotary_dim_;
  float base_;
  bool traditional_, norm_;
  std::vector<double> inv_freq_;  // empty: base_^(-2i / rotary_dim)
};

} // namespace muser::cpu
