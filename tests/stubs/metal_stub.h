// Just enough of the Metal Shading Language for `g++ -fsyntax-only` to check our kernels:
// address spaces vanish, attributes are ignored (-Wno-attributes), builtins are declared.
#include <cstddef>
#include <cstdint>
#include <cmath>

#define device
#define constant
#define threadgroup
#define thread
#define kernel

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

struct half {
  half() = default;
  half(float);
  operator float() const;
};
struct bfloat {
  bfloat() = default;
  bfloat(float);
  operator float() const;
};
typedef half float16_t;
typedef bfloat bfloat16_t;

struct uint2 {
  uint x, y;
  uint2(uint, uint);
};
struct uint3 {
  uint x, y, z;
};
struct uint4 {
  uint x, y, z, w;
  uint4() = default;
  uint4(uint, uint, uint, uint);
};
struct float4 {
  float x, y, z, w;
  float4() = default;
  float4(float, float, float, float);
};

template <typename T, typename U>
T as_type(U);

enum class mem_flags { mem_none, mem_device, mem_threadgroup };
namespace metal {
using ::mem_flags;
}
void threadgroup_barrier(mem_flags);
float simd_sum(float);
uint simd_sum(uint);
float simd_max(float);
float simd_shuffle_xor(float, uint);
float simd_shuffle(float, uint);
void simdgroup_barrier(mem_flags);

inline uint min(uint a, uint b) { return a < b ? a : b; }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float min(float a, float b) { return a < b ? a : b; }
inline float max(float a, float b) { return a > b ? a : b; }
using std::exp;
using std::cos;
using std::fabs;
using std::round;
using std::sin;
using std::sqrt;
using std::tanh;
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
