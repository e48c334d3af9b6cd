// kernel: dequant_rows
// inputs: weight
// outputs: values
//
// values[r, e] = dequant(weight row r)[e]: a whole matrix decoded, for a prefill chunk's
// matmul (the decode is shared by all rows of the chunk).
// weight: raw GGUF bytes [OUT, ROW_BYTES] uint8; values: [OUT, IN] f16 (or f32).
// Grid: one thread per 32-value unit of a row (OUT * UNITS threads, UNITS = ceil(IN / 32)),
// 256 per threadgroup; consecutive threads take consecutive units of a row.
// Q4_K, Q6_K and Q8_0 decode a unit from whole words, as the matvec kernels read it (their
// headers say how): the scales once per unit, and each code made a float without a conversion
// instruction (muser_unit_float); (1 + q / 2^b) - 1 and the offsets are exact, so a value is
// A * (code - offset) + B with one rounding in each step. Every other format decodes element
// by element (muser_value).
// Bytes per call: OUT * ROW_BYTES read, OUT * IN * sizeof(values) written.
// Bounds: threads past OUT * UNITS (CUDA's surplus) return at once; a unit past the row's end
// (F32/F16/BF16 rows need not be multiples of 32) stops at IN.
// Template constants: FORMAT (ggml type id), IN, ROW_BYTES, OUT.
const uint UNITS = (uint(IN) + 31u) / 32u;
uint index = thread_position_in_grid.x;
if (index >= uint(OUT) * UNITS) {
  return;
}
uint row = index / UNITS;
uint unit = index % UNITS;
const device uint8_t* row_bytes = weight + size_t(row) * size_t(ROW_BYTES);
size_t out = size_t(row) * size_t(IN);
if (FORMAT == MUSER_Q4_K) {
  uint super_block = unit / 8;
  uint group = (unit % 8) / 2;
  uint half_index = unit % 2;
  const device uint8_t* block = row_bytes + super_block * 144;
  uint4 head = *((const device uint4*)block);
  float d = 16.0f * muser_half_low(head.x);
  float dmin = muser_half_high(head.x);
  uint2 low_scale = muser_scale_min_words(head.y, head.z, head.w, 2 * group);
  uint2 high_scale = muser_scale_min_words(head.y, head.z, head.w, 2 * group + 1);
  // d*sc*q - dmin*m = A * ((1 + q/16) - 1) + B with A = 16*d*sc, B = -dmin*m
  float low_a = d * float(low_scale.x);
  float low_b = -dmin * float(low_scale.y);
  float high_a = d * float(high_scale.x);
  float high_b = -dmin * float(high_scale.y);
  uint4 quants = *((const device uint4*)(block + 16 + 32 * group + 16 * half_index));
  size_t first = out + super_block * 256 + group * 64 + half_index * 16;
  for (int word = 0; word < 4; ++word) {
    uint bits = muser_word(quants, word);
    for (int k = 0; k < 4; ++k) {
      values[first + 4 * word + k] =
          low_a * (muser_unit_float(muser_move(bits, 8 * k, 19) & 0x00780000u) - 1.0f) + low_b;
      values[first + 32 + 4 * word + k] =
          high_a * (muser_unit_float(muser_move(bits, 8 * k + 4, 19) & 0x00780000u) - 1.0f) + high_b;
    }
  }
} else if (FORMAT == MUSER_Q6_K) {
  uint super_block = unit / 8;
  uint half_index = (unit % 8) / 4;
  uint l0 = (unit % 4) * 8;
  const device uint8_t* block = row_bytes + super_block * 210;
  const device ushort* pairs_a = (const device ushort*)(block + 64 * half_index + l0);
  const device ushort* pairs_b = (const device ushort*)(block + 64 * half_index + 32 + l0);
  const device ushort* pairs_h = (const device ushort*)(block + 128 + 32 * half_index + l0);
  float d = 64.0f * muser_f16(block + 208);
  size_t first = out + super_block * 256 + half_index * 128 + l0;
  for (int word = 0; word < 2; ++word) {
    uint low_a = uint(pairs_a[2 * word]) | (uint(pairs_a[2 * word + 1]) << 16);
    uint low_b = uint(pairs_b[2 * word]) | (uint(pairs_b[2 * word + 1]) << 16);
    uint high = uint(pairs_h[2 * word]) | (uint(pairs_h[2 * word + 1]) << 16);
    for (int quarter = 0; quarter < 4; ++quarter) {
      // d*scale*(q6 - 32) = A * ((1 + q6/64) - 1.5) with A = 64*d*scale
      float a = d * float(int8_t(block[192 + 8 * half_index + 2 * quarter + l0 / 16]));
      uint low = quarter % 2 == 0 ? low_a : low_b;
      const int nibble = 4 * (quarter / 2);
      for (int k = 0; k < 4; ++k) {
        float code = muser_unit_float((muser_move(low, 8 * k + nibble, 17) & 0x001E0000u) |
                                      (muser_move(high, 8 * k + 2 * quarter, 21) & 0x00600000u));
        values[first + 32 * quarter + 4 * word + k] = a * (code - 1.5f);
      }
    }
  }
} else if (FORMAT == MUSER_Q8_0) {
  const device uint8_t* block = row_bytes + unit * 34;
  const device ushort* pairs = (const device ushort*)(block + 2);
  // d*q = A * ((1 + u/256) - 1.5) with u = q + 128, A = 256*d
  float a = 256.0f * muser_f16(block);
  size_t first = out + unit * 32;
  for (int word = 0; word < 8; ++word) {
    uint bits = (uint(pairs[2 * word]) | (uint(pairs[2 * word + 1]) << 16)) ^ 0x80808080u;
    for (int k = 0; k < 4; ++k) {
      values[first + 4 * word + k] =
          a * (muser_unit_float(muser_move(bits, 8 * k, 15) & 0x007F8000u) - 1.5f);
    }
  }
} else {
  uint end = min(unit * 32u + 32u, uint(IN));
  for (uint element = unit * 32u; element < end; ++element) {
    values[out + element] = muser_value<FORMAT>(row_bytes, element);
  }
}
