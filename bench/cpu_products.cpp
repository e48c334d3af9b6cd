// The CPU decode products on their own, outside MLX: linear_rounded_from_blocks (kernels/cpu)
// for one token over SmolLM2-135M's 30 layers of shapes (qkv 960 x 576, o 576 x 576, gate+up
// 3072 x 576, down 576 x 1536), each weight its own buffer, so that the products stream from
// memory as a decode step's do; or one product of as many rows (`one`), the kernel's steady state.
// Weights: random codes, valid scales (d 0.01, m -0.02). Prints the median and best of REPS.
//
//   g++ -std=c++20 -O3 -march=native -pthread -Ikernels/cpu bench/cpu_products.cpp \
//       kernels/cpu/products.cpp -o /tmp/cpu_products
//   /tmp/cpu_products [GGML_TYPE=3] [REPS=40] [THREADS=2] [layers|one]
//
// Compare with a decode step's products inside MLX (bench/linear.py, or a compiled graph of
// model.matrices()): the difference is MLX's cost a node.
#include "products.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace muser::cpu;

int main(int argc, char** argv) {
  const int type = argc > 1 ? std::atoi(argv[1]) : Q4_1;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 40;
  const int threads = argc > 3 ? std::atoi(argv[3]) : 2;
  const bool one = argc > 4 && std::string(argv[4]) == "one";
  if (!has_product(type) || block_values(type) != 32 || reps < 1 || threads < 1) {
    std::fprintf(stderr, "a 32-value format (2, 3, 6, 7, 8), REPS >= 1 and THREADS >= 1\n");
    return 2;
  }
  struct Shape { int64_t out, in; };
  std::vector<Shape> shapes;
  for (int layer = 0; layer < 30; ++layer) {
    for (Shape s : {Shape{960, 576}, Shape{576, 576}, Shape{3072, 576}, Shape{576, 1536}}) {
      shapes.push_back(s);
    }
  }
  if (one) {  // the same rows of 576 values as one product
    int64_t rows = 0;
    for (Shape s : shapes) rows += s.out * s.in / 576;
    shapes = {Shape{rows, 576}};
  }
  const int bytes = block_bytes(type);
  const bool f16_min = type == Q4_1 || type == Q5_1;
  const _Float16 d = 0.01f, m = -0.02f;
  std::mt19937 rng(1);
  std::vector<std::vector<uint8_t>> weights;
  size_t total = 0;
  int64_t widest = 0;
  for (Shape s : shapes) {
    std::vector<uint8_t> w(s.out * (s.in / 32) * bytes);
    for (auto& b : w) b = static_cast<uint8_t>(rng());
    for (size_t at = 0; at < w.size(); at += bytes) {
      std::memcpy(&w[at], &d, 2);
      if (f16_min) std::memcpy(&w[at + 2], &m, 2);
    }
    total += w.size();
    widest = std::max(widest, s.out);
    weights.push_back(std::move(w));
  }
  std::vector<float> x(1536), out(widest);
  for (auto& v : x) v = static_cast<float>(rng() % 1000) / 500.0f - 1.0f;
  std::vector<double> times;
  for (int rep = 0; rep < reps; ++rep) {
    auto start = std::chrono::steady_clock::now();
    for (size_t i = 0; i < shapes.size(); ++i) {
      linear_rounded_from_blocks(x.data(), weights[i].data(), out.data(), type, 1, shapes[i].in,
                                 shapes[i].out, threads);
    }
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  std::printf("ggml type %d, %d threads: %zu products, %.1f MB; median %.3f ms (%.1f GB/s), best %.3f ms (%.1f GB/s)\n",
              type, threads, shapes.size(), total / 1e6, times[reps / 2] * 1e3, total / times[reps / 2] / 1e9,
              times[0] * 1e3, total / times[0] / 1e9);
  return 0;
}
