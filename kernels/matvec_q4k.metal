// kernel: matvec_q4k
// inputs: weight x
// outputs: y
//
// y[t, r] = sum_e dequant(weight row r)[e] * x[t, e] for a Q4_K weight, a few tokens (decode).
// weight: raw GGUF bytes [OUT, ROW_BYTES] uint8; x: [TOKENS, IN] f32; y: [TOKENS, OUT] f32.
// Grid: one 32-thread SIMD group per output row, 8 rows per threadgroup. A lane's unit of
// work is 16 bytes of quants (one 16-byte load): the low nibbles are 16 values of sub-block
// 2g, the high nibbles 16 values of sub-block 2g+1 of 64-value group g. Scales are unpacked
// once per unit and the min term leaves the inner sum:
//   sum_i (d*sc*q_i - dmin*m) * x_i = d*sc * sum_i q_i*x_i - dmin*m * sum_i x_i.
// Bytes per call: OUT * ROW_BYTES + TOKENS * IN * 4 read (x from cache), TOKENS * OUT * 4 written.
// Bounds: a SIMD group past OUT returns whole, before any shuffle. Rows are whole super-blocks
// (the host checks), so every 16-byte and float4 load is aligned.
// Template constants: IN, ROW_BYTES, OUT, TOKENS (1..8).
uint row = thread_position_in_grid.x / 32;
uint lane = thread_index_in_simdgroup;
if (row >= uint(OUT)) {
  return;
}
const device uint8_t* w = weight + size_t(row) * size_t(ROW_BYTES);
float acc[TOKENS];
for (int t = 0; t < TOKENS; ++t) {
  acc[t] = 0.0f;
}
for (uint unit = lane; unit < uint(IN / 256 * 8); unit += 32) {
  uint super_block = unit / 8;
  uint group = (unit % 8) / 2;
  uint half_index = unit % 2;
  const device uint8_t* block = w + super_block * 144;
  float d = muser_f16(block);
  float dmin = muser_f16(block + 2);
  uint2 low_scale = muser_scale_min(block + 4, 2 * group);
  uint2 high_scale = muser_scale_min(block + 4, 2 * group + 1);
  uint4 quants = *((const device uint4*)(block + 16 + 32 * group + 16 * half_index));
  uint first = super_block * 256 + group * 64 + half_index * 16;
  for (int t = 0; t < TOKENS; ++t) {
    const device float* xt = x + t * IN + first;
    float dot_low = 0.0f;
    float dot_high = 0.0f;
    float sum_low = 0.0f;
    float sum_high = 0.0f;
    for (int word = 0; word < 4; ++word) {
      uint bits = muser_word(quants, word);
      float4 xl = *((const device float4*)(xt + 4 * word));
      float4 xh = *((const device float4*)(xt + 32 + 4 * word));
      dot_low += float(bits & 15u) * xl.x + float((bits >> 8) & 15u) * xl.y +
                 float((bits >> 16) & 15u) * xl.z + float((bits >> 24) & 15u) * xl.w;
      dot_high += float((bits >> 4) & 15u) * xh.x + float((bits >> 12) & 15u) * xh.y +
                  float((bits >> 20) & 15u) * xh.z + float(bits >> 28) * xh.w;
      sum_low += xl.x + xl.y + xl.z + xl.w;
      sum_high += xh.x + xh.y + xh.z + xh.w;
    }
    acc[t] += d * float(low_scale.x) * dot_low - dmin * float(low_scale.y) * sum_low +
              d * float(high_scale.x) * dot_high - dmin * float(high_scale.y) * sum_high;
  }
}
for (int t = 0; t < TOKENS; ++t) {
  float total = simd_sum(acc[t]);
  if (lane == 0) {
    y[t * OUT + row] = total;
  }
}
