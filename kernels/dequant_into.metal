// kernel: dequant_into
// inputs: weight target after
// outputs: done
//
// dequant_spans written in place: target[r * IN + e] = dequant(weight row r)[e] as float16,
// for r < OUT (the same values, bits and grid as dequant_spans). target is a float16 buffer
// of at least OUT * IN values that a GPU prefill reuses for piece after piece of its weights
// (ops.products: PREFILL_SLOTS), so that no float16 temporary is allocated per piece.
// after: the last launch's output that read target (unread here): MLX orders launches by the
// buffers they read and write (on CUDA, the edges of its CUDA graphs) and sees no write of
// target, so this input orders this launch after that reader. done: float16 [8] zeros, written
// by threads 0-7: a reader of target takes it (or an array computed from it) as an input, so
// that it follows this launch.
// weight: raw GGUF bytes [OUT, ROW_BYTES] uint8.
// Grid: one 32-thread SIMD group per span of 256 values of a row (OUT * SPANS * 32 threads).
// Bytes per call: OUT * ROW_BYTES read, OUT * IN * 2 written.
// Bounds: threads past OUT * SPANS * 32 (CUDA's surplus) return at once; lanes whose values lie
// past IN in a row's last span (IN a multiple of 32 but not of 256) store nothing. The host
// checks target's size and dtype (ops.products.dequantize_into).
// Template constants: FORMAT (ggml type id), IN, ROW_BYTES, OUT.
const uint SPANS = (uint(IN) + 255u) / 256u;
uint index = thread_position_in_grid.x;
if (index < 8u) {
  done[index] = half(0.0f);
}
uint lane = index % 32u;
uint span = (index / 32u) % SPANS;
uint row = index / 32u / SPANS;
if (row >= uint(OUT) || span * 256u + 8u * lane >= uint(IN)) {
  return;
}
size_t first = size_t(row) * size_t(IN) + span * 256u + 8u * lane;  // value 8l of the span
float v[8];
muser_span8<FORMAT, ROW_BYTES>(weight, row, span, lane, v);
muser_store8((device half*)target + first, v);
