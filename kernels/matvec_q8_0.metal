// kernel: matvec_q8_0
// inputs: weight x
// outputs: y
//
// y[t, r] = sum_e dequant(weight row r)[e] * x[t, e] for a Q8_0 weight, a few tokens (decode).
// weight: raw GGUF bytes [OUT, ROW_BYTES] uint8; x: [TOKENS, IN] f32; y: [TOKENS, OUT] f32.
// Grid: one threadgroup per ROWS consecutive output rows; its threads (a multiple of 32, at
// most 8 SIMD groups) stride the rows' units together. A unit is one 34-byte block (d, then
// 32 int8 quants) of each of the ROWS rows: consecutive threads read consecutive blocks. The
// thread loads the block's 32 values of x once (8 float4) and applies them to all ROWS rows.
// Blocks are 34 bytes, so quants are read as 2-byte pairs (every block starts on an even byte).
// Codes become floats without a conversion instruction: u = q + 128 (the sign bit flipped) is
// placed as 1 + u/256 (muser_unit_float), so with S = sum_i x_i over the block,
//   sum_i q_i x_i = 256 * sum_i (1 + u_i/256) x_i - 384 * S.
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
for (uint block_index = position; block_index < uint(IN / 32); block_index += threads) {
  float d[ROWS];
  uint words[ROWS * 8];  // [row][word]: quants 4w..4w+3, sign bits flipped
  for (int r = 0; r < ROWS; ++r) {
    uint row = min(first_row + uint(r), uint(OUT - 1));
    const device uint8_t* block = weight + size_t(row) * size_t(ROW_BYTES) + block_index * 34;
    const device ushort* pairs = (const device ushort*)(block + 2);
    d[r] = 256.0f * muser_f16(block);  // the 256 of 1 + u/256
    for (int word = 0; word < 8; ++word) {
      words[r * 8 + word] = (uint(pairs[2 * word]) | (uint(pairs[2 * word + 1]) << 16)) ^ 0x80808080u;
    }
  }
  for (int t = 0; t < TOKENS; ++t) {
    const device float4* xt = (const device float4*)(x + t * IN + block_index * 32);
    float4 xv[8];
    float x_sum = 0.0f;
    for (int word = 0; word < 8; ++word) {
      xv[word] = xt[word];
      x_sum += xv[word].x + xv[word].y + xv[word].z + xv[word].w;
    }
    for (int r = 0; r < ROWS; ++r) {
      float dot = 0.0f;
      for (int word = 0; word < 8; ++word) {
        uint bits = words[r * 8 + word];
        dot += muser_unit_float(muser_move(bits, 0, 15) & 0x007F8000u) * xv[word].x +
               muser_unit_float(muser_move(bits, 8, 15) & 0x007F8000u) * xv[word].y +
               muser_unit_float(muser_move(bits, 16, 15) & 0x007F8000u) * xv[word].z +
               muser_unit_float(muser_move(bits, 24, 15) & 0x007F8000u) * xv[word].w;
      }
      acc[t * ROWS + r] += d[r] * (dot - 1.5f * x_sum);
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
