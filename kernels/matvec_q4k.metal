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
// the matching 64 values of x once per token and applies them to all ROWS rows.
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
  uint4 quants[2 * ROWS];  // row r: quants[2r] holds bytes 0-15 of the group, quants[2r+1] 16-31
  float4 factors[ROWS];    // row r: (d * scale a, dmin * min a, d * scale b, dmin * min b)
  for (int r = 0; r < ROWS; ++r) {
    uint row = min(first_row + uint(r), uint(OUT - 1));
    const device uint8_t* block = weight + size_t(row) * size_t(ROW_BYTES) + super_block * 144;
    uint4 head = *((const device uint4*)block);
    float d = muser_half_low(head.x);
    float dmin = muser_half_high(head.x);
    uint4 pairs = muser_q4k_group_scales(head.y, head.z, head.w, group);
    factors[r] = float4(d * float(pairs.x), dmin * float(pairs.y), d * float(pairs.z), dmin * float(pairs.w));
    quants[2 * r] = *((const device uint4*)(block + 16 + 32 * group));
    quants[2 * r + 1] = *((const device uint4*)(block + 32 + 32 * group));
  }
  const device float* xg = x + super_block * 256 + group * 64;
  float sum_a[TOKENS];
  float sum_b[TOKENS];
  float dot_a[TOKENS * ROWS];
  float dot_b[TOKENS * ROWS];
  for (int i = 0; i < TOKENS * ROWS; ++i) {
    dot_a[i] = 0.0f;
    dot_b[i] = 0.0f;
  }
  for (int t = 0; t < TOKENS; ++t) {
    sum_a[t] = 0.0f;
    sum_b[t] = 0.0f;
  }
  for (int word = 0; word < 8; ++word) {  // quant bytes 4 * word .. 4 * word + 3
    float4 xa[TOKENS];
    float4 xb[TOKENS];
    for (int t = 0; t < TOKENS; ++t) {
      xa[t] = *((const device float4*)(xg + t * IN + 4 * word));
      xb[t] = *((const device float4*)(xg + t * IN + 32 + 4 * word));
      sum_a[t] += (xa[t].x + xa[t].y) + (xa[t].z + xa[t].w);
      sum_b[t] += (xb[t].x + xb[t].y) + (xb[t].z + xb[t].w);
    }
    for (int r = 0; r < ROWS; ++r) {
      uint bits = muser_word(quants[2 * r + word / 4], word % 4);
      uint middle = bits >> 8;
      uint top = bits >> 16;
      float4 a = float4(muser_code4<0>(bits), muser_code4<8>(bits), muser_code4<16>(bits), muser_code4<16>(middle));
      float4 b = float4(muser_code4<4>(bits), muser_code4<12>(bits), muser_code4<12>(middle), muser_code4<12>(top));
      for (int t = 0; t < TOKENS; ++t) {
        dot_a[t * ROWS + r] += a.x * xa[t].x + a.y * xa[t].y + a.z * xa[t].z + a.w * xa[t].w;
        dot_b[t * ROWS + r] += b.x * xb[t].x + b.y * xb[t].y + b.z * xb[t].z + b.w * xb[t].w;
      }
    }
  }
  for (int t = 0; t < TOKENS; ++t) {
    for (int r = 0; r < ROWS; ++r) {
      float4 f = factors[r];
      acc[t * ROWS + r] += f.x * dot_a[t * ROWS + r] - f.y * sum_a[t] + f.z * dot_b[t * ROWS + r] - f.w * sum_b[t];
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
