// The gated activation between a feed-forward's products (decode.h): out = act(gate) * up,
// 16 values at a time, sigmoid from exp16 (vector_math.h) of -|z|, so that e^-|z| <= 1 never
// overflows: sigmoid(z) = 1 / (1 + e) for z >= 0, e / (1 + e) below. One thread: a prefill
// chunk's 127 x 8960 values take ~1 ms.
// Bytes per call: gate, up and out once each.
// Bounds: a row's last n % 16 values through a zero-padded vector.

#include <cstring>

#include "decode.h"
#include "vector_math.h"
#include "vectors.h"

namespace muser::cpu {

namespace {

inline f32x16 sigmoid16(f32x16 z) {
  f32x16 e = exp16(z < 0 ? z : -z);
  f32x16 one = f32x16{} + 1.0f;
  return (z < 0 ? e : one) / (one + e);
}

inline f32x16 activate(f32x16 gate, f32x16 up, bool gelu) {
  f32x16 z = gelu ? 1.5957691216057308f * (gate + 0.044715f * gate * gate * gate) : gate;
  return gate * sigmoid16(z) * up;
}

} // namespace

void gated_activation(const float* gate, const float* up, float* out, int64_t rows, int64_t n,
                      int64_t gate_stride, int64_t up_stride, bool gelu) {
  for (int64_t row = 0; row < rows; ++row) {
    const float* g = gate + row * gate_stride;
    const float* u = up + row * up_stride;
    float* o = out + row * n;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      store(o + i, activate(load<f32x16>(g + i), load<f32x16>(u + i), gelu));
    }
    if (i < n) {
      f32x16 g_tail = {}, u_tail = {};
      std::memcpy(&g_tail, g + i, (n - i) * 4);
      std::memcpy(&u_tail, u + i, (n - i) * 4);
      f32x16 o_tail = activate(g_tail, u_tail, gelu);
      std::memcpy(o + i, &o_tail, (n - i) * 4);
    }
  }
}

} // namespace muser::cpu
