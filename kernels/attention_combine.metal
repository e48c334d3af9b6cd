// kernel: attention_combine
// inputs: partial y
// outputs: oq od os
//
// One decode token's attention, second pass (per row of a batch: grid y): the splits of kernel
// attention_decode merged,
// the attention gate applied (GATE 1: o * sigmoid(y[G_OFF + h * HEAD_DIM + e]), the gate
// projection's output), and the result written as q8x for the output projection:
//   o[h, e] = sum_s e^(m_s - M) partial_o[h, s, e] / sum_s e^(m_s - M) l_s,  M = max_s m_s.
// partial f32 [ROWS, HEADS * SPLITS * (HEAD_DIM + 2)]: a row's partial_o [HEADS, SPLITS,
// HEAD_DIM], then partial_stats [HEADS, SPLITS, 2] (m, l) (one array: each array of a launch is
// host work at every step); y f32 [ROWS, Y_WIDTH]. oq int8 [OUT_ROWS, HEADS * HEAD_DIM], od
// [OUT_ROWS, HEADS * HEAD_DIM / 32], os [OUT_ROWS, HEADS * HEAD_DIM / 8]: rows ROWS .. OUT_ROWS - 1
// (a batch padded for its products) are zeros.
// Grid: one SIMD group per 32 channels of one head (one q8x block): HEADS * HEAD_DIM / 32
// SIMD groups along x, OUT_ROWS along y; lane l takes channel l of the block and every split's
// weight.
// Bytes per call: HEADS * SPLITS * (HEAD_DIM + 2) * 4 read, HEADS * HEAD_DIM * 1.625 written.
// Bounds: SIMD groups past the last block (CUDA's surplus) return whole.
// ROWS and SPLITS come from partial's shape, read at run time.
// SPLITS is at most 128 (ops.attention sizes the splits so).
// WOVEN 1: oq and os in q8x's woven layout (formats.woven_positions) for a product that reads
// it (kernel product's WOVEN); HEADS * HEAD_DIM is a multiple of 64 (HEAD_DIM is).
// Template constants: HEADS, HEAD_DIM, GATE, G_OFF, WOVEN.
#include "lib/q8x.metal"
const int MAX_SPLITS = 128;
const uint ROWS = uint(partial_shape[0]);
const uint SPLITS = uint(partial_shape[1]) / uint(HEADS * (HEAD_DIM + 2));
uint lane = thread_index_in_simdgroup;
uint block = thread_position_in_grid.x / 32u;
if (block >= uint(HEADS * HEAD_DIM / 32)) {
  return;
}
const uint row = threadgroup_position_in_grid.y;
device int8_t* row_q = oq + size_t(row) * uint(HEADS * HEAD_DIM);
device float* row_d = od + size_t(row) * uint(HEADS * HEAD_DIM / 32);
device float* row_s = os + size_t(row) * uint(HEADS * HEAD_DIM / 8);
if (row >= ROWS) {  // a padding row
  muser_quantize_block<WOVEN ? HEADS * HEAD_DIM / 64 : 0>(0.0f, lane, row_q, row_d, row_s, block);
  return;
}
const device float* partial_o = partial + size_t(row) * size_t(HEADS) * SPLITS * size_t(HEAD_DIM + 2);
const device float* partial_stats = partial_o + size_t(HEADS) * SPLITS * size_t(HEAD_DIM);
uint head = block / uint(HEAD_DIM / 32);
uint channel = 32u * (block % uint(HEAD_DIM / 32)) + lane;
const device float* stats = partial_stats + size_t(head) * SPLITS * 2u;
// Lane l holds splits l, l + 32, ... (at most MAX_SPLITS / 32): their maxima, the merged max M,
// their weights e^(m - M); and how many splits hold any key (the rest are empty: a short
// context fills only the first).
float weights[MAX_SPLITS / 32];
float top = -3.0e38f;
uint used = 0u;
for (int k = 0; k < MAX_SPLITS / 32; ++k) {
  uint s = lane + 32u * uint(k);
  weights[k] = s < SPLITS ? stats[2u * s] : -3.0e38f;
  top = max(top, weights[k]);
  used = s < SPLITS && stats[2u * s + 1u] > 0.0f ? s + 1u : used;
}
top = simd_max(top);
used = uint(simd_max(float(used)));
float weight_sum = 0.0f;
for (int k = 0; k < MAX_SPLITS / 32; ++k) {
  uint s = lane + 32u * uint(k);
  weights[k] = s < used ? exp(weights[k] - top) : 0.0f;
  weight_sum += s < used ? weights[k] * stats[2u * s + 1u] : 0.0f;
}
weight_sum = simd_sum(weight_sum);
// Each lane's channel over the used splits, 32 loads in flight at a time (one SIMD group per
// SM or so: each round waits for memory once).
float total = 0.0f;
for (int k = 0; k < MAX_SPLITS / 32; ++k) {
  if (32u * uint(k) >= used) {
    break;
  }
  float o[32];
  for (int j = 0; j < 32; ++j) {
    uint s = 32u * uint(k) + uint(j);
    o[j] = s < used ? partial_o[(size_t(head) * SPLITS + s) * HEAD_DIM + channel] : 0.0f;
  }
  for (int j = 0; j < 32; ++j) {
    total += simd_shuffle(weights[k], uint(j)) * o[j];
  }
}
float o = total / weight_sum;
if (GATE) {
  o /= 1.0f + exp(-y[size_t(row) * uint(y_shape[1]) + G_OFF + head * uint(HEAD_DIM) + channel]);
}
muser_quantize_block<WOVEN ? HEADS * HEAD_DIM / 64 : 0>(o, lane, row_q, row_d, row_s, block);
