// kernel: argmax
// inputs: best
// outputs: tokens
//
// Greedy sampling's second stage: the row of the largest value, from kernel product's
// per-threadgroup maxima best [T, GROUPS, 2] (value, row) to tokens int32 [T]. Ties keep the
// smallest row, as mx.argmax does.
// Grid: one threadgroup of 1024 threads per token; thread i scans entries i, i + 1024, ...;
// SIMD groups reduce with shuffles, then threadgroup memory.
// Bytes per call: T * GROUPS * 8 read, T * 4 written.
// Bounds: threads past GROUPS hold no candidate (-inf).
// Template constants: GROUPS.
threadgroup float top_values[32];
threadgroup float top_rows[32];
uint t = threadgroup_position_in_grid.x;
uint lane = thread_index_in_simdgroup;
uint warp = simdgroup_index_in_threadgroup;
float top = -3.4e38f;
float top_row = 3.4e38f;
uint threads = threads_per_threadgroup.x;
for (uint i0 = thread_position_in_threadgroup.x; i0 < uint(GROUPS); i0 += 8u * threads) {
  float values[8];
  float rows[8];
  for (int k = 0; k < 8; ++k) {  // 8 loads in flight before any comparison
    uint i = i0 + uint(k) * threads;
    values[k] = i < uint(GROUPS) ? best[(size_t(t) * uint(GROUPS) + i) * 2u] : -3.4e38f;
    rows[k] = i < uint(GROUPS) ? best[(size_t(t) * uint(GROUPS) + i) * 2u + 1u] : 3.4e38f;
  }
  for (int k = 0; k < 8; ++k) {
    if (values[k] > top || (values[k] == top && rows[k] < top_row)) {
      top = values[k];
      top_row = rows[k];
    }
  }
}
for (uint offset = 16u; offset > 0u; offset /= 2u) {
  float value = simd_shuffle_xor(top, offset);
  float row = simd_shuffle_xor(top_row, offset);
  if (value > top || (value == top && row < top_row)) {
    top = value;
    top_row = row;
  }
}
if (lane == 0u) {
  top_values[warp] = top;
  top_rows[warp] = top_row;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (warp == 0u) {
  uint groups = threads_per_threadgroup.x / 32u;
  top = lane < groups ? top_values[lane] : -3.4e38f;
  top_row = lane < groups ? top_rows[lane] : 3.4e38f;
  for (uint offset = 16u; offset > 0u; offset /= 2u) {
    float value = simd_shuffle_xor(top, offset);
    float row = simd_shuffle_xor(top_row, offset);
    if (value > top || (value == top && row < top_row)) {
      top = value;
      top_row = row;
    }
  }
  if (lane == 0u) {
    tokens[t] = int(top_row);
  }
}
