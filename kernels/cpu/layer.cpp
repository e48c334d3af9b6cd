// One decoder layer of a one-token decode step (decode.h): the functions the layer's separate
// graph nodes run (products.cpp, attention.cpp, norm.cpp, activation.cpp), called back to back
// in the same order on the same values, so the result is the separate nodes' bit for bit.
// MLX evaluates one node instead of ~10 (~14 us each on this path), and
// the thread pool's workers, spinning after each job, are still awake for the next phase.
// Grid: each product and the attention split over `threads` (ThreadPool); the seams and the
// activation on the calling thread.
// Bytes per call: the layer's weights once, the cache slots attended once, a few kB of scratch.

#include <vector>

#include "decode.h"
#include "products.h"

namespace muser::cpu {

namespace {

// y [out_features] = W x for one row x of in_features values.
void product(const LayerProduct& p, const float* x, int64_t in_features, float* y, bool rounded,
             int threads) {
  if (rounded) {
    linear_rounded_from_blocks(x, p.weight, y, p.ggml_type, 1, in_features, p.out_features, threads);
  } else {
    linear_from_blocks(x, p.weight, y, p.ggml_type, 1, in_features, p.out_features, threads);
  }
}

// The outputs of `products` side by side in y (a stacked product's output, or the concatenation
// of several); returns the width written.
int64_t products_into(const std::vector<LayerProduct>& products, const float* x,
                      int64_t in_features, float* y, bool rounded, int threads) {
  int64_t width = 0;
  for (const auto& p : products) {
    product(p, x, in_features, y + width, rounded, threads);
    width += p.out_features;
  }
  return width;
}

} // namespace

template <class C>
void decode_layer(const float* x, const float* h, int64_t position, C* keys, C* values,
                  const DecodeLayer& layer, float* x_out, float* h_out) {
  const DecodeHeads& heads = layer.heads;
  const int64_t hidden = layer.hidden, attention_width = heads.heads * heads.head_dim;
  int64_t y_width = 0, ffn_in_width = 0;
  for (const auto& p : layer.attention_in) {
    y_width += p.out_features;
  }
  for (const auto& p : layer.ffn_in) {
    ffn_in_width += p.out_features;
  }
  const int64_t ffn = ffn_in_width / 2;
  // y | o | branch | x_mid | h_mid | gate, up | act
  std::vector<float> scratch(y_width + attention_width + 3 * hidden + ffn_in_width + ffn);
  float* y = scratch.data();
  float* o = y + y_width;
  float* branch = o + attention_width;
  float* x_mid = branch + hidden;
  float* h_mid = x_mid + hidden;
  float* gate_up = h_mid + hidden;
  float* act = gate_up + ffn_in_width;

  products_into(layer.attention_in, h, hidden, y, layer.rounded, layer.threads);
  write_cache(y, layer.bias, layer.k_norm, position, keys, heads, true);
  write_cache(y, layer.bias, nullptr, position, values, heads, false);
  attention_decode<C>(y, layer.bias, layer.q_norm, position, keys, values, o, heads, layer.threads);
  product(layer.attention_out, o, attention_width, branch, layer.rounded, layer.threads);
  residual_norm(x, branch, layer.post_attention_norm, layer.ffn_norm, x_mid, h_mid, 1, hidden,
                layer.post_eps, layer.eps);
  products_into(layer.ffn_in, h_mid, hidden, gate_up, layer.rounded, layer.threads);
  gated_activation(gate_up, gate_up + ffn, act, 1, ffn, ffn_in_width, ffn_in_width, layer.gelu);
  product(layer.ffn_out, act, ffn, branch, layer.rounded, layer.threads);
  residual_norm(x_mid, branch, layer.post_ffw_norm, layer.next_norm, x_out, h_out, 1, hidden,
                layer.post_eps, layer.eps);
}

template void decode_layer<float>(const float*, const float*, int64_t, float*, float*,
                                  const DecodeLayer&, float*, float*);
#ifdef MUSER_HALF_CACHE
template void decode_layer<half>(const float*, const float*, int64_t, half*, half*,
                                 const DecodeLayer&, float*, float*);
#endif

} // namespace muser::cpu
