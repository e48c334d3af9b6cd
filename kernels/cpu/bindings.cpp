// muser_mlx._cpu_kernels: the CPU products and attention as MLX ops (one op, one primitive, one
// binding each).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "primitives.h"
#include "products.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_cpu_kernels, m) {
  m.doc() = "muser_mlx's CPU products from raw GGUF blocks, as MLX primitives";

  m.def("linear", &muser::cpu::linear, "x"_a, "weight"_a, "ggml_type"_a, "threads"_a = 0,
        nb::kw_only(), "stream"_a = nb::none(),
        R"(x @ W.T for W kept as raw GGUF blocks, on the CPU.

Args:
    x (array): float [tokens, in_features]; cast to float32.
    weight (array): uint8 [out_features, row_bytes], blocks of ggml type `ggml_type`.
    ggml_type (int): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K.
    threads (int): threads inside the product; 0 for all of the machine's cores.

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

  m.def("has_product", &muser::cpu::has_product, "ggml_type"_a,
        "Whether ggml type `ggml_type` has a CPU product here.");
  m.attr("mlx_version") = MUSER_MLX_VERSION;  // the MLX it was compiled against
  m.def("instruction_set", &muser::cpu::instruction_set,
        "The vector instructions the products were compiled for.");
}
