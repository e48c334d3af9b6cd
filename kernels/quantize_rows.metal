// kernel: quantize_rows
// inputs: x
// outputs: xq xd xs
//
// Activations as int8 blocks (q8x, see lib/q8x.metal) for the products: xq int8 [rows, IN], xd
// [rows, IN/32], xs [rows, IN/8], from
//   GLU 0: x [rows, IN] f32 (inputs made otherwise than by a fused kernel's epilogue:
//          benchmarks, tests);
//   GLU 1: a gated FFN's two halves as a tile product wrote them unsummed, x [CHUNKS, rows,
//          2 * IN] (gate then up): f = act(sum of gate's chunks) * (sum of up's), act silu
//          (ACTIVATION 0) or tanh-approximated gelu (1) (ops.TileProduct's split gated form).
// Grid: one SIMD group per 32-value block, rows * IN / 32 SIMD groups; lane l holds value l.
// Bytes per call: rows * IN * 4 read (GLU 1: CHUNKS * rows * 2 * IN * 4), rows * IN * 1.625
// written.
// Bounds: SIMD groups past the last block (CUDA's surplus) return whole.
// Template constants: IN (a multiple of 32), GLU, ACTIVATION, CHUNKS (GLU 0: 1).
#include "lib/q8x.metal"
uint block = thread_position_in_grid.x / 32u;
uint lane = thread_index_in_simdgroup;
uint rows = GLU != 0 ? uint(x_shape[1]) : uint(x_shape[0]);
if (block >= rows * uint(IN / 32)) {
  return;
}
float value;
if (GLU != 0) {
  uint row = block / uint(IN / 32);
  size_t at = size_t(row) * uint(2 * IN) + 32u * (block % uint(IN / 32)) + lane;
  float gate = 0.0f;
  float up = 0.0f;
  for (uint c = 0; c < uint(CHUNKS); ++c) {
    gate += x[at + size_t(c) * rows * uint(2 * IN)];
    up += x[at + size_t(c) * rows * uint(2 * IN) + uint(IN)];
  }
  value = muser_activate<ACTIVATION>(gate) * up;
} else {
  value = x[32u * block + lane];
}
muser_quantize_block(value, lane, xq, xd, xs, block);
