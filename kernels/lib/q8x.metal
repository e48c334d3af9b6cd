// lib/q8x.metal — activations as int8 blocks ("q8x") and the decode products' engine that
// reads them. x [T, IN] f32 becomes
//   xq int8 [T, IN]: q = round(x / d), half away from zero (0 where d is 0);
//   xd f32 [T, IN / 32]: d = max |x| / 127 over each 32 values;
//   xs f32 [T, IN / 8]: d * (the sum of each 8 codes), for the formats' offset and min terms.
// formats.quantize_activations is the numpy reference.
// Here: q8x's woven layout and the quantization of one block (for the kernels that write q8x),
// the units a product lane reads of x and of a weight row (Q4_K, Q6_K, Q8_0) and their integer
// dots, the threadgroup copy of x, and muser_rows_dot, which the product kernels call.
#include "lib/base.metal"
#include "lib/formats.metal"

// q8x's woven layout (formats.woven_positions), for products whose lanes read whole 64-value
// units: within each run of 32 units (a row of UNITS units; the last run holds n <= 32), piece
// k of unit j sits PER_PIECE * (k n + j) elements into the run (PER_UNIT elements a unit: 64
// codes in pieces of 16, or 8 sums in pieces of 4). muser_code_at / muser_sum_at: where code or
// sum i of a row sits; WOVEN_UNITS 0 is the plain layout (i itself).
template <int PER_UNIT, int PER_PIECE>
inline uint muser_woven(uint i, uint units) {
  uint unit = i / uint(PER_UNIT);
  uint run = unit / 32u;
  uint within = i % uint(PER_UNIT);
  uint n = units % 32u == 0u ? 32u : min(32u, units - 32u * run);  // (units: a constant)
  return 32u * uint(PER_UNIT) * run + uint(PER_PIECE) * ((within / uint(PER_PIECE)) * n + unit % 32u) +
         within % uint(PER_PIECE);
}

template <int WOVEN_UNITS>
inline uint muser_code_at(uint i) {
  return WOVEN_UNITS != 0 ? muser_woven<64, 16>(i, uint(WOVEN_UNITS)) : i;
}

template <int WOVEN_UNITS>
inline uint muser_sum_at(uint i) {
  return WOVEN_UNITS != 0 ? muser_woven<8, 4>(i, uint(WOVEN_UNITS)) : i;
}

// One 32-value block of activations quantized by a SIMD group, lane l holding value l: writes
// codes xq[32 * block + l], the scale xd[block] and the four sums xs[4 * block + l / 8]
// (WOVEN_UNITS > 0: codes and sums at their woven places in a row of that many 64-value units).
template <int WOVEN_UNITS = 0>
inline void muser_quantize_block(float value, uint lane, device int8_t* xq, device float* xd,
                                 device float* xs, uint block) {
  float d = simd_max(fabs(value)) / 127.0f;
  float q = d > 0.0f ? round(value / d) : 0.0f;
  xq[muser_code_at<WOVEN_UNITS>(32u * block + lane)] = int8_t(q);
  float sum = q + simd_shuffle_xor(q, 1u);
  sum += simd_shuffle_xor(sum, 2u);
  sum += simd_shuffle_xor(sum, 4u);
  if (lane % 8u == 0u) {
    xs[muser_sum_at<WOVEN_UNITS>(4u * block + lane / 8u)] = d * sum;
  }
  if (lane == 0u) {
    xd[block] = d;
  }
}

// The activations one product unit reads (32 values of x for one token): codes as 8 words
// (int8 x4), and the scales and sums of the blocks they come from (Q6_K: each quarter's code sum,
// counted from its codes). Which 32 values, and which scales and sums, depends on the weight
// format's unit (muser_x_unit).
struct muser_x_unit {
  uint codes[8];
  float scale[4];
  float sum[4];
  int bias[4];  // Q6_K: -32 times each quarter's code sum (LEAN's integer offset term)
};

// Q6_K's 32-value unit, in two steps: int8 scale k (0..7) of a half super-block's 8
// (two words) times d; and four 6-bit codes of one quarter (0..3) as bytes, from a word of its
// ql run (quarters 0 and 1 in the low nibbles, 2 and 3 in the high ones) and the same
// positions' qh word (bits 2q, 2q+1).
template <int INT_FLOATS>
inline float muser_q6k_scale(uint2 scales, uint k, float d) {
  uint word = k < 4u ? scales.x : scales.y;
  return d * muser_float_of<INT_FLOATS>(int(word << (24u - 8u * (k % 4u))) >> 24);
}

inline uint muser_q6k_codes(uint low, uint high, uint quarter) {
  return ((low >> (4u * (quarter / 2u))) & 0x0F0F0F0Fu) | (((high >> (2u * quarter)) & 0x03030303u) << 4);
}

// Unit u of a row (u < IN / 32) for FORMAT (Q4_K, Q6_K or Q8_0); each unit covers 32 values.
//   Q4_K: super-block u / 8, 16 quant bytes c = u % 8 (group g = c / 2, half h = c % 2): low
//         nibbles are values 16h..16h+15 of sub-block 2g ("a"), high ones of sub-block 2g+1 ("b").
//   Q6_K: super-block u / 8, half h = (u % 8) / 4, positions l0 = 8 (u % 4) .. l0 + 7 of each
//         of the half's four 32-value quarters.
//   Q8_0: block u.
// WOVEN_UNITS > 0: x's codes and sums are woven (muser_code_at), in rows of that many
// 64-value units.
template <int FORMAT, int WOVEN_UNITS = 0, int INT_FLOATS = 0>
inline void muser_load_x_unit(thread muser_x_unit& x, const device int8_t* xq, const device float* xd,
                              const device float* xs, uint unit) {
  uint super_block = unit / 8u;
  if (FORMAT == MUSER_Q4_K) {
    uint c = unit % 8u;
    uint first = 256u * super_block + 64u * (c / 2u) + 16u * (c % 2u);  // value 0 of "a"
    uint4 a = *((const device uint4*)(xq + muser_code_at<WOVEN_UNITS>(first)));
    uint4 b = *((const device uint4*)(xq + muser_code_at<WOVEN_UNITS>(first + 32u)));
    x.codes[0] = a.x; x.codes[1] = a.y; x.codes[2] = a.z; x.codes[3] = a.w;
    x.codes[4] = b.x; x.codes[5] = b.y; x.codes[6] = b.z; x.codes[7] = b.w;
    x.scale[0] = xd[first / 32u];
    x.scale[1] = xd[first / 32u + 1u];
    x.sum[0] = xs[muser_sum_at<WOVEN_UNITS>(first / 8u)] + xs[muser_sum_at<WOVEN_UNITS>(first / 8u + 1u)];
    x.sum[1] = xs[muser_sum_at<WOVEN_UNITS>(first / 8u + 4u)] + xs[muser_sum_at<WOVEN_UNITS>(first / 8u + 5u)];
  } else if (FORMAT == MUSER_Q6_K) {
    uint first = 256u * super_block + 128u * ((unit % 8u) / 4u) + 8u * (unit % 4u);
    for (int quarter = 0; quarter < 4; ++quarter) {
      uint2 codes = *((const device uint2*)(xq + muser_code_at<WOVEN_UNITS>(first + 32u * uint(quarter))));
      x.codes[2 * quarter] = codes.x;
      x.codes[2 * quarter + 1] = codes.y;
      x.scale[quarter] = xd[first / 32u + uint(quarter)];
      // The quarter's code sum, an integer (|sum| <= 1016): from its codes, not a load of xs
      // (a float by INT_FLOATS's route, muser_float_of).
      int sum = muser_dot4(codes.y, 0x01010101u, muser_dot4(codes.x, 0x01010101u, 0));
      x.sum[quarter] = muser_float_of<INT_FLOATS>(sum);
      x.bias[quarter] = -32 * sum;
    }
  } else {
    uint4 a = *((const device uint4*)(xq + muser_code_at<WOVEN_UNITS>(32u * unit)));
    uint4 b = *((const device uint4*)(xq + muser_code_at<WOVEN_UNITS>(32u * unit + 16u)));
    x.codes[0] = a.x; x.codes[1] = a.y; x.codes[2] = a.z; x.codes[3] = a.w;
    x.codes[4] = b.x; x.codes[5] = b.y; x.codes[6] = b.z; x.codes[7] = b.w;
    x.scale[0] = xd[unit];
  }
}

// Unit u of one weight row (starting at byte `row` of `weight`, 4-byte aligned base) dotted
// with the activations of TOKENS tokens; adds into out[t * STRIDE].
//   Q4_K: sum_i (d sc q_i - dmin m) x_i = d sc xd (sum_i q_i c_i) - dmin m (xd sum_i c_i).
//   Q6_K: sum_i d sc (q_i - 32) x_i = d sc xd (sum_i q_i c_i - 32 sum_i c_i), the code sums
//         from the codes themselves (integers, exact).
//   Q8_0: sum_i d q_i x_i = d xd (sum_i q_i c_i).
template <int FORMAT, int TOKENS, int STRIDE, int INT_FLOATS, int LEAN>
inline void muser_unit_dot(const device uint8_t* weight, size_t row, uint unit,
                           thread const muser_x_unit* x, thread float* out) {
  uint super_block = unit / 8u;
  if (FORMAT == MUSER_Q4_K) {
    const device uint8_t* block = weight + row + 144u * super_block;
    uint c = unit % 8u;
    uint4 head = *((const device uint4*)block);
    uint4 quants = *((const device uint4*)(block + 16u + 16u * c));
    uint4 pairs = muser_q4k_group_scales(head.y, head.z, head.w, c / 2u);
    float d = muser_half_low(head.x);
    float dmin = muser_half_high(head.x);
    // The high nibbles stay in place (q & 0xF0): dot_b counts them 16 times; their scale
    // takes the 1/16 (exact: a power of two).
    uint low[4] = {quants.x & 0x0F0F0F0Fu, quants.y & 0x0F0F0F0Fu, quants.z & 0x0F0F0F0Fu, quants.w & 0x0F0F0F0Fu};
    uint high[4] = {quants.x & 0xF0F0F0F0u, quants.y & 0xF0F0F0F0u, quants.z & 0xF0F0F0F0u, quants.w & 0xF0F0F0F0u};
    float scale_a = d * muser_float_of<INT_FLOATS>(pairs.x);
    float scale_b = d * muser_float_of<INT_FLOATS>(pairs.z) * 0.0625f;
    for (int t = 0; t < TOKENS; ++t) {
      int dot_a = muser_dot4(low[1], x[t].codes[1], muser_dot4(low[0], x[t].codes[0], 0)) +
                  muser_dot4(low[3], x[t].codes[3], muser_dot4(low[2], x[t].codes[2], 0));
      int dot_b = muser_dot4u(high[1], x[t].codes[5], muser_dot4u(high[0], x[t].codes[4], 0)) +
                  muser_dot4u(high[3], x[t].codes[7], muser_dot4u(high[2], x[t].codes[6], 0));
      out[t * STRIDE] += (scale_a * x[t].scale[0] * muser_float_of<INT_FLOATS>(dot_a) +
                          scale_b * x[t].scale[1] * muser_float_of<INT_FLOATS>(dot_b)) -
                         dmin * (muser_float_of<INT_FLOATS>(pairs.y) * x[t].sum[0] +
                                 muser_float_of<INT_FLOATS>(pairs.w) * x[t].sum[1]);
    }
  } else if (FORMAT == MUSER_Q6_K) {
    size_t block = row + 210u * super_block;
    uint half_index = (unit % 8u) / 4u;
    uint l0 = 8u * (unit % 4u);
    uint2 low_a = muser_words2(weight, block + 64u * half_index + l0);        // quarters 0 and 2
    uint2 low_b = muser_words2(weight, block + 64u * half_index + 32u + l0);  // quarters 1 and 3
    uint2 high = muser_words2(weight, block + 128u + 32u * half_index + l0);  // bits 2q, 2q+1
    uint2 scales = muser_words2(weight, block + 192u + 8u * half_index);      // 8 int8 scales
    float d = float(as_type<half>(*((const device ushort*)(weight + block + 208u))));
    if (LEAN != 0) {
      // The offset -32 in the integers: each quarter's dot starts from x's -32 * (its code
      // sum), so the dot is sum_i (q_i - 32) c_i, |.| <= 8 * 32 * 127; times the int8 scale,
      // |.| <= 4,161,536 < 2^22, still an integer; then one float product by x's scale a
      // quarter and by d a unit. Another rounding order than LEAN 0's, the same bound.
      int sc[4];
      uint2 codes[4];
      for (int quarter = 0; quarter < 4; ++quarter) {
        uint k = 2u * uint(quarter) + l0 / 16u;
        uint word = quarter < 2 ? scales.x : scales.y;
        sc[quarter] = int(word << (24u - 8u * (k % 4u))) >> 24;
        uint2 low = quarter % 2 == 0 ? low_a : low_b;
        codes[quarter] = uint2(muser_q6k_codes(low.x, high.x, uint(quarter)), muser_q6k_codes(low.y, high.y, uint(quarter)));
      }
      for (int t = 0; t < TOKENS; ++t) {
        float p = 0.0f;
        for (int quarter = 0; quarter < 4; ++quarter) {
          int dot = muser_dot4(codes[quarter].y, x[t].codes[2 * quarter + 1],
                               muser_dot4(codes[quarter].x, x[t].codes[2 * quarter], x[t].bias[quarter]));
          p = fma(x[t].scale[quarter], muser_float_of<INT_FLOATS>(dot * sc[quarter]), p);
        }
        out[t * STRIDE] = fma(d, p, out[t * STRIDE]);
      }
      return;
    }
    float sc[4];
    for (int quarter = 0; quarter < 4; ++quarter) {
      sc[quarter] = muser_q6k_scale<INT_FLOATS>(scales, 2u * uint(quarter) + l0 / 16u, d);  // the quarter's 16 values
    }
    for (int quarter = 0; quarter < 4; ++quarter) {
      uint2 low = quarter % 2 == 0 ? low_a : low_b;
      uint code0 = muser_q6k_codes(low.x, high.x, uint(quarter));
      uint code1 = muser_q6k_codes(low.y, high.y, uint(quarter));
      for (int t = 0; t < TOKENS; ++t) {
        int dot = muser_dot4(code0, x[t].codes[2 * quarter], 0) + muser_dot4(code1, x[t].codes[2 * quarter + 1], 0);
        float codes = muser_float_of<INT_FLOATS>(dot);
        out[t * STRIDE] += sc[quarter] * (x[t].scale[quarter] * (codes - 32.0f * x[t].sum[quarter]));
      }
    }
  } else {
    size_t block = row + 34u * size_t(unit);
    float d = float(as_type<half>(*((const device ushort*)(weight + block))));
    uint codes[8];
    for (int pair = 0; pair < 4; ++pair) {
      uint2 words = muser_words2(weight, block + 2u + 8u * uint(pair));
      codes[2 * pair] = words.x;
      codes[2 * pair + 1] = words.y;
    }
    for (int t = 0; t < TOKENS; ++t) {
      int dot = 0;
      for (int word = 0; word < 8; ++word) {
        dot = muser_dot4(codes[word], x[t].codes[word], dot);
      }
      out[t * STRIDE] += d * x[t].scale[0] * muser_float_of<INT_FLOATS>(dot);
    }
  }
}

// Wide units: 64 values, so that a super-block's scales are read and unpacked once per 64
// values instead of once per 32. Q4_K only: group g = u % 4 of super-block u / 4 (its 32 quant
// bytes, both sub-blocks 2g and 2g+1 whole), about a third fewer instructions a weight byte.
// Activations: the codes of values 64g..64g+63 (16 words), the two blocks' scales and sums
// (scale[0..1], sum[0..1]). (Q6_K in 64-value units ran slower on the H200 and was dropped.)
struct muser_x_unit64 {
  uint codes[16];
  float scale[2];
  float sum[2];
};

// (WOVEN_UNITS > 0: woven x, whose 32 consecutive units' k-th pieces are contiguous.)
template <int FORMAT, int WOVEN_UNITS = 0, int INT_FLOATS = 0>
inline void muser_load_x_unit(thread muser_x_unit64& x, const device int8_t* xq, const device float* xd,
                              const device float* xs, uint unit) {
  uint block = 2u * unit;  // the first of the unit's two 32-value blocks
  for (int k = 0; k < 4; ++k) {
    uint4 words = *((const device uint4*)(xq + muser_code_at<WOVEN_UNITS>(64u * unit + 16u * uint(k))));
    x.codes[4 * k] = words.x; x.codes[4 * k + 1] = words.y; x.codes[4 * k + 2] = words.z; x.codes[4 * k + 3] = words.w;
  }
  x.scale[0] = xd[block];
  x.scale[1] = xd[block + 1u];
  float4 sums_a = *((const device float4*)(xs + muser_sum_at<WOVEN_UNITS>(4u * block)));
  float4 sums_b = *((const device float4*)(xs + muser_sum_at<WOVEN_UNITS>(4u * block + 4u)));
  x.sum[0] = (sums_a.x + sums_a.y) + (sums_a.z + sums_a.w);
  x.sum[1] = (sums_b.x + sums_b.y) + (sums_b.z + sums_b.w);
}

// A wide Q4_K unit's two integer dots with one token's codes: low nibbles with values 0-31
// (sub-block a), the high ones in place with values 32-63 (sub-block b, 16 times the dot),
// in four short chains a dot, not one of eight: these launches wait on their latency.
inline void muser_wide_dots(thread const uint* low, thread const uint* high, thread const uint* codes,
                            thread int& dot_a, thread int& dot_b) {
  int part_a[4];
  int part_b[4];
  for (int k = 0; k < 4; ++k) {
    part_a[k] = muser_dot4(low[2 * k + 1], codes[2 * k + 1], muser_dot4(low[2 * k], codes[2 * k], 0));
    part_b[k] = muser_dot4u(high[2 * k + 1], codes[9 + 2 * k], muser_dot4u(high[2 * k], codes[8 + 2 * k], 0));
  }
  dot_a = (part_a[0] + part_a[1]) + (part_a[2] + part_a[3]);
  dot_b = (part_b[0] + part_b[1]) + (part_b[2] + part_b[3]);
}

// Wide unit u of one Q4_K row dotted with TOKENS tokens; adds into out[t * STRIDE] (kernels
// take wide units for Q4_K only). LEAN 1: each integer dot is multiplied by its 6-bit scale
// as an integer (|63 * dot| < 2^22, dot_b taken / 16 first, exactly) before it becomes a
// float, so that no float scale products are formed: fewer instructions a unit-row, another
// rounding order, the same bound (kernel product's LEAN).
template <int FORMAT, int TOKENS, int STRIDE, int INT_FLOATS, int LEAN>
inline void muser_unit_dot(const device uint8_t* weight, size_t row, uint unit,
                           thread const muser_x_unit64* x, thread float* out) {
  const device uint8_t* block = weight + row + 144u * (unit / 4u);
  uint g = unit % 4u;
  uint4 head = *((const device uint4*)block);
  uint4 q0 = *((const device uint4*)(block + 16u + 32u * g));
  uint4 q1 = *((const device uint4*)(block + 32u + 32u * g));
  uint4 pairs = muser_q4k_group_scales(head.y, head.z, head.w, g);
  float d = muser_half_low(head.x);
  float dmin = muser_half_high(head.x);
  uint low[8] = {q0.x & 0x0F0F0F0Fu, q0.y & 0x0F0F0F0Fu, q0.z & 0x0F0F0F0Fu, q0.w & 0x0F0F0F0Fu,
                 q1.x & 0x0F0F0F0Fu, q1.y & 0x0F0F0F0Fu, q1.z & 0x0F0F0F0Fu, q1.w & 0x0F0F0F0Fu};
  // The high nibbles in place: dot_b counts them 16 times, scale_b takes the 1/16 (exact).
  uint high[8] = {q0.x & 0xF0F0F0F0u, q0.y & 0xF0F0F0F0u, q0.z & 0xF0F0F0F0u, q0.w & 0xF0F0F0F0u,
                  q1.x & 0xF0F0F0F0u, q1.y & 0xF0F0F0F0u, q1.z & 0xF0F0F0F0u, q1.w & 0xF0F0F0F0u};
  // (The 6-bit scales and the dots, |dot_a| <= 32 * 15 * 127 and |dot_b| <= 32 * 240 * 127,
  // below 2^22, become floats without a conversion where INT_FLOATS is 1: muser_float_of.)
  if (LEAN != 0) {
    float m_a = muser_float_of<INT_FLOATS>(pairs.y);
    float m_b = muser_float_of<INT_FLOATS>(pairs.w);
    for (int t = 0; t < TOKENS; ++t) {
      int dot_a, dot_b;
      muser_wide_dots(low, high, x[t].codes, dot_a, dot_b);
      // 6-bit scale times dot as integers, |.| <= 63 * 32 * 15 * 127 < 2^22 (dot_b is 16 times
      // an integer: the shift is exact).
      float scaled_a = muser_float_of<INT_FLOATS>(int(pairs.x) * dot_a);
      float scaled_b = muser_float_of<INT_FLOATS>(int(pairs.z) * (dot_b >> 4));
      float p = x[t].scale[0] * scaled_a + x[t].scale[1] * scaled_b;
      float m = m_a * x[t].sum[0] + m_b * x[t].sum[1];
      out[t * STRIDE] = fma(d, p, fma(-dmin, m, out[t * STRIDE]));
    }
    return;
  }
  float scale_a = d * muser_float_of<INT_FLOATS>(pairs.x);
  float scale_b = d * muser_float_of<INT_FLOATS>(pairs.z) * 0.0625f;
  float min_a = dmin * muser_float_of<INT_FLOATS>(pairs.y);
  float min_b = dmin * muser_float_of<INT_FLOATS>(pairs.w);
  for (int t = 0; t < TOKENS; ++t) {
    int dot_a, dot_b;
    muser_wide_dots(low, high, x[t].codes, dot_a, dot_b);
    out[t * STRIDE] += (scale_a * x[t].scale[0] * muser_float_of<INT_FLOATS>(dot_a) +
                        scale_b * x[t].scale[1] * muser_float_of<INT_FLOATS>(dot_b)) -
                       (min_a * x[t].sum[0] + min_b * x[t].sum[1]);
  }
}

// Where a product's units read x: muser_x_global, the q8x arrays in device memory (TOKENS rows
// of IN values; WOVEN_UNITS > 0: codes and sums woven, muser_code_at, in rows of that many
// 64-value units); muser_x_staged, a threadgroup's copy of them (muser_stage_x; IN a multiple
// of 64) for wide Q4_K units and Q8_0 units.
template <int WOVEN_UNITS = 0>
struct muser_x_global {
  const device int8_t* xq;
  const device float* xd;
  const device float* xs;
};

// words: x's codes as 16-byte chunks, chunk i (of all TOKENS rows, in order) at muser_x_slot(i)
// (a slot stays within its aligned group of 4). A SIMD group's lanes read chunk k of
// consecutive units (4 chunks a wide Q4_K unit, 2 a Q8_0 one; 16-byte reads, 8 lanes at a
// time); the slots put any 8 consecutive lanes on distinct banks of a 128-byte window. blocks:
// per 64 values, (scale, sum) of its two 32-value blocks (the sum as xs's four, added as
// muser_load_x_unit adds them).
struct muser_x_staged {
  const threadgroup uint4* words;
  const threadgroup float4* blocks;
};

inline uint muser_x_slot(uint chunk) {
  return chunk ^ ((chunk >> 3) & 3u);
}

// Threads first, first + step, ... of a threadgroup copy TOKENS rows of q8x x to words
// (TOKENS * IN / 16 chunks) and blocks (TOKENS * IN / 64); the caller then waits at a
// threadgroup barrier. WOVEN_UNITS > 0: x arrives woven (IN / 64 units a row); the copy is
// in the plain order either way.
template <int TOKENS, int IN, int WOVEN_UNITS = 0>
inline void muser_stage_x(const device int8_t* xq, const device float* xd, const device float* xs,
                          threadgroup uint4* words, threadgroup float4* blocks, uint first, uint step) {
  for (uint i = first; i < uint(TOKENS * IN / 16); i += step) {
    uint row = i / uint(IN / 16);
    uint at = WOVEN_UNITS != 0 ? uint(IN) * row + muser_code_at<WOVEN_UNITS>(16u * (i - uint(IN / 16) * row)) : 16u * i;
    words[muser_x_slot(i)] = *((const device uint4*)(xq + at));
  }
  for (uint p = first; p < uint(TOKENS * IN / 64); p += step) {
    uint row = p / uint(IN / 64);
    uint at = 8u * (p - uint(IN / 64) * row);  // the unit's first sum in its row
    const device float* sums = xs + uint(IN / 8) * row;
    float4 sums_a = WOVEN_UNITS != 0 ? *((const device float4*)(sums + muser_sum_at<WOVEN_UNITS>(at)))
                                     : ((const device float4*)xs)[2u * p];
    float4 sums_b = WOVEN_UNITS != 0 ? *((const device float4*)(sums + muser_sum_at<WOVEN_UNITS>(at + 4u)))
                                     : ((const device float4*)xs)[2u * p + 1u];
    blocks[p] = float4(xd[2u * p], (sums_a.x + sums_a.y) + (sums_a.z + sums_a.w), xd[2u * p + 1u],
                       (sums_b.x + sums_b.y) + (sums_b.z + sums_b.w));
  }
}

// Unit u of token t's activations, from either source: the same values (the staged sums are
// added in the same order).
template <int FORMAT, int IN, int INT_FLOATS, class X, int WOVEN_UNITS>
inline void muser_load_x(thread X& x, muser_x_global<WOVEN_UNITS> source, int t, uint unit) {
  muser_load_x_unit<FORMAT, WOVEN_UNITS, INT_FLOATS>(x, source.xq + t * IN, source.xd + t * (IN / 32),
                                                     source.xs + t * (IN / 8), unit);
}

template <int FORMAT, int IN, int INT_FLOATS>
inline void muser_load_x(thread muser_x_unit64& x, muser_x_staged source, int t, uint unit) {  // wide Q4_K
  uint first = uint(t) * uint(IN / 16) + 4u * unit;
  for (int k = 0; k < 4; ++k) {
    uint4 words = source.words[muser_x_slot(first + uint(k))];
    x.codes[4 * k] = words.x; x.codes[4 * k + 1] = words.y; x.codes[4 * k + 2] = words.z; x.codes[4 * k + 3] = words.w;
  }
  float4 pair = source.blocks[uint(t) * uint(IN / 64) + unit];
  x.scale[0] = pair.x;
  x.sum[0] = pair.y;
  x.scale[1] = pair.z;
  x.sum[1] = pair.w;
}

template <int FORMAT, int IN, int INT_FLOATS>
inline void muser_load_x(thread muser_x_unit& x, muser_x_staged source, int t, uint unit) {  // Q8_0
  uint first = uint(t) * uint(IN / 16) + 2u * unit;
  uint4 a = source.words[muser_x_slot(first)];
  uint4 b = source.words[muser_x_slot(first + 1u)];
  x.codes[0] = a.x; x.codes[1] = a.y; x.codes[2] = a.z; x.codes[3] = a.w;
  x.codes[4] = b.x; x.codes[5] = b.y; x.codes[6] = b.z; x.codes[7] = b.w;
  float4 pair = source.blocks[uint(t) * uint(IN / 64) + unit / 2u];
  x.scale[0] = (unit & 1u) != 0u ? pair.z : pair.x;
}

// One pass of muser_rows_dot_units: the UNROLL units base, base + 32, ... of each row (CLAMP:
// a unit past the row's last re-reads the last unit and adds nothing).
template <class X, int FORMAT, int ROW_BYTES, int OUT, int ROWS, int TOKENS, int IN, int UNROLL, int INT_FLOATS,
          int LEAN, bool CLAMP, class SOURCE>
inline void muser_rows_dot_pass(const device uint8_t* weight, uint first_row, SOURCE source, uint base,
                                uint units_count, thread float* acc) {
  X x[UNROLL * TOKENS];
  uint units[UNROLL];
  for (int u = 0; u < UNROLL; ++u) {
    units[u] = CLAMP ? min(base + 32u * uint(u), units_count - 1u) : base + 32u * uint(u);
    for (int t = 0; t < TOKENS; ++t) {
      muser_load_x<FORMAT, IN, INT_FLOATS>(x[u * TOKENS + t], source, t, units[u]);
    }
  }
  float part[UNROLL * TOKENS * ROWS];
  for (int i = 0; i < UNROLL * TOKENS * ROWS; ++i) {
    part[i] = 0.0f;
  }
  for (int u = 0; u < UNROLL; ++u) {
    for (int r = 0; r < ROWS; ++r) {
      uint row = min(first_row + uint(r), uint(OUT - 1));
      muser_unit_dot<FORMAT, TOKENS, ROWS, INT_FLOATS, LEAN>(weight, size_t(row) * size_t(ROW_BYTES), units[u],
                                                             x + u * TOKENS, part + u * TOKENS * ROWS + r);
    }
  }
  for (int u = 0; u < UNROLL; ++u) {
    if (!CLAMP || base + 32u * uint(u) < units_count) {
      for (int i = 0; i < TOKENS * ROWS; ++i) {
        acc[i] += part[u * TOKENS * ROWS + i];
      }
    }
  }
}

// The ROWS rows first_row.. of a weight (rows past OUT re-read row OUT-1; the caller never
// stores them) dotted with TOKENS tokens of q8x activations (from `source`) by one SIMD group:
// lane l takes units l, l + 32, ... of every row, so the lanes' weight loads are consecutive.
// UNROLL units per lane at a time (l, l + 32, ..., l + 32 (UNROLL - 1)): their loads are issued
// together before any is used (a unit past the row's last re-reads the last unit and adds
// nothing). Adds each lane's share into acc[t * ROWS + r]; the caller sums the lanes. The units
// are X's: muser_x_unit (32 values) or, for Q4_K, muser_x_unit64 (64; muser_rows_dot's WIDE).
// Rows of exactly 32 * UNROLL units take one pass without a loop or a clamp, the lane's
// bound said aloud, so that the compiler folds the units' arithmetic.
template <class X, int UNIT_VALUES, int FORMAT, int ROW_BYTES, int OUT, int ROWS, int TOKENS, int IN, int UNROLL,
          int INT_FLOATS, int LEAN, class SOURCE>
inline void muser_rows_dot_units(const device uint8_t* weight, uint first_row, SOURCE source, uint lane,
                                 thread float* acc) {
  const uint UNITS = uint(IN / UNIT_VALUES);
  if (IN / UNIT_VALUES == 32 * UNROLL) {
    muser_rows_dot_pass<X, FORMAT, ROW_BYTES, OUT, ROWS, TOKENS, IN, UNROLL, INT_FLOATS, LEAN, false>(
        weight, first_row, source, lane & 31u, UNITS, acc);
  } else {
    for (uint base = lane; base < UNITS; base += 32u * uint(UNROLL)) {
      muser_rows_dot_pass<X, FORMAT, ROW_BYTES, OUT, ROWS, TOKENS, IN, UNROLL, INT_FLOATS, LEAN, true>(
          weight, first_row, source, base, UNITS, acc);
    }
  }
}

// muser_rows_dot_units in 32-value units, or in wide ones for Q4_K when WIDE is 1 (other
// formats ignore WIDE). SOURCE: muser_x_global, or muser_x_staged for the formats and units it
// holds. INT_FLOATS: how the units' integer dots and scales become floats (muser_float_of).
template <int FORMAT, int ROW_BYTES, int OUT, int ROWS, int TOKENS, int IN, int UNROLL, int WIDE, int INT_FLOATS,
          int LEAN = 0, class SOURCE>
inline void muser_rows_dot(const device uint8_t* weight, uint first_row, SOURCE source, uint lane, thread float* acc) {
  if (WIDE != 0 && FORMAT == MUSER_Q4_K) {
    muser_rows_dot_units<muser_x_unit64, 64, FORMAT, ROW_BYTES, OUT, ROWS, TOKENS, IN, UNROLL, INT_FLOATS, LEAN>(
        weight, first_row, source, lane, acc);
  } else {
    muser_rows_dot_units<muser_x_unit, 32, FORMAT, ROW_BYTES, OUT, ROWS, TOKENS, IN, UNROLL, INT_FLOATS, LEAN>(
        weight, first_row, source, lane, acc);
  }
}
