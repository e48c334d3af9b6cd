// kernel: residual_norm
// inputs: residual branch branch_weight next_weight
// outputs: sum normed
//
// The seam between two branches of a decoder layer, fused into one pass over each row:
//   sum    = residual + rms(branch, eps_branch) * branch_weight  (SANDWICH: Gemma / Muse's post-norm)
//   sum    = residual + branch                                 (otherwise: a plain residual add)
//   normed = rms(sum, eps_next) * next_weight                    (the next branch's pre-norm)
// with rms(v, e) = v / sqrt(mean(v²) + e), in float32. Three or four MLX ops become one launch.
// residual, branch: [ROWS, HIDDEN] f32; branch_weight, next_weight: [HIDDEN] f32. The two eps
// arrive as the bit patterns of float32s in template constants (no per-call upload of a scalar).
// sum, normed: [ROWS, HIDDEN] f32.
// Grid: one threadgroup of THREADS threads per row (ROWS * THREADS threads); each thread strides
// the row. Two reductions (sum of branch², then of sum²): simd_sum inside each SIMD group, then
// the THREADS / 32 partials through threadgroup memory.
// Bytes per call: ROWS * HIDDEN * 4 * 2 + HIDDEN * 4 * 2 read, ROWS * HIDDEN * 4 * 2 written.
// Bounds: the grid is exactly ROWS threadgroups; each thread touches only e < HIDDEN of its row.
// Template constants: HIDDEN, THREADS (a multiple of 32, at most 1024), SANDWICH (0 or 1),
// EPS_BRANCH_BITS, EPS_NEXT_BITS.
uint row = threadgroup_position_in_grid.x;
uint tid = thread_position_in_threadgroup.x;
uint lane = thread_index_in_simdgroup;
uint group = simdgroup_index_in_threadgroup;
threadgroup float partial[32];
const float eps_branch = as_type<float>(uint(EPS_BRANCH_BITS));
const float eps_next = as_type<float>(uint(EPS_NEXT_BITS));
const device float* r = residual + size_t(row) * HIDDEN;
const device float* b = branch + size_t(row) * HIDDEN;
device float* s = sum + size_t(row) * HIDDEN;
device float* n = normed + size_t(row) * HIDDEN;
float branch_scale = 1.0f;
if (SANDWICH) {
  float squares = 0.0f;
  for (uint e = tid; e < uint(HIDDEN); e += THREADS) {
    squares += b[e] * b[e];
  }
  squares = simd_sum(squares);
  if (lane == 0) {
    partial[group] = squares;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint g = 0; g < uint(THREADS / 32); ++g) {
    total += partial[g];
  }
  branch_scale = 1.0f / sqrt(total / float(HIDDEN) + eps_branch);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
float squares = 0.0f;
for (uint e = tid; e < uint(HIDDEN); e += THREADS) {
  float value = r[e] + (SANDWICH ? b[e] * branch_scale * branch_weight[e] : b[e]);
  s[e] = value;
  squares += value * value;
}
squares = simd_sum(squares);
if (lane == 0) {
  partial[group] = squares;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float total = 0.0f;
for (uint g = 0; g < uint(THREADS / 32); ++g) {
  total += partial[g];
}
float scale = 1.0f / sqrt(total / float(HIDDEN) + eps_next);
for (uint e = tid; e < uint(HIDDEN); e += THREADS) {
  n[e] = s[e] * scale * next_weight[e];
}
