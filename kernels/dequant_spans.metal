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
#include "lib/base.metal"
#include "lib/formats.metal"
const uint SPANS = (uint(IN) + 255u) / 256u;
uint index = thread_position_in_grid.x;
uint lane = index % 32u;
uint span = (index / 32u) % SPANS;
uint row = index / 32u / SPANS;
if (row >= uint(OUT) || span * 256u + 8u * lane >= uint(IN)) {
  return;
}
size_t first = size_t(row) * size_t(IN) + span * 256u + 8u * lane;  // value 8l of the span
float v[8];
muser_span8<FORMAT, ROW_BYTES>(weight, row, span, lane, v);
muser_store8(values + first, v);
