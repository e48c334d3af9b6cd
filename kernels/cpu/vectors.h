// GCC vector types the CPU kernels compute with, and unaligned loads and stores of them (memcpy:
// the compiler emits one vector move).
#pragma once

#include <cstdint>
#include <cstring>

namespace muser::cpu {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int16_t i16x32 __attribute__((vector_size(64)));
typedef uint16_t u16x32 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef uint8_t u8x64 __attribute__((vector_size(64)));
typedef int8_t i8x64 __attribute__((vector_size(64)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef int8_t i8x32 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x4 __attribute__((vector_size(4)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));

// The vector at p (any alignment): load<u8x16>(bytes), load<f32x16>(floats).
template <typename V, typename T>
inline V load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V, typename T>
inline void store(T* p, V v) {
  std::memcpy(p, &v, sizeof(V));
}

// A decode cache may hold IEEE half floats (where the compiler has _Float16): half the bytes
// a long context's attention reads. load16 reads 16 floats; arch.h's load16 16 halves widened
// to floats (and load_values either).
#if defined(__FLT16_MAX__)
#define MUSER_HALF_CACHE 1
using half = _Float16;
typedef half f16x16 __attribute__((vector_size(32)));
#endif

inline f32x16 load16(const float* p) {
  return load<f32x16>(p);
}

inline f32x8 load8(const float* p) {
  return load<f32x8>(p);
}

}  // namespace muser::cpu
