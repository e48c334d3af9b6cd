// Attention of T query rows over S keys, on the CPU, in float32: no MLX types here
// (primitives.cpp wraps it in an MLX primitive).

#pragma once

#include <cstdint>

namespace muser::cpu {

// out[b, h, t] = softmax_s(scale * q[b, h, t] . k[b, h / group, s] where mask[t, s])
//                . v[b, h / group, s],  group = heads / kv_heads
//   q, out: float32 [batch, heads, tokens, head_dim]; k, v: float32 [batch, kv_heads, keys,
//   head_dim]; mask: bool [tokens, keys] or null (every key visible). head_dim % 16 == 0.
// A row that sees no key gets zeros.
void attention(const float* q, const float* k, const float* v, const bool* mask, float* out,
               int64_t batch, int64_t heads, int64_t kv_heads, int64_t tokens, int64_t keys,
               int64_t head_dim, float scale, int threads);

} // namespace muser::cpu
