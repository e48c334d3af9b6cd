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
float values[PER_GROUP];
float squares = 0.0f;
for (int i = 0; i < PER_GROUP; ++i) {
  uint b = warp + uint(i * GROUPS);
  values[i] = b < uint(BLOCKS) ? branch[row + 32u * b + lane] : 0.0f;
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
  if (b < uint(BLOCKS)) {
    uint e = 32u * b + lane;
    float v = values[i] * branch_scale * (BRANCH_NORM ? branch_weight[e] : 1.0f);
    if (RESIDUAL) {
      v += residual[row + e];
    }
    total[row + e] = v;
    values[i] = v;
    squares += v * v;
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
for (int i = 0; i < PER_GROUP; ++i) {
  uint b = warp + uint(i * GROUPS);
  if (b < uint(BLOCKS)) {
    muser_quantize_block(values[i] * next_scale * next_weight[32u * b + lane], lane, xq + row, xd + row / 32u,
                         xs + row / 8u, b);
  }
}
