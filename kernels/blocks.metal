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

// Integers as floats without a conversion instruction (which runs at 16 a clock on an SM,
// an eighth of the FMA rate): the integer added into the mantissa of 2^23 (c, 0 <= c < 2^23)
// or of 1.5 * 2^23 (v, |v| < 2^22: negative ones borrow from the 0.5), and that float
// subtracted again, exactly. The same values as float(c) and float(v), bit for bit.
inline float muser_uint_float(uint c) {
  return as_type<float>(c | 0x4B000000u) - 8388608.0f;
}

inline float muser_int_float(int v) {
  return as_type<float>(uint(v + 0x4B400000)) - 12582912.0f;
}

// float(v) by either route: INT_FLOATS 1, muser_int_float / muser_uint_float; 0, a conversion
// instruction (the products choose per launch: kernel product's INT_FLOATS).
template <int INT_FLOATS>
inline float muser_float_of(int v) {
  return INT_FLOATS != 0 ? muser_int_float(v) : float(v);
}

template <int INT_FLOATS>
inline float muser_float_of(uint c) {
  return INT_FLOATS != 0 ? muser_uint_float(c) : float(c);
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

// Two floats as float16, packed into one word (the first in the low half).
inline uint muser_pack_halves(float a, float b) {
  return uint(as_type<ushort>(half(a))) | (uint(as_type<ushort>(half(b))) << 16u);
}

// Eight consecutive values stored with 16-byte stores (out 16-byte aligned): as float16 or
// float32, the type of the output.
inline void muser_store8(device half* out, thread const float* v) {
  *((device uint4*)out) = uint4(muser_pack_halves(v[0], v[1]), muser_pack_halves(v[2], v[3]),
                                muser_pack_halves(v[4], v[5]), muser_pack_halves(v[6], v[7]));
}

inline void muser_store8(device float* out, thread const float* v) {
  *((device float4*)out) = float4(v[0], v[1], v[2], v[3]);
  *((device float4*)(out + 4)) = float4(v[4], v[5], v[6], v[7]);
}

// One value stored in the output's type (float16: rounded to nearest even).
inline void muser_store1(device half* out, float v) {
  *out = half(v);
}

inline void muser_store1(device float* out, float v) {
  *out = v;
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

// ---------------------------------------------------------------------------------------------
// Activations as int8 blocks ("q8x"), for the decode products. x [T, IN] f32 becomes
//   xq int8 [T, IN]: q = round(x / d), half away from zero (0 where d is 0);
//   xd f32 [T, IN / 32]: d = max |x| / 127 over each 32 values;
//   xs f32 [T, IN / 8]: d * (the sum of each 8 codes), for the formats' offset and min terms.
// formats.quantize_activations is the numpy reference.

// acc plus the four signed bytes of a times those of b (a packed int8 dot product: one dp4a
// instruction on NVIDIA GPUs, its accumulator included, so a chain of them needs no adds).
// muser_dot4u: a's four bytes unsigned (0..255), b's signed.
#if defined(__CUDACC__)
inline int muser_dot4(uint a, uint b, int acc) {
  return __dp4a(int(a), int(b), acc);
}
inline int muser_dot4u(uint a, uint b, int acc) {
  int sum;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(sum) : "r"(a), "r"(b), "r"(acc));
  return sum;
}
#else
inline int muser_dot4(uint a, uint b, int acc) {
  return acc + (int(a << 24) >> 24) * (int(b << 24) >> 24) + (int(a << 16) >> 24) * (int(b << 16) >> 24) +
         (int(a << 8) >> 24) * (int(b << 8) >> 24) + (int(a) >> 24) * (int(b) >> 24);
}
inline int muser_dot4u(uint a, uint b, int acc) {
  return acc + int(a & 255u) * (int(b << 24) >> 24) + int((a >> 8) & 255u) * (int(b << 16) >> 24) +
         int((a >> 16) & 255u) * (int(b << 8) >> 24) + int(a >> 24) * (int(b) >> 24);
}
#endif

// The low 32 bits of (high:low) >> shift, shift 0 or 16: a word at a 2-byte offset from two
// aligned words (one funnel-shift instruction on NVIDIA GPUs).
#if defined(__CUDACC__)
inline uint muser_funnel(uint low, uint high, uint shift) {
  return __funnelshift_r(low, high, shift);
}
#else
inline uint muser_funnel(uint low, uint high, uint shift) {
  return uint(((ulong(high) << 32) | ulong(low)) >> shift);
}
#endif

// Device atomics on 32-bit counters, and the device-scope fence, for a count of the
// threadgroups (or SIMD groups) done: a writer fences its results, then adds 1; the one that
// sees the count reach its total fences again and reads every result; it stores 0 back for
// the next launch. `counter` is an input the kernel writes in place.
#if defined(__CUDACC__)
inline uint muser_atomic_add(device uint* counter, uint value) {
  return atomicAdd(counter, value);
}
inline void muser_atomic_store(device uint* counter, uint value) {
  atomicExch(counter, value);
}
inline void muser_device_fence() {
  __threadfence();
}
#else
inline uint muser_atomic_add(device uint* counter, uint value) {
  return atomic_fetch_add_explicit((device atomic_uint*)counter, value, memory_order_relaxed);
}
inline void muser_atomic_store(device uint* counter, uint value) {
  atomic_store_explicit((device atomic_uint*)counter, value, memory_order_relaxed);
}
inline void muser_device_fence() {
  atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
}
#endif

// The 8 bytes at byte `offset` of `base` (base 4-byte aligned, offset even) as two words, from
// aligned word loads. The third word is read only when the bytes straddle it.
inline uint2 muser_words2(const device uint8_t* base, size_t offset) {
  const device uint* words = (const device uint*)(base + (offset & ~size_t(3)));
  uint shift = uint(offset & 2u) * 8u;
  uint w0 = words[0];
  uint w1 = words[1];
  uint w2 = shift != 0u ? words[2] : 0u;
  return uint2(muser_funnel(w0, w1, shift), muser_funnel(w1, w2, shift));
}

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
// (scale[0..1], sum[0..1]). (Q6_K in 64-value units ran slower on the H200 and was dropped:
// bench/RESULTS.md, session 23.)
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

// attention_decode's value rows of one block of 32 slots, base .. base + 31: lane l's channels
// 2l, 2l+1, 2l+64, ... of each slot as packed half pairs, rows[k * (HEAD_DIM / 64) + c]; a slot
// at or past `last` re-reads slot last - 1 (its probability is 0).
template <int HEAD_DIM>
inline void muser_load_value_rows(const device half* values, uint base, uint last, uint lane, thread uint* rows) {
  for (int k = 0; k < 32; ++k) {
    uint slot = min(base + uint(k), last - 1u);
    for (int c = 0; c < HEAD_DIM / 64; ++c) {
      rows[k * (HEAD_DIM / 64) + c] = *((const device uint*)(values + size_t(slot) * HEAD_DIM + 2u * lane + 64u * uint(c)));
    }
  }
}

// muser_load_value_rows for a block whose 32 slots are all stored: no clamp, one address.
template <int HEAD_DIM>
inline void muser_load_full_value_rows(const device half* values, uint base, uint lane, thread uint* rows) {
  const device uint* row = (const device uint*)(values + size_t(base) * HEAD_DIM + 2u * lane);
  for (int k = 0; k < 32; ++k) {
    for (int c = 0; c < HEAD_DIM / 64; ++c) {
      rows[k * (HEAD_DIM / 64) + c] = row[k * (HEAD_DIM / 2) + 32 * c];
    }
  }
}

// RoPE's pair i of a head: the channels (a, b) it rotates, (2i, 2i+1) when TRADITIONAL
// (llama.cpp's NORM), (i, i + ROTARY/2) otherwise (NEOX); pairs past the rotary width keep
// their channels and pass through (muser_rope_rotates says which).
template <int ROTARY, int TRADITIONAL>
inline uint2 muser_rope_pair(uint pair) {
  if (TRADITIONAL || pair >= uint(ROTARY / 2)) {
    uint a = TRADITIONAL ? 2u * pair : uint(ROTARY) + 2u * (pair - uint(ROTARY / 2));
    return uint2(a, a + 1u);
  }
  return uint2(pair, pair + uint(ROTARY / 2));
}

template <int ROTARY, int TRADITIONAL>
inline bool muser_rope_rotates(uint pair) {
  return TRADITIONAL ? 2u * pair < uint(ROTARY) : pair < uint(ROTARY / 2);
}

// COUNT consecutive heads of a projection made ready for attention by one SIMD group:
// (source + bias), RMS-normed with norm_weight when QK_NORM, rotated by RoPE at `position`
// (ROTARY 0: none), times `scale`, into out[COUNT * HEAD_DIM]. Lane l takes pairs l, l + 32, ...
// (HEAD_DIM / 64 each) of every head: all loads are issued before any use, and the angles'
// sines and cosines are computed once for all the heads.
template <int COUNT, int HEAD_DIM, int ROTARY, int TRADITIONAL, int QK_NORM, int BIAS>
inline void muser_heads_prepare(const device float* source, const device float* bias,
                                const device float* norm_weight, const device float* inv_freq,
                                float position, float eps, float scale, uint lane, threadgroup float* out) {
  const int PAIRS = HEAD_DIM / 64;
  float first[COUNT * PAIRS];
  float second[COUNT * PAIRS];
  float weight_first[PAIRS];
  float weight_second[PAIRS];
  float cosine[PAIRS];
  float sine[PAIRS];
  for (int k = 0; k < PAIRS; ++k) {
    uint pair = lane + 32u * uint(k);
    uint2 channels = muser_rope_pair<ROTARY, TRADITIONAL>(pair);
    for (int i = 0; i < COUNT; ++i) {
      first[i * PAIRS + k] = source[i * HEAD_DIM + int(channels.x)] + (BIAS ? bias[i * HEAD_DIM + int(channels.x)] : 0.0f);
      second[i * PAIRS + k] = source[i * HEAD_DIM + int(channels.y)] + (BIAS ? bias[i * HEAD_DIM + int(channels.y)] : 0.0f);
    }
    weight_first[k] = QK_NORM ? norm_weight[channels.x] : 1.0f;
    weight_second[k] = QK_NORM ? norm_weight[channels.y] : 1.0f;
    float angle = muser_rope_rotates<ROTARY, TRADITIONAL>(pair) ? position * inv_freq[pair] : 0.0f;
    cosine[k] = cos(angle);
    sine[k] = sin(angle);
  }
  for (int i = 0; i < COUNT; ++i) {
    float squares = 0.0f;
    for (int k = 0; k < PAIRS; ++k) {
      squares += first[i * PAIRS + k] * first[i * PAIRS + k] + second[i * PAIRS + k] * second[i * PAIRS + k];
    }
    float norm = QK_NORM ? 1.0f / sqrt(simd_sum(squares) / float(HEAD_DIM) + eps) : 1.0f;
    for (int k = 0; k < PAIRS; ++k) {
      uint2 channels = muser_rope_pair<ROTARY, TRADITIONAL>(lane + 32u * uint(k));
      float x0 = first[i * PAIRS + k] * norm * weight_first[k];
      float x1 = second[i * PAIRS + k] * norm * weight_second[k];
      out[i * HEAD_DIM + int(channels.x)] = (x0 * cosine[k] - x1 * sine[k]) * scale;
      out[i * HEAD_DIM + int(channels.y)] = (x0 * sine[k] + x1 * cosine[k]) * scale;
    }
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
