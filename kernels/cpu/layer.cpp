// One decoder layer of a decode step of B rows, one token each (decode.h): the functions the
// layer's separate graph nodes run (products.cpp, attention.cpp, norm.cpp, activation.cpp),
// called back to back in the same order on the same values, so the result is the separate
// nodes' bit for bit. A batched step's rows go through each product together (the weights
// read once for all of them) and attend their own cache rows, one row a task.
// MLX evaluates one node instead of ~10 (~14 us each on this path), and
// the thread pool's workers, spinning after each job, are still awake for the next phase.
// Grid: each product and the attention split over `threads` (ThreadPool); the seams and the
// activation on the calling thread.
// Bytes per call: the layer's weights once, the cache slots attended once, a few kB of scratch.

#include <algorithm>
#include <vector>

#include "decode.h"
#include "products.h"
#include "thread_pool.h"

namespace muser::cpu {

namespace {

// y [rows, out_features] = x W^T for `rows` rows of x of in_features values.
void product(const LayerProduct& p, const float* x, int64_t rows, int64_t in_features, float* y,
             bool rounded, int threads) {
  if (rounded) {
    linear_rounded_from_blocks(x, p.weight, y, p.ggml_type, rows, in_features, p.out_features, threads);
  } else {
    linear_from_blocks(x, p.weight, y, p.ggml_type, rows, in_features, p.out_features, threads);
  }
}

// The outputs of `products` side by side in each row of y [rows, their widths summed] (a
// stacked product's output, or the concatenation of several). Several products for more than
// one row go through `staging` ([rows, the widest]) and are copied into place.
void products_into(const std::vector<LayerProduct>& products, const float* x, int64_t rows,
                   int64_t in_features, float* y, float* staging, bool rounded, int threads) {
  if (products.size() == 1 || rows == 1) {
    int64_t offset = 0;
    for (const auto& p : products) {
      product(p, x, rows, in_features, y + offset, rounded, threads);
      offset += p.out_features;
    }
    return;
  }
  int64_t width = 0;
  for (const auto& p : products) {
    width += p.out_features;
  }
  int64_t offset = 0;
  for (const auto& p : products) {
    product(p, x, rows, in_features, staging, rounded, threads);
    for (int64_t r = 0; r < rows; ++r) {
      std::copy(staging + r * p.out_features, staging + (r + 1) * p.out_features, y + r * width + offset);
    }
    offset += p.out_features;
  }
}

} // namespace

template <class C>
void decode_layer(const float* x, const float* h, const int32_t* positions, int64_t rows, C* keys,
                  C* values, const DecodeLayer& layer, float* x_out, float* h_out) {
  const DecodeHeads& heads = layer.heads;
  const int64_t hidden = layer.hidden, attention_width = heads.heads * heads.head_dim;
  const int64_t cache_row = heads.kv_heads * heads.capacity * heads.head_dim;
  int64_t y_width = 0, ffn_in_width = 0, widest = 0;
  for (const auto& p : layer.attention_in) {
    y_width += p.out_features;
    widest = std::max(widest, p.out_features);
  }
  for (const auto& p : layer.ffn_in) {
    ffn_in_width += p.out_features;
    widest = std::max(widest, p.out_features);
  }
  const int64_t ffn = ffn_in_width / 2;
  // Each [rows, width]: y | o | branch | x_mid | h_mid | gate, up | act | staging
  std::vector<float> scratch(rows * (y_width + attention_width + 3 * hidden + ffn_in_width + ffn) +
                             (rows > 1 ? rows * widest : 0));
  float* y = scratch.data();
  float* o = y + rows * y_width;
  float* branch = o + rows * attention_width;
  float* x_mid = branch + rows * hidden;
  float* h_mid = x_mid + rows * hidden;
  float* gate_up = h_mid + rows * hidden;
  float* act = gate_up + rows * ffn_in_width;
  float* staging = act + rows * ffn;

  products_into(layer.attention_in, h, rows, hidden, y, staging, layer.rounded, layer.threads);
  for (int64_t r = 0; r < rows; ++r) {  // row r's token into row r of the caches
    write_cache(y + r * y_width, layer.bias, layer.k_norm, positions[r], keys + r * cache_row, heads, true);
    write_cache(y + r * y_width, layer.bias, nullptr, positions[r], values + r * cache_row, heads, false);
  }
  if (rows == 1) {
    attention_decode<C>(y, layer.bias, layer.q_norm, positions[0], keys, values, o, heads, layer.threads);
  } else {  // one row a task, each over its own keys (as AttentionDecode's rows)
    ThreadPool::instance().run(static_cast<int>(rows), layer.threads, [&](int r) {
      attention_decode<C>(y + r * y_width, layer.bias, layer.q_norm, positions[r], keys + r * cache_row,
                          values + r * cache_row, o + r * attention_width, heads, 1);
    });
  }
  product(layer.attention_out, o, rows, attention_width, branch, layer.rounded, layer.threads);
  residual_norm(x, branch, layer.post_attention_norm, layer.ffn_norm, x_mid, h_mid, rows, hidden,
                layer.post_eps, layer.eps);
  products_into(layer.ffn_in, h_mid, rows, hidden, gate_up, staging, layer.rounded, layer.threads);
  gated_activation(gate_up, gate_up + ffn, act, rows, ffn, ffn_in_width, ffn_in_width, layer.gelu);
  product(layer.ffn_out, act, rows, ffn, branch, layer.rounded, layer.threads);
  residual_norm(x_mid, branch, layer.post_ffw_norm, layer.next_norm, x_out, h_out, rows, hidden,
                layer.post_eps, layer.eps);
}

template void decode_layer<float>(const float*, const float*, const int32_t*, int64_t, float*, float*,
                                  const DecodeLayer&, float*, float*);
#ifdef MUSER_HALF_CACHE
template void decode_layer<half>(const float*, const float*, const int32_t*, int64_t, half*, half*,
                                 const DecodeLayer&, float*, float*);
#endif

} // namespace muser::cpu
