// kernel: product_tiles
// inputs: weight_a weight_b xq xd xs
// outputs: y
//
// The batched decode step's products: y = x W.T for up to TOKENS rows of q8x x per token group
// (xq int8 [rows, IN], xd f32 [rows, IN/32], xs f32 [rows, IN/8]; rows a multiple of 8, read
// from xq's shape) and raw GGUF weights (Q4_K, Q6_K or Q8_0; [OUT, ROW_BYTES] uint8, 4-byte
// aligned), as int8 matrix products (lib/tiles.metal; tensor cores on NVIDIA GPUs):
//   GLU 0: y [rows, OUT_A + OUT_B] = [x A.T | x B.T] (no B when OUT_B is 0).
//   GLU 1: y [rows, OUT_A] = act(x A.T) * (x B.T), A the gate and B the up projection (OUT_B =
//          OUT_A), act silu (ACTIVATION 0) or tanh-approximated gelu (1).
// Grid: threadgroup (token group, tile): SPLIT SIMD groups take one 16-row tile of A (then of
// B; with GLU the same rows of both) and TOKENS rows of x from TOKENS * (token group), SIMD
// group p the spans p, p + SPLIT, ... of each row (lib/tiles.metal: a span's weight loads are
// issued together), their sums added in threadgroup memory in a fixed order. The token groups
// of one tile are neighbours in launch order, so a weight byte read from memory by one is read
// from L2 by the others. Each lane reads its share of each block of its rows once for all the
// token tiles, and x's share from L1/L2.
// Bytes per call: OUT_A * ROW_BYTES_A + OUT_B * ROW_BYTES_B + rows * IN * 1.625 read (x once
// per tile: from cache), rows * WIDTH * 4 written.
// Bounds: threadgroups past the last tile return at once (all of their threads); rows past
// OUT re-read row OUT-1 and are not stored; token tiles past the rows are skipped (uniform in a
// SIMD group, as the products need).
// Template constants: FORMAT_A, ROW_BYTES_A, OUT_A, FORMAT_B, ROW_BYTES_B, OUT_B, IN (a
// multiple of 32; of 256 for Q4_K and Q6_K), TOKENS (a multiple of 8), SPLIT, GLU, ACTIVATION.
#include "lib/tiles.metal"
const int NT = TOKENS / 8;
const int SUMS = GLU != 0 ? 2 * NT * 4 : NT * 4;  // a lane's sums (GLU: gate's, then up's)
const uint GROUPS_A = (uint(OUT_A) + 15u) / 16u;
const uint GROUPS_B = GLU != 0 ? 0u : (uint(OUT_B) + 15u) / 16u;
threadgroup float partial[SPLIT > 1 ? (SPLIT - 1) * SUMS * 32 : 1];
uint lane = thread_index_in_simdgroup;
uint part = simdgroup_index_in_threadgroup;
uint group = threadgroup_position_in_grid.y;
if (group >= GROUPS_A + GROUPS_B) {
  return;
}
uint first_token = threadgroup_position_in_grid.x * uint(TOKENS);
uint rows = uint(xq_shape[0]);
uint live = (min(uint(TOKENS), rows - first_token) + 7u) / 8u;
bool in_a = group < GROUPS_A;
uint first_row = (in_a ? group : group - GROUPS_A) * 16u;
float acc[SUMS];
for (int i = 0; i < SUMS; ++i) {
  acc[i] = 0.0f;
}
if (in_a) {
  muser_tile_rows<FORMAT_A, ROW_BYTES_A, OUT_A, NT, IN, SPLIT>(weight_a, first_row, xq, xd, xs, first_token, live,
                                                               part, lane, acc);
} else {
  muser_tile_rows<FORMAT_B, ROW_BYTES_B, OUT_B, NT, IN, SPLIT>(weight_b, first_row, xq, xd, xs, first_token, live,
                                                               part, lane, acc);
}
if (GLU != 0) {
  muser_tile_rows<FORMAT_B, ROW_BYTES_B, OUT_B, NT, IN, SPLIT>(weight_b, first_row, xq, xd, xs, first_token, live,
                                                               part, lane, acc + NT * 4);
}
if (SPLIT > 1) {  // SIMD groups 1.. hand their sums to SIMD group 0, which adds them in order
  if (part > 0u) {
    for (int i = 0; i < SUMS; ++i) {
      partial[((part - 1u) * uint(SUMS) + uint(i)) * 32u + lane] = acc[i];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (part > 0u) {
    return;
  }
  for (uint p = 0; p < uint(SPLIT - 1); ++p) {
    for (int i = 0; i < SUMS; ++i) {
      acc[i] += partial[(p * uint(SUMS) + uint(i)) * 32u + lane];
    }
  }
}
const uint WIDTH = GLU != 0 ? uint(OUT_A) : uint(OUT_A + OUT_B);
uint out_rows = in_a ? uint(OUT_A) : uint(OUT_B);
uint column = in_a ? 0u : uint(OUT_A);
uint g = lane / 4u;
uint t = lane % 4u;
for (int j = 0; j < NT; ++j) {
  for (int e = 0; e < 4; ++e) {
    uint row = first_row + g + 8u * uint(e / 2);
    uint token = first_token + 8u * uint(j) + 2u * t + uint(e % 2);
    if (uint(j) < live && row < out_rows) {
      float value = acc[j * 4 + e];
      if (GLU != 0) {
        float activated = ACTIVATION == 0 ? value / (1.0f + exp(-value))
                                          : 0.5f * value * (1.0f + tanh(0.7978845608f * (value + 0.044715f * value * value * value)));
        value = activated * acc[GLU != 0 ? NT * 4 + j * 4 + e : 0];
      }
      y[size_t(token) * WIDTH + column + row] = value;
    }
  }
}
