// kernel: matvec
// inputs: weight x
// outputs: y
//
// y[t, r] = sum_e dequant(weight row r)[e] * x[t, e] for a few tokens (decode): any format.
// weight: raw GGUF bytes [OUT, ROW_BYTES] uint8; x: [TOKENS, IN] f32; y: [TOKENS, OUT] f32.
// Grid: one 32-thread SIMD group per output row (32 * OUT threads), lanes stride the row
// element by element through the shared per-element decoders; 8 rows per threadgroup.
// Bytes per call: OUT * ROW_BYTES + TOKENS * IN * 4 read, TOKENS * OUT * 4 written.
// Bounds: a SIMD group past OUT returns whole (CUDA's surplus threads), before any shuffle.
// Template constants: FORMAT, IN, ROW_BYTES, OUT, TOKENS (1..8).
#include "lib/formats.metal"
uint row = thread_position_in_grid.x / 32;
uint lane = thread_index_in_simdgroup;
if (row >= uint(OUT)) {
  return;
}
const device uint8_t* w = weight + size_t(row) * size_t(ROW_BYTES);
float acc[TOKENS];
for (int t = 0; t < TOKENS; ++t) {
  acc[t] = 0.0f;
}
for (uint e = lane; e < uint(IN); e += 32) {
  float value = muser_value<FORMAT>(w, e);
  for (int t = 0; t < TOKENS; ++t) {
    acc[t] += value * x[t * IN + e];
  }
}
for (int t = 0; t < TOKENS; ++t) {
  float total = simd_sum(acc[t]);
  if (lane == 0) {
    y[t * OUT + row] = total;
  }
}
