// blocks.metal — decoders for one element of a GGUF row, included by every kernel.
//
// `row` points at the first byte of a row; `element` counts values from the row's start.
// Each decoder re-derives its element's address from that one integer (block, sub-block,
// byte, bit position), exactly as muser_mlx/formats.py does on the host. Arithmetic is
// float32 in ggml's order. Format ids are the ggml type numbers.

#define MUSER_F32 0
#define MUSER_F16 1
#define MUSER_Q4_0 2
#define MUSER_Q4_1 3
#define MUSER_Q5_0 6
#define MUSER_Q5_1 7
#define MUSER_Q8_0 8
#define MUSER_Q2_K 10
#define MUSER_Q3_K 11
#define MUSER_Q4_K 12
#define MUSER_Q5_K 13
#define MUSER_Q6_K 14
#define MUSER_IQ4_NL 20
#define MUSER_IQ4_XS 23
#define MUSER_BF16 30

// The IQ4_NL / IQ4_XS code book.
constant float muser_iq4_values[16] = {
    -127.f, -104.f, -83.f, -65.f, -49.f, -35.f, -22.f, -10.f,
    1.f, 13.f, 25.f, 38.f, 53.f, 69.f, 89.f, 113.f};

// Little-endian scalars from byte pointers (rows are byte-aligned, so no wide loads here).
inline float muser_f16(const device uint8_t* p) {
  return float(as_type<half>(ushort(uint(p[0]) | (uint(p[1]) << 8))));
}

inline float muser_bf16(const device uint8_t* p) {
  return as_type<float>((uint(p[0]) << 16) | (uint(p[1]) << 24));
}

inline float muser_f32(const device uint8_t* p) {
  return as_type<float>(uint(p[0]) | (uint(p[1]) << 8) | (uint(p[2]) << 16) | (uint(p[3]) << 24));
}

// 32-element blocks: element w of the block is the low nibble of byte w % 16 (w < 16) or the
// high nibble (w >= 16).
inline uint muser_nibble32(const device uint8_t* qs, uint w) {
  return (uint(qs[w % 16]) >> (4 * (w / 16))) & 15u;
}

// Word i (0..3) of a 16-byte load; i is a compile-time constant in unrolled loops.
inline uint muser_word(uint4 words, int i) {
  return i == 0 ? words.x : (i == 1 ? words.y : (i == 2 ? words.z : words.w));
}

// Q5_0 / Q5_1: bit w of the 32-bit qh field is element w's fifth bit.
inline uint muser_fifth_bit(const device uint8_t* qh, uint w) {
  return ((uint(qh[w / 8]) >> (w % 8)) & 1u) << 4;
}

inline float muser_q4_0_value(const device uint8_t* row, uint element) {
  const device uint8_t* block = row + (element / 32) * 18;
  uint w = element % 32;
  return muser_f16(block) * (float(muser_nibble32(block + 2, w)) - 8.0f);
}

inline float muser_q4_1_value(const device uint8_t* row, uint element) {
  const device uint8_t* block = row + (element / 32) * 20;
  uint w = element % 32;
  return muser_f16(block) * float(muser_nibble32(block + 4, w)) + muser_f16(block + 2);
}

inline float muser_q5_0_value(const device uint8_t* row, uint element) {
  const device uint8_t* block = row + (element / 32) * 22;
  uint w = element % 32;
  uint q = muser_nibble32(block + 6, w) | muser_fifth_bit(block + 2, w);
  return muser_f16(block) * (float(q) - 16.0f);
}

inline float muser_q5_1_value(const device uint8_t* row, uint element) {
  const device uint8_t* block = row + (element / 32) * 24;
  uint w = element % 32;
  uint q = muser_nibble32(block + 8, w) | muser_fifth_bit(block + 4, w);
  return muser_f16(block) * float(q) + muser_f16(block + 2);
}

inline float muser_q8_0_value(const device uint8_t* row, uint element) {
  const device uint8_t* block = row + (element / 32) * 34;
  return muser_f16(block) * float(int8_t(block[2 + element % 32]));
}

inline float muser_iq4_nl_value(const device uint8_t* row, uint element) {
  const device uint8_t* block = row + (element / 32) * 18;
  return muser_f16(block) * muser_iq4_values[muser_nibble32(block + 2, element % 32)];
}

// Q2_K / Q3_K: a 256-element super-block is two 128-element halves, each stored in 32 bytes
// of 2-bit planes: element w reads byte 32*(w/128) + w%32, plane (w%128)/32; scales go per
// 16 elements.
inline uint muser_2bit(const device uint8_t* qs, uint w) {
  return (uint(qs[32 * (w / 128) + w % 32]) >> (2 * ((w % 128) / 32))) & 3u;
}

inline float muser_q2_k_value(const device uint8_t* row, uint element) {
  const device uint8_t* block = row + (element / 256) * 84;
  uint w = element % 256;
  uint packed = block[w / 16];  // low nibble: scale, high nibble: min
  float d = muser_f16(block + 80);
  float dmin = muser_f16(block + 82);
  return d * float(packed & 15u) * float(muser_2bit(block + 16, w)) - dmin * float(packed >> 4);
}

inline float muser_q3_k_value(const device uint8_t* row, uint element) {
  const device uint8_t* block = row + (element / 256) * 110;
  uint w = element % 256;
  const device uint8_t* scales = block + 96;
  uint j = w / 16;
  uint low = j < 8 ? (uint(scales[j]) & 15u) : (uint(scales[j - 8]) >> 4);
  uint high = (uint(scales[8 + j % 4]) >> (2 * (j / 4))) & 3u;
  int scale = int(low | (high << 4)) - 32;
  int q = int(muser_2bit(block + 32, w)) - (((uint(block[w % 32]) >> (w / 32)) & 1u) ? 0 : 4);
  return muser_f16(block + 108) * float(scale) * float(q);
}

// Q4_K / Q5_K: 6-bit (scale, min) of sub-block j (0..7) from the 12 packed bytes.
inline uint2 muser_scale_min(const device uint8_t* scales, uint j) {
  if (j < 4) {
    return uint2(uint(scales[j]) & 63u, uint(scales[j + 4]) & 63u);
  }
  return uint2((uint(scales[j + 4]) & 15u) | ((uint(scales[j - 4]) >> 6) << 4),
               (uint(scales[j + 4]) >> 4) | ((uint(scales[j]) >> 6) << 4));
}

// The seed's four-level address: super-block, 64-element group, nibble half, byte lane.
inline float muser_q4_k_value(const device uint8_t* row, uint element) {
  const device uint8_t* block = row + (element / 256) * 144;
  uint within_block = element % 256;
  uint group = within_block / 64;
  uint within_group = within_block % 64;
  uint sub_block = group * 2 + (within_group >= 32 ? 1 : 0);
  uint lane = within_group % 32;
  uint2 scale_min = muser_scale_min(block + 4, sub_block);
  uint packed = block[16 + group * 32 + lane];
  uint quant = within_group < 32 ? (packed & 15u) : (packed >> 4);
  return muser_f16(block) * float(scale_min.x) * float(quant) -
         muser_f16(block + 2) * float(scale_min.y);
}

inline float muser_q5_k_value(const device uint8_t* row, uint element) {
  const device uint8_t* block = row + (element / 256) * 176;
  uint within_block = element % 256;
  uint group = within_block / 64;
  uint within_group = within_block % 64;
  uint sub_block = group * 2 + (within_group >= 32 ? 1 : 0);
  uint lane = within_group % 32;
  uint2 scale_min = muser_scale_min(block + 4, sub_block);
  uint packed = block[48 + group * 32 + lane];
  uint quant = (within_group < 32 ? (packed & 15u) : (packed >> 4)) |
               (((uint(block[16 + lane]) >> sub_block) & 1u) << 4);
  return muser_f16(block) * float(scale_min.x) * float(quant) -
         muser_f16(block + 2) * float(scale_min.y);
}

inline float muser_q6_k_value(const device uint8_t* row, uint element) {
  const device uint8_t* block = row + (element / 256) * 210;
  uint w = element % 256;
  uint half_index = w / 128;
  uint v = w % 128;
  uint quarter = v / 32;
  uint low = (uint(block[64 * half_index + v % 64]) >> (4 * (quarter / 2))) & 15u;
  uint high = (uint(block[128 + 32 * half_index + v % 32]) >> (2 * quarter)) & 3u;
  int quant = int(low | (high << 4)) - 32;
  float scale = float(int8_t(block[192 + w / 16]));
  return muser_f16(block + 208) * scale * float(quant);
}

inline float muser_iq4_xs_value(const device uint8_t* row, uint element) {
  const device uint8_t* block = row + (element / 256) * 136;
  uint w = element % 256;
  uint sub_block = w / 32;
  uint low = (uint(block[4 + sub_block / 2]) >> (4 * (sub_block % 2))) & 15u;
  uint scales_high = uint(block[2]) | (uint(block[3]) << 8);
  uint high = (scales_high >> (2 * sub_block)) & 3u;
  float scale = float(int(low | (high << 4)) - 32);
  uint nibble = muser_nibble32(block + 8 + 16 * sub_block, w % 32);
  return muser_f16(block) * scale * muser_iq4_values[nibble];
}

// ---------------------------------------------------------------------------------------------
// Whole words, for the matvec kernels (which read 16 bytes or 2-byte pairs at a time).

// Byte k (0..3) of a little-endian word.
inline uint muser_byte(uint word, uint k) {
  return (word >> (8u * k)) & 255u;
}

// The f16 in the low or high half of a word.
inline float muser_half_low(uint word) {
  return float(as_type<half>(ushort(word & 65535u)));
}

inline float muser_half_high(uint word) {
  return float(as_type<half>(ushort(word >> 16)));
}

// Bits of `word` moved from bit position FROM to TO (both compile-time constants in unrolled
// loops, so one shift instruction).
inline uint muser_move(uint word, int from, int to) {
  return from <= to ? (word << uint(to - from)) : (word >> uint(from - to));
}

// A small unsigned code c of b bits, already placed at bits 23-b .. 22 (the top of the
// mantissa), becomes the float 1 + c / 2^b exactly: OR in the bits of 1.0f. This replaces an
// integer-to-float conversion, which runs at a quarter of the FMA rate or less on NVIDIA
// GPUs, with one logic instruction. A dot product then needs only FMAs:
//   sum_i c_i x_i = 2^b * (sum_i (1 + c_i / 2^b) x_i - sum_i x_i).
inline float muser_unit_float(uint placed) {
  return as_type<float>(placed | 0x3F800000u);
}

// Q4_K / Q5_K: (scale, min) of sub-block j (0..7) from the 12 scale bytes as three words
// (bytes 4-7, 8-11 and 12-15 of the super-block); muser_scale_min's rule.
inline uint2 muser_scale_min_words(uint s0, uint s1, uint s2, uint j) {
  if (j < 4) {
    return uint2(muser_byte(s0, j) & 63u, muser_byte(s1, j) & 63u);
  }
  uint k = j - 4;
  uint packed = muser_byte(s2, k);
  return uint2((packed & 15u) | ((muser_byte(s0, k) >> 6) << 4),
               (packed >> 4) | ((muser_byte(s1, k) >> 6) << 4));
}

// A 4-bit code at bits P..P+3 of `word` (P <= 19, a compile-time constant) as an exact float,
// with one logic instruction and one FMA: OR-ing the masked bits into 1.0f gives
// f = 1 + c * 2^(P-23), and f * 2^(23-P) - 2^(23-P) = c exactly (one rounding of an integer
// below 16). No shift is needed for codes in the low 20 bits.
template <int P>
inline float muser_code4(uint word) {
  float f = as_type<float>((word & (15u << P)) | 0x3F800000u);
  float scale = float(1u << (23 - P));
  return fma(f, scale, -scale);
}

// Q4_K: the 6-bit (scale, min) pairs of sub-blocks 2g and 2g+1 (one 64-value group g, 0..3)
// from the scale words s0, s1, s2 (bytes 4-7, 8-11, 12-15 of the super-block), two bytes at a
// time and without a branch: (scale 2g, min 2g, scale 2g+1, min 2g+1). muser_scale_min's rule.
inline uint4 muser_q4k_group_scales(uint s0, uint s1, uint s2, uint group) {
  uint shift = 16u * (group & 1u);
  uint low_scales = s0 >> shift;
  uint low_mins = s1 >> shift;
  uint packed = s2 >> shift;
  uint scales = group < 2u ? (low_scales & 0x3F3Fu) : ((packed & 0x0F0Fu) | ((low_scales >> 2) & 0x3030u));
  uint mins = group < 2u ? (low_mins & 0x3F3Fu) : (((packed >> 4) & 0x0F0Fu) | ((low_mins >> 2) & 0x3030u));
  return uint4(scales & 255u, mins & 255u, (scales >> 8) & 255u, (mins >> 8) & 255u);
}

// Sums over a threadgroup: acc[0..COUNT) of every thread added up, the totals left in
// partial[0..COUNT). partial holds (threads / 32) * COUNT floats, one row per SIMD group; each
// SIMD group reduces its lanes with simd_sum, then thread i adds columns i, i + threads, ...
// (COUNT may exceed the threads: 8 tokens x 8 rows over one SIMD group). Every thread of the
// threadgroup must call it (it holds a barrier).
template <int COUNT>
inline void muser_threadgroup_sum(thread float* acc, threadgroup float* partial, uint index, uint threads) {
  for (int i = 0; i < COUNT; ++i) {
    float total = simd_sum(acc[i]);
    if (index % 32u == 0u) {
      partial[(index / 32u) * uint(COUNT) + uint(i)] = total;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint column = index; column < uint(COUNT); column += threads) {
    float total = 0.0f;
    for (uint group = 0; group < threads / 32u; ++group) {
      total += partial[group * uint(COUNT) + column];
    }
    partial[column] = total;  // each column is one thread's alone
  }
}

// One element of a row in format FORMAT (a compile-time constant: dead cases fold away).
template <int FORMAT>
inline float muser_value(const device uint8_t* row, uint element) {
  switch (FORMAT) {
    case MUSER_F32: return muser_f32(row + 4 * element);
    case MUSER_F16: return muser_f16(row + 2 * element);
    case MUSER_BF16: return muser_bf16(row + 2 * element);
    case MUSER_Q4_0: return muser_q4_0_value(row, element);
    case MUSER_Q4_1: return muser_q4_1_value(row, element);
    case MUSER_Q5_0: return muser_q5_0_value(row, element);
    case MUSER_Q5_1: return muser_q5_1_value(row, element);
    case MUSER_Q8_0: return muser_q8_0_value(row, element);
    case MUSER_Q2_K: return muser_q2_k_value(row, element);
    case MUSER_Q3_K: return muser_q3_k_value(row, element);
    case MUSER_Q4_K: return muser_q4_k_value(row, element);
    case MUSER_Q5_K: return muser_q5_k_value(row, element);
    case MUSER_Q6_K: return muser_q6_k_value(row, element);
    case MUSER_IQ4_NL: return muser_iq4_nl_value(row, element);
    case MUSER_IQ4_XS: return muser_iq4_xs_value(row, element);
    default: return 0.0f;
  }
}
