// kernel: product_glu
// inputs: weight_gate weight_up xq xd xs
// outputs: fq fd fs
//
// The gated FFN's first half for q8x activations, fused with its epilogue:
//   f = act(x G.T) * (x U.T), act = silu (ACTIVATION 0) or tanh-approximated gelu (1),
// written again as q8x (fq int8 [TOKENS, OUT], fd [TOKENS, OUT/32], fs [TOKENS, OUT/8]): the
// input of the down projection, which never exists in float32.
// weight_gate, weight_up: raw GGUF bytes [OUT, ROW_BYTES] (formats FORMAT_G, FORMAT_U: Q4_K,
// Q6_K or Q8_0); xq, xd, xs: q8x [TOKENS, IN].
// Grid: one threadgroup per 32 rows (one q8x block of f): 32 / ROWS SIMD groups, each taking
// ROWS rows of both weights the way kernel product does (lane l: units l, l + 32, ...). The
// products meet in threadgroup memory; SIMD group t then quantizes token t's block.
// Bytes per call: OUT * (ROW_BYTES_G + ROW_BYTES_U) + TOKENS * IN * 1.625 read,
// TOKENS * OUT * 1.625 written.
// Bounds: OUT is a multiple of 32 (the host checks), so every threadgroup is whole and every
// row exists.
// GROUPED 1: x and f hold G * TOKENS rows (G the grid's threadgroups along x), threadgroup
// (g, b) takes rows g * TOKENS .. and the 32 rows of f that threadgroup b takes ungrouped, as
// kernel product's GROUPED.
// Template constants: FORMAT_G, ROW_BYTES_G, FORMAT_U, ROW_BYTES_U, OUT, IN, TOKENS, ROWS,
// UNROLL (units per lane at a time, as kernel product), WIDE (as kernel product), ACTIVATION,
// GROUPED.
#include "lib/q8x.metal"
threadgroup float tile[TOKENS * 32];
uint lane = thread_index_in_simdgroup;
uint warp = simdgroup_index_in_threadgroup;
uint block = GROUPED ? threadgroup_position_in_grid.y : threadgroup_position_in_grid.x;
uint token_group = GROUPED ? threadgroup_position_in_grid.x : 0u;
uint x_first = token_group * uint(TOKENS * IN);  // this threadgroup's rows of x
uint f_first = token_group * uint(TOKENS * OUT);  // and of f
uint first_row = 32u * block + warp * uint(ROWS);
float gate[TOKENS * ROWS];
float up[TOKENS * ROWS];
for (int i = 0; i < TOKENS * ROWS; ++i) {
  gate[i] = 0.0f;
  up[i] = 0.0f;
}
muser_x_global<> x = {xq + x_first, xd + x_first / 32u, xs + x_first / 8u};
muser_rows_dot<FORMAT_G, ROW_BYTES_G, OUT, ROWS, TOKENS, IN, UNROLL, WIDE, 0, 0>(weight_gate, first_row, x, lane, gate);
muser_rows_dot<FORMAT_U, ROW_BYTES_U, OUT, ROWS, TOKENS, IN, UNROLL, WIDE, 0, 0>(weight_up, first_row, x, lane, up);
for (int t = 0; t < TOKENS; ++t) {
  for (int r = 0; r < ROWS; ++r) {
    float g = simd_sum(gate[t * ROWS + r]);
    float u = simd_sum(up[t * ROWS + r]);
    float activated = muser_activate<ACTIVATION>(g);
    if (lane == uint(r)) {
      tile[t * 32 + int(warp) * ROWS + r] = activated * u;
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint t = warp; t < uint(TOKENS); t += threads_per_threadgroup.x / 32u) {
  muser_quantize_block(tile[t * 32u + lane], lane, fq + f_first + t * uint(OUT), fd + f_first / 32u + t * uint(OUT / 32),
                       fs + f_first / 8u + t * uint(OUT / 8), block);
}
