// kernel: quantize_rows
// inputs: x
// outputs: xq xd xs
//
// Activations x [ROWS_X, IN] f32 as int8 blocks (q8x, see lib/q8x.metal) for the products:
// xq int8 [ROWS_X, IN], xd [ROWS_X, IN/32], xs [ROWS_X, IN/8]. The fused step's kernels quantize
// their own outputs; this one serves inputs made otherwise (benchmarks, tests).
// Grid: one SIMD group per 32-value block, ROWS_X * IN / 32 SIMD groups; lane l holds value l.
// Bytes per call: ROWS_X * IN * 4 read, ROWS_X * IN * 1.625 written.
// Bounds: SIMD groups past the last block (CUDA's surplus) return whole.
// Template constants: IN (a multiple of 32).
#include "lib/q8x.metal"
uint block = thread_position_in_grid.x / 32u;
uint lane = thread_index_in_simdgroup;
if (block >= uint(x_shape[0]) * uint(IN / 32)) {
  return;
}
muser_quantize_block(x[32u * block + lane], lane, xq, xd, xs, block);
