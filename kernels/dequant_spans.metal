// kernel: dequant_spans
// inputs: weight
// outputs: values
//
// values[r, e] = dequant(weight row r)[e], as kernel dequant_rows (the same expression for
// each value, so the same bits), with each lane's values consecutive: a whole matrix decoded
// for a prefill chunk's matmul, bound by its writes (f16 output is 3.6x the bytes of Q4_K).
// weight: raw GGUF bytes [OUT, ROW_BYTES] uint8; values: [OUT, IN] f16 (or f32).
// Grid: one 32-thread SIMD group per span of 256 values of a row (OUT * SPANS * 32 threads,
// SPANS = ceil(IN / 256)); lane l decodes values 8l .. 8l + 7 of its span from 8 consecutive
// quant bytes (two word loads) and writes them with one 16-byte store (two for f32), where
// dequant_rows' lanes write 2-byte values 64 bytes apart. A span is one Q4_K/Q6_K super-block
// or 8 Q8_0 blocks; other formats decode element by element (muser_value).
// Bytes per call: OUT * ROW_BYTES read, OUT * IN * sizeof(values) written.
// Bounds: threads past OUT * SPANS * 32 (CUDA's surplus) return at once; lanes whose values lie
// past IN in a row's last span (IN a multiple of 32 but not of 256) store nothing.
// Template constants: FORMAT (ggml type id), IN, ROW_BYTES, OUT.
const uint SPANS = (uint(IN) + 255u) / 256u;
uint index = thread_position_in_grid.x;
uint lane = index % 32u;
uint span = (index / 32u) % SPANS;
uint row = index / 32u / SPANS;
if (row >= uint(OUT) || span * 256u + 8u * lane >= uint(IN)) {
  return;
}
const device uint8_t* row_bytes = weight + size_t(row) * size_t(ROW_BYTES);
size_t first = size_t(row) * size_t(IN) + span * 256u + 8u * lane;  // value 8l of the span
float v[8];
if (FORMAT == MUSER_Q4_K) {
  // Values 64g + 32h + j0 .. + 7 (g = l / 8, h = (l % 8) / 4, j0 = 8 (l % 4)): nibble h of
  // quant bytes 32g + j0 .. + 7, sub-block 2g + h.
  const device uint8_t* block = row_bytes + span * 144;
  uint group = lane / 8u;
  uint h = (lane % 8u) / 4u;
  uint4 head = *((const device uint4*)block);
  uint2 quants = *((const device uint2*)(block + 16u + 32u * group + 8u * (lane % 4u)));
  float d = 16.0f * muser_half_low(head.x);  // the 16 of 1 + q/16
  float dmin = muser_half_high(head.x);
  uint2 scale_min = muser_scale_min_words(head.y, head.z, head.w, 2u * group + h);
  for (int i = 0; i < 8; ++i) {
    uint word = i < 4 ? quants.x : quants.y;
    float code = muser_unit_float((word >> (8u * uint(i % 4) + 4u * h) << 19) & 0x00780000u);
    v[i] = d * float(scale_min.x) * (code - 1.0f) - dmin * float(scale_min.y);
  }
} else if (FORMAT == MUSER_Q6_K) {
  // Values 128hh + 32q + l0 .. + 7 (hh = l / 16, q = (l % 16) / 4, l0 = 8 (l % 4)): nibble q / 2
  // of ql[64hh + 32 (q % 2) + l0 ..], bits 2q, 2q+1 of qh[32hh + l0 ..], scale 8hh + 2q + l0 / 16.
  size_t block = size_t(row) * size_t(ROW_BYTES) + size_t(span) * 210u;
  uint hh = lane / 16u;
  uint q = (lane % 16u) / 4u;
  uint l0 = 8u * (lane % 4u);
  uint2 low = muser_words2(weight, block + 64u * hh + 32u * (q % 2u) + l0);
  uint2 high = muser_words2(weight, block + 128u + 32u * hh + l0);
  float d = 64.0f * muser_f16(weight + block + 208u);  // the 64 of 1 + q6/64
  float scale = float(int8_t(weight[block + 192u + 8u * hh + 2u * q + l0 / 16u]));
  for (int i = 0; i < 8; ++i) {
    uint low_word = i < 4 ? low.x : low.y;
    uint high_word = i < 4 ? high.x : high.y;
    uint shift = 8u * uint(i % 4);
    float code = muser_unit_float(((low_word >> (shift + 4u * (q / 2u)) << 17) & 0x001E0000u) |
                                  ((high_word >> (shift + 2u * q) << 21) & 0x00600000u));
    v[i] = d * scale * (code - 1.5f);
  }
} else if (FORMAT == MUSER_Q8_0) {
  // Values 32k + j0 .. + 7 of the span (k = l / 4, j0 = 8 (l % 4)): quants j0 .. of block 8 span + k.
  size_t block = size_t(row) * size_t(ROW_BYTES) + size_t(span * 8u + lane / 4u) * 34u;
  // Four 2-byte loads (a block is 2-byte aligned; three words could read past the last block).
  const device ushort* pairs = (const device ushort*)(weight + block + 2u + 8u * (lane % 4u));
  uint2 quants = uint2(uint(pairs[0]) | (uint(pairs[1]) << 16), uint(pairs[2]) | (uint(pairs[3]) << 16));
  float d = 256.0f * muser_f16(weight + block);
  for (int i = 0; i < 8; ++i) {
    uint word = i < 4 ? quants.x : quants.y;
    float code = muser_unit_float((((word >> (8u * uint(i % 4))) & 255u) ^ 128u) << 15);
    v[i] = d * (code - 1.5f);
  }
} else {
  for (int i = 0; i < 8; ++i) {
    v[i] = muser_value<FORMAT>(row_bytes, span * 256u + 8u * lane + uint(i));
  }
}
muser_store8(values + first, v);
