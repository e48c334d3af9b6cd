// kernel: matvec_q6k
// inputs: weight x
// outputs: y
//
// y[t, r] = sum_e dequant(weight row r)[e] * x[t, e] for a Q6_K weight, a few tokens (decode).
// weight: raw GGUF bytes [OUT, ROW_BYTES] uint8; x: [TOKENS, IN] f32; y: [TOKENS, OUT] f32.
// A Q6_K super-block (210 bytes): ql[128] low nibbles | qh[64] high bit pairs | scales int8[16]
// | d f16. Value w = 128h + 32q + l (half h, quarter q, position l < 32) takes the low or high
// nibble (q / 2) of ql[64h + 32(q % 2) + l] and bits 2q..2q+1 of qh[32h + l]; its scale is
// scales[w / 16]; value = d * scale * (q6 - 32).
// Grid: one 32-thread SIMD group per ROWS consecutive output rows, 8 SIMD groups per
// threadgroup. A lane's unit of work is 4 consecutive positions l0..l0+3 of one half of one
// super-block, all four quarters: 16 values from 4 + 4 ql bytes and 4 qh bytes, 4 scales. Its
// 16 values of x (4 float4) are loaded once and applied to all ROWS rows; the -32 offset leaves
// the inner sum: sum (q - 32) x = sum q x - 32 sum x.
// Bytes per call: OUT * ROW_BYTES + TOKENS * IN * 4 read, TOKENS * OUT * 4 written.
// Bounds: a SIMD group past OUT returns whole, before any shuffle; rows past OUT inside the
// last group re-read row OUT-1 and are never stored.
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
for (uint unit = lane; unit < uint(IN / 256 * 16); unit += 32) {
  uint super_block = unit / 16;
  uint half_index = (unit % 16) / 8;
  uint l0 = (unit % 8) * 4;
  uint q6[ROWS * 16];  // [row][quarter * 4 + i]
  float scale[ROWS * 4];  // d * scales[...] per row and quarter
  for (int r = 0; r < ROWS; ++r) {
    uint row = min(first_row + uint(r), uint(OUT - 1));
    const device uint8_t* block = weight + size_t(row) * size_t(ROW_BYTES) + super_block * 210;
    float d = muser_f16(block + 208);
    for (int quarter = 0; quarter < 4; ++quarter) {
      scale[r * 4 + quarter] = d * float(int8_t(block[192 + 8 * half_index + 2 * quarter + l0 / 16]));
    }
    for (int i = 0; i < 4; ++i) {
      uint low_a = uint(block[64 * half_index + l0 + i]);
      uint low_b = uint(block[64 * half_index + 32 + l0 + i]);
      uint high = uint(block[128 + 32 * half_index + l0 + i]);
      q6[r * 16 + 0 + i] = (low_a & 15u) | ((high & 3u) << 4);
      q6[r * 16 + 4 + i] = (low_b & 15u) | (((high >> 2) & 3u) << 4);
      q6[r * 16 + 8 + i] = (low_a >> 4) | (((high >> 4) & 3u) << 4);
      q6[r * 16 + 12 + i] = (low_b >> 4) | ((high >> 6) << 4);
    }
  }
  uint first = super_block * 256 + half_index * 128 + l0;
  for (int t = 0; t < TOKENS; ++t) {
    float4 xv[4];
    float x_sum[4];
    for (int quarter = 0; quarter < 4; ++quarter) {
      xv[quarter] = *((const device float4*)(x + t * IN + first + 32 * quarter));
      x_sum[quarter] = xv[quarter].x + xv[quarter].y + xv[quarter].z + xv[quarter].w;
    }
    for (int r = 0; r < ROWS; ++r) {
      float total = 0.0f;
      for (int quarter = 0; quarter < 4; ++quarter) {
        const int base = r * 16 + quarter * 4;
        float dot = float(q6[base]) * xv[quarter].x + float(q6[base + 1]) * xv[quarter].y +
                    float(q6[base + 2]) * xv[quarter].z + float(q6[base + 3]) * xv[quarter].w;
        total += scale[r * 4 + quarter] * (dot - 32.0f * x_sum[quarter]);
      }
      acc[t * ROWS + r] += total;
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
