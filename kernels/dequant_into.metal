// kernel: dequant_into
// inputs: weight target after x
// outputs: x16
//
// dequant_spans written in place, with the product's input converted: target[r * IN + e] =
// dequant(weight row r)[e] as float16 for r < OUT (the same values, bits and grid as
// dequant_spans), and x16 = x as float16. target is a float16 buffer of at least OUT * IN values
// that a GPU prefill reuses for piece after piece of its weights (ops.products: PREFILL_SLOTS),
// so that no float16 temporary is allocated per piece; the piece's matmul is x16 @ target.T.
// Ordering: MLX orders launches by the buffers they read and write (on CUDA, the edges of its
// CUDA graphs) and sees no write of target. after: the last launch's output that read target
// (unread here), so this launch follows that reader; x16: the matmul's input, so the matmul
// follows this launch and reads what it wrote.
// weight: raw GGUF bytes [OUT, ROW_BYTES] uint8; x: float32, any shape, XV values (the product
// of its shape, read at run time: a template constant made every new prompt length a kernel of
// its own, compiled on first use, ~1.5 s each on the H200), a multiple of 8; x16: float16, x's
// shape.
// Grid: one 32-thread SIMD group per span of 256 values of a row (OUT * SPANS * 32 threads),
// or XV / 8 threads if more: thread i also converts x's values 8i .. 8i + 7.
// Bytes per call: OUT * ROW_BYTES read, OUT * IN * 2 written; XV * 4 read, XV * 2 written.
// Bounds: threads past XV / 8 convert nothing; threads past OUT * SPANS * 32 and lanes whose
// values lie past IN in a row's last span (IN a multiple of 32 but not of 256) decode nothing.
// The host checks target's size and dtype and x's (ops.products.dequantize_into).
// Template constants: FORMAT (ggml type id), IN, ROW_BYTES, OUT.
#include "lib/base.metal"
#include "lib/formats.metal"
const uint SPANS = (uint(IN) + 255u) / 256u;
uint index = thread_position_in_grid.x;
uint XV = 1u;
for (int d = 0; d < int(x_ndim); ++d) {
  XV *= uint(x_shape[d]);
}
if (index < XV / 8u) {
  float c[8];
  for (int i = 0; i < 8; ++i) {
    c[i] = x[size_t(index) * 8u + uint(i)];
  }
  muser_store8(x16 + size_t(index) * 8u, c);
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
