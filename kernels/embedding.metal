// kernel: embedding
// inputs: table token_ids
// outputs: hidden
//
// hidden[t, e] = dequant(table row token_ids[t])[e]: a row gather fused with the dequant.
// table: raw GGUF bytes [VOCAB * ROW_BYTES] uint8; token_ids: [T] int32; hidden: [T, HIDDEN] f32.
// Grid: one thread per output element, T * HIDDEN threads, 256 per threadgroup.
// Bytes per call: T * (ROW_BYTES + 4) read, T * HIDDEN * 4 written.
// Bounds: threads past T * HIDDEN (CUDA's surplus in the last block) return at once; an id
// outside 0..VOCAB-1 reads row VOCAB-1 (the host validates ids first; this is the second line).
// Template constants: FORMAT (ggml type id), HIDDEN, ROW_BYTES, VOCAB.
#include "lib/formats.metal"
uint index = thread_position_in_grid.x;
uint tokens = uint(token_ids_shape[0]);
if (index >= tokens * uint(HIDDEN)) {
  return;
}
uint slot = index / uint(HIDDEN);
uint element = index % uint(HIDDEN);
uint token_id = min(uint(token_ids[slot]), uint(VOCAB - 1));
const device uint8_t* row = table + size_t(token_id) * size_t(ROW_BYTES);
hidden[index] = muser_value<FORMAT>(row, element);
