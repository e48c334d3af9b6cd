// Attention on the CPU: for each query row, the scores against every visible key, their
// softmax, and the weighted sum of the value rows. A task of at least BLOCK_MIN_ROWS rows
// scores 16 keys at a time for all its rows (attend_rows); fewer rows score one key at a time
// (attend_row: a dot product of head_dim floats each).
// A decode token (attention_decode, below): tasks of one kv head's group of q heads over one
// part of the keys (group_part: each key and value row read once for the group), the parts'
// partial softmaxes merged after; the cache float32 or float16.
//
// Grid: batch x heads x tokens query rows, split into ROWS_PER_TASK-row tasks that `threads`
// threads claim in turn (thread_pool.h); the rows of a task share one head, so its key and
// value rows stay in cache across them.
// Bytes per call: q and out once; k and v once per task (from cache after the first).
// Bounds: attend_row skips masked keys; attend_rows skips blocks of 16 keys that no row of its
// task sees, and scores the other masked keys before setting them to -inf (a partial last
// block re-reads its last key, never stored). A row with no visible key is written as zeros;
// keys beyond the last multiple of 16 get scalar code in the softmax. head_dim is a multiple of
// 16 (the op checks).

#include "attention.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "arch.h"
#include "decode.h"
#include "vector_math.h"
#include "thread_pool.h"
#include "vectors.h"

namespace muser::cpu {

namespace {

constexpr int64_t ROWS_PER_TASK = 16;
// Tasks of fewer query rows score one key at a time (attend_row): transposing a block of 16
// keys costs about as much as scoring it for 4 rows.
constexpr int64_t BLOCK_MIN_ROWS = 4;

// out_row [16 D] = the sum over keys of weights[key] * v[key] / total, v's rows `stride` floats
// apart. Key by key, each value row read once (a pass per 16 channels re-read every row
// head_dim / 16 times: Gemma 3's 256 channels made that most of a prefill's attention), into D
// vectors held in registers (out_row in memory made each key's adds wait for the last key's
// stores: ~40 % of SmolLM2's decode attention samples). Keys of weight 0 (masked) are skipped.
template <int D>
void weighted_sum(const float* weights, const float* v, int64_t stride, int64_t keys, float total,
                  float* out_row) {
  f32x16 acc[D] = {};
  for (int64_t key = 0; key < keys; ++key) {
    if (weights[key] != 0.0f) {
      for (int d = 0; d < D; ++d) {
        acc[d] += weights[key] * load<f32x16>(v + key * stride + 16 * d);
      }
    }
  }
  for (int d = 0; d < D; ++d) {
    store(out_row + 16 * d, acc[d] / total);
  }
}

using WeightedSumFn = void (*)(const float*, const float*, int64_t, int64_t, float, float*);

template <int... D>
constexpr std::array<WeightedSumFn, sizeof...(D)> weighted_sums(std::integer_sequence<int, D...>) {
  return {weighted_sum<D + 1>...};
}

// WEIGHTED_SUMS[D - 1]: 16 D channels, D <= 16 (wider heads: 256 channels at a time).
constexpr int MAX_VECTORS = 16;
constexpr auto WEIGHTED_SUMS = weighted_sums(std::make_integer_sequence<int, MAX_VECTORS>{});

// One query row's softmax and weighted sum, from its scores [keys] (masked: -inf) and their
// maximum `top`: out_row [head_dim]; zeros when no key is visible. Overwrites scores with the
// weights.
void finish_row(float* scores, float top, const float* v, float* out_row, int64_t keys,
                int64_t head_dim) {
  std::fill(out_row, out_row + head_dim, 0.0f);
  if (top == -std::numeric_limits<float>::infinity()) {
    return;  // no visible key
  }
  float total = 0;
  int64_t s = 0;
  for (; s + 16 <= keys; s += 16) {
    f32x16 p = exp16(load<f32x16>(scores + s) - top);
    for (int lane = 0; lane < 16; ++lane) {  // masked keys: -inf - top -> flushed to 0
      p[lane] = scores[s + lane] == -std::numeric_limits<float>::infinity() ? 0.0f : p[lane];
    }
    store(scores + s, p);
    total += hsum(p);
  }
  for (; s < keys; ++s) {
    scores[s] = scores[s] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(scores[s] - top);
    total += scores[s];
  }
  for (int64_t d = 0; d < head_dim; d += 16 * MAX_VECTORS) {
    int vectors = static_cast<int>(std::min<int64_t>(MAX_VECTORS, (head_dim - d) / 16));
    WEIGHTED_SUMS[vectors - 1](scores, v + d, head_dim, keys, total, out_row + d);
  }
}

// One query row: q_row [head_dim], keys/values [keys, head_dim], visible [keys] or null.
void attend_row(const float* q_row, const float* k, const float* v, const bool* visible,
                float* out_row, int64_t keys, int64_t head_dim, float scale,
                std::vector<float>& scores) {
  scores.assign(keys, -std::numeric_limits<float>::infinity());
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < keys; ++s) {
    if (visible && !visible[s]) {
      continue;
    }
    const float* k_row = k + s * head_dim;
    f32x16 acc = {};
    for (int64_t d = 0; d < head_dim; d += 16) {
      acc += load<f32x16>(q_row + d) * load<f32x16>(k_row + d);
    }
    scores[s] = scale * hsum(acc);
    top = std::max(top, scores[s]);
  }
  finish_row(scores.data(), top, v, out_row, keys, head_dim);
}

// `rows` consecutive query rows of one head (q [rows, head_dim], masks [rows, keys] or null),
// as attend_row each, but scored 16 keys at a time: a block of keys is transposed once
// (kt [head_dim, 16]) for all the rows, and a row's 16 scores are vector multiply-adds of its
// channels by kt's rows, in four chains (one key at a time was a chain of head_dim / 16
// dependent adds and a horizontal sum per key: ~50 GFLOP/s on Gemma 3's 256-channel heads).
// Blocks no row sees are skipped; masked keys are scored, then set to -inf.
void attend_rows(const float* q, const float* k, const float* v, const bool* mask, float* out,
                 int64_t rows, int64_t keys, int64_t head_dim, float scale) {
  thread_local std::vector<float> kt, all_scores;
  thread_local std::vector<f32x16> tops;  // each row's running maximum, lane by lane
  const f32x16 none = f32x16{} - std::numeric_limits<float>::infinity();
  kt.resize(head_dim * 16);
  all_scores.assign(rows * keys, -std::numeric_limits<float>::infinity());
  tops.assign(rows, none);
  for (int64_t first = 0; first < keys; first += 16) {
    const int64_t width = std::min<int64_t>(16, keys - first);
    bool seen = mask == nullptr;
    for (int64_t r = 0; r < rows && !seen; ++r) {
      for (int64_t j = 0; j < width && !seen; ++j) {
        seen = mask[r * keys + first + j];
      }
    }
    if (!seen) {
      continue;
    }
    for (int64_t j = 0; j < 16; ++j) {
      const float* k_row = k + (first + std::min(j, width - 1)) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        kt[d * 16 + j] = k_row[d];
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* q_row = q + r * head_dim;
      f32x16 s0 = {}, s1 = {}, s2 = {}, s3 = {};
      for (int64_t d = 0; d < head_dim; d += 4) {
        s0 += q_row[d] * load<f32x16>(kt.data() + d * 16);
        s1 += q_row[d + 1] * load<f32x16>(kt.data() + (d + 1) * 16);
        s2 += q_row[d + 2] * load<f32x16>(kt.data() + (d + 2) * 16);
        s3 += q_row[d + 3] * load<f32x16>(kt.data() + (d + 3) * 16);
      }
      f32x16 block = ((s0 + s1) + (s2 + s3)) * scale;
      float* row = all_scores.data() + r * keys + first;
      for (int64_t j = 0; j < 16; ++j) {  // masked keys and lanes past the last key: -inf
        bool kept = j < width && (!mask || mask[r * keys + first + j]);
        block[j] = kept ? block[j] : -std::numeric_limits<float>::infinity();
      }
      for (int64_t j = 0; j < width; ++j) {
        row[j] = block[j];
      }
      tops[r] = block > tops[r] ? block : tops[r];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float top = -std::numeric_limits<float>::infinity();
    for (int lane = 0; lane < 16; ++lane) {
      top = std::max(top, tops[r][lane]);
    }
    finish_row(all_scores.data() + r * keys, top, v, out + r * head_dim, keys, head_dim);
  }
}

// x [n] <- x / sqrt(mean(x^2) + eps) * weight.
void rms_norm_in_place(float* x, const float* weight, int64_t n, float eps) {
  float squares = 0;
  for (int64_t i = 0; i < n; ++i) {
    squares += x[i] * x[i];
  }
  float scale = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = x[i] * scale * weight[i];
  }
}

// RoPE on one head x [head_dim]: pair i of the first `half * 2` channels rotated by the angle
// whose cosine and sine are cos[i], sin[i].
void rotate(float* x, const float* cos, const float* sin, int64_t half, bool traditional) {
  for (int64_t i = 0; i < half; ++i) {
    float& a = traditional ? x[2 * i] : x[i];
    float& b = traditional ? x[2 * i + 1] : x[i + half];
    float first = a, second = b;
    a = first * cos[i] - second * sin[i];
    b = first * sin[i] + second * cos[i];
  }
}

} // namespace

namespace {

// cos and sin of the angle p * inv_freq[i] (by default base^(-2i / rotary_dim)) of each pair
// i, in double as the reference computes it.
void rope_angles(int64_t position, const DecodeHeads& shape, std::vector<float>& cos,
                 std::vector<float>& sin) {
  int64_t half = shape.rotary_dim / 2;
  cos.resize(half);
  sin.resize(half);
  for (int64_t i = 0; i < half; ++i) {
    double inverse = shape.inv_freq.empty()
                         ? std::pow(static_cast<double>(shape.rope_base), -2.0 * i / shape.rotary_dim)
                         : shape.inv_freq[i];
    double angle = static_cast<double>(position) * inverse;
    cos[i] = static_cast<float>(std::cos(angle));
    sin[i] = static_cast<float>(std::sin(angle));
  }
}

// 1 / rms of a whole projection (y + offset, `size` values, its bias at bias + bias_offset):
// the scale of a norm over the whole projection (DecodeHeads.qk_norm_whole).
float projection_inverse_rms(const float* y, int64_t offset, const float* bias, int64_t bias_offset,
                             int64_t size, float eps) {
  float squares = 0;
  for (int64_t i = 0; i < size; ++i) {
    float value = y[offset + i] + (bias ? bias[bias_offset + i] : 0.0f);
    squares += value * value;
  }
  return 1.0f / std::sqrt(squares / static_cast<float>(size) + eps);
}

// One head of a projection (y + offset, its bias at bias + bias_offset) into `head`:
// biased, normed by `norm` unless null (per head; or, where whole_scale > 0, times whole_scale,
// the projection's 1 / rms, and norm's values of this head), rotated unless cos is empty.
void prepare_head(float* head, const float* y, int64_t offset, const float* bias,
                  int64_t bias_offset, const float* norm, float whole_scale,
                  const std::vector<float>& cos, const std::vector<float>& sin,
                  const DecodeHeads& shape) {
  for (int64_t d = 0; d < shape.head_dim; ++d) {
    head[d] = y[offset + d] + (bias ? bias[bias_offset + d] : 0.0f);
  }
  if (norm && whole_scale > 0.0f) {
    for (int64_t d = 0; d < shape.head_dim; ++d) {
      head[d] = head[d] * whole_scale * norm[d];
    }
  } else if (norm) {
    rms_norm_in_place(head, norm, shape.head_dim, shape.eps);
  }
  if (!cos.empty()) {
    rotate(head, cos.data(), sin.data(), static_cast<int64_t>(cos.size()), shape.traditional);
  }
}

} // namespace

template <class C>
void write_cache(const float* y, const float* bias, const float* norm, int64_t position,
                 C* cache, const DecodeHeads& shape, bool key) {
  std::vector<float> cos, sin, head(shape.head_dim);
  if (key) {
    rope_angles(position, shape, cos, sin);
  }
  const int64_t head_dim = shape.head_dim, slot = position % shape.capacity;
  const int64_t q_size = shape.heads * head_dim, kv_size = shape.kv_heads * head_dim;
  const bool whole = key && norm && shape.qk_norm_whole;
  const float whole_scale = whole ? projection_inverse_rms(y, shape.k_off, bias, q_size, kv_size, shape.eps) : 0.0f;
  for (int64_t h = 0; h < shape.kv_heads; ++h) {
    if (key) {
      prepare_head(head.data(), y, shape.k_off + h * head_dim, bias, q_size + h * head_dim,
                   whole ? norm + h * head_dim : norm, whole_scale, cos, sin, shape);
    } else {
      prepare_head(head.data(), y, shape.v_off + h * head_dim, bias, q_size + kv_size + h * head_dim,
                   nullptr, 0.0f, cos, sin, shape);
    }
    C* row = cache + (h * shape.capacity + slot) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {
      row[d] = static_cast<C>(head[d]);  // half: rounded to nearest
    }
  }
}

// A decode step's attention, flash-decoding style: a task takes one kv head's group of q heads
// (at most GROUP_HEADS of them) over one part of the keys, so each key and value row is read
// once for the group (not once per head) and the parts keep every thread busy; the parts'
// partial results (each head's largest score, sum of weights, unnormalized output) are merged
// after.
constexpr int GROUP_HEADS = 4;
constexpr int64_t PART_MIN_KEYS = 64;

// The decode attention's float vectors: 16 floats where a register holds 16, else 8 (AVX2: GCC
// builds 16-float vectors through the stack there, group_values).
constexpr int VECTOR_FLOATS = REGISTER_FLOATS;
using FloatVector = std::conditional_t<VECTOR_FLOATS == 8, f32x8, f32x16>;

// Scores of G heads (q [G, head_dim]) against keys [n, head_dim]: scores [G, n], each head's
// largest in top[G].
template <class C, int G>
void group_scores(const float* q, const C* k, int64_t n, int64_t head_dim, float scale, float softcap,
                  float* scores, float* top) {
  for (int g = 0; g < G; ++g) {
    top[g] = -std::numeric_limits<float>::infinity();
  }
  for (int64_t s = 0; s < n; ++s) {
    const C* k_row = k + s * head_dim;
    FloatVector acc[G] = {};
    for (int64_t d = 0; d < head_dim; d += VECTOR_FLOATS) {
      FloatVector key = load_values<FloatVector>(k_row + d);
      for (int g = 0; g < G; ++g) {
        acc[g] += load<FloatVector>(q + g * head_dim + d) * key;
      }
    }
    for (int g = 0; g < G; ++g) {
      float score = scale * hsum(acc[g]);
      score = softcap > 0.0f ? softcap * std::tanh(score / softcap) : score;
      scores[g * n + s] = score;
      top[g] = std::max(top[g], score);
    }
  }
}

// out [G, head_dim] (channels d0 .. d0 + 16 V) += the weighted sum of the value rows (on AVX2
// with 16-float vectors, each weight's splat went through the stack: 7x AVX-512's time).
template <class C, int G, int V>
void group_values(const float* weights, const C* v, int64_t n, int64_t head_dim, int64_t d0, float* out) {
  constexpr int N = 16 * V / VECTOR_FLOATS;  // vectors a row's 16 V channels take
  FloatVector acc[G][N] = {};
  for (int64_t s = 0; s < n; ++s) {
    const C* v_row = v + s * head_dim + d0;
    FloatVector w[G];
    for (int g = 0; g < G; ++g) {
      w[g] = FloatVector{} + weights[g * n + s];
    }
    for (int j = 0; j < N; ++j) {
      FloatVector value = load_values<FloatVector>(v_row + VECTOR_FLOATS * j);
      for (int g = 0; g < G; ++g) {
        acc[g][j] += w[g] * value;
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < N; ++j) {
      store(out + g * head_dim + d0 + VECTOR_FLOATS * j, acc[g][j]);
    }
  }
}

template <class C, int G>
void group_part(const float* q, const C* k, const C* v, int64_t n, int64_t head_dim, float scale,
                float softcap, float* top, float* total, float* out, std::vector<float>& scores) {
  scores.resize(G * n);
  group_scores<C, G>(q, k, n, head_dim, scale, softcap, scores.data(), top);
  for (int g = 0; g < G; ++g) {
    float* w = scores.data() + g * n;
    float sum = 0;
    int64_t s = 0;
    for (; s + 16 <= n; s += 16) {
      f32x16 p = exp16(load<f32x16>(w + s) - top[g]);
      store(w + s, p);
      sum += hsum(p);
    }
    for (; s < n; ++s) {
      w[s] = std::exp(w[s] - top[g]);
      sum += w[s];
    }
    total[g] = sum;
  }
  int64_t d0 = 0;
  // 4 vectors of channels a pass: G x 4 accumulators, in registers (64 channels with AVX-512's
  // 32 registers, 32 with AVX2's 16, where 64 spilled: ~10 % of an AVX2 decode).
  constexpr int PASS = 4 * VECTOR_FLOATS;
  for (; d0 + PASS <= head_dim; d0 += PASS) {
    group_values<C, G, PASS / 16>(scores.data(), v, n, head_dim, d0, out);
  }
  for (; d0 < head_dim; d0 += 16) {
    group_values<C, G, 1>(scores.data(), v, n, head_dim, d0, out);
  }
}

template <class C>
void group_part_any(int heads, const float* q, const C* k, const C* v, int64_t n, int64_t head_dim,
                    float scale, float softcap, float* top, float* total, float* out,
                    std::vector<float>& scores) {
  switch (heads) {
    case 1: return group_part<C, 1>(q, k, v, n, head_dim, scale, softcap, top, total, out, scores);
    case 2: return group_part<C, 2>(q, k, v, n, head_dim, scale, softcap, top, total, out, scores);
    case 3: return group_part<C, 3>(q, k, v, n, head_dim, scale, softcap, top, total, out, scores);
    default: return group_part<C, 4>(q, k, v, n, head_dim, scale, softcap, top, total, out, scores);
  }
}

template <class C>
void attention_decode(const float* y, const float* bias, const float* q_norm, int64_t position,
                      const C* keys, const C* values, float* out,
                      const DecodeHeads& shape, int threads) {
  const int64_t heads = shape.heads, head_dim = shape.head_dim, capacity = shape.capacity;
  const int64_t seen = std::min(position + 1, capacity), group = heads / shape.kv_heads;
  std::vector<float> cos, sin, q(heads * head_dim);
  rope_angles(position, shape, cos, sin);
  const bool whole = q_norm && shape.qk_norm_whole;
  const float whole_scale = whole ? projection_inverse_rms(y, shape.q_off, bias, 0, heads * head_dim, shape.eps) : 0.0f;
  for (int64_t h = 0; h < heads; ++h) {
    prepare_head(q.data() + h * head_dim, y, shape.q_off + h * head_dim, bias, h * head_dim,
                 whole ? q_norm + h * head_dim : q_norm, whole_scale, cos, sin, shape);
  }
  const int64_t chunks = (group + GROUP_HEADS - 1) / GROUP_HEADS;  // head chunks per kv head
  const int64_t units = shape.kv_heads * chunks;
  int workers = seen * heads * head_dim >= (1 << 17) ? threads : 1;
  // Parts of the keys: enough tasks for every worker (4 each), none shorter than PART_MIN_KEYS.
  const int64_t parts = workers == 1 ? 1 : std::max<int64_t>(
      1, std::min<int64_t>((4 * workers + units - 1) / units, seen / PART_MIN_KEYS));
  std::vector<float> tops(parts * heads), totals(parts * heads), partial(parts * heads * head_dim);
  ThreadPool::instance().run(static_cast<int>(units * parts), workers, [&](int task) {
    FlushSubnormals flush;
    thread_local std::vector<float> scores;
    const int64_t unit = task / parts, part = task % parts;
    const int64_t kv = unit / chunks, h0 = kv * group + unit % chunks * GROUP_HEADS;
    const int count = static_cast<int>(std::min<int64_t>(GROUP_HEADS, kv * group + group - h0));
    const int64_t first = seen * part / parts, last = seen * (part + 1) / parts;
    const int64_t offset = (kv * capacity + first) * head_dim;
    group_part_any<C>(count, q.data() + h0 * head_dim, keys + offset, values + offset, last - first,
                      head_dim, shape.scale, shape.softcap, tops.data() + part * heads + h0,
                      totals.data() + part * heads + h0, partial.data() + (part * heads + h0) * head_dim,
                      scores);
  });
  for (int64_t h = 0; h < heads; ++h) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t part = 0; part < parts; ++part) {
      top = std::max(top, tops[part * heads + h]);
    }
    float total = 0;
    float* out_row = out + h * head_dim;
    std::fill(out_row, out_row + head_dim, 0.0f);
    for (int64_t part = 0; part < parts; ++part) {
      float factor = std::exp(tops[part * heads + h] - top);
      total += factor * totals[part * heads + h];
      const float* o = partial.data() + (part * heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        out_row[d] += factor * o[d];
      }
    }
    for (int64_t d = 0; d < head_dim; ++d) {
      out_row[d] /= total;
    }
    if (shape.gate_off >= 0) {
      const float* gate = y + shape.gate_off + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        out_row[d] /= 1.0f + std::exp(-gate[d]);
      }
    }
  }
}

template void write_cache<float>(const float*, const float*, const float*, int64_t, float*,
                                 const DecodeHeads&, bool);
template void attention_decode<float>(const float*, const float*, const float*, int64_t, const float*,
                                      const float*, float*, const DecodeHeads&, int);
#ifdef MUSER_HALF_CACHE
template void write_cache<half>(const float*, const float*, const float*, int64_t, half*,
                                const DecodeHeads&, bool);
template void attention_decode<half>(const float*, const float*, const float*, int64_t, const half*,
                                     const half*, float*, const DecodeHeads&, int);
#endif

void attention(const float* q, const float* k, const float* v, const bool* mask, float* out,
               int64_t batch, int64_t heads, int64_t kv_heads, int64_t tokens, int64_t keys,
               int64_t head_dim, float scale, int threads) {
  int64_t group = heads / kv_heads;
  int64_t tasks_per_head = (tokens + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  int64_t tasks = batch * heads * tasks_per_head;
  int workers = tokens * keys * heads * head_dim >= (1 << 17) ? threads : 1;
  ThreadPool::instance().run(static_cast<int>(tasks), workers, [&](int task) {
    FlushSubnormals flush;
    int64_t bh = task / tasks_per_head;  // b * heads + h
    int64_t b = bh / heads, h = bh % heads;
    int64_t kv = b * kv_heads + h / group;
    int64_t t0 = (task % tasks_per_head) * ROWS_PER_TASK;
    int64_t rows = std::min(tokens, t0 + ROWS_PER_TASK) - t0;
    if (rows < BLOCK_MIN_ROWS) {  // a transposed key block would serve too few rows
      std::vector<float> scores;
      for (int64_t t = t0; t < t0 + rows; ++t) {
        attend_row(q + (bh * tokens + t) * head_dim, k + kv * keys * head_dim,
                   v + kv * keys * head_dim, mask ? mask + t * keys : nullptr,
                   out + (bh * tokens + t) * head_dim, keys, head_dim, scale, scores);
      }
      return;
    }
    attend_rows(q + (bh * tokens + t0) * head_dim, k + kv * keys * head_dim,
                v + kv * keys * head_dim, mask ? mask + t0 * keys : nullptr,
                out + (bh * tokens + t0) * head_dim, rows, keys, head_dim, scale);
  });
}

void norm_rope_heads(const float* y, int64_t stride, int64_t offset, const float* norm,
                     float* out, int64_t batch, int64_t tokens, int64_t heads, int64_t head_dim,
                     float eps, int64_t start, int64_t rotary_dim, float base, bool traditional,
                     const double* inv_freq) {
  const int64_t half = rotary_dim / 2;
  std::vector<float> cos_table(tokens * half), sin_table(tokens * half);
  for (int64_t i = 0; i < half; ++i) {
    double theta = inv_freq ? inv_freq[i] : std::pow(static_cast<double>(base), -2.0 * i / rotary_dim);
    double step_cos = std::cos(theta), step_sin = std::sin(theta), c = 0.0, s = 0.0;
    for (int64_t t = 0; t < tokens; ++t) {
      if (t % 32 == 0) {
        double angle = static_cast<double>(start + t) * theta;
        c = std::cos(angle);
        s = std::sin(angle);
      } else {
        double next_c = c * step_cos - s * step_sin;
        s = s * step_cos + c * step_sin;
        c = next_c;
      }
      cos_table[t * half + i] = static_cast<float>(c);
      sin_table[t * half + i] = static_cast<float>(s);
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < tokens; ++t) {
      const float* row = y + (b * tokens + t) * stride + offset;
      for (int64_t h = 0; h < heads; ++h) {
        float* head = out + ((b * heads + h) * tokens + t) * head_dim;
        std::copy(row + h * head_dim, row + (h + 1) * head_dim, head);
        if (norm) {
          rms_norm_in_place(head, norm, head_dim, eps);
        }
        if (half > 0) {
          rotate(head, cos_table.data() + t * half, sin_table.data() + t * half, half, traditional);
        }
      }
    }
  }
}

} // namespace muser::cpu
