// kernel: matvec_q4k
// inputs: weight x
// outputs: y
//
// y[t, r] = sum_e dequant(weight row r)[e] * x[t, e] for a Q4_K weight, a few tokens (decode).
// weight: raw GGUF bytes [OUT, ROW_BYTES] uint8; x: [TOKENS, IN] f32; y: [TOKENS, OUT] f32.
// Grid: one threadgroup per ROWS consecutive output rows; its threads (a multiple of 32, at
// most 8 SIMD groups) stride the rows' units together, so even a short row keeps a whole
// threadgroup of loads in flight. A unit is one 64-value group g of a super-block: 32 bytes
// of quants per row (two 16-byte loads) whose low nibbles are sub-block 2g ("a") and high
// nibbles sub-block 2g+1 ("b"), and one 16-byte load of the super-block's header (d, dmin,
// 12 scale bytes) whose two scale/min pairs are decoded once per 64 values. The thread loads
// the matching 64 values of x into registers once per token and streams the ROWS rows past
// them: x is read from cache once per ROWS rows, and that traffic, not DRAM, bounded the
// previous version (ncu: L1 throughput 89 %, DRAM 36 %, at 4 rows per threadgroup).
// The work per value is what bounds this kernel (integer instructions run at half the FMA
// rate): a code becomes an exact float with one logic instruction and one FMA
// (muser_code4), and byte k of a quant word puts code a[4i+k] at bits 8k and b[4i+k] at
// 8k+4, so only the codes above bit 19 need a shift (two per word). The min term leaves the
// inner sum:  sum_i (d*sc*q_i - dmin*m) * x_i = d*sc * sum_i q_i x_i - dmin*m * sum_i x_i.
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
for (uint unit = position; unit < uint(IN / 64); unit += threads) {
  uint super_block = unit / 4;
  uint group = unit % 4;
  for (int t = 0; t < TOKENS; ++t) {
    // x of this unit: loaded once, kept in registers for all ROWS rows.
    const device float* xg = x + t * IN + super_block * 256 + group * 64;
    float4 xa[8];
    float4 xb[8];
    float sum_a = 0.0f;
    float sum_b = 0.0f;
    for (int word = 0; word < 8; ++word) {
      xa[word] = *((const device float4*)(xg + 4 * word));
      xb[word] = *((const device float4*)(xg + 32 + 4 * word));
      sum_a += (xa[word].x + xa[word].y) + (xa[word].z + xa[word].w);
      sum_b += (xb[word].x + xb[word].y) + (xb[word].z + xb[word].w);
    }
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      uint row = min(first_row + uint(r), uint(OUT - 1));
      const device uint8_t* block = weight + size_t(row) * size_t(ROW_BYTES) + super_block * 144;
      uint4 head = *((const device uint4*)block);
      uint4 low = *((const device uint4*)(block + 16 + 32 * group));   // quant bytes 0-15
      uint4 high = *((const device uint4*)(block + 32 + 32 * group));  // quant bytes 16-31
      float d = muser_half_low(head.x);
      float dmin = muser_half_high(head.x);
      uint4 pairs = muser_q4k_group_scales(head.y, head.z, head.w, group);
      float dot_a = 0.0f;
      float dot_b = 0.0f;
      for (int word = 0; word < 8; ++word) {  // quant bytes 4 * word .. 4 * word + 3
        uint bits = muser_word(word < 4 ? low : high, word % 4);
        uint middle = bits >> 8;
        uint top = bits >> 16;
        dot_a += muser_code4<0>(bits) * xa[word].x + muser_code4<8>(bits) * xa[word].y +
                 muser_code4<16>(bits) * xa[word].z + muser_code4<16>(middle) * xa[word].w;
        dot_b += muser_code4<4>(bits) * xb[word].x + muser_code4<12>(bits) * xb[word].y +
                 muser_code4<12>(middle) * xb[word].z + muser_code4<12>(top) * xb[word].w;
      }
      acc[t * ROWS + r] += d * (float(pairs.x) * dot_a + float(pairs.z) * dot_b) -
                           dmin * (float(pairs.y) * sum_a + float(pairs.w) * sum_b);
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
