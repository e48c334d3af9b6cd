// kernel: qk_norm_rope
// inputs: q k q_weight k_weight inv_freq start eps
// outputs: q_out k_out
//
// The tail of the q and k projections, fused: per head, RMS norm with its weight, then RoPE,
// written head-major for attention.
//   q_out[b, h, t, :] = rope(rms(q[b, t, h, :]) * q_weight, start + t)   (and k alike)
// q: [B, T, Q_STRIDE] with row t's heads at columns Q_OFF .. Q_OFF + HEADS * HEAD_DIM - 1;
// k: [B, T, K_STRIDE], its heads from column K_OFF (q and k may be one array: a prefill
// product's output, whose columns hold q, k, v and the gate); both float32 or both float16,
// read as float. q_weight, k_weight: [HEAD_DIM] f32; inv_freq: [ROTARY / 2] f32,
// base^(-2i / ROTARY); start: [1] int32, the position of row t = 0; eps: [1] f32. q_out:
// [B, HEADS, T, HEAD_DIM]; k_out: [B, KV_HEADS, T, HEAD_DIM], float32 or float16 (attention's
// dtype in a GPU prefill chunk), the same dtype, written through muser_store1. RoPE rotates pairs (2i, 2i+1) when TRADITIONAL (llama.cpp's NORM), else (i,
// i + ROTARY/2) (NEOX) by the angle (start + t) * inv_freq[i]; values past ROTARY pass through
// normed; ROTARY = 0: no RoPE (a full-attention Muse Glimmer layer).
// Grid: one 32-thread SIMD group per (b, t, head) of q then k: B * T * (HEADS + KV_HEADS)
// groups, 256 threads per threadgroup. The lanes share the head's sum of squares (simd_sum);
// each lane then writes whole rotation pairs.
// Replaces, for q and k each: the head split, its transpose, rms_norm and rope (8 MLX ops in
// one launch).
// Bytes per call: (HEADS + KV_HEADS) * B * T * HEAD_DIM values read and written, plus weights.
// Bounds: SIMD groups past the last head (CUDA's surplus threads) return whole.
// Template constants: HEADS, KV_HEADS, HEAD_DIM, ROTARY, TRADITIONAL (0 or 1), Q_STRIDE,
// K_STRIDE (values from one row of q or k to the next), Q_OFF, K_OFF (the heads' first column).
#include "lib/base.metal"
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
size_t at = size_t(row) * size_t(is_q ? Q_STRIDE : K_STRIDE) + uint(is_q ? Q_OFF : K_OFF) + h * uint(HEAD_DIM);
const device float* weight = is_q ? q_weight : k_weight;
size_t out_at = ((size_t(row / tokens) * heads + h) * tokens + row % tokens) * uint(HEAD_DIM);
float squares = 0.0f;
for (uint e = lane; e < uint(HEAD_DIM); e += 32u) {
  float v = is_q ? float(q[at + e]) : float(k[at + e]);
  squares += v * v;
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
  float x0 = (is_q ? float(q[at + a]) : float(k[at + a])) * scale * weight[a];
  float x1 = (is_q ? float(q[at + b]) : float(k[at + b])) * scale * weight[b];
  float y0 = x0;
  float y1 = x1;
  if (rotate) {
    float angle = position * inv_freq[pair];
    float c = cos(angle);
    float s = sin(angle);
    y0 = x0 * c - x1 * s;
    y1 = x0 * s + x1 * c;
  }
  muser_store1((is_q ? q_out : k_out) + out_at + a, y0);
  muser_store1((is_q ? q_out : k_out) + out_at + b, y1);
}
