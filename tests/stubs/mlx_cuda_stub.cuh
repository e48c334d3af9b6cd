// Stands in for MLX's default CUDA header ("mlx/backend/cuda/device/utils.cuh" plus
// cooperative groups) so nvcc can compile a kernel exactly as MLX's cuda_kernel renders it.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#include <cstdint>

namespace mlx::core::cu {
constexpr int MAX_NDIM = 10;
struct Shape {
  int32_t dims[MAX_NDIM];
  __device__ int32_t operator[](int i) const { return dims[i]; }
};
struct Strides {
  int64_t dims[MAX_NDIM];
  __device__ int64_t operator[](int i) const { return dims[i]; }
};
}  // namespace mlx::core::cu
