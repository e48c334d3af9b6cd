// lib/tiles.metal — the batched decode products' engine (kernel product_tiles): a SIMD group
// multiplies 16-row tiles of a raw GGUF weight (Q4_K, Q6_K, Q8_0) by 8-token tiles of q8x
// activations as int8 matrix products (lib/base.metal's muser_mma_k32 / muser_mma_k16: tensor
// cores on NVIDIA GPUs), one 32-value block at a time, and scales each block's integer dots
// into float accumulators.
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
//   sc: Q6_K's int8 scales, [half * 2 + r].
struct muser_tile_w {
  uint a[4];
  float scale[2];
  float least[2];
  int sc[4];
};

// A span: the blocks a SIMD group's loads of a weight cover at once, 8 (a super-block of Q4_K
// or Q6_K; 8 Q8_0 blocks), or 1 for Q8_0 rows of a length that is not whole 256-value spans.
// The lane's words of a span of its two rows, all loaded before any is used (the loads of a
// span in flight together: ~2.3 KB a SIMD group), RAW words a row:
//   Q4_K (12): the super-block's 16-byte head (d, dmin, scales), then for each pair of
//              sub-blocks p the 8 quant bytes 32p + 8t .. (both sub-blocks' nibbles);
//   Q6_K (17): ql words 64n + 32m + 16h + 4t (i = 4n + 2m + h), qh words 128 + 32n + 16h + 4t
//              (8 + 2n + h), the 16 int8 scales (12..15), d (16);
//   Q8_0 (3 a block): the block's codes 2 + 8t.. (two words), then d.
template <int FORMAT, int IN>
inline uint muser_tile_span() {
  return FORMAT == MUSER_Q8_0 && IN % 256 != 0 ? 1u : 8u;
}

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
      for (uint k = 0; k < muser_tile_span<FORMAT, IN>(); ++k) {
        size_t block = row + 34u * size_t(span * muser_tile_span<FORMAT, IN>() + k);
        uint2 codes = muser_words2(weight, block + 2u + 8u * t);
        words[3u * k] = codes.x;
        words[3u * k + 1u] = codes.y;
        words[3u * k + 2u] = uint(*((const device ushort*)(weight + block)));
      }
    }
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
        w.sc[2u * h + uint(r)] = int(words[12u + byte / 4u] << (24u - 8u * (byte % 4u))) >> 24;
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

template <int FORMAT, int IN>
inline void muser_tile_activations(thread muser_tile_x& x, const device int8_t* xq, const device float* xd,
                                   const device float* xs, uint first_token, uint b, uint g, uint t) {
  const device int8_t* codes = xq + size_t(first_token + g) * uint(IN) + 32u * b;
  if (FORMAT == MUSER_Q6_K) {
    x.b0 = *((const device uint*)(codes + 4u * t));
    x.b1 = *((const device uint*)(codes + 16u + 4u * t));
  } else {
    uint2 words = *((const device uint2*)(codes + 8u * t));
    x.b0 = words.x;
    x.b1 = words.y;
  }
  for (uint e = 0; e < 2u; ++e) {
    uint token = first_token + 2u * t + e;
    x.scale[e] = xd[size_t(token) * uint(IN / 32) + b];
    if (FORMAT == MUSER_Q4_K) {
      float4 sums = *((const device float4*)(xs + size_t(token) * uint(IN / 8) + 4u * b));
      x.sum[e] = (sums.x + sums.y) + (sums.z + sums.w);
    } else {
      x.sum[e] = 0.0f;
    }
  }
}

// One block's products of a 16-row tile and an 8-token tile, added into acc[0..3] (C's
// layout: rows g, g, g+8, g+8; tokens 2t, 2t+1, 2t, 2t+1). The integer dots are exact; each
// becomes a float once (Q4_K |dot| <= 32 * 15 * 127, Q8_0 <= 32 * 127 * 127: below 2^22, by
// muser_int_float; Q6_K's two halves times their int8 scales may pass 2^22: a conversion).
template <int FORMAT>
inline void muser_tile_block(thread const muser_tile_w& w, thread const muser_tile_x& x, uint lane,
                             thread float* acc) {
  int c[4] = {0, 0, 0, 0};
  if (FORMAT == MUSER_Q6_K) {
    int second[4] = {0, 0, 0, 0};
    muser_mma_k16(w.a, x.b0, c, lane);
    muser_mma_k16(w.a + 2, x.b1, second, lane);
    for (int e = 0; e < 4; ++e) {
      int r = e / 2;
      int v = c[e] * w.sc[r] + second[e] * w.sc[2 + r];
      acc[e] = fma(w.scale[r] * x.scale[e % 2], float(v), acc[e]);
    }
  } else {
    muser_mma_k32(w.a, x.b0, x.b1, c, lane);
    for (int e = 0; e < 4; ++e) {
      int r = e / 2;
      acc[e] = fma(w.scale[r] * x.scale[e % 2], muser_int_float(c[e]), acc[e]);
      if (FORMAT == MUSER_Q4_K) {
        acc[e] = fma(-w.least[r], x.sum[e % 2], acc[e]);
      }
    }
  }
}

// The 16-row tile from first_row (rows past OUT re-read row OUT - 1; the caller never stores
// them) times `live` 8-token tiles (of at most NT) of x from first_token, over the spans part,
// part + SPLIT, ... of the row (SPLIT SIMD groups share a tile, each a share of its columns):
// acc[j * 4 + e] (e as muser_tile_block's). The weights' share of a block is read once for all
// the token tiles.
template <int FORMAT, int ROW_BYTES, int OUT, int NT, int IN, int SPLIT>
inline void muser_tile_rows(const device uint8_t* weight, uint first_row, const device int8_t* xq,
                            const device float* xd, const device float* xs, uint first_token, uint live, uint part,
                            uint lane, thread float* acc) {
  uint g = lane / 4u;
  uint t = lane % 4u;
  size_t row0 = size_t(min(first_row + g, uint(OUT - 1))) * uint(ROW_BYTES);
  size_t row8 = size_t(min(first_row + g + 8u, uint(OUT - 1))) * uint(ROW_BYTES);
  const uint SPAN = muser_tile_span<FORMAT, IN>();
  for (uint span = part; span < uint(IN / 32) / SPAN; span += uint(SPLIT)) {
    uint raw[2 * MUSER_TILE_RAW(FORMAT)];
    muser_tile_load<FORMAT, IN>(raw, weight, row0, row8, span, t);
    MUSER_UNROLL
    for (uint k = 0; k < SPAN; ++k) {
      muser_tile_w w;
      muser_tile_unpack<FORMAT>(w, raw, k);
      for (int j = 0; j < NT; ++j) {
        if (uint(j) < live) {
          muser_tile_x x;
          muser_tile_activations<FORMAT, IN>(x, xq, xd, xs, first_token + 8u * uint(j), span * SPAN + k, g, t);
          muser_tile_block<FORMAT>(w, x, lane, acc + j * 4);
        }
      }
    }
  }
}
