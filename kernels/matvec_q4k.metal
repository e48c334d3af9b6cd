// kernel: matvec_q4k
// inputs: weight x
// outputs: y
//
// y[t, r] = sum_e dequant(weight row r)[e] * x[t, e] for a Q4_K weight, a few tokens (decode).
// weight: raw GGUF bytes [OUT, ROW_BYTES] uint8; x: [TOKENS, IN] f32; y: [TOKENS, OUT] f32.
// Grid: one threadgroup per ROWS consecutive output rows; its threads (a multiple of 32, at
// most 8 SIMD groups) stride the rows' units together, so even a short row keeps a whole
// threadgroup of loads in flight. A unit is 16 bytes of quants per row (one 16-byte load): the
// low nibbles are 16 values of sub-block 2g, the high nibbles 16 values of sub-block 2g+1 of
// 64-value group g. The thread loads the matching 32 values of x once and applies them to all
// ROWS rows; each row's super-block header (d, dmin, 12 scale bytes) is one more 16-byte load.
// Codes become floats without a conversion instruction (muser_unit_float: 1 + q/16), and
// the min term leaves the inner sum:
//   sum_i (d*sc*q_i - dmin*m) * x_i = d*sc*16 * (sum_i (1 + q_i/16) x_i - sum_i x_i) - dmin*m * sum_i x_i.
// Each SIMD group sums its lanes (simd_sum); threadgroup memory adds the SIMD groups.
// Bytes per call: OUT * ROW_BYTES + TOKENS * IN * 4 read, TOKENS * OUT * 4 written.
// Bounds: a threadgroup past OUT returns whole, before any barrier; rows past OUT in the last
// threadgroup re-read row OUT-1 and are never stored. Rows are whole super-blocks (the host
// checks), so every 16-byte and float4 load is aligned.
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
    uint4 head = *((const device uint4*)block);
    float d = 16.0f * muser_half_low(head.x);  // the 16 of 1 + q/16
    float dmin = muser_half_high(head.x);
    uint2 low_scale = muser_scale_min_words(head.y, head.z, head.w, 2 * group);
    uint2 high_scale = muser_scale_min_words(head.y, head.z, head.w, 2 * group + 1);
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
        dot_low += muser_unit_float(muser_move(bits, 0, 19) & 0x00780000u) * xl[word].x +
                   muser_unit_float(muser_move(bits, 8, 19) & 0x00780000u) * xl[word].y +
                   muser_unit_float(muser_move(bits, 16, 19) & 0x00780000u) * xl[word].z +
                   muser_unit_float(muser_move(bits, 24, 19) & 0x00780000u) * xl[word].w;
        dot_high += muser_unit_float(muser_move(bits, 4, 19) & 0x00780000u) * xh[word].x +
                    muser_unit_float(muser_move(bits, 12, 19) & 0x00780000u) * xh[word].y +
                    muser_unit_float(muser_move(bits, 20, 19) & 0x00780000u) * xh[word].z +
                    muser_unit_float(muser_move(bits, 28, 19) & 0x00780000u) * xh[word].w;
      }
      acc[t * ROWS + r] += low_d[r] * (dot_low - sum_low) - low_m[r] * sum_low +
                           high_d[r] * (dot_high - sum_high) - high_m[r] * sum_high;
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
