// kernel: matvec_q4k
// inputs: weight x
// outputs: y
//
// y[t, r] = sum_e dequant(weight row r)[e] * x[t, e] for a Q4_K weight, a few tokens (decode).
// weight: raw GGUF bytes [OUT, ROW_BYTES] uint8; x: [TOKENS, IN] f32; y: [TOKENS, OUT] f32.
// Grid: one 32-thread SIMD group per ROWS consecutive output rows (32 * ceil(OUT / ROWS)
// threads), 8 SIMD groups per threadgroup. A lane's unit of work is 16 bytes of quants per
// row (one 16-byte load): the low nibbles are 16 values of sub-block 2g, the high nibbles 16
// values of sub-block 2g+1 of 64-value group g. The lane loads the matching 32 values of x
// once and applies them to all ROWS rows. Scales are unpacked once per unit and row, and the
// min term leaves the inner sum:
//   sum_i (d*sc*q_i - dmin*m) * x_i = d*sc * sum_i q_i*x_i - dmin*m * sum_i x_i.
// Bytes per call: OUT * ROW_BYTES + TOKENS * IN * 4 read, TOKENS * OUT * 4 written.
// Bounds: a SIMD group past OUT returns whole, before any shuffle; rows past OUT inside the
// last group re-read row OUT-1 and are never stored. Rows are whole super-blocks (the host
// checks), so every 16-byte and float4 load is aligned.
// Template constants: IN, ROW_BYTES, OUT, TOKENS (1..8), ROWS (rows per SIMD group).
uint first_row = (thread_position_in_grid.x / 32) * uint(ROWS);
uint lane = thread_index_in_simdgroup;
if (first_row >= uint(OUT)) {
  return;
}
float acc[TOKENS * ROWS];
for (int i = 0; i < TOKENS * ROWS; ++i) {
  acc[i] = 0.0f;
}
for (uint unit = lane; unit < uint(IN / 256 * 8); unit += 32) {
  uint super_block = unit / 8;
  uint group = (unit % 8) / 2;
  uint half_index = unit % 2;
  uint4 quants[ROWS];
  float low_d[ROWS];
  float low_m[ROWS];
  float high_d[ROWS];
  float high_m[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    uint row = min(first_row + uint(r), uint(OUT - 1));
    const device uint8_t* block = weight + size_t(row) * size_t(ROW_BYTES) + super_block * 144;
    float d = muser_f16(block);
    float dmin = muser_f16(block + 2);
    uint2 low_scale = muser_scale_min(block + 4, 2 * group);
    uint2 high_scale = muser_scale_min(block + 4, 2 * group + 1);
    low_d[r] = d * float(low_scale.x);
    low_m[r] = dmin * float(low_scale.y);
    high_d[r] = d * float(high_scale.x);
    high_m[r] = dmin * float(high_scale.y);
    quants[r] = *((const device uint4*)(block + 16 + 32 * group + 16 * half_index));
  }
  uint first = super_block * 256 + group * 64 + half_index * 16;
  for (int t = 0; t < TOKENS; ++t) {
    const device float* xt = x + t * IN + first;
    float4 xl[4];
    float4 xh[4];
    float sum_low = 0.0f;
    float sum_high = 0.0f;
    for (int word = 0; word < 4; ++word) {
      xl[word] = *((const device float4*)(xt + 4 * word));
      xh[word] = *((const device float4*)(xt + 32 + 4 * word));
      sum_low += xl[word].x + xl[word].y + xl[word].z + xl[word].w;
      sum_high += xh[word].x + xh[word].y + xh[word].z + xh[word].w;
    }
    for (int r = 0; r < ROWS; ++r) {
      float dot_low = 0.0f;
      float dot_high = 0.0f;
      for (int word = 0; word < 4; ++word) {
        uint bits = muser_word(quants[r], word);
        dot_low += float(bits & 15u) * xl[word].x + float((bits >> 8) & 15u) * xl[word].y +
                   float((bits >> 16) & 15u) * xl[word].z + float((bits >> 24) & 15u) * xl[word].w;
        dot_high += float((bits >> 4) & 15u) * xh[word].x + float((bits >> 12) & 15u) * xh[word].y +
                    float((bits >> 20) & 15u) * xh[word].z + float(bits >> 28) * xh[word].w;
      }
      acc[t * ROWS + r] += low_d[r] * dot_low - low_m[r] * sum_low + high_d[r] * dot_high -
                           high_m[r] * sum_high;
    }
  }
}
for (int t = 0; t < TOKENS; ++t) {
  for (int r = 0; r < ROWS; ++r) {
    float total = simd_sum(acc[t * ROWS + r]);
    if (lane == 0 && first_row + uint(r) < uint(OUT)) {
      y[t * OUT + first_row + r] = total;
    }
  }
}
