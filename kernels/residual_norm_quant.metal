// kernel: residual_norm_quant
// inputs: residual branch branch_weight next_weight params
// outputs: total xq xd xs
//
// The seam between two branches of a decoder layer, each token over SLICES threadgroups:
//   total = residual + b * params[2]        (RESIDUAL 1; RESIDUAL 0: no residual, the
//                                            embedding row becoming the residual stream)
//   b     = rms(branch, params[0]) * branch_weight   (BRANCH_NORM 1: a sandwich post-norm or
//                                                     the embedding's norm; 0: b = branch)
//   h     = rms(total, params[1]) * next_weight, written as q8x for the next products
//                                                    (NEXT_NORM 0: h = total, for a branch
//                                                     that reads the stream unnormed).
// rms(v, e) = v / sqrt(mean(v^2) + e), in float32 (an eps of 1e-8 vanishes in float16).
// residual, branch, total: f32 [T, HIDDEN]; weights f32 [HIDDEN]; xq int8 [T, HIDDEN], xd
// [T, HIDDEN/32], xs [T, HIDDEN/8]. CHUNKS > 1: branch [CHUNKS, T, HIDDEN], a tile product's
// partial sums over runs of its input (kernel product_tiles' CHUNKS), added here in order.
// Grid: T * SLICES threadgroups of THREADS threads, SLICES = ceil(HIDDEN / 32 / SLICE_BLOCKS);
// threadgroup g takes token g / SLICES and writes only slice g % SLICES: SLICE_BLOCKS whole
// 32-value blocks of total, xq, xd, xs (the last slice may hold fewer). A decode token so
// spreads over SLICES SMs (one threadgroup of one SM was bound by instruction issue). Each
// threadgroup computes both rms of the WHOLE row itself (the row is read from L2 once per
// slice), with no communication between threadgroups: every thread loads its float4s of
// branch, residual and branch_weight (thread i: float4s i, i + THREADS, ...) at once, with
// its slice's float4 of all four inputs; two threadgroup sums (simd_sum, then threadgroup
// memory) give the rms. In the slice, thread i holds values 4i .. 4i + 3, so a block is 8
// lanes of one SIMD group: its maximum and per-8 sums are shuffles among them.
// A thread holds PER_THREAD float4s of each of three vectors across the first barrier (at 256
// threads: 119 registers for HIDDEN 6656, no spills up to HIDDEN 16384).
// Bytes per call: T * HIDDEN * 13.4 read and written (two f32 vectors in, one out, q8x out),
// plus SLICES - 1 more reads of the rows from L2.
// Bounds: HIDDEN is a multiple of 32, SLICE_BLOCKS * 8 <= THREADS, THREADS a multiple of 32
// and the grid whole threadgroups (the host checks); rows are whole blocks, so every float4
// access is aligned. Past the row: loads give 0 (whole-row pass) or re-read the row's last
// float4 (slice), never stored; SIMD groups with no value of the slice return after the
// barriers.
// Template constants: HIDDEN, RESIDUAL, BRANCH_NORM, NEXT_NORM, SLICE_BLOCKS (blocks per threadgroup),
// THREADS (threads per threadgroup), CHUNKS.
const int BLOCKS = HIDDEN / 32;
const int QUADS = HIDDEN / 4;                        // float4s in a row
const int SLICES = (BLOCKS + SLICE_BLOCKS - 1) / SLICE_BLOCKS;
const int GROUPS = THREADS / 32;
const int FULL = QUADS / THREADS;                    // whole-row float4s every thread takes
const int PER_THREAD = (QUADS + THREADS - 1) / THREADS;
threadgroup float partial_branch[GROUPS];
threadgroup float partial_total[GROUPS];
uint token = threadgroup_position_in_grid.x / uint(SLICES);
uint slice = threadgroup_position_in_grid.x % uint(SLICES);
uint position = thread_position_in_threadgroup.x;
uint lane = thread_index_in_simdgroup;
uint warp = simdgroup_index_in_threadgroup;
size_t row = size_t(token) * size_t(HIDDEN);
const device float4* branch4 = (const device float4*)(branch + row);
const size_t CHUNK_QUADS = CHUNKS > 1 ? size_t(branch_shape[1]) * size_t(QUADS) : 0;  // a chunk's float4s
const device float4* residual4 = (const device float4*)(residual + row);
const device float4* branch_weight4 = (const device float4*)(branch_weight);
const device float4* next_weight4 = (const device float4*)(next_weight);
// Every load first, so the threadgroup waits for memory once: the slice's float4 (past the
// row: the row's last one), then the whole row.
uint first = slice * uint(SLICE_BLOCKS * 8);         // the slice's first float4
uint quad = min(first + position, uint(QUADS - 1));
float4 mine = branch4[quad];
for (int c = 1; c < CHUNKS; ++c) {
  float4 more = branch4[size_t(c) * CHUNK_QUADS + quad];
  mine = float4(mine.x + more.x, mine.y + more.y, mine.z + more.z, mine.w + more.w);
}
float4 mine_residual = RESIDUAL ? residual4[quad] : float4(0.0f, 0.0f, 0.0f, 0.0f);
float4 mine_weight = BRANCH_NORM ? branch_weight4[quad] : float4(1.0f, 1.0f, 1.0f, 1.0f);
float4 mine_next = NEXT_NORM ? next_weight4[quad] : float4(1.0f, 1.0f, 1.0f, 1.0f);
float4 values[PER_THREAD];
float4 residuals[PER_THREAD];
float4 weights[PER_THREAD];
for (int i = 0; i < PER_THREAD; ++i) {
  uint q = uint(i * THREADS) + position;
  bool inside = i < FULL || q < uint(QUADS);         // only the last pass can leave the row
  values[i] = inside ? branch4[q] : float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int c = 1; c < CHUNKS; ++c) {  // the same sums, in the same order, as `mine`
    float4 more = inside ? branch4[size_t(c) * CHUNK_QUADS + q] : float4(0.0f, 0.0f, 0.0f, 0.0f);
    values[i] = float4(values[i].x + more.x, values[i].y + more.y, values[i].z + more.z, values[i].w + more.w);
  }
  residuals[i] = RESIDUAL && inside ? residual4[q] : float4(0.0f, 0.0f, 0.0f, 0.0f);
  weights[i] = BRANCH_NORM && inside ? branch_weight4[q] : float4(1.0f, 1.0f, 1.0f, 1.0f);
}
float branch_scale = params[2];
if (BRANCH_NORM) {
  float sx = 0.0f, sy = 0.0f, sz = 0.0f, sw = 0.0f;  // four chains, not one
  for (int i = 0; i < PER_THREAD; ++i) {
    sx += values[i].x * values[i].x;
    sy += values[i].y * values[i].y;
    sz += values[i].z * values[i].z;
    sw += values[i].w * values[i].w;
  }
  float squares = simd_sum((sx + sy) + (sz + sw));
  if (lane == 0u) {
    partial_branch[warp] = squares;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float sum = 0.0f;
  for (int g = 0; g < GROUPS; ++g) {
    sum += partial_branch[g];
  }
  branch_scale *= 1.0f / sqrt(sum / float(HIDDEN) + params[0]);
}
float next_scale = 1.0f;
if (NEXT_NORM) {
  float tx = 0.0f, ty = 0.0f, tz = 0.0f, tw = 0.0f;
  for (int i = 0; i < PER_THREAD; ++i) {  // past the row: 0 * scale * 1 + 0
    float x = values[i].x * branch_scale * weights[i].x + residuals[i].x;
    float y = values[i].y * branch_scale * weights[i].y + residuals[i].y;
    float z = values[i].z * branch_scale * weights[i].z + residuals[i].z;
    float w = values[i].w * branch_scale * weights[i].w + residuals[i].w;
    tx += x * x;
    ty += y * y;
    tz += z * z;
    tw += w * w;
  }
  float squares = simd_sum((tx + ty) + (tz + tw));
  if (lane == 0u) {
    partial_total[warp] = squares;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float sum = 0.0f;
  for (int g = 0; g < GROUPS; ++g) {
    sum += partial_total[g];
  }
  next_scale = 1.0f / sqrt(sum / float(HIDDEN) + params[1]);
}
// The slice: a SIMD group whose first float4 is past it (or past the row) has nothing to do.
uint end = min(first + uint(SLICE_BLOCKS * 8), uint(QUADS));
if (first + 32u * warp >= end) {
  return;
}
float t0 = mine.x * branch_scale * mine_weight.x + mine_residual.x;
float t1 = mine.y * branch_scale * mine_weight.y + mine_residual.y;
float t2 = mine.z * branch_scale * mine_weight.z + mine_residual.z;
float t3 = mine.w * branch_scale * mine_weight.w + mine_residual.w;
float h0 = t0 * next_scale * mine_next.x;
float h1 = t1 * next_scale * mine_next.y;
float h2 = t2 * next_scale * mine_next.z;
float h3 = t3 * next_scale * mine_next.w;
// Block quad / 8 is lanes 8k .. 8k + 7: its maximum over them, its sums of 8 over lane pairs.
float peak = max(max(fabs(h0), fabs(h1)), max(fabs(h2), fabs(h3)));
peak = max(peak, simd_shuffle_xor(peak, 1u));
peak = max(peak, simd_shuffle_xor(peak, 2u));
peak = max(peak, simd_shuffle_xor(peak, 4u));
float d = peak / 127.0f;
float q0 = d > 0.0f ? round(h0 / d) : 0.0f;
float q1 = d > 0.0f ? round(h1 / d) : 0.0f;
float q2 = d > 0.0f ? round(h2 / d) : 0.0f;
float q3 = d > 0.0f ? round(h3 / d) : 0.0f;
float pair = (q0 + q1) + (q2 + q3);
pair += simd_shuffle_xor(pair, 1u);
quad = first + position;
if (quad < end) {
  size_t at = row + 4u * quad;
  ((device float4*)(total + row))[quad] = float4(t0, t1, t2, t3);
  xq[at] = int8_t(q0);
  xq[at + 1u] = int8_t(q1);
  xq[at + 2u] = int8_t(q2);
  xq[at + 3u] = int8_t(q3);
  if (lane % 2u == 0u) {
    xs[at / 8u] = d * pair;
  }
  if (lane % 8u == 0u) {
    xd[at / 32u] = d;
  }
}
