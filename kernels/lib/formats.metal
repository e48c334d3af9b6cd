// lib/formats.metal — GGUF block formats: the format ids, decoders for one element of a row,
// the K-quants' scale and min unpacking, and the dequant helpers built on them.
//
// `row` points at the first byte of a row; `element` counts values from the row's start.
// Each decoder re-derives its element's address from that one integer (block, sub-block,
// byte, bit position), exactly as muser_mlx/formats.py does on the host. Arithmetic is
// float32 in ggml's order. Format ids are the ggml type numbers.
#include "lib/base.metal"

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

// Values 8 lane .. 8 lane + 7 of 256-value span `span` of row `row` (ROW_BYTES bytes a row) of
// a GGUF matrix in format FORMAT, into v: kernels dequant_spans and dequant_into. Q4_K, Q6_K
// and Q8_0 decode from two word loads (the same expression for each value as muser_value,
// so the same bits); other formats element by element.
template <int FORMAT, int ROW_BYTES>
inline void muser_span8(const device uint8_t* weight, uint row, uint span, uint lane, thread float* v) {
  const device uint8_t* row_bytes = weight + size_t(row) * size_t(ROW_BYTES);
  if (FORMAT == MUSER_Q4_K) {
    // Values 64g + 32h + j0 .. + 7 (g = l / 8, h = (l % 8) / 4, j0 = 8 (l % 4)): nibble h of
    // quant bytes 32g + j0 .. + 7, sub-block 2g + h.
    const device uint8_t* block = row_bytes + span * 144;
    uint group = lane / 8u;
    uint h = (lane % 8u) / 4u;
    uint4 head = *((const device uint4*)block);
    uint2 quants = *((const device uint2*)(block + 16u + 32u * group + 8u * (lane % 4u)));
    float d = 16.0f * muser_half_low(head.x);  // the 16 of 1 + q/16
    float dmin = muser_half_high(head.x);
    uint2 scale_min = muser_scale_min_words(head.y, head.z, head.w, 2u * group + h);
    for (int i = 0; i < 8; ++i) {
      uint word = i < 4 ? quants.x : quants.y;
      float code = muser_unit_float((word >> (8u * uint(i % 4) + 4u * h) << 19) & 0x00780000u);
      v[i] = d * float(scale_min.x) * (code - 1.0f) - dmin * float(scale_min.y);
    }
  } else if (FORMAT == MUSER_Q6_K) {
    // Values 128hh + 32q + l0 .. + 7 (hh = l / 16, q = (l % 16) / 4, l0 = 8 (l % 4)): nibble q / 2
    // of ql[64hh + 32 (q % 2) + l0 ..], bits 2q, 2q+1 of qh[32hh + l0 ..], scale 8hh + 2q + l0 / 16.
    size_t block = size_t(row) * size_t(ROW_BYTES) + size_t(span) * 210u;
    uint hh = lane / 16u;
    uint q = (lane % 16u) / 4u;
    uint l0 = 8u * (lane % 4u);
    uint2 low = muser_words2(weight, block + 64u * hh + 32u * (q % 2u) + l0);
    uint2 high = muser_words2(weight, block + 128u + 32u * hh + l0);
    float d = 64.0f * muser_f16(weight + block + 208u);  // the 64 of 1 + q6/64
    float scale = float(int8_t(weight[block + 192u + 8u * hh + 2u * q + l0 / 16u]));
    for (int i = 0; i < 8; ++i) {
      uint low_word = i < 4 ? low.x : low.y;
      uint high_word = i < 4 ? high.x : high.y;
      uint shift = 8u * uint(i % 4);
      float code = muser_unit_float(((low_word >> (shift + 4u * (q / 2u)) << 17) & 0x001E0000u) |
                                    ((high_word >> (shift + 2u * q) << 21) & 0x00600000u));
      v[i] = d * scale * (code - 1.5f);
    }
  } else if (FORMAT == MUSER_Q8_0) {
    // Values 32k + j0 .. + 7 of the span (k = l / 4, j0 = 8 (l % 4)): quants j0 .. of block 8 span + k.
    size_t block = size_t(row) * size_t(ROW_BYTES) + size_t(span * 8u + lane / 4u) * 34u;
    // Four 2-byte loads (a block is 2-byte aligned; three words could read past the last block).
    const device ushort* pairs = (const device ushort*)(weight + block + 2u + 8u * (lane % 4u));
    uint2 quants = uint2(uint(pairs[0]) | (uint(pairs[1]) << 16), uint(pairs[2]) | (uint(pairs[3]) << 16));
    float d = 256.0f * muser_f16(weight + block);
    for (int i = 0; i < 8; ++i) {
      uint word = i < 4 ? quants.x : quants.y;
      float code = muser_unit_float((((word >> (8u * uint(i % 4))) & 255u) ^ 128u) << 15);
      v[i] = d * (code - 1.5f);
    }
  } else {
    for (int i = 0; i < 8; ++i) {
      v[i] = muser_value<FORMAT>(row_bytes, span * 256u + 8u * lane + uint(i));
    }
  }
}
