// muser_mlx._cpu_kernels: the CPU products and attention as MLX ops (one op, one primitive, one
// binding each).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "primitives.h"
#include "products.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

NB_MODULE(_cpu_kernels, m) {
  m.doc() = "muser_mlx's CPU products from raw GGUF blocks, as MLX primitives";

  m.def("linear", &muser::cpu::linear, "x"_a, "weight"_a, "ggml_type"_a, "threads"_a = 0,
        nb::kw_only(), "rounded"_a = false, "stream"_a = nb::none(),
        R"(x @ W.T for W kept as raw GGUF blocks, on the CPU.

Args:
    x (array): float [tokens, in_features]; cast to float32.
    weight (array): uint8 [out_features, row_bytes], blocks of ggml type `ggml_type`.
    ggml_type (int): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K.
    threads (int): threads inside the product; 0 for all of the machine's cores.
    rounded (bool): x rounded to int8 blocks (one scale max|x|/127 each, half away from
        zero) of 32 values, or of 256 for Q4_K, Q5_K and Q6_K, and multiplied with integer
        dot products (more than 8 tokens: as integer panels).

Returns:
    array: float32 [tokens, out_features].)");

  m.def("attention", &muser::cpu::attention, "q"_a, "k"_a, "v"_a, "scale"_a, "mask"_a = nb::none(),
        "threads"_a = 0, nb::kw_only(), "stream"_a = nb::none(),
        R"(softmax(q k^T * scale, masked) v on the CPU, in float32.

Args:
    q (array): [batch, heads, tokens, head_dim]
    k, v (array): [batch, kv_heads, keys, head_dim]; heads a multiple of kv_heads (grouped
        query attention), head_dim a multiple of 16.
    scale (float): multiplies the scores.
    mask (array, optional): bool [tokens, keys], True where a query may see a key.
    threads (int): threads inside the op; 0 for all of the machine's cores.

Returns:
    array: float32 [batch, heads, tokens, head_dim]; a row that sees no key is zeros.)");

  nb::class_<muser::cpu::DecodeHeads>(m, "DecodeHeads",
                                      "The shapes and settings of attention_decode (decode.h).")
      .def("__init__",
           [](muser::cpu::DecodeHeads* self, int64_t heads, int64_t kv_heads, int64_t head_dim,
              int64_t q_off, int64_t k_off, int64_t v_off, int64_t gate_off, int64_t rotary_dim,
              bool traditional, float rope_base, float eps, float scale,
              std::vector<double> inv_freq, bool qk_norm_whole, float softcap) {
             if (!inv_freq.empty() && static_cast<int64_t>(inv_freq.size()) != rotary_dim / 2) {
               throw std::invalid_argument("[DecodeHeads] inv_freq needs rotary_dim / 2 values");
             }
             new (self) muser::cpu::DecodeHeads{heads, kv_heads, head_dim, 0, q_off, k_off,
                                                v_off, gate_off, rotary_dim, traditional,
                                                rope_base, eps, scale, std::move(inv_freq),
                                                qk_norm_whole, softcap};
           },
           "heads"_a, "kv_heads"_a, "head_dim"_a, "q_off"_a, "k_off"_a, "v_off"_a, "gate_off"_a,
           "rotary_dim"_a, "traditional"_a, "rope_base"_a, "eps"_a, "scale"_a,
           "inv_freq"_a = std::vector<double>{}, "qk_norm_whole"_a = false, "softcap"_a = 0.0f);

  // The ops, not the raw kernels of the same names (decode.h).
  using ResidualNormOp = std::vector<mx::array> (*)(
      const std::optional<mx::array>&, const mx::array&, const std::optional<mx::array>&,
      const std::optional<mx::array>&, float, float, mx::StreamOrDevice);
  using WriteCacheOp = mx::array (*)(const mx::array&, const mx::array&, const mx::array&,
                                     const std::optional<mx::array>&,
                                     const std::optional<mx::array>&, muser::cpu::DecodeHeads,
                                     bool, mx::StreamOrDevice);
  using AttentionDecodeOp = mx::array (*)(
      const mx::array&, const mx::array&, const mx::array&, const mx::array&,
      const std::optional<mx::array>&, const std::optional<mx::array>&,
      muser::cpu::DecodeHeads, int, mx::StreamOrDevice);
  m.def("residual_norm", static_cast<ResidualNormOp>(&muser::cpu::residual_norm), "residual"_a.none(), "branch"_a,
        "branch_weight"_a.none(), "next_weight"_a.none(), "branch_eps"_a, "next_eps"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        R"(The seam between two branches of a decoder layer, on the CPU, in float32:
b = rms(branch) * branch_weight (or branch), sum = residual + b (or b),
normed = rms(sum) * next_weight (or sum). Returns [sum, normed], each [rows, hidden].)");

  m.def("write_cache", static_cast<WriteCacheOp>(&muser::cpu::write_cache), "y"_a, "cache"_a,
        "position"_a, "bias"_a.none(), "norm"_a.none(), "shape"_a, "key"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        R"(The cache [1, kv_heads, capacity, head_dim] with one decode token's keys (key=True:
from y [1, width] at shape's k offset, plus bias, per-head norm, RoPE at `position`) or values
written at slot position % capacity. Reuses the cache's memory when nothing else holds it.)");

  m.def("attention_decode", static_cast<AttentionDecodeOp>(&muser::cpu::attention_decode),
        "y"_a, "keys"_a, "values"_a, "position"_a, "bias"_a.none(), "q_norm"_a.none(),
        "shape"_a, "threads"_a = 0, nb::kw_only(), "stream"_a = nb::none(),
        R"(One decode token's attention on the CPU, in float32: its q heads from y [1, width]
(plus bias, per-head norm, RoPE at `position`, int32 [1]) over slots 0 .. min(position + 1,
capacity) - 1 of keys and values [1, kv_heads, capacity, head_dim], the attention gate applied.
Returns o [1, heads * head_dim].)");

  using DecodeLayerOp = std::vector<mx::array> (*)(
      const mx::array&, const mx::array&, const mx::array&, const mx::array&, const mx::array&,
      const std::vector<muser::cpu::WeightOf>&, const muser::cpu::WeightOf&,
      const std::vector<muser::cpu::WeightOf>&, const muser::cpu::WeightOf&,
      const std::optional<mx::array>&, const std::optional<mx::array>&,
      const std::optional<mx::array>&, const std::optional<mx::array>&, const std::optional<mx::array>&,
      const std::optional<mx::array>&, const std::optional<mx::array>&, muser::cpu::DecodeHeads, float, float,
      bool, bool, int, bool, mx::StreamOrDevice);
  m.def("decode_layer", static_cast<DecodeLayerOp>(&muser::cpu::decode_layer), "x"_a, "h"_a,
        "position"_a, "keys"_a, "values"_a, "attention_in"_a, "attention_out"_a, "ffn_in"_a,
        "ffn_out"_a, "bias"_a.none(), "q_norm"_a.none(), "k_norm"_a.none(),
        "post_attention_norm"_a.none(), "ffn_norm"_a.none(), "post_ffw_norm"_a.none(), "next_norm"_a.none(),
        "shape"_a, "eps"_a, "post_eps"_a, "gelu"_a, "rounded"_a, "threads"_a = 0, "in_place"_a = false,
        nb::kw_only(), "stream"_a = nb::none(),
        R"(One decoder layer of a one-token decode step on the CPU, as one node: the products
(each a (uint8 weight [out, row_bytes], ggml type) pair), the cache writes, attention_decode,
the residual seams and the gated activation of models/cpu_decode.py's layer, in its order.
x, h [B, hidden]: the residual stream and its normed copy, a token a row. Returns [x, h, keys,
values]; in_place: the caches' memory written even where MLX still holds them.)");

  using GatedActivationOp = mx::array (*)(const mx::array&, const mx::array&, bool,
                                          mx::StreamOrDevice);
  m.def("gated_activation", static_cast<GatedActivationOp>(&muser::cpu::gated_activation),
        "gate"_a, "up"_a, "gelu"_a, nb::kw_only(), "stream"_a = nb::none(),
        R"(act(gate) * up on the CPU, in float32, 16 values at a time: act is SiLU, x sigmoid(x),
or (gelu=True) GELU's tanh form, x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)). gate and up
[..., n] of one shape; slices of one product's output are read in place.)");

  using NormRopeHeadsOp = mx::array (*)(const mx::array&, const std::optional<mx::array>&, int,
                                        int, int, float, int, int, float, bool,
                                        const std::vector<double>&, mx::StreamOrDevice);
  m.def("norm_rope_heads", static_cast<NormRopeHeadsOp>(&muser::cpu::norm_rope_heads), "y"_a,
        "norm"_a.none(), "heads"_a, "head_dim"_a, "offset"_a, "eps"_a, "start"_a, "rotary_dim"_a,
        "base"_a, "traditional"_a, "inv_freq"_a = std::vector<double>{}, nb::kw_only(),
        "stream"_a = nb::none(),
        R"(A prompt's heads on the CPU, in float32: y [batch, tokens, width] (heads of head_dim
values from `offset`) as [batch, heads, tokens, head_dim], each head RMS-normed by `norm`
[head_dim] (None: not normed), then its first rotary_dim channels rotated by RoPE at positions
start, start + 1, ... (rotary_dim 0: not rotated; angles in double, as the decode step's), by
the angle p * inv_freq[i] of pair i (empty: base^(-2i / rotary_dim)).)");

  m.def("has_product", &muser::cpu::has_product, "ggml_type"_a,
        "Whether ggml type `ggml_type` has a CPU product here.");
  m.attr("mlx_version") = MUSER_MLX_VERSION;  // the MLX it was compiled against
  m.attr("half_cache") = muser::cpu::half_cache_supported();  // decode caches may be float16
  m.def("instruction_set", &muser::cpu::instruction_set,
        "The vector instructions the products were compiled for.");
}
