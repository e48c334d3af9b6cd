// kernel: qk_norm_rope
// inputs: q k q_weight k_weight inv_freq start eps
// outputs: q_out k_out
//
// The tail of the q and k projections, fused: per head, RMS norm with its weight, then RoPE,
// written head-major for attention.
//   q_out[b, h, t, :] = rope(rms(q[b, t, h, :]) * q_weight, start + t)   (and k alike)
// q: [B, T, HEADS * HEAD_DIM] f32; k: [B, T, KV_HEADS * HEAD_DIM] f32; q_weight, k_weight:
// [HEAD_DIM] f32; inv_freq: [ROTARY / 2] f32, base^(-2i / ROTARY); start: [1] int32, the
// position of row t = 0; eps: [1] f32. q_out: [B, HEADS, T, HEAD_DIM]; k_out: [B, KV_HEADS, T,
// HEAD_DIM]. RoPE rotates pairs (2i, 2i+1) when TRADITIONAL (llama.cpp's NORM), else (i,
// i + ROTARY/2) (NEOX) by the angle (start + t) * inv_freq[i]; values past ROTARY pass through
// normed; ROTARY = 0: no RoPE (a full-attention Muse Glimmer layer).
// Grid: one 32-thread SIMD group per (b, t, head) of q then k: B * T * (HEADS + KV_HEADS)
// groups, 256 threads per threadgroup. The lanes share the head's sum of squares (simd_sum);
// each lane then writes whole rotation pairs.
// Replaces, for q and k each: the head split, its transpose, rms_norm and rope (8 MLX ops in
// one launch).
// Bytes per call: (HEADS + KV_HEADS) * B * T * HEAD_DIM * 4 read and written, plus weights.
// Bounds: SIMD groups past the last head (CUDA's surplus threads) return whole.
// Template constants: HEADS, KV_HEADS, HEAD_DIM, ROTARY, TRADITIONAL (0 or 1).
uint batch = uint(q_shape[0]);
uint tokens = uint(q_shape[1]);
uint group = thread_position_in_grid.x / 32u;
uint lane = thread_index_in_simdgroup;
if (group >= batch * tokens * uint(HEADS + KV_HEADS)) {
  return;
}
uint head = group % uint(HEADS + KV_HEADS);
uint row = group / uint(HEADS + KV_HEADS);  // b * tokens + t
bool is_q = head < uint(HEADS);
uint h = is_q ? head : head - uint(HEADS);
uint heads = is_q ? uint(HEADS) : uint(KV_HEADS);
const device float* source = (is_q ? q : k) + (size_t(row) * heads + h) * uint(HEAD_DIM);
const device float* weight = is_q ? q_weight : k_weight;
device float* target = (is_q ? q_out : k_out) +
                       ((size_t(row / tokens) * heads + h) * tokens + row % tokens) * uint(HEAD_DIM);
float squares = 0.0f;
for (uint e = lane; e < uint(HEAD_DIM); e += 32u) {
  squares += source[e] * source[e];
}
float scale = 1.0f / sqrt(simd_sum(squares) / float(HEAD_DIM) + eps[0]);
float position = float(int(start[0]) + int(row % tokens));
for (uint pair = lane; pair < uint(HEAD_DIM / 2); pair += 32u) {
  uint a = 2u * pair;  // TRADITIONAL, or a pass-through pair past ROTARY
  uint b = a + 1u;
  bool rotate = TRADITIONAL && a < uint(ROTARY);
  if (!TRADITIONAL && pair < uint(ROTARY / 2)) {
    a = pair;
    b = pair + uint(ROTARY / 2);
    rotate = true;
  } else if (!TRADITIONAL) {
    a = uint(ROTARY) + 2u * (pair - uint(ROTARY / 2));
    b = a + 1u;
  }
  float x0 = source[a] * scale * weight[a];
  float x1 = source[b] * scale * weight[b];
  if (rotate) {
    float angle = position * inv_freq[pair];
    float c = cos(angle);
    float s = sin(angle);
    target[a] = x0 * c - x1 * s;
    target[b] = x0 * s + x1 * c;
  } else {
    target[a] = x0;
    target[b] = x1;
  }
}
