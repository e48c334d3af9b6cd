// kernel: product_tiles
// inputs: weight_a weight_b xq xd xs
// outputs: y
//
// The batched decode step's products: y = x W.T for up to TOKENS rows of q8x x per token group
// (xq int8 [rows, IN], xd f32 [rows, IN/32], xs f32 [rows, IN/8]; rows a multiple of 8, read
// from xq's shape) and raw GGUF weights (Q4_K, Q6_K or Q8_0; [OUT, ROW_BYTES] uint8, 4-byte
// aligned), as int8 or (HALF 1) f16 matrix products (lib/tiles.metal; tensor cores on NVIDIA
// GPUs):
//   GLU 0: y [CHUNKS, rows, OUT_A + OUT_B] = [x A.T | x B.T] over chunk c's share of the input
//          (no B when OUT_B is 0); the caller adds the chunks.
//   GLU 1: y [rows, OUT_A] = act(x A.T) * (x B.T), A the gate and B the up projection (OUT_B =
//          OUT_A), act silu (ACTIVATION 0) or tanh-approximated gelu (1); CHUNKS 1.
//   GLU 2: y [CHUNKS, rows, 2 OUT_A] = [x A.T | x B.T] over chunk c's share, each SIMD group
//          taking the same rows of A and B as GLU 1 (one read of each x tile for both), no
//          activation (a split gated product: quantize_rows' GLU 1 finishes it; or an ungated
//          product in pairs, A and B the two halves of one weight's rows: y is then x W.T).
// Grid: threadgroup (token group, row block, chunk) of WARPS SIMD groups. SIMD group w takes the
// 16-row tile WARPS * (row block) + w of A (then of B; with GLU the same rows of both) and the
// TOKENS rows of x from TOKENS * (token group), over the spans of chunk c (IN's spans split in
// CHUNKS runs: products of few rows still fill the GPU). Span by span, the threadgroup stages
// x's span in threadgroup memory (muser_tile_stage: x read from L2 once a threadgroup, not once
// a SIMD group) while each SIMD group's loads of its weight span are in flight; then each SIMD
// group multiplies its tile by every token tile of the stage. The token groups of one row block
// are neighbours in launch order, so a weight byte read from memory by one is read from L2 by
// the others.
// Bytes per call: OUT_A * ROW_BYTES_A + OUT_B * ROW_BYTES_B read once, rows * IN * 1.625 read
// once a row block (from L2), CHUNKS * rows * WIDTH * 4 written.
// Bounds: threadgroups past the last tile return at once (all of their threads); SIMD groups
// past it stage x and meet the barriers but compute and store nothing; rows past OUT re-read
// row OUT-1 and are not stored; token tiles past the rows are skipped (uniform in a SIMD group,
// as the products need) and their stage rows never written.
// Template constants: FORMAT_A, ROW_BYTES_A, OUT_A, FORMAT_B, ROW_BYTES_B, OUT_B, IN (a
// multiple of 32; of 256 for Q4_K and Q6_K), TOKENS (a multiple of 8), WARPS, CHUNKS, GLU,
// ACTIVATION, HALF (1: the products in f16 on x's values and the weights' (lib/tiles.metal's
// f16 form: no scaling per block and token tile); 0: int8 products of the codes, scaled per
// block), BY_TOKEN (HALF 1: the stage written by SIMD groups, a token a load instruction; 0: by
// items), LAUNCH_THREADS and LAUNCH_MIN_THREADGROUPS (CUDA's launch bounds: the header's).
#include "lib/tiles.metal"
const int NT = TOKENS / 8;
const int SUMS = GLU != 0 ? 2 * NT * 4 : NT * 4;  // a lane's sums (its tile's, then the up projection's)
const int SPANS = IN / (32 * MUSER_TILE_SPAN(IN));
const int PER_CHUNK = (SPANS + CHUNKS - 1) / CHUNKS;
const int RAW = MUSER_TILE_RAW(FORMAT_A) > MUSER_TILE_RAW(FORMAT_B) ? MUSER_TILE_RAW(FORMAT_A) : MUSER_TILE_RAW(FORMAT_B);
const uint GROUPS_A = (uint(OUT_A) + 15u) / 16u;
const uint GROUPS_B = GLU != 0 ? 0u : (uint(OUT_B) + 15u) / 16u;
// One array for the stage: the codes, then the scales (HALF 1: x's f16 values alone, 32 KB for
// 64 tokens, Metal's limit).
const int STAGE_CODES = TOKENS * MUSER_TILE_ROW_WORDS(IN) / 4;
const int STAGE_SCALES = MUSER_TILE_SPAN(IN) * TOKENS / 2;
const int ITEMS = (TOKENS * 4 + 32 * WARPS - 1) / (32 * WARPS);  // the f16 stage's items a thread
threadgroup uint4 stage_codes[HALF != 0 ? TOKENS * MUSER_TILE_SPAN(IN) * 4 : STAGE_CODES + STAGE_SCALES];
threadgroup float4* stage_scales = (threadgroup float4*)(stage_codes + STAGE_CODES);
uint lane = thread_index_in_simdgroup;
uint first_tile = threadgroup_position_in_grid.y * uint(WARPS);
if (first_tile >= GROUPS_A + GROUPS_B) {
  return;
}
uint tile = first_tile + simdgroup_index_in_threadgroup;
bool active = tile < GROUPS_A + GROUPS_B;
bool in_a = tile < GROUPS_A;
uint first_row = (in_a ? tile : tile - GROUPS_A) * 16u;
uint first_token = threadgroup_position_in_grid.x * uint(TOKENS);
uint rows = uint(xq_shape[0]);
uint tokens = min(uint(TOKENS), rows - first_token);
uint live = tokens / 8u;
uint chunk = threadgroup_position_in_grid.z;
uint first_span = min(chunk * uint(PER_CHUNK), uint(SPANS));
uint end_span = min(first_span + uint(PER_CHUNK), uint(SPANS));
uint g = lane / 4u;
uint t = lane % 4u;
size_t offsets[2];
size_t up_offsets[2];  // GLU: the same rows of B
muser_tile_offsets<ROW_BYTES_A, OUT_A, ROW_BYTES_B, OUT_B, GLU>(offsets, up_offsets, in_a, first_row, g);
float acc[SUMS];
for (int i = 0; i < SUMS; ++i) {
  acc[i] = 0.0f;
}
uint raw[2 * RAW];
uint up_raw[GLU != 0 ? 2 * MUSER_TILE_RAW(FORMAT_B) : 1];
float items[HALF != 0 ? ITEMS : 1];  // the f16 stage's M of this thread's items (set at the first span)
for (int n = 0; n < (HALF != 0 ? ITEMS : 1); ++n) {
  items[n] = MUSER_TILE_F16_FLOOR;
}
const int TOP = HALF != 0 && BY_TOKEN != 0 ? MUSER_TILE_F16_TOP(IN, TOKENS, WARPS) : 1;
float top[TOP];  // BY_TOKEN 1: the M of the SIMD group's tokens (lib/tiles.metal; set at the first span)
for (int r = 0; r < TOP; ++r) {
  top[r] = MUSER_TILE_F16_FLOOR;
}
uint warp = simdgroup_index_in_threadgroup;
for (uint span = first_span; span < end_span; ++span) {
  if (active) {  // the weight loads go out before the stage, and land while it is copied
    muser_tile_load_rows<FORMAT_A, FORMAT_B, IN, GLU>(raw, up_raw, weight_a, weight_b, offsets, up_offsets, in_a,
                                                   span, t);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // every SIMD group is done with the last span
  if (HALF != 0) {
    if (span == first_span) {  // M of each token by items (BY_TOKEN 1: then to the lanes that keep it)
      muser_tile_f16_scales<IN, TOKENS, 32 * WARPS, ITEMS>(items, xd, first_token, tokens, first_span, end_span,
                                                           thread_position_in_threadgroup.x);
      if (BY_TOKEN != 0) {
        muser_tile_f16_share<TOKENS, 32 * WARPS, ITEMS>(stage_codes, items, thread_position_in_threadgroup.x);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        muser_tile_f16_spread<IN, TOKENS, WARPS>(top, stage_codes, warp, lane);
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
    }
    if (BY_TOKEN != 0) {
      muser_tile_stage_f16_by_token<IN, TOKENS, WARPS>(stage_codes, xq, xd, top, first_token, tokens, span, warp, lane);
    } else {
      muser_tile_stage_f16<IN, TOKENS, 32 * WARPS, ITEMS>(stage_codes, xq, xd, items, first_token, tokens, span,
                                                          thread_position_in_threadgroup.x);
    }
  } else {
    muser_tile_stage<IN, TOKENS, 32 * WARPS>(stage_codes, stage_scales, xq, xd, xs, first_token, tokens, span,
                                             thread_position_in_threadgroup.x);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (active && HALF != 0) {
    if (GLU != 0 && FORMAT_A == FORMAT_B) {  // gate and up from one read of each x tile
      muser_tile_span_product_f16<FORMAT_A, NT, IN, 1>(raw, up_raw, stage_codes, live, lane, acc);
    } else {
      if (in_a) {
        muser_tile_span_product_f16<FORMAT_A, NT, IN, 0>(raw, raw, stage_codes, live, lane, acc);
      } else {
        muser_tile_span_product_f16<FORMAT_B, NT, IN, 0>(raw, raw, stage_codes, live, lane, acc);
      }
      if (GLU != 0) {
        muser_tile_span_product_f16<FORMAT_B, NT, IN, 0>(up_raw, up_raw, stage_codes, live, lane, acc + NT * 4);
      }
    }
  } else if (active) {
    if (in_a) {
      muser_tile_span_product<FORMAT_A, NT, IN, TOKENS>(raw, stage_codes, stage_scales, live, lane, acc);
    } else {
      muser_tile_span_product<FORMAT_B, NT, IN, TOKENS>(raw, stage_codes, stage_scales, live, lane, acc);
    }
    if (GLU != 0) {
      muser_tile_span_product<FORMAT_B, NT, IN, TOKENS>(up_raw, stage_codes, stage_scales, live, lane, acc + NT * 4);
    }
  }
}
if (HALF != 0) {  // M to the store, through the stage
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (BY_TOKEN != 0) {
    muser_tile_f16_keep<IN, TOKENS, WARPS>(stage_codes, top, warp, lane);
  } else {
    muser_tile_f16_share<TOKENS, 32 * WARPS, ITEMS>(stage_codes, items, thread_position_in_threadgroup.x);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (!active) {
  return;
}
const uint WIDTH = GLU == 1 ? uint(OUT_A) : GLU == 2 ? uint(2 * OUT_A) : uint(OUT_A + OUT_B);
uint out_rows = in_a ? uint(OUT_A) : uint(OUT_B);
uint column = in_a ? 0u : uint(OUT_A);
device float* out = y + size_t(chunk) * rows * WIDTH;
for (int j = 0; j < NT; ++j) {
  for (int e = 0; e < 4; ++e) {
    uint row = first_row + g + 8u * uint(e / 2);
    uint token = first_token + 8u * uint(j) + 2u * t + uint(e % 2);
    if (uint(j) < live && row < out_rows) {
      float scale = HALF != 0 ? muser_tile_f16_scale(stage_codes, token - first_token) : 1.0f;
      float value = acc[j * 4 + e] * scale;
      float up = acc[GLU != 0 ? NT * 4 + j * 4 + e : 0] * scale;  // GLU: B's same row
      if (GLU == 1) {
        value = muser_activate<ACTIVATION>(value) * up;
      } else if (GLU == 2) {
        out[size_t(token) * WIDTH + uint(OUT_A) + row] = up;
      }
      out[size_t(token) * WIDTH + column + row] = value;
    }
  }
}
