// The op and primitive behind muser_mlx.cpu_ext.linear: x @ W.T with W as raw GGUF blocks,
// evaluated on the CPU by products.cpp. In the shape of MLX's extension example (axpby).

#pragma once

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

} // namespace muser::cpu
