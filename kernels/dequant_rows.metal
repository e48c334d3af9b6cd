// kernel: dequant_rows
// inputs: weight
// outputs: values
//
// values[r, e] = dequant(weight row r)[e]: a whole matrix decoded, for a prefill chunk's
// matmul (the decode is shared by all rows of the chunk).
// weight: raw GGUF bytes [OUT, ROW_BYTES] uint8; values: [OUT, IN] f16 (or f32).
// Grid: one 32-thread SIMD group per span of 256 values of a row (OUT * SPANS * 32 threads,
// SPANS = ceil(IN / 256)); lane l decodes values l, l + 32, ..., l + 224 of its span, so each
// store of the SIMD group writes 32 consecutive values (a decode is bound by its writes: f16
// output is 3.6x the bytes of Q4_K input). A span is one Q4_K/Q6_K super-block or 8 Q8_0
// blocks: the lanes share its header loads and scale decoding. Codes become floats without a
// conversion instruction (muser_unit_float); (1 + q / 2^b) minus the offset is exact, so each
// value is one rounding of A * code + B. Other formats decode element by element (muser_value).
// Bytes per call: OUT * ROW_BYTES read, OUT * IN * sizeof(values) written.
// Bounds: threads past OUT * SPANS * 32 (CUDA's surplus) return at once; values past IN in a
// row's last span (rows that are no multiple of 256) are skipped.
// Template constants: FORMAT (ggml type id), IN, ROW_BYTES, OUT.
#include "lib/base.metal"
#include "lib/formats.metal"
const uint SPANS = (uint(IN) + 255u) / 256u;
uint index = thread_position_in_grid.x;
uint lane = index % 32u;
uint span = (index / 32u) % SPANS;
uint row = index / 32u / SPANS;
if (row >= uint(OUT)) {
  return;
}
const device uint8_t* row_bytes = weight + size_t(row) * size_t(ROW_BYTES);
size_t first = size_t(row) * size_t(IN) + span * 256u + lane;  // value l of the span
if (FORMAT == MUSER_Q4_K) {
  // Value 64g + 32h + l: nibble h of quant byte 32g + l, sub-block 2g + h.
  const device uint8_t* block = row_bytes + span * 144;
  uint4 head = *((const device uint4*)block);
  float d = 16.0f * muser_half_low(head.x);  // the 16 of 1 + q/16
  float dmin = muser_half_high(head.x);
  for (int group = 0; group < 4; ++group) {
    uint packed = block[16 + 32 * group + lane];
    for (int h = 0; h < 2; ++h) {
      uint2 scale_min = muser_scale_min_words(head.y, head.z, head.w, uint(2 * group + h));
      // d*sc*q - dmin*m = A * ((1 + q/16) - 1) + B with A = 16*d*sc, B = -dmin*m
      float code = muser_unit_float(muser_move(packed, 4 * h, 19) & 0x00780000u);
      values[first + 64 * group + 32 * h] =
          d * float(scale_min.x) * (code - 1.0f) - dmin * float(scale_min.y);
    }
  }
} else if (FORMAT == MUSER_Q6_K) {
  // Value 128h + 32q + l: nibble q/2 of ql[64h + 32(q%2) + l], bits 2q of qh[32h + l].
  const device uint8_t* block = row_bytes + span * 210;
  float d = 64.0f * muser_f16(block + 208);  // the 64 of 1 + q6/64
  for (int h = 0; h < 2; ++h) {
    uint high = block[128 + 32 * h + lane];
    for (int quarter = 0; quarter < 4; ++quarter) {
      uint low = block[64 * h + 32 * (quarter % 2) + lane];
      float code = muser_unit_float((muser_move(low, 4 * (quarter / 2), 17) & 0x001E0000u) |
                                    (muser_move(high, 2 * quarter, 21) & 0x00600000u));
      float scale = float(int8_t(block[192 + 8 * h + 2 * quarter + lane / 16]));
      // d*scale*(q6 - 32) = A * ((1 + q6/64) - 1.5) with A = 64*d*scale
      values[first + 128 * h + 32 * quarter] = d * scale * (code - 1.5f);
    }
  }
} else if (FORMAT == MUSER_Q8_0) {
  // Value 32k + l of the span: quant l of block 8 * span + k.
  for (int k = 0; k < 8; ++k) {
    if (span * 256u + 32u * uint(k) >= uint(IN)) {
      break;
    }
    const device uint8_t* block = row_bytes + (span * 8 + k) * 34;
    // d*q = A * ((1 + u/256) - 1.5) with u = q + 128, A = 256*d
    float code = muser_unit_float(((uint(block[2 + lane]) ^ 128u) << 15));
    values[first + 32 * k] = 256.0f * muser_f16(block) * (code - 1.5f);
  }
} else {
  for (int k = 0; k < 8; ++k) {
    uint element = span * 256u + 32u * uint(k) + lane;
    if (element < uint(IN)) {
      values[first + 32 * k] = muser_value<FORMAT>(row_bytes, element);
    }
  }
}
