// kernel: matvec_q8_0
// inputs: weight x
// outputs: y
//
// y[t, r] = sum_e dequant(weight row r)[e] * x[t, e] for a Q8_0 weight, a few tokens (decode).
// weight: raw GGUF bytes [OUT, ROW_BYTES] uint8; x: [TOKENS, IN] f32; y: [TOKENS, OUT] f32.
// Grid: one 32-thread SIMD group per ROWS consecutive output rows (32 * ceil(OUT / ROWS)
// threads), 8 SIMD groups per threadgroup. A lane's unit of work is one 34-byte block (d, then
// 32 int8 quants) of each of its ROWS rows: consecutive lanes read consecutive blocks, so a
// SIMD group streams 32 * 34 contiguous bytes per row and step. The lane loads the block's 32
// values of x once (8 float4) and applies them to all ROWS rows: sum = d * sum_i q_i * x_i.
// Blocks are 34 bytes, so quants are read as 2-byte pairs (every block starts on an even byte).
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
for (uint block_index = lane; block_index < uint(IN / 32); block_index += 32) {
  float d[ROWS];
  const device ushort* pairs[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    uint row = min(first_row + uint(r), uint(OUT - 1));
    const device uint8_t* block = weight + size_t(row) * size_t(ROW_BYTES) + block_index * 34;
    d[r] = muser_f16(block);
    pairs[r] = (const device ushort*)(block + 2);
  }
  for (int t = 0; t < TOKENS; ++t) {
    const device float4* xt = (const device float4*)(x + t * IN + block_index * 32);
    float4 xv[8];
    for (int word = 0; word < 8; ++word) {
      xv[word] = xt[word];
    }
    for (int r = 0; r < ROWS; ++r) {
      float dot = 0.0f;
      for (int word = 0; word < 8; ++word) {
        uint low = uint(pairs[r][2 * word]);
        uint high = uint(pairs[r][2 * word + 1]);
        dot += float(int8_t(low & 255u)) * xv[word].x + float(int8_t(low >> 8)) * xv[word].y +
               float(int8_t(high & 255u)) * xv[word].z + float(int8_t(high >> 8)) * xv[word].w;
      }
      acc[t * ROWS + r] += d[r] * dot;
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
