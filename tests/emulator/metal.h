// metal.h — the part of the Metal Shading Language our kernels use, as C++17 for g++.
//
// The one list of Metal builtins for the CPU: tests/emulate.py compiles kernels against it and
// runs them (tests/emulator/runtime.cpp supplies the threads), and the compile check of
// tests/test_kernels.py includes it through tests/stubs/metal_stub.h. A kernel that needs a
// builtin not here fails both; add it to the matching section below:
//   scalars and vectors        half (_Float16), bfloat (bit-exact RNE), vec<T, N> typedefs
//   math                       MUSER_MATH1 / MUSER_MATH2 lines: float, half and vector overloads
//   SIMD-group functions       one line each: a function of all 32 lanes' arguments
//   device atomics             32-bit unsigned counters, the device-scope fence
// Address spaces vanish and attributes ([[buffer(0)]], [[kernel]]) are ignored. emulate.py first
// rewrites what a macro cannot: a `threadgroup` array declaration (one array per threadgroup,
// MUSER_EMU_THREADGROUP) and pointer casts (Aligned: the pointer's alignment is checked).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#define device
#define constant
#define thread
#define threadgroup
#define kernel

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;  // 64 bits, as in Metal

namespace metal {

// ---- Scalars --------------------------------------------------------------------------------
typedef _Float16 half;  // real IEEE binary16 arithmetic and conversions (g++ >= 12, x86-64)

struct bfloat {  // storage type: arithmetic goes through float, conversions round to nearest even
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = std::isnan(f) ? uint16_t((u >> 16) | 64u) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
typedef half float16_t;
typedef bfloat bfloat16_t;

template <typename T, typename U>
inline T as_type(U value) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of one size");
  T result;
  std::memcpy(&result, &value, sizeof(T));
  return result;
}

// ---- Vectors: float4, uint2, uchar4, char4, half2, ... -------------------------------------
// Metal's sizes and alignments (a 3-vector takes the room of a 4-vector). Constructors: N
// scalars, one scalar for all, or an explicit conversion from another element type.
// Not emulated: swizzles (.xy, .zyx), construction from smaller vectors, vector comparisons.
template <typename T, int N>
struct vec;
#define MUSER_VEC_BODY(N)                                                          \
  typedef T scalar;                                                                \
  vec() = default;                                                                 \
  vec(T s) { for (int i = 0; i < N; ++i) (*this)[i] = s; }                         \
  template <typename U>                                                            \
  explicit vec(vec<U, N> v) { for (int i = 0; i < N; ++i) (*this)[i] = T(v[i]); } \
  T& operator[](int i) { return (&x)[i]; }                                         \
  const T& operator[](int i) const { return (&x)[i]; }
template <typename T>
struct alignas(sizeof(T) * 2) vec<T, 2> {
  T x, y;
  vec(T a, T b) : x(a), y(b) {}
  MUSER_VEC_BODY(2)
};
template <typename T>
struct alignas(sizeof(T) * 4) vec<T, 3> {
  T x, y, z;
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  MUSER_VEC_BODY(3)
};
template <typename T>
struct alignas(sizeof(T) * 4) vec<T, 4> {
  T x, y, z, w;
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  MUSER_VEC_BODY(4)
};
#define MUSER_VECTOR_TYPES(T, name) \
  typedef vec<T, 2> name##2;        \
  typedef vec<T, 3> name##3;        \
  typedef vec<T, 4> name##4;
MUSER_VECTOR_TYPES(float, float)
MUSER_VECTOR_TYPES(half, half)
MUSER_VECTOR_TYPES(bfloat, bfloat)
MUSER_VECTOR_TYPES(int, int)
MUSER_VECTOR_TYPES(uint, uint)
MUSER_VECTOR_TYPES(short, short)
MUSER_VECTOR_TYPES(ushort, ushort)
MUSER_VECTOR_TYPES(signed char, char)
MUSER_VECTOR_TYPES(uchar, uchar)
MUSER_VECTOR_TYPES(bool, bool)

// Component-wise operators: vector with vector, vector with scalar, scalar with vector.
#define MUSER_VEC_OPERATOR(op)                                                                    \
  template <typename T, int N>                                                                    \
  vec<T, N> operator op(vec<T, N> a, vec<T, N> b) { for (int i = 0; i < N; ++i) a[i] = a[i] op b[i]; return a; } \
  template <typename T, int N>                                                                    \
  vec<T, N> operator op(vec<T, N> a, typename vec<T, N>::scalar b) { return a op vec<T, N>(b); } \
  template <typename T, int N>                                                                    \
  vec<T, N> operator op(typename vec<T, N>::scalar a, vec<T, N> b) { return vec<T, N>(a) op b; } \
  template <typename T, int N, typename U>                                                        \
  vec<T, N>& operator op##=(vec<T, N>& a, U b) { return a = a op b; }
MUSER_VEC_OPERATOR(+)
MUSER_VEC_OPERATOR(-)
MUSER_VEC_OPERATOR(*)
MUSER_VEC_OPERATOR(/)
MUSER_VEC_OPERATOR(%)
MUSER_VEC_OPERATOR(&)
MUSER_VEC_OPERATOR(|)
MUSER_VEC_OPERATOR(^)
MUSER_VEC_OPERATOR(<<)
MUSER_VEC_OPERATOR(>>)
template <typename T, int N>
vec<T, N> operator-(vec<T, N> a) { for (int i = 0; i < N; ++i) a[i] = -a[i]; return a; }

// ---- Math -----------------------------------------------------------------------------------
// Correctly rounded float32 (Metal compiles with fast math by default, CUDA does not: the
// emulator follows CUDA). Each MUSER_MATH line gives float, half and component-wise vector
// overloads, so overload resolution never falls back to the C library's double versions.
#define MUSER_MATH1(name, expr)                                                    \
  inline float name(float x) { return expr; }                                      \
  inline half name(half h) { return half(name(float(h))); }                        \
  template <typename T, int N>                                                     \
  vec<T, N> name(vec<T, N> v) { for (int i = 0; i < N; ++i) v[i] = name(v[i]); return v; }
#define MUSER_MATH2(name, expr)                                                    \
  inline float name(float x, float y) { return expr; }                             \
  inline half name(half a, half b) { return half(name(float(a), float(b))); }      \
  template <typename T, int N>                                                     \
  vec<T, N> name(vec<T, N> a, vec<T, N> b) { for (int i = 0; i < N; ++i) a[i] = name(a[i], b[i]); return a; }
MUSER_MATH1(sqrt, std::sqrt(x))
MUSER_MATH1(rsqrt, 1.0f / std::sqrt(x))
MUSER_MATH1(exp, std::exp(x))
MUSER_MATH1(exp2, std::exp2(x))
MUSER_MATH1(log, std::log(x))
MUSER_MATH1(log2, std::log2(x))
MUSER_MATH1(sin, std::sin(x))
MUSER_MATH1(cos, std::cos(x))
MUSER_MATH1(tanh, std::tanh(x))
MUSER_MATH1(fabs, std::fabs(x))
MUSER_MATH1(floor, std::floor(x))
MUSER_MATH1(ceil, std::ceil(x))
MUSER_MATH1(round, std::round(x))
MUSER_MATH1(trunc, std::trunc(x))
MUSER_MATH2(pow, std::pow(x, y))
MUSER_MATH2(fmax, std::fmax(x, y))
MUSER_MATH2(fmin, std::fmin(x, y))
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
// min/max/clamp/abs: one type for all arguments, as in Metal (min(uint, int) does not compile).
template <typename T> T min(T a, T b) { return b < a ? b : a; }
template <typename T> T max(T a, T b) { return a < b ? b : a; }
template <typename T> T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <typename T> T abs(T x) { return x < T(0) ? T(-x) : x; }
template <typename T> T select(T a, T b, bool c) { return c ? b : a; }
template <typename T> T mix(T a, T b, T t) { return a + (b - a) * t; }
template <typename T, int N> vec<T, N> min(vec<T, N> a, vec<T, N> b) { for (int i = 0; i < N; ++i) a[i] = min(a[i], b[i]); return a; }
template <typename T, int N> vec<T, N> max(vec<T, N> a, vec<T, N> b) { for (int i = 0; i < N; ++i) a[i] = max(a[i], b[i]); return a; }
template <typename T, int N> T dot(vec<T, N> a, vec<T, N> b) { T s = a[0] * b[0]; for (int i = 1; i < N; ++i) s += a[i] * b[i]; return s; }
inline uint popcount(uint x) { return uint(__builtin_popcount(x)); }
inline uint clz(uint x) { return x ? uint(__builtin_clz(x)) : 32u; }
inline uint ctz(uint x) { return x ? uint(__builtin_ctz(x)) : 32u; }
namespace fast { using metal::cos; using metal::exp; using metal::exp2; using metal::log; using metal::rsqrt; using metal::sin; using metal::sqrt; using metal::tanh; }
namespace precise { using metal::cos; using metal::exp; using metal::exp2; using metal::log; using metal::rsqrt; using metal::sin; using metal::sqrt; using metal::tanh; }

}  // namespace metal

// ---- Threads (runtime.cpp) ------------------------------------------------------------------
namespace muser_emu {
using namespace metal;
constexpr int SIMD_WIDTH = 32;
constexpr int SLOT_BYTES = 64;  // the largest argument of a SIMD-group function

// The attributes of the running thread, named as the [[attributes]] MLX passes.
struct Thread {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid,
      threads_per_threadgroup, threadgroups_per_grid, threads_per_grid, grid_size, grid_origin,
      dispatch_threads_per_threadgroup;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup,
      simdgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup, threads_per_simdgroup,
      thread_execution_width, thread_index_in_quadgroup, quadgroup_index_in_threadgroup,
      quadgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};
extern const Thread* self;
// Wait until every thread of the threadgroup that has not returned arrives.
void barrier();
// Hand `size` bytes to a SIMD-group function named `op`; returns the 32 lanes' arguments
// (SLOT_BYTES apart) once all 32 lanes have called the same function.
const unsigned char* arrive(const char* op, const void* value, size_t size);
// Called where a threadgroup array is declared: fills it with 0xFF bytes (NaN) once per threadgroup.
void threadgroup_memory(void* memory, size_t size, unsigned long& epoch);
[[noreturn]] void fail(const char* message);
// Fails unless `pointer` is a multiple of `align` bytes from its buffer's start (MLX aligns
// buffers; a GPU faults on, or silently rounds, a misaligned load).
void check_alignment(const void* pointer, size_t align);

// A pointer cast, `(const device uint4*)p`, is rewritten to `(Aligned<const device uint4>)p`
// by emulate.py: the same pointer, its alignment checked when the cast is made.
template <typename T>
struct Aligned {
  T* pointer;
  template <typename U>
  Aligned(U* p) : pointer((T*)p) { check_alignment((const void*)p, alignof(T)); }
  operator T*() const { return pointer; }
};

template <typename T, typename F>
T collective(const char* op, T value, F result) {
  static_assert(sizeof(T) <= SLOT_BYTES, "argument too large for a SIMD-group function");
  const unsigned char* slots = arrive(op, &value, sizeof(T));
  T lanes[SIMD_WIDTH];
  for (int i = 0; i < SIMD_WIDTH; ++i) std::memcpy(&lanes[i], slots + i * SLOT_BYTES, sizeof(T));
  return result(lanes, self->thread_index_in_simdgroup);
}
// A reduction in the order of the CUDA rendering's shuffles: value op= lane (i ^ offset),
// offset 16, 8, 4, 2, 1.
template <typename T, typename F>
T butterfly(T* v, uint lane, F op) {
  for (int offset = SIMD_WIDTH / 2; offset > 0; offset /= 2) {
    T next[SIMD_WIDTH];
    for (int i = 0; i < SIMD_WIDTH; ++i) next[i] = op(v[i], v[i ^ offset]);
    for (int i = 0; i < SIMD_WIDTH; ++i) v[i] = next[i];
  }
  return v[lane];
}
inline uint lane_index(uint lane) {
  if (lane >= uint(SIMD_WIDTH)) fail("names a lane outside 0..31 in a SIMD-group function");
  return lane;
}
}  // namespace muser_emu

#define MUSER_EMU_THREADGROUP(name) \
  static unsigned long name##_muser_epoch; \
  ::muser_emu::threadgroup_memory(&name, sizeof(name), name##_muser_epoch)

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
inline void threadgroup_barrier(mem_flags) { muser_emu::barrier(); }

// ---- SIMD-group functions: `v` holds the 32 lanes' arguments, `lane` is the caller's ------
#define MUSER_SIMD(name, ...) muser_emu::collective(#name, value, [=](T* v, uint lane) { (void)v; (void)lane; return __VA_ARGS__; })
template <typename T> T simd_sum(T value) { return MUSER_SIMD(simd_sum, muser_emu::butterfly(v, lane, [](T a, T b) { return T(a + b); })); }
template <typename T> T simd_product(T value) { return MUSER_SIMD(simd_product, muser_emu::butterfly(v, lane, [](T a, T b) { return T(a * b); })); }
template <typename T> T simd_max(T value) { return MUSER_SIMD(simd_max, muser_emu::butterfly(v, lane, [](T a, T b) { return max(a, b); })); }
template <typename T> T simd_min(T value) { return MUSER_SIMD(simd_min, muser_emu::butterfly(v, lane, [](T a, T b) { return min(a, b); })); }
template <typename T> T simd_and(T value) { return MUSER_SIMD(simd_and, muser_emu::butterfly(v, lane, [](T a, T b) { return T(a & b); })); }
template <typename T> T simd_or(T value) { return MUSER_SIMD(simd_or, muser_emu::butterfly(v, lane, [](T a, T b) { return T(a | b); })); }
template <typename T> T simd_xor(T value) { return MUSER_SIMD(simd_xor, muser_emu::butterfly(v, lane, [](T a, T b) { return T(a ^ b); })); }
template <typename T> T simd_shuffle(T value, ushort from) { return MUSER_SIMD(simd_shuffle, v[muser_emu::lane_index(from)]); }
template <typename T> T simd_broadcast(T value, ushort from) { return MUSER_SIMD(simd_broadcast, v[muser_emu::lane_index(from)]); }
template <typename T> T simd_broadcast_first(T value) { return MUSER_SIMD(simd_broadcast_first, v[0]); }
template <typename T> T simd_shuffle_xor(T value, ushort mask) { return MUSER_SIMD(simd_shuffle_xor, v[muser_emu::lane_index(lane ^ mask)]); }
template <typename T> T simd_shuffle_down(T value, ushort delta) { return MUSER_SIMD(simd_shuffle_down, lane + delta < 32u ? v[lane + delta] : v[lane]); }
template <typename T> T simd_shuffle_up(T value, ushort delta) { return MUSER_SIMD(simd_shuffle_up, lane >= delta ? v[lane - delta] : v[lane]); }
template <typename T> T simd_prefix_exclusive_sum(T value) { return MUSER_SIMD(simd_prefix_exclusive_sum, [&] { T s = T(0); for (uint i = 0; i < lane; ++i) s += v[i]; return s; }()); }
template <typename T> T simd_prefix_inclusive_sum(T value) { return MUSER_SIMD(simd_prefix_inclusive_sum, [&] { T s = v[0]; for (uint i = 1; i <= lane; ++i) s += v[i]; return s; }()); }
inline bool simd_all(bool predicate) { typedef bool T; bool value = predicate; return MUSER_SIMD(simd_all, [&] { bool r = true; for (int i = 0; i < 32; ++i) r = r && v[i]; return r; }()); }
inline bool simd_any(bool predicate) { typedef bool T; bool value = predicate; return MUSER_SIMD(simd_any, [&] { bool r = false; for (int i = 0; i < 32; ++i) r = r || v[i]; return r; }()); }
inline void simdgroup_barrier(mem_flags) { typedef int T; int value = 0; MUSER_SIMD(simdgroup_barrier, 0); }

// ---- Device atomics: 32-bit unsigned counters ---------------------------------------------
// Fibers run one at a time and switch only at barriers and SIMD-group functions, so an atomic
// read-modify-write is a plain one here and a fence has nothing to order. What the emulator
// does vary is which threadgroup comes last: emulated_gpu's reverse order runs them last to
// first. (On a GPU, a threadgroup that reads what others wrote before their counter increment
// also needs the fence, and loads that bypass its own L1.)
enum memory_order { memory_order_relaxed, memory_order_seq_cst };
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };
typedef uint atomic_uint;
inline uint atomic_fetch_add_explicit(device atomic_uint* object, uint operand, memory_order) {
  uint old = *object;
  *object = old + operand;
  return old;
}
inline void atomic_store_explicit(device atomic_uint* object, uint desired, memory_order) { *object = desired; }
inline void atomic_thread_fence(mem_flags, memory_order, thread_scope) {}

}  // namespace metal

using namespace metal;
