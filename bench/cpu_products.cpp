// The CPU decode products on their own, outside MLX: linear_rounded_from_blocks (kernels/cpu)
// for TOKENS rows of x (a batched decode step's) over SmolLM2-135M's 30 layers of shapes (qkv
// 960 x 576, o 576 x 576, gate+up 3072 x 576, down 576 x 1536), or for the K-quants (256-value
// blocks) Gemma 3 270M's 18 layers of theirs (o 640 x 1024, down 640 x 2048), each weight its
// own buffer, so that the products stream from memory as a decode step's do; or one product of
// as many rows (`one`), the kernel's steady state. Weights: random codes, valid scales (d 0.01,
// m -0.02; a K-quant's super-block scales 0.001). Prints the median and best of REPS.
//
//   g++ -std=c++20 -O3 -march=native -pthread -Ikernels/cpu bench/cpu_products.cpp \
//       kernels/cpu/products.cpp kernels/cpu/rounded_*.cpp kernels/cpu/float_*.cpp -o /tmp/cpu_products
//   /tmp/cpu_products [GGML_TYPE=3] [REPS=40] [THREADS=2] [layers|one] [TOKENS=1]
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
  const int64_t tokens = argc > 5 ? std::atoi(argv[5]) : 1;
  if (!has_product(type) || reps < 1 || threads < 1 || tokens < 1) {
    std::fprintf(stderr, "a format with a product (2, 3, 6, 7, 8, 12, 13, 14), REPS, THREADS and TOKENS >= 1\n");
    return 2;
  }
  const bool super = block_values(type) == 256;
  struct Shape { int64_t out, in; };
  std::vector<Shape> shapes;
  for (int layer = 0; layer < (super ? 18 : 30); ++layer) {
    for (Shape s : super ? std::vector<Shape>{{640, 1024}, {640, 2048}}
                         : std::vector<Shape>{{960, 576}, {576, 576}, {3072, 576}, {576, 1536}}) {
      shapes.push_back(s);
    }
  }
  if (one) {  // the same rows of the first shape's length as one product
    int64_t rows = 0, in = shapes[0].in;
    for (Shape s : shapes) rows += s.out * s.in / in;
    shapes = {Shape{rows, in}};
  }
  const int bytes = block_bytes(type);
  const bool f16_min = type == Q4_1 || type == Q5_1;
  const _Float16 d = super ? 0.001f : 0.01f, m = -0.02f;
  const int scale_at = type == Q6_K ? 208 : 0;  // a K-quant's super-block d (Q4_K/Q5_K: then dmin)
  std::mt19937 rng(1);
  std::vector<std::vector<uint8_t>> weights;
  size_t total = 0;
  int64_t widest = 0;
  for (Shape s : shapes) {
    std::vector<uint8_t> w(s.out * (s.in / 32) * bytes);
    for (auto& b : w) b = static_cast<uint8_t>(rng());
    for (size_t at = 0; at < w.size(); at += bytes) {
      std::memcpy(&w[at + scale_at], &d, 2);
      if (f16_min || type == Q4_K || type == Q5_K) std::memcpy(&w[at + 2], &d, 2);
    }
    total += w.size();
    widest = std::max(widest, s.out);
    weights.push_back(std::move(w));
  }
  std::vector<float> x(tokens * 2048), out(tokens * widest);
  for (auto& v : x) v = static_cast<float>(rng() % 1000) / 500.0f - 1.0f;
  std::vector<double> times;
  for (int rep = 0; rep < reps; ++rep) {
    auto start = std::chrono::steady_clock::now();
    for (size_t i = 0; i < shapes.size(); ++i) {
      linear_rounded_from_blocks(x.data(), weights[i].data(), out.data(), type, tokens, shapes[i].in,
                                 shapes[i].out, threads);
    }
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  std::printf("ggml type %d, %d threads, %ld tokens: %zu products, %.1f MB; median %.3f ms (%.1f GB/s), best %.3f ms (%.1f GB/s)\n",
              type, threads, static_cast<long>(tokens), shapes.size(), total / 1e6, times[reps / 2] * 1e3, total / times[reps / 2] / 1e9,
              times[0] * 1e3, total / times[0] / 1e9);
  return 0;
}
