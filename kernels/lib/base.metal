// lib/base.metal — what the other lib files and the kernels build on: bytes and halves of
// 32-bit words, integers as floats without a conversion instruction, stores in the output's
// type, and the portable shims. What Metal and CUDA spell differently (a packed int8 dot
// product, a funnel shift, f16 pair arithmetic and int8 and f16 matrix products, which Metal
// lacks or spells otherwise; device atomics and the device fence) are this file's
// `#if defined(__CUDACC__)` branches, the only ones in the kernels.
// Includes no other lib file.

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

// v's route in two halves: the add of the bias, and the float read and subtracted. The tile
// products' int32 accumulators start at the bias (muser_mma_k32 / k16 add A B into C), so the
// tensor core does the add: muser_biased_float(BIAS + v) == float(v), bit for bit.
#define MUSER_INT_FLOAT_BIAS 0x4B400000

inline float muser_biased_float(int biased) {
  return as_type<float>(uint(biased)) - 12582912.0f;
}

inline float muser_int_float(int v) {
  return muser_biased_float(v + MUSER_INT_FLOAT_BIAS);
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

// A loop unrolled whole (CUDA; Metal's compiler decides): where a loop's index picks array
// elements, which then stay in registers instead of the stack. MUSER_UNROLL_BY(n): by n, a
// constant expression (a loop whose unrolled loads, all in flight at once, may take too many
// registers).
#if defined(__CUDACC__)
#define MUSER_UNROLL _Pragma("unroll")
#define MUSER_PRAGMA(text) _Pragma(#text)
#define MUSER_UNROLL_BY(n) MUSER_PRAGMA(unroll n)
#else
#define MUSER_UNROLL
#define MUSER_UNROLL_BY(n)
#endif

// Integer matrix products of a SIMD group on int8 codes (tensor cores on NVIDIA GPUs: one
// mma.sync instruction each; elsewhere the same result from shuffles and muser_dot4), for the
// batched decode products (lib/tiles.metal). Lane l holds, with g = l / 4 and t = l % 4:
//   k32: C [16 x 8] += A [16 x 32] B [32 x 8]. a[0]: A's row g, columns 4t..4t+3 (4 int8 in a
//        word); a[1]: row g + 8, the same columns; a[2], a[3]: rows g, g + 8, columns 16 + 4t..;
//        b0: B's rows 4t..4t+3 of column g; b1: rows 16 + 4t..; c[0], c[1]: C's row g, columns
//        2t, 2t + 1; c[2], c[3]: row g + 8, the same columns.
//   k16: C [16 x 8] += A [16 x 16] B [16 x 8]: a[0], a[1] rows g, g + 8, columns 4t..4t+3; b0
//        B's rows 4t..4t+3 of column g; c as k32's.
// Every lane of the SIMD group calls it together (uniform control flow).
#if defined(__CUDACC__)
inline void muser_mma_k32(thread const uint* a, uint b0, uint b1, thread int* c, uint lane) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
inline void muser_mma_k16(thread const uint* a, uint b0, thread int* c, uint lane) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
               : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(b0));
}
#else
inline void muser_mma_k32(thread const uint* a, uint b0, uint b1, thread int* c, uint lane) {
  uint g = lane / 4u;
  uint t = lane % 4u;
  int out[4];
  for (int i = 0; i < 4; ++i) {
    uint column = 2u * t + uint(i % 2);
    int sum = c[i];
    for (uint k = 0; k < 4u; ++k) {
      uint low = simd_shuffle(i < 2 ? a[0] : a[1], ushort(4u * g + k));
      uint high = simd_shuffle(i < 2 ? a[2] : a[3], ushort(4u * g + k));
      sum = muser_dot4(low, simd_shuffle(b0, ushort(4u * column + k)), sum);
      sum = muser_dot4(high, simd_shuffle(b1, ushort(4u * column + k)), sum);
    }
    out[i] = sum;
  }
  for (int i = 0; i < 4; ++i) {
    c[i] = out[i];
  }
}
inline void muser_mma_k16(thread const uint* a, uint b0, thread int* c, uint lane) {
  uint g = lane / 4u;
  uint t = lane % 4u;
  int out[4];
  for (int i = 0; i < 4; ++i) {
    uint column = 2u * t + uint(i % 2);
    int sum = c[i];
    for (uint k = 0; k < 4u; ++k) {
      sum = muser_dot4(simd_shuffle(i < 2 ? a[0] : a[1], ushort(4u * g + k)), simd_shuffle(b0, ushort(4u * column + k)), sum);
    }
    out[i] = sum;
  }
  for (int i = 0; i < 4; ++i) {
    c[i] = out[i];
  }
}
#endif

// f16 pairs in a word (the low half the first value; muser_half_low / high read them), for the
// batched products' f16 form (lib/tiles.metal's muser_tile_*_f16): a float pair rounded to
// nearest even, a fused multiply-add of pairs (one rounding), and the matrix product
//   C [16 x 8] (f32) += A [16 x 16] B [16 x 8] (f16): a[0]: A's row g, columns 2t, 2t + 1;
//   a[1]: row g + 8, the same columns; a[2], a[3]: rows g, g + 8, columns 2t + 8, 2t + 9; b0:
//   B's rows 2t, 2t + 1 of column g; b1: rows 2t + 8, 2t + 9; c as muser_mma_k32's.
// CUDA: cvt.rn.f16x2.f32, fma.rn.f16x2 and one mma.sync; elsewhere the same values from float
// arithmetic and shuffles (the fma in float, then rounded to half: rarely a last bit apart from
// one rounding).
#if defined(__CUDACC__)
inline uint muser_half_pair(float low, float high) {
  uint pair;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(high), "f"(low));
  return pair;
}
inline uint muser_half_fma(uint a, uint b, uint c) {
  uint d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
inline void muser_mma_f16(thread const uint* a, uint b0, uint b1, thread float* c, uint lane) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#else
inline uint muser_half_pair(float low, float high) {
  return uint(as_type<ushort>(half(low))) | (uint(as_type<ushort>(half(high))) << 16);
}
inline uint muser_half_fma(uint a, uint b, uint c) {
  return muser_half_pair(fma(muser_half_low(a), muser_half_low(b), muser_half_low(c)),
                         fma(muser_half_high(a), muser_half_high(b), muser_half_high(c)));
}
inline void muser_mma_f16(thread const uint* a, uint b0, uint b1, thread float* c, uint lane) {
  uint g = lane / 4u;
  uint t = lane % 4u;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    uint column = 2u * t + uint(i % 2);
    float sum = c[i];
    for (uint k = 0; k < 4u; ++k) {  // A's columns 2k, 2k + 1 and 2k + 8, 2k + 9 of row g (+ 8)
      uint low = simd_shuffle(i < 2 ? a[0] : a[1], ushort(4u * g + k));
      uint high = simd_shuffle(i < 2 ? a[2] : a[3], ushort(4u * g + k));
      uint x_low = simd_shuffle(b0, ushort(4u * column + k));
      uint x_high = simd_shuffle(b1, ushort(4u * column + k));
      sum += muser_half_low(low) * muser_half_low(x_low) + muser_half_high(low) * muser_half_high(x_low);
      sum += muser_half_low(high) * muser_half_low(x_high) + muser_half_high(high) * muser_half_high(x_high);
    }
    out[i] = sum;
  }
  for (int i = 0; i < 4; ++i) {
    c[i] = out[i];
  }
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

// A gated FFN's activation of the gate's value: silu (ACTIVATION 0) or tanh-approximated gelu (1).
template <int ACTIVATION>
inline float muser_activate(float g) {
  return ACTIVATION == 0 ? g / (1.0f + exp(-g)) : 0.5f * g * (1.0f + tanh(0.7978845608f * (g + 0.044715f * g * g * g)));
}
