// The ops and primitives of muser_mlx._cpu_kernels, in the shape of MLX's extension example
// (axpby): an op that builds the graph node, a primitive whose eval_cpu runs the kernel.
//   linear:    x @ W.T with W as raw GGUF blocks (products.cpp)
//   attention: softmax(q k^T * scale, masked) v (attention.cpp)

#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace muser::cpu {

namespace mx = mlx::core;

// x: float [tokens, in_features] (any float dtype: cast to float32)
// weight: uint8 [out_features, row_bytes], raw blocks of `ggml_type`
// threads: threads inside the product (0: all the machine's cores)
// returns float32 [tokens, out_features]
mx::array linear(const mx::array& x, const mx::array& weight, int ggml_type, int threads,
                 mx::StreamOrDevice s = {});

class GGUFLinear : public mx::Primitive {
 public:
  GGUFLinear(mx::Stream stream, int ggml_type, int threads)
      : mx::Primitive(stream), ggml_type_(ggml_type), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "GGUFLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int ggml_type_;
  int threads_;
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

} // namespace muser::cpu
