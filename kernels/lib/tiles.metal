// lib/tiles.metal — the batched decode products' engine (kernel product_tiles): a SIMD group
// multiplies 16-row tiles of a raw GGUF weight (Q4_K, Q6_K, Q8_0) by 8-token tiles of q8x
// activations staged in threadgroup memory, as int8 matrix products (lib/base.metal's
// muser_mma_k32 / muser_mma_k16: tensor cores on NVIDIA GPUs), one 32-value block at a time,
// and scales each block's integer dots into float accumulators; or (the f16 form, below) as
// f16 products of the weights' and x's values (muser_mma_f16), summed into the accumulators
// directly.
// Which values a lane holds: lane l (g = l / 4, t = l % 4) gives the products positions
// 8t..8t+7 of a block (k32: positions 8t..8t+3 as the product's columns 4t..4t+3, 8t+4..8t+7
// as 16+4t..); a dot does not depend on the order of its terms, and weights and activations
// take the same order, so each lane's share of a block is 8 contiguous bytes of both. Q6_K's
// blocks have two scales (16 values each): two k16 products, lane t taking positions 4t..4t+3
// of each half.
#include "lib/base.metal"
#include "lib/formats.metal"

// The 4 bytes at an even byte `offset` of `base` (base 4-byte aligned) as a word; the next
// aligned word is read only when the bytes straddle it.
inline uint muser_word_at(const device uint8_t* base, size_t offset) {
  const device uint* words = (const device uint*)(base + (offset & ~size_t(3)));
  return (offset & 2u) != 0u ? muser_funnel(words[0], words[1], 16u) : words[0];
}

// A lane's share of one 32-value block of two weight rows (g and g + 8 of a 16-row tile):
//   a: the products' A operand (k32: a[0], a[1] rows g, g+8 at positions 8t..8t+3, a[2], a[3]
//      at 8t+4..8t+7; Q6_K k16: a[0], a[1] rows g, g+8 at 4t..4t+3 of the first half, a[2],
//      a[3] of the second);
//   scale[r]: Q4_K d * sc, Q6_K d, Q8_0 d of row r (0: g, 1: g + 8); least[r]: Q4_K dmin * m;
//   sc: Q6_K's int8 scales (as floats), [half * 2 + r].
struct muser_tile_w {
  uint a[4];
  float scale[2];
  float least[2];
  float sc[4];
};

// A span: the blocks a threadgroup stages and a SIMD group's loads of a weight cover at once:
// 8 (a super-block of Q4_K or Q6_K; 8 Q8_0 blocks), or 1 when IN is not whole 256-value spans
// (Q8_0 weights only). The lane's words of a span of its two rows, all loaded before any is
// used (the loads of a span in flight together: ~2.3 KB a SIMD group), RAW words a row:
//   Q4_K (12): the super-block's 16-byte head (d, dmin, scales), then for each pair of
//              sub-blocks p the 8 quant bytes 32p + 8t .. (both sub-blocks' nibbles);
//   Q6_K (17): ql words 64n + 32m + 16h + 4t (i = 4n + 2m + h), qh words 128 + 32n + 16h + 4t
//              (8 + 2n + h), the 16 int8 scales (12..15), d (16);
//   Q8_0 (3 a block): the block's codes 2 + 8t.. (two words), then d.
#define MUSER_TILE_SPAN(IN) ((IN) % 256 == 0 ? 8 : 1)

#define MUSER_TILE_RAW(FORMAT) ((FORMAT) == MUSER_Q4_K ? 12 : (FORMAT) == MUSER_Q6_K ? 17 : 24)

template <int FORMAT, int IN>
inline void muser_tile_load(thread uint* raw, const device uint8_t* weight, size_t row0, size_t row8, uint span,
                            uint t) {
  const int RAW = MUSER_TILE_RAW(FORMAT);
  for (int r = 0; r < 2; ++r) {
    size_t row = r == 0 ? row0 : row8;
    thread uint* words = raw + r * RAW;
    if (FORMAT == MUSER_Q4_K) {
      const device uint8_t* block = weight + row + 144u * span;
      uint4 head = *((const device uint4*)block);
      words[0] = head.x; words[1] = head.y; words[2] = head.z; words[3] = head.w;
      for (uint p = 0; p < 4u; ++p) {
        uint2 quants = *((const device uint2*)(block + 16u + 32u * p + 8u * t));
        words[4u + 2u * p] = quants.x;
        words[5u + 2u * p] = quants.y;
      }
    } else if (FORMAT == MUSER_Q6_K) {
      size_t block = row + 210u * size_t(span);
      for (uint i = 0; i < 8u; ++i) {
        words[i] = muser_word_at(weight, block + 64u * (i / 4u) + 32u * ((i / 2u) % 2u) + 16u * (i % 2u) + 4u * t);
      }
      for (uint i = 0; i < 4u; ++i) {
        words[8u + i] = muser_word_at(weight, block + 128u + 32u * (i / 2u) + 16u * (i % 2u) + 4u * t);
        words[12u + i] = muser_word_at(weight, block + 192u + 4u * i);
      }
      words[16] = uint(*((const device ushort*)(weight + block + 208u)));
    } else {
      for (uint k = 0; k < uint(MUSER_TILE_SPAN(IN)); ++k) {
        size_t block = row + 34u * size_t(span * uint(MUSER_TILE_SPAN(IN)) + k);
        uint2 codes = muser_words2(weight, block + 2u + 8u * t);
        words[3u * k] = codes.x;
        words[3u * k + 1u] = codes.y;
        words[3u * k + 2u] = uint(*((const device ushort*)(weight + block)));
      }
    }
  }
}

// A SIMD group's loads of span `span` of its tile: its rows of A (in_a) or of B into raw, and
// with GLU the same rows of B (the up projection, at up_offsets) into up_raw.
template <int FORMAT_A, int FORMAT_B, int IN, int GLU>
inline void muser_tile_load_rows(thread uint* raw, thread uint* up_raw, const device uint8_t* weight_a,
                                 const device uint8_t* weight_b, thread const size_t* offsets,
                                 thread const size_t* up_offsets, bool in_a, uint span, uint t) {
  if (in_a) {
    muser_tile_load<FORMAT_A, IN>(raw, weight_a, offsets[0], offsets[1], span, t);
  } else {
    muser_tile_load<FORMAT_B, IN>(raw, weight_b, offsets[0], offsets[1], span, t);
  }
  if (GLU != 0) {
    muser_tile_load<FORMAT_B, IN>(up_raw, weight_b, up_offsets[0], up_offsets[1], span, t);
  }
}

// Block k of a span (its words `raw`, muser_tile_load's) as the products' operands.
//   Q4_K: sub-block k: the low (k even) or high nibbles of pair k / 2's quant bytes; value =
//         d sc q - dmin m.
//   Q6_K: half n = k / 4, quarter q = k % 4: codes from ql (nibble q / 2) and qh (bits 2q,
//         2q+1), position l of the block at ql byte 64n + 32 (q % 2) + l and qh byte 32n + l;
//         value = d sc (q - 32), the -32 taken into the int8 code; scale 8n + 2q + (l >= 16).
//   Q8_0: value = d q.
template <int FORMAT>
inline void muser_tile_unpack(thread muser_tile_w& w, thread const uint* raw, uint k) {
  const int RAW = MUSER_TILE_RAW(FORMAT);
  for (int r = 0; r < 2; ++r) {
    thread const uint* words = raw + r * RAW;
    if (FORMAT == MUSER_Q4_K) {
      uint4 pairs = muser_q4k_group_scales(words[1], words[2], words[3], k / 2u);
      uint shift = 4u * (k % 2u);
      w.a[r] = (words[4u + 2u * (k / 2u)] >> shift) & 0x0F0F0F0Fu;
      w.a[2 + r] = (words[5u + 2u * (k / 2u)] >> shift) & 0x0F0F0F0Fu;
      w.scale[r] = muser_half_low(words[0]) * float(k % 2u != 0u ? pairs.z : pairs.x);
      w.least[r] = muser_half_high(words[0]) * float(k % 2u != 0u ? pairs.w : pairs.y);
    } else if (FORMAT == MUSER_Q6_K) {
      uint n = k / 4u;
      uint q = k % 4u;
      for (uint h = 0; h < 2u; ++h) {
        uint low = words[4u * n + 2u * (q % 2u) + h];
        uint high = words[8u + 2u * n + h];
        uint codes = ((low >> (4u * (q / 2u))) & 0x0F0F0F0Fu) | (((high >> (2u * q)) & 0x03030303u) << 4);
        w.a[2u * h + uint(r)] = ((codes | 0x80808080u) - 0x20202020u) ^ 0x80808080u;  // q - 32, bytewise
        uint byte = 8u * n + 2u * q + h;
        w.sc[2u * h + uint(r)] = muser_int_float(int(words[12u + byte / 4u] << (24u - 8u * (byte % 4u))) >> 24);
      }
      w.scale[r] = muser_half_low(words[16]);
      w.least[r] = 0.0f;
    } else {
      w.a[r] = words[3u * k];
      w.a[2 + r] = words[3u * k + 1u];
      w.scale[r] = muser_half_low(words[3u * k + 2u]);
      w.least[r] = 0.0f;
    }
  }
}

// A lane's share of one 32-value block of an 8-token tile of q8x x: token g's codes at the
// lane's positions (k32: 8t..8t+7; Q6_K: 4t..4t+3 and 16+4t..16+4t+3), and the scales (xd) and
// code sums times scale (xs's four added) of tokens 2t and 2t + 1, the columns of C it holds.
struct muser_tile_x {
  uint b0;
  uint b1;
  float scale[2];
  float sum[2];
};

// A span of x staged in threadgroup memory for TOKENS tokens (muser_tile_stage): codes [token]
// [ROW_WORDS words: the span's SPAN * 32 codes, then 16 bytes of padding, so that the 8 tokens
// of a tile fall in different banks], and scales [block][token] as (d, d * code sum) pairs.
#define MUSER_TILE_ROW_WORDS(IN) (8 * MUSER_TILE_SPAN(IN) + 4)

// Every thread of the threadgroup (THREADS of them) copies its share of span `span` of x's
// tokens first_token .. first_token + tokens - 1 (the rest of the stage is not written).
template <int IN, int TOKENS, int THREADS>
inline void muser_tile_stage(threadgroup uint4* codes, threadgroup float4* scales, const device int8_t* xq,
                             const device float* xd, const device float* xs, uint first_token, uint tokens,
                             uint span, uint thread_index) {
  const uint SPAN = uint(MUSER_TILE_SPAN(IN));
  const uint VECTORS = 2u * SPAN;  // 16-byte vectors of a token's codes of a span
  const uint STRIDE = uint(MUSER_TILE_ROW_WORDS(IN)) / 4u;
  for (uint i = thread_index; i < uint(TOKENS) * VECTORS; i += uint(THREADS)) {
    uint token = i / VECTORS;
    if (token < tokens) {
      const device uint4* row = (const device uint4*)(xq + size_t(first_token + token) * uint(IN) + 32u * SPAN * span);
      codes[token * STRIDE + i % VECTORS] = row[i % VECTORS];
    }
  }
  threadgroup float* pairs = (threadgroup float*)scales;
  for (uint i = thread_index; i < SPAN * uint(TOKENS); i += uint(THREADS)) {
    uint token = i % uint(TOKENS);
    if (token < tokens) {
      size_t row = size_t(first_token + token);
      uint block = SPAN * span + i / uint(TOKENS);
      float4 sums = *((const device float4*)(xs + row * uint(IN / 8) + 4u * block));
      pairs[2u * i] = xd[row * uint(IN / 32) + block];
      pairs[2u * i + 1u] = (sums.x + sums.y) + (sums.z + sums.w);
    }
  }
}

// Block k of the staged span for 8-token tile j (tokens 8j..8j+7 of the stage).
template <int FORMAT, int IN, int TOKENS>
inline void muser_tile_staged(thread muser_tile_x& x, const threadgroup uint4* codes, const threadgroup float4* scales,
                              uint j, uint k, uint g, uint t) {
  const threadgroup uint* words = (const threadgroup uint*)codes + (8u * j + g) * uint(MUSER_TILE_ROW_WORDS(IN)) + 8u * k;
  if (FORMAT == MUSER_Q6_K) {
    x.b0 = words[t];
    x.b1 = words[4u + t];
  } else {
    uint2 pair = ((const threadgroup uint2*)words)[t];
    x.b0 = pair.x;
    x.b1 = pair.y;
  }
  float4 s = scales[k * uint(TOKENS / 2) + 4u * j + t];
  x.scale[0] = s.x;
  x.sum[0] = s.y;
  x.scale[1] = s.z;
  x.sum[1] = s.w;
}

// One block's products of a 16-row tile and an 8-token tile, added into acc[0..3] (C's
// layout: rows g, g, g+8, g+8; tokens 2t, 2t+1, 2t, 2t+1). The integer dots are exact and
// become floats with no conversion instruction: C starts at MUSER_INT_FLOAT_BIAS (Q4_K |dot| <=
// 32 * 15 * 127, Q8_0 <= 32 * 127 * 127, a Q6_K half <= 16 * 32 * 127: below 2^22); Q6_K's two
// halves times their int8 scales (as floats) add exactly in float (below 2^24), the same value
// as their integer sum.
template <int FORMAT>
inline void muser_tile_block(thread const muser_tile_w& w, thread const muser_tile_x& x, uint lane,
                             thread float* acc) {
  int c[4] = {MUSER_INT_FLOAT_BIAS, MUSER_INT_FLOAT_BIAS, MUSER_INT_FLOAT_BIAS, MUSER_INT_FLOAT_BIAS};
  if (FORMAT == MUSER_Q6_K) {
    int second[4] = {MUSER_INT_FLOAT_BIAS, MUSER_INT_FLOAT_BIAS, MUSER_INT_FLOAT_BIAS, MUSER_INT_FLOAT_BIAS};
    muser_mma_k16(w.a, x.b0, c, lane);
    muser_mma_k16(w.a + 2, x.b1, second, lane);
    for (int e = 0; e < 4; ++e) {
      int r = e / 2;
      float v = fma(muser_biased_float(second[e]), w.sc[2 + r], muser_biased_float(c[e]) * w.sc[r]);
      acc[e] = fma(w.scale[r] * x.scale[e % 2], v, acc[e]);
    }
  } else {
    muser_mma_k32(w.a, x.b0, x.b1, c, lane);
    for (int e = 0; e < 4; ++e) {
      int r = e / 2;
      acc[e] = fma(w.scale[r] * x.scale[e % 2], muser_biased_float(c[e]), acc[e]);
      if (FORMAT == MUSER_Q4_K) {
        acc[e] = fma(-w.least[r], x.sum[e % 2], acc[e]);
      }
    }
  }
}

// The byte offsets of a lane's two rows (g and g + 8) of the 16-row tile from first_row: rows
// past OUT re-read row OUT - 1 (the caller never stores them).
template <int ROW_BYTES, int OUT>
inline void muser_tile_row_offsets(thread size_t* offsets, uint first_row, uint g) {
  offsets[0] = size_t(min(first_row + g, uint(OUT - 1))) * uint(ROW_BYTES);
  offsets[1] = size_t(min(first_row + g + 8u, uint(OUT - 1))) * uint(ROW_BYTES);
}

// The byte offsets of a lane's rows (muser_tile_row_offsets): offsets, its tile's in A (in_a)
// or B; up_offsets, with GLU the same rows of B.
template <int ROW_BYTES_A, int OUT_A, int ROW_BYTES_B, int OUT_B, int GLU>
inline void muser_tile_offsets(thread size_t* offsets, thread size_t* up_offsets, bool in_a, uint first_row, uint g) {
  if (in_a) {
    muser_tile_row_offsets<ROW_BYTES_A, OUT_A>(offsets, first_row, g);
  } else {
    muser_tile_row_offsets<ROW_BYTES_B, OUT_B>(offsets, first_row, g);
  }
  if (GLU != 0) {
    muser_tile_row_offsets<ROW_BYTES_B, OUT_B>(up_offsets, first_row, g);
  }
}

// One span of a 16-row tile (its words `raw`, muser_tile_load's) times `live` 8-token tiles (of
// at most NT) of the staged x (codes, scales): acc[j * 4 + e] (e as muser_tile_block's). The
// weights' share of a block is unpacked once for all the token tiles.
template <int FORMAT, int NT, int IN, int TOKENS>
inline void muser_tile_span_product(thread const uint* raw, const threadgroup uint4* codes,
                                    const threadgroup float4* scales, uint live, uint lane, thread float* acc) {
  uint g = lane / 4u;
  uint t = lane % 4u;
  MUSER_UNROLL
  for (uint k = 0; k < uint(MUSER_TILE_SPAN(IN)); ++k) {
    muser_tile_w w;
    muser_tile_unpack<FORMAT>(w, raw, k);
    for (int j = 0; j < NT; ++j) {
      if (uint(j) < live) {
        muser_tile_x x;
        muser_tile_staged<FORMAT, IN, TOKENS>(x, codes, scales, uint(j), k, g, t);
        muser_tile_block<FORMAT>(w, x, lane, acc + j * 4);
      }
    }
  }
}

// ---- The f16 form (kernel product_tiles' HALF 1) --------------------------------------------
// The weights' values (scales applied, Q4_K's minimum taken off) and x's as f16, multiplied by
// muser_mma_f16 with the float sums as its accumulator: no scaling per block and token tile.
// A 32-value block is two k16 products (h 0, 1); lane t holds 4 positions of each, as
// muser_mma_f16's columns 2t, 2t + 1, 2t + 8, 2t + 9 in the order 0, 2, 1, 3 (bytes 0 and 2 of
// a word of codes, then 1 and 3: one mask each). Q4_K and Q8_0: positions 8t + 4h .. 8t + 4h +
// 3 of the block; Q6_K: 16h + 4t .. 16h + 4t + 3 (its scales are per 16 values).
// x in f16's range: a token's values are staged over its M, the largest block scale xd of the
// chunk's spans (|x / M| <= 127); the store multiplies its sums by M. The weights' values must
// lie in f16's range (those of real models do: |w| < 65,504; below 6.1e-5 they lose bits as
// subnormals).

// The stage: for each token, its span's values over M in 16-byte groups of 8 positions (8t ..
// 8t + 7 of a block: the pairs (0, 2), (1, 3), (4, 6), (5, 7)); a block's 4 groups (64 bytes)
// at slot k ^ (token & 1) of the token's row (rows of 8 blocks: a SIMD group's tokens g and
// g + 1 then read different banks): TOKENS * 512 bytes, 32 KB for 64 tokens (Metal's limit).
// A thread's items: i = thread_index + n * THREADS < TOKENS * 4 (n < ITEMS), token i / 4's
// group i % 4 of each block: M is found by items (muser_tile_f16_scales), and the stage written
// by items (muser_tile_stage_f16) or (BY_TOKEN 1) by SIMD groups, a token's whole span a load
// instruction (muser_tile_stage_f16_by_token).
#define MUSER_TILE_F16_SLOT(IN, token, k) (MUSER_TILE_SPAN(IN) > 1 ? ((k) ^ ((token) & 1u)) : (k))
#define MUSER_TILE_F16_FLOOR 7.888609e-31f  // 2^-100: M of a token whose scales are all 0

// M of the thread's items' tokens (top[n]) over spans first_span .. end_span - 1: the 4 items of
// a token (neighbouring lanes) take every 4th block (every 4th vector of 4) and share their
// maximum. Called by every thread at the chunk's first span, its weight loads in flight.
template <int IN, int TOKENS, int THREADS, int ITEMS>
inline void muser_tile_f16_scales(thread float* top, const device float* xd, uint first_token, uint tokens,
                                  uint first_span, uint end_span, uint thread_index) {
  const uint SPAN = uint(MUSER_TILE_SPAN(IN));
  MUSER_UNROLL
  for (uint n = 0; n < uint(ITEMS); ++n) {
    uint i = thread_index + n * uint(THREADS);
    float m = MUSER_TILE_F16_FLOOR;
    if (i < uint(TOKENS) * 4u) {  // uniform in a SIMD group (TOKENS * 4 and THREADS are multiples of 32)
      uint token = i / 4u;
      if (token < tokens) {
        const device float* scales = xd + size_t(first_token + token) * uint(IN / 32) + SPAN * first_span;
        if (SPAN == 8u) {  // 16-byte aligned rows of 8 scales a span: 4 vectors a lane in flight at once
          const device float4* vectors = (const device float4*)scales;
          uint count = 2u * (end_span - first_span);
          for (uint b = i % 4u; b < count; b += 16u) {
            float4 v[4];
            for (uint u = 0u; u < 4u; ++u) {
              v[u] = b + 4u * u < count ? vectors[b + 4u * u] : vectors[b];
            }
            for (uint u = 0u; u < 4u; ++u) {
              m = max(m, max(max(v[u].x, v[u].y), max(v[u].z, v[u].w)));
            }
          }
        } else {
          for (uint b = i % 4u; b < end_span - first_span; b += 4u) {
            m = max(m, scales[b]);
          }
        }
      }
      m = max(m, simd_shuffle_xor(m, 1u));
      m = max(m, simd_shuffle_xor(m, 2u));
    }
    top[n] = m;
  }
}

// Two f16 pairs of a word of codes (bytes, after the caller's shift and mask): (byte 0,
// byte 2) and (byte 1, byte 3) of `mask`ed bytes as 1024 + code (the code into f16's mantissa),
// minus `bias` (exact), times `scale` plus `least` (one rounding).
inline void muser_tile_f16_codes(thread uint* low, thread uint* high, uint word, uint mask, uint bias, uint scale,
                                 uint least) {
  const uint ONE = 0x3C003C00u;
  *low = muser_half_fma(muser_half_fma((word & mask) | 0x64006400u, ONE, bias), scale, least);
  *high = muser_half_fma(muser_half_fma(((word >> 8) & mask) | 0x64006400u, ONE, bias), scale, least);
}

// Every thread of the threadgroup (THREADS of them) stages its items of span `span` of tokens
// first_token .. first_token + tokens - 1 (top: their M, muser_tile_f16_scales').
template <int IN, int TOKENS, int THREADS, int ITEMS>
inline void muser_tile_stage_f16(threadgroup uint4* stage, const device int8_t* xq, const device float* xd,
                                 thread const float* top, uint first_token, uint tokens, uint span,
                                 uint thread_index) {
  const uint SPAN = uint(MUSER_TILE_SPAN(IN));
  MUSER_UNROLL
  for (uint n = 0; n < uint(ITEMS); ++n) {
    uint i = thread_index + n * uint(THREADS);
    uint token = i / 4u;
    uint group = i % 4u;
    if (i < uint(TOKENS) * 4u && token < tokens) {
      size_t row = size_t(first_token + token);
      const device uint2* codes = (const device uint2*)(xq + row * uint(IN) + 32u * SPAN * span + 8u * group);
      const device float* scales = xd + row * uint(IN / 32) + SPAN * span;
      threadgroup uint4* out = stage + token * SPAN * 4u + group;
      float inverse = 1.0f / top[n];
      MUSER_UNROLL
      for (uint k = 0; k < SPAN; ++k) {
        float f = scales[k] * inverse;
        uint factor = muser_half_pair(f, f);
        uint2 code = codes[4u * k];
        uint4 pairs;
        const uint MINUS_1152 = 0xE480E480u;  // 1024 + (code + 128) becomes code
        muser_tile_f16_codes(&pairs.x, &pairs.y, code.x ^ 0x80808080u, 0x00FF00FFu, MINUS_1152, factor, 0u);
        muser_tile_f16_codes(&pairs.z, &pairs.w, code.y ^ 0x80808080u, 0x00FF00FFu, MINUS_1152, factor, 0u);
        out[4u * MUSER_TILE_F16_SLOT(IN, token, k)] = pairs;
      }
    }
  }
}

// The stage's tokens by SIMD group (muser_tile_stage_f16_by_token): a token's span is 32 * SPAN
// bytes of codes, 8 a lane, so one load instruction of a SIMD group covers TPI = 8 / SPAN tokens
// (1: the whole span of one token, 256 contiguous bytes and its 8 scales: few cache lines an
// instruction). Instruction i (< TOKENS / TPI) is SIMD group i % WARPS's, its n-th (n = i /
// WARPS); the n-th instruction's tokens are its SIMD group's tokens n * TPI .. n * TPI + TPI - 1,
// and lane j holds the M of its SIMD group's tokens j and j + 32 (top[0], top[1]), handed round by
// a shuffle as each token is staged.
#define MUSER_TILE_F16_TPI(IN) (8 / MUSER_TILE_SPAN(IN))
#define MUSER_TILE_F16_OWN(IN, TOKENS, WARPS) \
  ((TOKENS / MUSER_TILE_F16_TPI(IN) + WARPS - 1) / WARPS * MUSER_TILE_F16_TPI(IN))  // tokens a SIMD group stages
#define MUSER_TILE_F16_TOP(IN, TOKENS, WARPS) ((MUSER_TILE_F16_OWN(IN, TOKENS, WARPS) + 31) / 32)

// The token (of the threadgroup's) that is SIMD group `warp`'s own-th, or TOKENS where it has
// none (own past its share, or an instruction past the stage's).
template <int IN, int TOKENS, int WARPS>
inline uint muser_tile_f16_owned(uint own, uint warp) {
  const uint TPI = uint(MUSER_TILE_F16_TPI(IN));
  uint i = warp + (own / TPI) * uint(WARPS);
  return own < uint(MUSER_TILE_F16_OWN(IN, TOKENS, WARPS)) && i < uint(TOKENS) / TPI ? i * TPI + own % TPI
                                                                                    : uint(TOKENS);
}

// Between barriers at the chunk's first span: the M of every token, written to the stage's
// floats by muser_tile_f16_share, read into the lanes that keep them (top, as above).
template <int IN, int TOKENS, int WARPS>
inline void muser_tile_f16_spread(thread float* top, const threadgroup uint4* stage, uint warp, uint lane) {
  for (uint r = 0; r < uint(MUSER_TILE_F16_TOP(IN, TOKENS, WARPS)); ++r) {
    uint token = muser_tile_f16_owned<IN, TOKENS, WARPS>(lane + 32u * r, warp);
    top[r] = token < uint(TOKENS) ? ((const threadgroup float*)stage)[token] : MUSER_TILE_F16_FLOOR;
  }
}

// After the last span (the stage free), between barriers: the M the lanes keep written back for
// the store (muser_tile_f16_scale).
template <int IN, int TOKENS, int WARPS>
inline void muser_tile_f16_keep(threadgroup uint4* stage, thread const float* top, uint warp, uint lane) {
  for (uint r = 0; r < uint(MUSER_TILE_F16_TOP(IN, TOKENS, WARPS)); ++r) {
    uint token = muser_tile_f16_owned<IN, TOKENS, WARPS>(lane + 32u * r, warp);
    if (token < uint(TOKENS)) {
      ((threadgroup float*)stage)[token] = top[r];
    }
  }
}

// SIMD group `warp` stages its tokens of span `span` (of first_token .. first_token + tokens -
// 1; top: their M, muser_tile_f16_spread's), every SIMD group of the threadgroup calling it
// (kernel product_tiles' BY_TOKEN 1; Settings.tile_stage_by_token).
template <int IN, int TOKENS, int WARPS>
inline void muser_tile_stage_f16_by_token(threadgroup uint4* stage, const device int8_t* xq,
                                          const device float* xd, thread const float* top, uint first_token,
                                          uint tokens, uint span, uint warp, uint lane) {
  const uint SPAN = uint(MUSER_TILE_SPAN(IN));
  const uint TPI = uint(MUSER_TILE_F16_TPI(IN));
  const uint LANES = 4u * SPAN;  // lanes a token
  uint sub = lane / LANES;
  uint piece = lane % LANES;  // the lane's 8 bytes: block piece / 4, group piece % 4 (positions 8 (piece % 4) ..)
  uint k = piece / 4u;
  uint group = piece % 4u;
  // Every load is made, a dead token's (past the rows) from the SIMD group's first row, and only
  // the stores are conditional: loads each under its own condition are not hoisted, and the
  // tokens' trips to L2 go one after another (bench/history/session-48.md).
  uint first_live = min(warp * TPI + sub, tokens - 1u);
  MUSER_UNROLL_BY((TOKENS >= 64 ? 16 : 4))
  for (uint n = 0; n < uint(MUSER_TILE_F16_OWN(IN, TOKENS, WARPS)) / TPI; ++n) {
    uint own = n * TPI + sub;  // (n * TPI + sub) / 32 = n * TPI / 32: top's index is the same in all lanes
    float m = simd_shuffle(top[MUSER_TILE_F16_TOP(IN, TOKENS, WARPS) > 1 ? (n * TPI) / 32u : 0u], ushort(own % 32u));
    uint token = muser_tile_f16_owned<IN, TOKENS, WARPS>(own, warp);
    bool live = token < tokens;  // (TOKENS where the SIMD group has no such token)
    size_t row = size_t(first_token + (live ? token : first_live));
    uint2 code = *((const device uint2*)(xq + row * uint(IN) + 32u * SPAN * span + 8u * piece));
    float f = xd[row * uint(IN / 32) + SPAN * span + k] * (1.0f / m);
    uint factor = muser_half_pair(f, f);
    uint4 pairs;
    const uint MINUS_1152 = 0xE480E480u;  // 1024 + (code + 128) becomes code
    muser_tile_f16_codes(&pairs.x, &pairs.y, code.x ^ 0x80808080u, 0x00FF00FFu, MINUS_1152, factor, 0u);
    muser_tile_f16_codes(&pairs.z, &pairs.w, code.y ^ 0x80808080u, 0x00FF00FFu, MINUS_1152, factor, 0u);
    if (live) {  // uniform in a SIMD group with SPAN 8
      stage[token * SPAN * 4u + 4u * MUSER_TILE_F16_SLOT(IN, token, k) + group] = pairs;
    }
  }
}

// The M of the thread's items (muser_tile_f16_scales) written to the stage's floats: for
// muser_tile_f16_spread (BY_TOKEN 1) at the first span, or for the store after the last (BY_TOKEN
// 0). Every thread calls it, between barriers.
template <int TOKENS, int THREADS, int ITEMS>
inline void muser_tile_f16_share(threadgroup uint4* stage, thread const float* top, uint thread_index) {
  MUSER_UNROLL
  for (uint n = 0; n < uint(ITEMS); ++n) {
    uint i = thread_index + n * uint(THREADS);
    if (i < uint(TOKENS) * 4u && i % 4u == 0u) {
      ((threadgroup float*)stage)[i / 4u] = top[n];
    }
  }
}

inline float muser_tile_f16_scale(const threadgroup uint4* stage, uint token) {
  return ((const threadgroup float*)stage)[token];
}

// Block k of a span (muser_tile_load's words) as muser_mma_f16's A operands: a[4h .. 4h + 3]
// for product h (a[4h + r]: row r's (0: g, 1: g + 8) positions 0, 2; a[4h + 2 + r]: 1, 3).
template <int FORMAT>
inline void muser_tile_unpack_f16(thread uint* a, thread const uint* raw, uint k) {
  const int RAW = MUSER_TILE_RAW(FORMAT);
  for (uint r = 0; r < 2u; ++r) {
    thread const uint* words = raw + r * uint(RAW);
    if (FORMAT == MUSER_Q4_K) {  // d sc q - dmin m
      uint4 pairs = muser_q4k_group_scales(words[1], words[2], words[3], k / 2u);
      uint sc_m = (k % 2u != 0u ? pairs.z | (pairs.w << 16) : pairs.x | (pairs.y << 16)) | 0x64006400u;
      // (d sc, dmin m), each rounded once: (sc, m) exactly in f16, times (d, dmin)
      uint both = muser_half_fma(words[0], muser_half_fma(sc_m, 0x3C003C00u, 0xE400E400u), 0u);
      uint scales = (both & 65535u) | (both << 16);
      uint leasts = ((both >> 16) | (both & 0xFFFF0000u)) ^ 0x80008000u;  // -(dmin m), twice
      for (uint h = 0; h < 2u; ++h) {
        uint word = words[4u + 2u * (k / 2u) + h] >> (4u * (k % 2u));
        muser_tile_f16_codes(a + 4u * h + r, a + 4u * h + 2u + r, word, 0x000F000Fu, 0xE400E400u /* -1024 */,
                             scales, leasts);
      }
    } else if (FORMAT == MUSER_Q6_K) {  // d sc (c - 32)
      uint n = k / 4u;
      uint q = k % 4u;
      uint d = words[16] & 65535u;
      uint byte = 8u * n + 2u * q;  // the two halves' int8 scales: bytes byte, byte + 1 of words 12..15
      uint sc = (words[12u + byte / 4u] >> (8u * (byte % 4u))) & 65535u;
      uint sc_pair = (((sc & 255u) | ((sc & 0xFF00u) << 8)) ^ 0x00800080u) | 0x64006400u;  // 1024 + (sc + 128)
      uint both = muser_half_fma(muser_half_fma(sc_pair, 0x3C003C00u, 0xE480E480u), d | (d << 16), 0u);
      for (uint h = 0; h < 2u; ++h) {
        uint low = words[4u * n + 2u * (q % 2u) + h];
        uint high = words[8u + 2u * n + h];
        uint codes = ((low >> (4u * (q / 2u))) & 0x0F0F0F0Fu) | (((high >> (2u * q)) & 0x03030303u) << 4);
        uint scale = h == 0u ? (both & 65535u) | (both << 16) : (both >> 16) | (both & 0xFFFF0000u);
        muser_tile_f16_codes(a + 4u * h + r, a + 4u * h + 2u + r, codes, 0x00FF00FFu, 0xE420E420u /* -1056 */,
                             scale, 0u);
      }
    } else {  // d q: q + 128 from the flipped sign bit
      uint d = words[3u * k + 2u] & 65535u;
      for (uint h = 0; h < 2u; ++h) {
        muser_tile_f16_codes(a + 4u * h + r, a + 4u * h + 2u + r, words[3u * k + h] ^ 0x80808080u, 0x00FF00FFu,
                             0xE480E480u /* -1152 */, d | (d << 16), 0u);
      }
    }
  }
}

// Block k of the staged span for 8-token tile j: muser_mma_f16's B operands b[2h], b[2h + 1]
// for product h (token 8j + g).
template <int FORMAT, int IN>
inline void muser_tile_staged_f16(thread uint* b, const threadgroup uint4* stage, uint j, uint k, uint g, uint t) {
  // slot k ^ (g & 1): k + (g & 1) for even k, k - (g & 1) for odd (with k and j unrolled, a
  // constant offset from one of two addresses of the lane)
  uint swap = MUSER_TILE_SPAN(IN) > 1 ? 4u * (g & 1u) : 0u;
  const threadgroup uint4* row = stage + (8u * j + g) * uint(MUSER_TILE_SPAN(IN)) * 4u + 4u * k;
  const threadgroup uint4* block = k % 2u == 0u ? row + swap : row - swap;
  if (FORMAT == MUSER_Q6_K) {
    for (uint h = 0; h < 2u; ++h) {  // positions 16h + 4t ..: group 2h + t / 2, its pairs 2 (t % 2) ..
      const threadgroup uint2* halves = (const threadgroup uint2*)(block + 2u * h + t / 2u);
      uint2 pair = halves[t % 2u];
      b[2u * h] = pair.x;
      b[2u * h + 1u] = pair.y;
    }
  } else {
    uint4 group = block[t];
    b[0] = group.x;
    b[1] = group.y;
    b[2] = group.z;
    b[3] = group.w;
  }
}

// One block's products of the staged token tile j: the tile's (a) into acc[j * 4 ..], and with
// TWO the up projection's tile (up) into
// acc[NT * 4 + j * 4 ..], from one read of the stage.
template <int FORMAT, int NT, int IN, int TWO>
inline void muser_tile_block_f16(thread const uint* a, thread const uint* up, const threadgroup uint4* stage, uint j,
                                 uint k, uint lane, thread float* acc) {
  uint b[4];
  muser_tile_staged_f16<FORMAT, IN>(b, stage, j, k, lane / 4u, lane % 4u);
  muser_mma_f16(a, b[0], b[1], acc + j * 4u, lane);
  muser_mma_f16(a + 4, b[2], b[3], acc + j * 4u, lane);
  if (TWO != 0) {
    muser_mma_f16(up, b[0], b[1], acc + uint(NT * 4) + j * 4u, lane);
    muser_mma_f16(up + 4, b[2], b[3], acc + uint(NT * 4) + j * 4u, lane);
  }
}

// muser_tile_span_product's f16 form: the span's products added into the `live` token tiles'
// sums (acc), and with TWO (GLU's up projection, of the same format) its tile's (up_raw) into
// acc[NT * 4 ..]: each x tile read from the stage once for both.
template <int FORMAT, int NT, int IN, int TWO>
inline void muser_tile_span_product_f16(thread const uint* raw, thread const uint* up_raw,
                                        const threadgroup uint4* stage, uint live, uint lane, thread float* acc) {
  bool full = live == uint(NT);  // every token tile: no test a tile (uniform)
  MUSER_UNROLL
  for (uint k = 0; k < uint(MUSER_TILE_SPAN(IN)); ++k) {
    uint a[8];
    uint up[TWO != 0 ? 8 : 1];
    muser_tile_unpack_f16<FORMAT>(a, raw, k);
    if (TWO != 0) {
      muser_tile_unpack_f16<FORMAT>(up, up_raw, k);
    }
    if (full) {
      for (int j = 0; j < NT; ++j) {
        muser_tile_block_f16<FORMAT, NT, IN, TWO>(a, up, stage, uint(j), k, lane, acc);
      }
    } else {
      for (int j = 0; j < NT; ++j) {
        if (uint(j) < live) {
          muser_tile_block_f16<FORMAT, NT, IN, TWO>(a, up, stage, uint(j), k, lane, acc);
        }
      }
    }
  }
}
