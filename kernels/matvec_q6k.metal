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
// Grid: one threadgroup per ROWS consecutive output rows; its threads (a multiple of 32, at
// most 8 SIMD groups) stride the rows' units together. A unit is 8 consecutive positions
// l0..l0+7 (l0 a multiple of 8) of one half of one super-block, all four quarters: 32 values
// from 8 + 8 ql bytes and 8 qh bytes, read as 2-byte pairs (a super-block is 210 bytes, so
// only 2-byte alignment holds), and 4 scales. Its 32 values of x (8 float4) are loaded once
// and applied to all ROWS rows. Codes become floats without a conversion instruction
// (muser_unit_float: 1 + q6/64), so with S = sum_i x_i over a quarter's 8 values,
//   sum_i (q6_i - 32) x_i = 64 * sum_i (1 + q6_i/64) x_i - 96 * S.
// Each SIMD group sums its lanes (simd_sum); threadgroup memory adds the SIMD groups.
// Bytes per call: OUT * ROW_BYTES + TOKENS * IN * 4 read, TOKENS * OUT * 4 written.
// Bounds: a threadgroup past OUT returns whole, before any barrier; rows past OUT in the last
// threadgroup re-read row OUT-1 and are never stored.
// Template constants: IN, ROW_BYTES, OUT, TOKENS (1..8), ROWS (rows per threadgroup).
threadgroup float partial[8 * TOKENS * ROWS];
uint first_row = threadgroup_position_in_grid.x * uint(ROWS);
uint position = thread_position_in_threadgroup.x;
uint threads = threads_per_threadgroup.x;
if (first_row >= uint(OUT)) {
  return;
}
float acc[TOKENS * ROWS];
for (int i = 0; i < TOKENS * ROWS; ++i) {
  acc[i] = 0.0f;
}
for (uint unit = position; unit < uint(IN / 32); unit += threads) {
  uint super_block = unit / 8;
  uint half_index = (unit % 8) / 4;
  uint l0 = (unit % 4) * 8;
  uint low_a[ROWS * 2];  // ql bytes of quarters 0 (low nibbles) and 2 (high), 4 per word
  uint low_b[ROWS * 2];  // ql bytes of quarters 1 and 3
  uint high[ROWS * 2];   // qh bytes: bit pair q of each byte belongs to quarter q
  float scale[ROWS * 4];  // 64 * d * scales[...] per row and quarter
  for (int r = 0; r < ROWS; ++r) {
    uint row = min(first_row + uint(r), uint(OUT - 1));
    const device uint8_t* block = weight + size_t(row) * size_t(ROW_BYTES) + super_block * 210;
    const device ushort* pairs_a = (const device ushort*)(block + 64 * half_index + l0);
    const device ushort* pairs_b = (const device ushort*)(block + 64 * half_index + 32 + l0);
    const device ushort* pairs_h = (const device ushort*)(block + 128 + 32 * half_index + l0);
    for (int word = 0; word < 2; ++word) {
      low_a[r * 2 + word] = uint(pairs_a[2 * word]) | (uint(pairs_a[2 * word + 1]) << 16);
      low_b[r * 2 + word] = uint(pairs_b[2 * word]) | (uint(pairs_b[2 * word + 1]) << 16);
      high[r * 2 + word] = uint(pairs_h[2 * word]) | (uint(pairs_h[2 * word + 1]) << 16);
    }
    float d = 64.0f * muser_f16(block + 208);  // the 64 of 1 + q6/64
    for (int quarter = 0; quarter < 4; ++quarter) {
      scale[r * 4 + quarter] = d * float(int8_t(block[192 + 8 * half_index + 2 * quarter + l0 / 16]));
    }
  }
  uint first = super_block * 256 + half_index * 128 + l0;
  for (int t = 0; t < TOKENS; ++t) {
    float4 xv[8];  // [quarter * 2 + word]: x at first + 32 * quarter + 4 * word .. + 3
    float x_sum[4];
    for (int quarter = 0; quarter < 4; ++quarter) {
      xv[2 * quarter] = *((const device float4*)(x + t * IN + first + 32 * quarter));
      xv[2 * quarter + 1] = *((const device float4*)(x + t * IN + first + 32 * quarter + 4));
      x_sum[quarter] = xv[2 * quarter].x + xv[2 * quarter].y + xv[2 * quarter].z + xv[2 * quarter].w +
                       xv[2 * quarter + 1].x + xv[2 * quarter + 1].y + xv[2 * quarter + 1].z +
                       xv[2 * quarter + 1].w;
    }
    for (int r = 0; r < ROWS; ++r) {
      float total = 0.0f;
      for (int quarter = 0; quarter < 4; ++quarter) {
        // quarter 0: low nibbles of ql_a, 1: low of ql_b, 2: high of ql_a, 3: high of ql_b
        const int nibble = 4 * (quarter / 2);
        float dot = 0.0f;
        for (int word = 0; word < 2; ++word) {
          uint low = quarter % 2 == 0 ? low_a[r * 2 + word] : low_b[r * 2 + word];
          uint bits = high[r * 2 + word];
          float4 xq = xv[2 * quarter + word];
          dot += muser_unit_float((muser_move(low, nibble, 17) & 0x001E0000u) |
                                  (muser_move(bits, 2 * quarter, 21) & 0x00600000u)) * xq.x +
                 muser_unit_float((muser_move(low, 8 + nibble, 17) & 0x001E0000u) |
                                  (muser_move(bits, 8 + 2 * quarter, 21) & 0x00600000u)) * xq.y +
                 muser_unit_float((muser_move(low, 16 + nibble, 17) & 0x001E0000u) |
                                  (muser_move(bits, 16 + 2 * quarter, 21) & 0x00600000u)) * xq.z +
                 muser_unit_float((muser_move(low, 24 + nibble, 17) & 0x001E0000u) |
                                  (muser_move(bits, 24 + 2 * quarter, 21) & 0x00600000u)) * xq.w;
        }
        total += scale[r * 4 + quarter] * (dot - 1.5f * x_sum[quarter]);
      }
      acc[t * ROWS + r] += total;
    }
  }
}
muser_threadgroup_sum<TOKENS * ROWS>(acc, partial, position, threads);
for (uint i = position; i < uint(TOKENS * ROWS); i += threads) {  // partial[t * ROWS + r]
  uint row = first_row + i % uint(ROWS);
  if (row < uint(OUT)) {
    y[(i / uint(ROWS)) * uint(OUT) + row] = partial[i];
  }
}
