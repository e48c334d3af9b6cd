// The residual seam of a decoder layer (decode.h): one pass over each row to add and sum
// squares, one to scale. Rows are few (a decode step's one), so one thread.
// Bytes per call: residual, branch, sum and normed once each, the weights once per row.

#include <cmath>

#include "decode.h"

namespace muser::cpu {

namespace {

float inverse_rms(const float* x, int64_t n, float eps) {
  float squares = 0;
  for (int64_t i = 0; i < n; ++i) {
    squares += x[i] * x[i];
  }
  return 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
}

} // namespace

void residual_norm(const float* residual, const float* branch, const float* branch_weight,
                   const float* next_weight, float* sum, float* normed, int64_t rows,
                   int64_t hidden, float branch_eps, float next_eps) {
  for (int64_t row = 0; row < rows; ++row) {
    const float* b = branch + row * hidden;
    float* total = sum + row * hidden;
    float branch_scale = branch_weight ? inverse_rms(b, hidden, branch_eps) : 1.0f;
    for (int64_t i = 0; i < hidden; ++i) {
      float value = branch_weight ? b[i] * branch_scale * branch_weight[i] : b[i];
      total[i] = residual ? residual[row * hidden + i] + value : value;
    }
    float scale = next_weight ? inverse_rms(total, hidden, next_eps) : 1.0f;
    for (int64_t i = 0; i < hidden; ++i) {
      normed[row * hidden + i] = next_weight ? total[i] * scale * next_weight[i] : total[i];
    }
  }
}

} // namespace muser::cpu
