// kernel: product
// inputs: weight_a weight_b xq xd xs params
// outputs: y
//
// y = x W.T for activations given as int8 blocks (q8x: xq, xd, xs; see lib/q8x.metal) and up
// to two weights of their own formats (Q4_K, Q6_K or Q8_0), a few tokens at a time (decode):
//   EPILOGUE 0: y [TOKENS, OUT_A + OUT_B] = [x A.T | x B.T] (no B when OUT_B is 0: q/gate and
//               k/v of one layer are one launch even when their formats differ).
//   EPILOGUE 1: the LM head. y [TOKENS, OUT_A] = c * tanh(s * x A.T / c) with s = params[0]
//               and c = params[1] (c = 0: s * x A.T), then after it in y (one output: each
//               array of a launch is host work at every step) best [TOKENS, threadgroups, 2]:
//               each threadgroup's largest value and its row (the first on ties), for kernel
//               argmax.
// weight_a, weight_b: raw GGUF bytes [OUT, ROW_BYTES] uint8 (4-byte aligned); xq int8
// [TOKENS, IN]; xd f32 [TOKENS, IN/32]; xs f32 [TOKENS, IN/8]; params f32 [2].
// Grid: one SIMD group per ROWS consecutive rows of A, then of B: ceil(OUT_A / ROWS) +
// ceil(OUT_B / ROWS) SIMD groups, up to 8 per threadgroup. Lane l takes units l, l + 32, ...
// of its rows (a unit is 32 values: 16 bytes of Q4_K quants, 24 bytes of Q6_K, one Q8_0
// block; with WIDE, a Q4_K unit is 64 values, its scales unpacked once), so
// consecutive lanes read consecutive weight bytes; it loads its unit of x once for
// all ROWS rows. A code times an activation code is an integer (muser_dot4: four at a time);
// the block scales apply once per 32 or 16 values. simd_sum adds the lanes.
// Bytes per call: OUT_A * ROW_BYTES_A + OUT_B * ROW_BYTES_B + TOKENS * IN * 1.625 read,
// TOKENS * (OUT_A + OUT_B) * 4 written.
// Bounds: SIMD groups past the last row group (the last threadgroup's surplus) compute nothing
// and store nothing, but reach the barrier; rows past OUT re-read row OUT-1 and are not stored.
// STAGE 1: the threadgroup first copies x to threadgroup memory (muser_stage_x: TOKENS * IN *
// 1.25 bytes), then every SIMD group reads it there: one copy of x through L1 a threadgroup
// instead of one a SIMD group, and reads without bank conflicts. Only for weights in wide Q4_K
// units or Q8_0 (both weights of the launch), IN a multiple of 64 (the host checks).
// WOVEN 1: x's codes and sums arrive in q8x's woven layout (formats.woven_positions: each run
// of 32 64-value units stored piece by piece, so that a SIMD group's 16-byte loads of its
// lanes' wide units are contiguous), as attention_combine writes them for the o-projection;
// IN a multiple of 64 (the host checks). Results equal the plain layout's bit for bit.
// INT_FLOATS 1: the integer dots and scales become floats by adding into a float's mantissa
// (lib/base.metal's muser_int_float) instead of conversion instructions (16 a clock on an SM):
// the same values bit for bit, more instructions, fewer of the slow kind; Q6_K x's code sums
// too.
// LEAN 1: wide Q4_K units scale each integer dot by its 6-bit scale as integers, with no
// float scale products (lib/q8x.metal's muser_unit_dot), and ROWS 2 without the head's
// epilogue reduces both rows in one butterfly: 5 shuffles, not 10 (lanes 0-15 end with row
// 0's total, 16-31 with row 1's; CUDA's simd_sum adds in that order). Another rounding order
// than LEAN 0's within the same bound. Other formats ignore it.
// Q6_K weights take LEAN too: the -32 offset and the 6-bit codes' int8 scales applied as
// integers (lib/q8x.metal's muser_unit_dot), one float product by x's scale a quarter.
// GROUPED 1 (a batched decode step, more rows than TOKENS): x and y hold G * TOKENS rows, G
// = the grid's threadgroups along x; threadgroup (g, b) takes rows g * TOKENS .. of x and the
// row group b that threadgroup b takes ungrouped. The token groups of one row group are
// neighbours in launch order, so a weight row read from memory by one is read from L2 by the
// others: each weight byte crosses the memory bus about once a step for every batch size.
// EPILOGUE 0 only (the host checks).
// Template constants: FORMAT_A, ROW_BYTES_A, OUT_A, FORMAT_B, ROW_BYTES_B, OUT_B, IN, TOKENS,
// ROWS, UNROLL (units per lane at a time), WIDE (1: Q4_K weights in 64-value units,
// lib/q8x.metal's muser_x_unit64; other formats ignore it), STAGE, WOVEN, EPILOGUE, INT_FLOATS,
// LEAN, GROUPED.
#include "lib/q8x.metal"
threadgroup float best_rows[8 * TOKENS * 2];
const uint GROUPS_A = uint((OUT_A + ROWS - 1) / ROWS);
const uint GROUPS_B = uint((OUT_B + ROWS - 1) / ROWS);
uint lane = thread_index_in_simdgroup;
uint warp = simdgroup_index_in_threadgroup;
uint warps = threads_per_threadgroup.x / 32u;
uint token_group = GROUPED ? threadgroup_position_in_grid.x : 0u;
uint group = (GROUPED ? threadgroup_position_in_grid.y : threadgroup_position_in_grid.x) * warps + warp;
uint x_first = token_group * uint(TOKENS * IN);  // this threadgroup's rows of x
bool in_a = group < GROUPS_A;
bool active = group < GROUPS_A + GROUPS_B;
uint first_row = in_a ? group * uint(ROWS) : (group - GROUPS_A) * uint(ROWS);
float acc[TOKENS * ROWS];
for (int i = 0; i < TOKENS * ROWS; ++i) {
  acc[i] = 0.0f;
}
threadgroup uint4 x_words[STAGE ? TOKENS * IN / 16 : 1];
threadgroup float4 x_blocks[STAGE ? TOKENS * IN / 64 : 1];
if (STAGE) {
  muser_stage_x<TOKENS, IN, WOVEN ? IN / 64 : 0>(xq + x_first, xd + x_first / 32u, xs + x_first / 8u, x_words, x_blocks, warp * 32u + lane, warps * 32u);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  muser_x_staged x = {x_words, x_blocks};
  if (in_a) {
    muser_rows_dot<FORMAT_A, ROW_BYTES_A, OUT_A, ROWS, TOKENS, IN, UNROLL, WIDE, INT_FLOATS, LEAN>(
        weight_a, first_row, x, lane, acc);
  } else if (active) {
    muser_rows_dot<FORMAT_B, ROW_BYTES_B, OUT_B, ROWS, TOKENS, IN, UNROLL, WIDE, INT_FLOATS, LEAN>(
        weight_b, first_row, x, lane, acc);
  }
} else {
  muser_x_global<WOVEN ? IN / 64 : 0> x = {xq + x_first, xd + x_first / 32u, xs + x_first / 8u};
  if (in_a) {
    muser_rows_dot<FORMAT_A, ROW_BYTES_A, OUT_A, ROWS, TOKENS, IN, UNROLL, WIDE, INT_FLOATS, LEAN>(
        weight_a, first_row, x, lane, acc);
  } else if (active) {
    muser_rows_dot<FORMAT_B, ROW_BYTES_B, OUT_B, ROWS, TOKENS, IN, UNROLL, WIDE, INT_FLOATS, LEAN>(
        weight_b, first_row, x, lane, acc);
  }
}
const uint WIDTH = EPILOGUE == 0 ? uint(OUT_A + OUT_B) : uint(OUT_A);
device float* best = y + uint(TOKENS) * WIDTH;  // EPILOGUE 1 only
device float* out = y + token_group * uint(TOKENS) * WIDTH;  // this threadgroup's rows of y
uint rows = in_a ? uint(OUT_A) : uint(OUT_B);
uint column = in_a ? first_row : uint(OUT_A) + first_row;
if (LEAN != 0 && ROWS == 2 && EPILOGUE == 0) {  // both rows in one butterfly
  for (int t = 0; t < TOKENS; ++t) {
    bool upper = (lane & 16u) != 0u;
    float total = (upper ? acc[t * ROWS + 1] : acc[t * ROWS]) +
                  simd_shuffle_xor(upper ? acc[t * ROWS] : acc[t * ROWS + 1], 16);
    for (ushort offset = 8; offset > 0; offset /= 2) {
      total += simd_shuffle_xor(total, offset);
    }
    uint r = upper ? 1u : 0u;
    if (active && first_row + r < rows && (lane & 15u) == 0u) {
      out[uint(t) * WIDTH + column + r] = total;
    }
  }
} else {
  for (int t = 0; t < TOKENS; ++t) {
    float top = -3.0e38f;
    float top_row = 0.0f;
    for (int r = 0; r < ROWS; ++r) {
      float total = simd_sum(acc[t * ROWS + r]);
      if (EPILOGUE == 1) {
        total *= params[0];
        if (params[1] > 0.0f) {
          total = params[1] * tanh(total / params[1]);
        }
      }
      bool stored = active && first_row + uint(r) < rows;
      if (stored && lane == uint(r)) {
        out[uint(t) * WIDTH + column + uint(r)] = total;
      }
      if (stored && total > top) {
        top = total;
        top_row = float(first_row + uint(r));
      }
    }
    if (EPILOGUE == 1 && lane == 0u) {
      best_rows[(warp * uint(TOKENS) + uint(t)) * 2u] = top;
      best_rows[(warp * uint(TOKENS) + uint(t)) * 2u + 1u] = top_row;
    }
  }
}
if (EPILOGUE == 1) {
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (warp == 0u && lane < uint(TOKENS)) {
    float top = -3.0e38f;
    float top_row = 0.0f;
    for (uint w = 0; w < warps; ++w) {  // SIMD groups hold increasing rows: ties keep the first
      float value = best_rows[(w * uint(TOKENS) + lane) * 2u];
      if (value > top) {
        top = value;
        top_row = best_rows[(w * uint(TOKENS) + lane) * 2u + 1u];
      }
    }
    uint slot = (lane * threadgroups_per_grid.x + threadgroup_position_in_grid.x) * 2u;
    best[slot] = top;
    best[slot + 1u] = top_row;
  }
}
