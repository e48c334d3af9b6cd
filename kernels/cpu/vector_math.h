// Vector functions the CPU kernels share (MLX's CPU computes exp, sigmoid and tanh one value
// at a time through libm, ~15 ns a value here).
#pragma once

#include <cstring>

#include "arch.h"

namespace muser::cpu {

// e^x for x <= 0 (attention's scores minus their maximum; -|z| for a sigmoid), Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2,
// e^r by a degree-7 polynomial (relative error ~1e-7), 2^n from the exponent bits. Below
// -87 the result is flushed to 0.
inline f32x16 exp16(f32x16 x) {
  const f32x16 magic = f32x16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  x = x < -87.0f ? f32x16{} - 87.0f : x;
  f32x16 shifted = x * 1.44269504088896341f + magic;
  f32x16 n = shifted - magic;
  f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  i32x16 exponent = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &exponent, 64);
  return p * scale;
}

} // namespace muser::cpu
