// Vector functions the CPU kernels share (MLX's CPU computes exp, sigmoid and tanh one value
// at a time through libm, ~15 ns a value here).
#pragma once

#include <cstring>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "vectors.h"

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

// Inside its scope, this thread's float arithmetic flushes subnormal results and inputs to 0
// (x86: MXCSR's FTZ and DAZ bits; restored on exit; elsewhere nothing). Attention's weighted
// sums multiply probabilities near e^-87 by values: subnormal products, which x86 computes
// ~100x slower, took ~2 of Gemma 3's 10 ms a layer of a 128-token prefill. A flushed value is
// below 2^-126 (1.2e-38), invisible beside the probabilities' total, which is at least 1.
class FlushSubnormals {
 public:
#if defined(__SSE__) || defined(__x86_64__)
  FlushSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

} // namespace muser::cpu
