// kernel: residual_norm_quant
// inputs: residual branch branch_weight next_weight params
// outputs: total xq xd xs
//
// The seam between two branches of a decoder layer, for one token per threadgroup:
//   total = residual + b * params[2]        (RESIDUAL 1; RESIDUAL 0: no residual, the
//                                            embedding row becoming the residual stream)
//   b     = rms(branch, params[0]) * branch_weight   (BRANCH_NORM 1: a sandwich post-norm or
//                                                     the embedding's norm; 0: b = branch)
//   h     = rms(total, params[1]) * next_weight, written as q8x for the next products.
// rms(v, e) = v / sqrt(mean(v^2) + e), in float32 (an eps of 1e-8 vanishes in float16).
// residual, branch, total: f32 [T, HIDDEN]; weights f32 [HIDDEN]; xq int8 [T, HIDDEN], xd
// [T, HIDDEN/32], xs [T, HIDDEN/8].
// Grid: one threadgroup per token of min(HIDDEN / 32, 32) SIMD groups; SIMD group w takes the
// 32-value blocks w, w + groups, ... (lane l: value l of each), so each block's quantization
// is one SIMD group's. Two threadgroup sums (simd_sum, then threadgroup memory) give the rms.
// Bytes per call: T * HIDDEN * 13.4 read and written (two f32 vectors in, one out, q8x out).
// Bounds: HIDDEN is a multiple of 32 and the grid whole threadgroups (the host checks).
// Template constants: HIDDEN, RESIDUAL, BRANCH_NORM.
const int BLOCKS = HIDDEN / 32;
const int GROUPS = BLOCKS < 32 ? BLOCKS : 32;
const int PER_GROUP = (BLOCKS + GROUPS - 1) / GROUPS;
threadgroup float partial_branch[32];
threadgroup float partial_total[32];
uint token = threadgroup_position_in_grid.x;
uint lane = thread_index_in_simdgroup;
uint warp = simdgroup_index_in_threadgroup;
size_t row = size_t(token) * size_t(HIDDEN);
// Every load first, so the threadgroup waits for memory once.
float values[PER_GROUP];
float residuals[PER_GROUP];
float branch_weights[PER_GROUP];
float next_weights[PER_GROUP];
float squares = 0.0f;
for (int i = 0; i < PER_GROUP; ++i) {
  uint b = warp + uint(i * GROUPS);
  uint e = min(b, uint(BLOCKS - 1)) * 32u + lane;  // past the last block: a value never stored
  values[i] = b < uint(BLOCKS) ? branch[row + e] : 0.0f;
  residuals[i] = RESIDUAL ? residual[row + e] : 0.0f;
  branch_weights[i] = BRANCH_NORM ? branch_weight[e] : 1.0f;
  next_weights[i] = next_weight[e];
  squares += values[i] * values[i];
}
float branch_scale = params[2];
if (BRANCH_NORM) {
  float total_squares = simd_sum(squares);
  if (lane == 0u) {
    partial_branch[warp] = total_squares;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float sum = 0.0f;
  for (int g = 0; g < GROUPS; ++g) {
    sum += partial_branch[g];
  }
  branch_scale *= 1.0f / sqrt(sum / float(HIDDEN) + params[0]);
}
squares = 0.0f;
for (int i = 0; i < PER_GROUP; ++i) {
  uint b = warp + uint(i * GROUPS);
  values[i] = values[i] * branch_scale * branch_weights[i] + residuals[i];
  if (b < uint(BLOCKS)) {
    total[row + 32u * b + lane] = values[i];
    squares += values[i] * values[i];
  }
}
float total_squares = simd_sum(squares);
if (lane == 0u) {
  partial_total[warp] = total_squares;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float sum = 0.0f;
for (int g = 0; g < GROUPS; ++g) {
  sum += partial_total[g];
}
float next_scale = 1.0f / sqrt(sum / float(HIDDEN) + params[1]);
// The SIMD group's blocks quantized side by side (their shuffle chains independent), stores
// of blocks past the last skipped.
float scales[PER_GROUP];
float codes[PER_GROUP];
for (int i = 0; i < PER_GROUP; ++i) {
  values[i] *= next_scale * next_weights[i];
  scales[i] = simd_max(fabs(values[i])) / 127.0f;
}
for (int i = 0; i < PER_GROUP; ++i) {
  codes[i] = scales[i] > 0.0f ? round(values[i] / scales[i]) : 0.0f;
  values[i] = codes[i] + simd_shuffle_xor(codes[i], 1u);
}
for (int i = 0; i < PER_GROUP; ++i) {
  values[i] += simd_shuffle_xor(values[i], 2u);
}
for (int i = 0; i < PER_GROUP; ++i) {
  values[i] += simd_shuffle_xor(values[i], 4u);
  uint b = warp + uint(i * GROUPS);
  if (b < uint(BLOCKS)) {
    xq[row + 32u * b + lane] = int8_t(codes[i]);
    if (lane % 8u == 0u) {
      xs[row / 8u + 4u * b + lane / 8u] = scales[i] * values[i];
    }
    if (lane == 0u) {
      xd[row / 32u + b] = scales[i];
    }
  }
}
