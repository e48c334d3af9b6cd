// kernel: residual_norm_rows
// inputs: residual branch branch_weight next_weight params
// outputs: total normed
//
// The seam between two branches of a decoder layer for a prefill chunk's rows, one
// threadgroup a row (residual_norm_quant is the decode step's, with q8x output):
//   b      = rms(branch, params[0]) * branch_weight   (BRANCH_NORM 1: a sandwich post-norm;
//                                                      0: b = branch)
//   total  = residual + b
//   normed = rms(total, params[1]) * next_weight   (NEXT_NORM 1; 0: normed = total, for a
//                                                  branch that reads the stream unnormed)
// rms(v, e) = v / sqrt(mean(v^2) + e), in float32 (an eps of 1e-8 vanishes in float16).
// residual: f32 [R, HIDDEN]; branch: [R, HIDDEN], float16 (a prefill product's output as it
// is) or float32, read as float; weights f32 [HIDDEN] (branch_weight unread when BRANCH_NORM
// is 0, next_weight when NEXT_NORM is 0); params f32 [2]. total, normed: f32 [R, HIDDEN]. R comes from residual's shape.
// Replaces MLX's conversion of branch, rms_norm, add and rms_norm: four launches.
// Grid: R threadgroups of THREADS threads; thread i takes values i, i + THREADS, ... of its
// row (coalesced) and keeps them in registers between the two sums, each a simd_sum and then
// threadgroup memory.
// Bytes per call: R * HIDDEN * (4 + 2 or 4) read, R * HIDDEN * 8 written, plus the weights.
// Bounds: values past the row are 0 and never stored; a threadgroup past R (none on a grid
// of whole rows) returns whole, before any barrier.
// Template constants: HIDDEN, BRANCH_NORM (0 or 1), NEXT_NORM (0 or 1), THREADS (threads per threadgroup, a
// multiple of 32).
const int GROUPS = THREADS / 32;
const int PER_THREAD = (HIDDEN + THREADS - 1) / THREADS;
threadgroup float partial_branch[GROUPS];
threadgroup float partial_total[GROUPS];
uint row = threadgroup_position_in_grid.x;
if (row >= uint(residual_shape[0])) {
  return;
}
uint position = thread_position_in_threadgroup.x;
uint lane = thread_index_in_simdgroup;
uint warp = simdgroup_index_in_threadgroup;
size_t base = size_t(row) * size_t(HIDDEN);
float values[PER_THREAD];
float squares = 0.0f;
for (int i = 0; i < PER_THREAD; ++i) {
  uint e = position + uint(i * THREADS);
  values[i] = e < uint(HIDDEN) ? float(branch[base + e]) : 0.0f;
  squares += values[i] * values[i];
}
float branch_scale = 1.0f;
if (BRANCH_NORM) {
  float sum = simd_sum(squares);
  if (lane == 0u) {
    partial_branch[warp] = sum;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  sum = 0.0f;
  for (int g = 0; g < GROUPS; ++g) {
    sum += partial_branch[g];
  }
  branch_scale = 1.0f / sqrt(sum / float(HIDDEN) + params[0]);
}
squares = 0.0f;
for (int i = 0; i < PER_THREAD; ++i) {
  uint e = position + uint(i * THREADS);
  if (e < uint(HIDDEN)) {
    float b = BRANCH_NORM ? values[i] * branch_scale * branch_weight[e] : values[i];
    values[i] = residual[base + e] + b;
    total[base + e] = values[i];
    squares += values[i] * values[i];
  }
}
float next_scale = 1.0f;
if (NEXT_NORM) {
  float sum = simd_sum(squares);
  if (lane == 0u) {
    partial_total[warp] = sum;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  sum = 0.0f;
  for (int g = 0; g < GROUPS; ++g) {
    sum += partial_total[g];
  }
  next_scale = 1.0f / sqrt(sum / float(HIDDEN) + params[1]);
}
for (int i = 0; i < PER_THREAD; ++i) {
  uint e = position + uint(i * THREADS);
  if (e < uint(HIDDEN)) {
    normed[base + e] = NEXT_NORM ? values[i] * next_scale * next_weight[e] : values[i];
  }
}
