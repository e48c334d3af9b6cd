#include "primitives.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "mlx/backend/cpu/encoder.h"
#include "thread_pool.h"
#include "mlx/utils.h"

#include "attention.h"
#include "products.h"

namespace muser::cpu {

bool half_cache_supported() {
#ifdef MUSER_HALF_CACHE
  return true;
#else
  return false;
#endif
}

namespace {

int all_cores() {
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// Inputs are taken as they come (a graph node costs 3-30 us on MLX's CPU: a decode step has
// hundreds): cast only where the dtype differs, and made row-major by the primitive itself.
mx::array as_f32(const mx::array& a, mx::Stream stream) {
  return a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, stream);
}

mx::array as_shape(const mx::array& a, const mx::Shape& shape, mx::Stream stream) {
  return a.shape() == shape ? a : mx::reshape(a, shape, stream);
}

// The elements of `in` in row-major order, for the work dispatched after this call: its own
// memory when it is row-contiguous, else a copy (in any strides, broadcasts too) made first.
template <class T>
const T* row_major(const mx::array& in, mx::cpu::CommandEncoder& encoder) {
  if (in.flags().row_contiguous) {
    return in.data<T>();
  }
  mx::array copy(in.shape(), in.dtype(), nullptr, {});
  copy.set_data(mx::allocator::malloc(copy.nbytes()));
  encoder.add_temporary(copy);
  T* to = copy.data<T>();
  encoder.dispatch([from = in.data<T>(), to, shape = in.shape(), strides = in.strides()] {
    // Row by row along the last axis (a slice of a cache: whole rows of head_dim values).
    const int last = static_cast<int>(shape.size()) - 1;
    const int64_t inner = last >= 0 ? shape[last] : 1, inner_stride = last >= 0 ? strides[last] : 1;
    int64_t rows = 1;
    for (int d = 0; d < last; ++d) {
      rows *= shape[d];
    }
    std::vector<int64_t> index(std::max(last, 0), 0);
    for (int64_t row = 0; row < rows; ++row) {
      int64_t offset = 0;
      for (int d = 0; d < last; ++d) {
        offset += index[d] * strides[d];
      }
      T* out = to + row * inner;
      if (inner_stride == 1) {
        std::memcpy(out, from + offset, inner * sizeof(T));
      } else {
        for (int64_t i = 0; i < inner; ++i) {
          out[i] = from[offset + i * inner_stride];
        }
      }
      for (int d = last - 1; d >= 0; --d) {
        if (++index[d] < shape[d]) {
          break;
        }
        index[d] = 0;
      }
    }
  });
  return to;
}

// `out` takes `in`'s buffer when nothing else holds it (MLX's donation, as its slice_update
// does); else `out` gets a buffer of its own and the returned work copies `in` [a, b, c, d]
// (any strides) into it, to run before anything writes `out`.
template <class T>
std::function<void()> reuse_or_copy_as(const mx::array& in, mx::array& out) {
  if (in.is_donatable() && in.flags().row_contiguous) {
    out.copy_shared_buffer(in);
    return [] {};
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  return [from = in.data<T>(), to = out.data<T>(), shape = in.shape(),
          strides = in.strides()] {
    T* next = to;
    for (int64_t a = 0; a < shape[0]; ++a) {
      for (int64_t b = 0; b < shape[1]; ++b) {
        for (int64_t c = 0; c < shape[2]; ++c) {
          const T* row = from + a * strides[0] + b * strides[1] + c * strides[2];
          for (int64_t d = 0; d < shape[3]; ++d) {
            *next++ = row[d * strides[3]];
          }
        }
      }
    }
  };
}

// A float32 or float16 cache (elements copied as 2-byte words: no conversion).
std::function<void()> reuse_or_copy(const mx::array& in, mx::array& out) {
  return in.dtype() == mx::float16 ? reuse_or_copy_as<uint16_t>(in, out) : reuse_or_copy_as<float>(in, out);
}

// As reuse_or_copy; where `in_place` (caches no one else reads: decode_layer's, which writes and
// attends in one node), `out` takes `in`'s buffer even while MLX still holds `in`. MLX holds the buffers of a node's
// inputs and outputs until its work has run, and a pipelined loop builds the next step while the
// last one runs: without this every layer whose last step had not run yet was copied whole (8
// rows of SmolLM2: 18.3 against 16.1 ms a step). The writes stay in order: one stream runs them.
std::function<void()> take_or_copy(const mx::array& in, mx::array& out, bool in_place) {
  if (in_place && in.flags().row_contiguous) {
    out.copy_shared_buffer(in);
    return [] {};
  }
  return reuse_or_copy(in, out);
}

} // namespace

mx::array linear(const mx::array& x, const mx::array& weight, int ggml_type, int threads,
                 bool rounded, mx::StreamOrDevice s) {
  if (!has_product(ggml_type)) {
    throw std::invalid_argument("[gguf_linear] ggml type " + std::to_string(ggml_type) +
                                " has no CPU product");
  }
  if (x.ndim() != 2 || weight.ndim() != 2 || weight.dtype() != mx::uint8) {
    std::ostringstream message;
    message << "[gguf_linear] expected x [tokens, in] and uint8 weight [out, row_bytes], got x "
            << x.shape() << " and weight " << weight.shape() << " of " << weight.dtype();
    throw std::invalid_argument(message.str());
  }
  int values = block_values(ggml_type);
  int64_t in_features = x.shape(1);
  if (in_features % values != 0 || weight.shape(1) != in_features / values * block_bytes(ggml_type)) {
    std::ostringstream message;
    message << "[gguf_linear] weight rows of " << weight.shape(1) << " bytes do not hold "
            << in_features << " values of ggml type " << ggml_type;
    throw std::invalid_argument(message.str());
  }
  if (threads < 0) {
    throw std::invalid_argument("[gguf_linear] threads must be >= 0 (0: all cores)");
  }
  if (rounded && in_features % 32 != 0) {
    std::ostringstream message;
    message << "[gguf_linear] a rounded product takes rows of x of whole 32-value blocks, got x "
            << x.shape();
    throw std::invalid_argument(message.str());
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);
  auto x32 = as_f32(x, stream);
  auto rows = weight;
  return mx::array({x.shape(0), weight.shape(0)}, mx::float32,
                   std::make_shared<GGUFLinear>(stream, ggml_type, threads, rounded), {x32, rows});
}

void GGUFLinear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  const mx::array& weight = inputs[1];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(weight);
  encoder.set_output_array(out);
  int threads = threads_ > 0 ? threads_ : all_cores();
  const float* x_rows = row_major<float>(x, encoder);
  const uint8_t* weight_rows = row_major<uint8_t>(weight, encoder);
  encoder.dispatch([x_data = x_rows, weight_data = weight_rows,
                    out_data = out.data<float>(), type = ggml_type_, tokens = x.shape(0),
                    in_features = x.shape(1), out_features = weight.shape(0), threads,
                    rounded = rounded_]() {
    if (rounded) {
      linear_rounded_from_blocks(x_data, weight_data, out_data, type, tokens, in_features,
                                 out_features, threads);
    } else {
      linear_from_blocks(x_data, weight_data, out_data, type, tokens, in_features, out_features,
                         threads);
    }
  });
}

void GGUFLinear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[gguf_linear] runs on the CPU only; the GPU has kernels/*.metal");
}

bool GGUFLinear::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GGUFLinear&>(other);
  return ggml_type_ == o.ggml_type_ && threads_ == o.threads_ && rounded_ == o.rounded_;
}

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    const std::optional<mx::array>& mask, int threads, mx::StreamOrDevice s) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.shape() != k.shape() || q.shape(0) != k.shape(0) ||
      q.shape(3) != k.shape(3) || k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0 ||
      q.shape(3) % 16 != 0) {
    std::ostringstream message;
    message << "[attention] expected q [B, heads, T, head_dim] and k, v [B, kv_heads, S, head_dim] "
            << "(heads a multiple of kv_heads, head_dim of 16), got q " << q.shape() << ", k "
            << k.shape() << ", v " << v.shape();
    throw std::invalid_argument(message.str());
  }
  if (mask && (mask->dtype() != mx::bool_ || mask->shape() != mx::Shape{q.shape(2), k.shape(2)})) {
    std::ostringstream message;
    message << "[attention] the mask must be bool [T, S] = [" << q.shape(2) << ", " << k.shape(2)
            << "], got " << mask->shape() << " of " << mask->dtype();
    throw std::invalid_argument(message.str());
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs = {as_f32(q, stream), as_f32(k, stream), as_f32(v, stream)};
  if (mask) {
    inputs.push_back(*mask);
  }
  return mx::array(q.shape(), mx::float32,
                   std::make_shared<Attention>(stream, scale, mask.has_value(), threads), inputs);
}

void Attention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  encoder.set_output_array(out);
  int threads = threads_ > 0 ? threads_ : all_cores();
  const float* q_rows = row_major<float>(q, encoder);
  const float* k_rows = row_major<float>(k, encoder);
  const float* v_rows = row_major<float>(v, encoder);
  const bool* mask_rows = masked_ ? row_major<bool>(inputs[3], encoder) : nullptr;
  encoder.dispatch([q = q_rows, k = k_rows, v = v_rows, mask = mask_rows, out = out.data<float>(),
                    batch = q.shape(0), heads = q.shape(1), kv_heads = k.shape(1),
                    tokens = q.shape(2), keys = k.shape(2), head_dim = q.shape(3),
                    scale = scale_, threads]() {
    attention(q, k, v, mask, out, batch, heads, kv_heads, tokens, keys, head_dim, scale, threads);
  });
}

void Attention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[attention] runs on the CPU only; on a GPU MLX's own attention serves");
}

bool Attention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Attention&>(other);
  return scale_ == o.scale_ && masked_ == o.masked_ && threads_ == o.threads_;
}

std::vector<mx::array> residual_norm(const std::optional<mx::array>& residual,
                                     const mx::array& branch,
                                     const std::optional<mx::array>& branch_weight,
                                     const std::optional<mx::array>& next_weight, float branch_eps,
                                     float next_eps, mx::StreamOrDevice s) {
  int64_t hidden = branch.ndim() == 2 ? branch.shape(1) : -1;
  auto vector_of = [&](const mx::array& w) { return w.ndim() == 1 && w.shape(0) == hidden; };
  if (hidden < 1 || (residual && residual->shape() != branch.shape()) ||
      (branch_weight && !vector_of(*branch_weight)) || (next_weight && !vector_of(*next_weight))) {
    std::ostringstream message;
    message << "[residual_norm] expected branch (and residual) [rows, hidden] and weights "
            << "[hidden], got branch " << branch.shape();
    if (next_weight) {
      message << ", next weight " << next_weight->shape();
    }
    throw std::invalid_argument(message.str());
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs;
  if (residual) {
    inputs.push_back(as_f32(*residual, stream));
  }
  inputs.push_back(as_f32(branch, stream));
  if (branch_weight) {
    inputs.push_back(as_f32(*branch_weight, stream));
  }
  if (next_weight) {
    inputs.push_back(as_f32(*next_weight, stream));
  }
  return mx::array::make_arrays(
      {branch.shape(), branch.shape()}, {mx::float32, mx::float32},
      std::make_shared<ResidualNorm>(stream, residual.has_value(), branch_weight.has_value(),
                                     next_weight.has_value(), branch_eps, next_eps),
      inputs);
}

void ResidualNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  for (auto& output : outputs) {
    output.set_data(mx::allocator::malloc(output.nbytes()));
    encoder.set_output_array(output);
  }
  size_t i = 0;
  const float* residual = residual_ ? row_major<float>(inputs[i++], encoder) : nullptr;
  const mx::array& branch = inputs[i++];
  const float* branch_data = row_major<float>(branch, encoder);
  const float* branch_weight = branch_weight_ ? row_major<float>(inputs[i++], encoder) : nullptr;
  const float* next_weight = next_weight_ ? row_major<float>(inputs[i], encoder) : nullptr;
  encoder.dispatch([=, sum = outputs[0].data<float>(),
                    normed = outputs[1].data<float>(), rows = branch.shape(0),
                    hidden = branch.shape(1), branch_eps = branch_eps_, next_eps = next_eps_]() {
    residual_norm(residual, branch_data, branch_weight, next_weight, sum, normed, rows, hidden,
                  branch_eps, next_eps);
  });
}

void ResidualNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[residual_norm] runs on the CPU only");
}

bool ResidualNorm::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const ResidualNorm&>(other);
  return residual_ == o.residual_ && branch_weight_ == o.branch_weight_ &&
         next_weight_ == o.next_weight_ && branch_eps_ == o.branch_eps_ && next_eps_ == o.next_eps_;
}

namespace {

// The rows of `a` [..., n] (float32) as (first value, floats from one row to the next): its
// own memory when its last axis is contiguous and the others collapse into one stride (a
// slice of a wider product output), else a row-major copy made first.
std::pair<const float*, int64_t> rows_of(const mx::array& a, mx::cpu::CommandEncoder& encoder) {
  const int last = static_cast<int>(a.ndim()) - 1;
  bool in_place = last < 0 || a.strides()[last] == 1 || a.shape(last) == 1;
  for (int d = 0; d + 1 < last && in_place; ++d) {
    in_place = a.shape(d) == 1 || a.strides()[d] == a.strides()[d + 1] * a.shape(d + 1);
  }
  if (in_place && last >= 1) {
    return {a.data<float>(), a.strides()[last - 1]};
  }
  return {row_major<float>(a, encoder), last >= 0 ? a.shape(last) : 1};
}

} // namespace

mx::array gated_activation(const mx::array& gate, const mx::array& up, bool gelu,
                           mx::StreamOrDevice s) {
  if (gate.shape() != up.shape() || gate.ndim() < 1 || gate.size() == 0) {
    std::ostringstream message;
    message << "[gated_activation] gate and up must be of one non-empty shape [..., n], got "
            << gate.shape() << " and " << up.shape();
    throw std::invalid_argument(message.str());
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(gate.shape(), mx::float32, std::make_shared<GatedActivation>(stream, gelu),
                   {as_f32(gate, stream), as_f32(up, stream)});
}

void GatedActivation::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_output_array(out);
  auto [gate, gate_stride] = rows_of(inputs[0], encoder);
  auto [up, up_stride] = rows_of(inputs[1], encoder);
  const int64_t n = out.shape(-1);
  encoder.dispatch([=, out_data = out.data<float>(), rows = static_cast<int64_t>(out.size()) / n,
                    gelu = gelu_]() {
    gated_activation(gate, up, out_data, rows, n, gate_stride, up_stride, gelu);
  });
}

void GatedActivation::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[gated_activation] runs on the CPU only");
}

bool GatedActivation::is_equivalent(const mx::Primitive& other) const {
  return gelu_ == static_cast<const GatedActivation&>(other).gelu_;
}

namespace {

bool cache_dtype_supported(mx::Dtype dtype) {
  return dtype == mx::float32 || (half_cache_supported() && dtype == mx::float16);
}

// Refuses y, a cache and the optional vectors that do not fit `shape` (capacity from the
// cache), naming the op. norm: of the q projection's `norm_heads` heads (heads) or k's (kv_heads).
// y holds B rows (1 unless `rows`: a batched decode step), each with its position and the
// cache's row of the same index (the cache may hold more rows).
void check_decode_inputs(const char* op, const mx::Shape& y, const mx::array& cache,
                         const mx::array& position, const std::optional<mx::array>& bias,
                         const std::optional<mx::array>& norm, const DecodeHeads& shape,
                         int64_t norm_heads, bool rows = false) {
  const int64_t head_dim = shape.head_dim, q_size = shape.heads * head_dim;
  const int64_t kv_size = shape.kv_heads * head_dim;
  int64_t width = y.size() == 2 ? y[1] : -1;
  auto fits = [&](int64_t offset, int64_t size) { return offset >= 0 && offset + size <= width; };
  const int64_t batch = y.size() == 2 ? y[0] : -1;
  bool cache_ok = cache.ndim() == 4 && cache.shape(0) >= std::max<int64_t>(batch, 1) &&
                  (rows || cache.shape(0) == 1) && cache.shape(1) == shape.kv_heads &&
                  cache.shape(3) == head_dim && cache.shape(2) > 0 && cache_dtype_supported(cache.dtype());
  if (y.size() != 2 || y[0] < 1 || (!rows && y[0] != 1) || shape.kv_heads < 1 || shape.heads % shape.kv_heads ||
      head_dim % 16 || !cache_ok || !fits(shape.q_off, q_size) || !fits(shape.k_off, kv_size) ||
      !fits(shape.v_off, kv_size) || (shape.gate_off >= 0 && !fits(shape.gate_off, q_size)) ||
      shape.rotary_dim % 2 || shape.rotary_dim > head_dim || shape.rotary_dim < 0 || shape.softcap < 0) {
    std::ostringstream message;
    message << "[" << op << "] expected y [" << (rows ? "B" : "1") << ", width] holding q, k, v (and gate) "
            << "at their offsets, a " << (half_cache_supported() ? "float32 or float16" : "float32")
            << " cache [" << (rows ? "at least B" : "1") << ", " << shape.kv_heads << ", capacity, " << head_dim
            << "], heads a multiple of kv_heads, head_dim of 16, an even rotary_dim <= head_dim, "
            << "a softcap >= 0;"
            << " got y " << y << ", cache " << cache.shape() << " " << cache.dtype()
            << ", heads " << shape.heads << "/" << shape.kv_heads;
    throw std::invalid_argument(message.str());
  }
  if (position.dtype() != mx::int32 || static_cast<int64_t>(position.size()) != batch) {
    throw std::invalid_argument(std::string("[") + op + "] position must be int32 [" +
                                (rows ? "B]: one per row of y" : "1]"));
  }
  const int64_t norm_size = shape.qk_norm_whole ? norm_heads * head_dim : head_dim;
  if ((bias && bias->size() != q_size + 2 * kv_size) || (norm && norm->size() != norm_size)) {
    throw std::invalid_argument(std::string("[") + op + "] the bias must hold (heads + 2 "
                                "kv_heads) * head_dim values, a norm weight head_dim (over the "
                                "whole projection: its heads * head_dim)");
  }
}

} // namespace

mx::array write_cache(const mx::array& y, const mx::array& cache, const mx::array& position,
                      const std::optional<mx::array>& bias, const std::optional<mx::array>& norm,
                      DecodeHeads shape, bool key, mx::StreamOrDevice s) {
  check_decode_inputs("write_cache", y.shape(), cache, position, bias, norm, shape, shape.kv_heads, true);
  shape.capacity = cache.shape(2);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs = {as_f32(y, stream), cache, as_shape(position, {y.shape(0)}, stream)};
  if (bias) {
    inputs.push_back(as_f32(*bias, stream));
  }
  bool normed = key && norm.has_value();
  if (normed) {
    inputs.push_back(as_f32(*norm, stream));
  }
  return mx::array(cache.shape(), cache.dtype(),
                   std::make_shared<CacheWrite>(stream, shape, key, bias.has_value(), normed),
                   inputs);
}

void CacheWrite::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  auto copy = reuse_or_copy(inputs[1], outputs[0]);
  encoder.set_output_array(outputs[0]);
  size_t i = 3;
  const float* bias = bias_ ? row_major<float>(inputs[i++], encoder) : nullptr;
  const float* norm = norm_ ? row_major<float>(inputs[i++], encoder) : nullptr;
  const float* y = row_major<float>(inputs[0], encoder);
  const int32_t* position = inputs[2].data<int32_t>();
  const int64_t rows = inputs[0].shape(0), width = inputs[0].shape(1);
  const int64_t row_size = shape_.kv_heads * shape_.capacity * shape_.head_dim;
  auto write = [&](auto* cache) {
    encoder.dispatch([=, shape = shape_, key = key_]() {
      copy();
      for (int64_t b = 0; b < rows; ++b) {  // row b of y into row b of the cache
        write_cache(y + b * width, bias, norm, position[b], cache + b * row_size, shape, key);
      }
    });
  };
#ifdef MUSER_HALF_CACHE
  if (outputs[0].dtype() == mx::float16) {
    return write(reinterpret_cast<half*>(outputs[0].data<mx::float16_t>()));
  }
#endif
  write(outputs[0].data<float>());
}

void CacheWrite::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[write_cache] runs on the CPU only; a GPU has kernels/*.metal");
}

static bool same_heads(const DecodeHeads& a, const DecodeHeads& b) {
  return a.heads == b.heads && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim &&
         a.capacity == b.capacity && a.q_off == b.q_off && a.k_off == b.k_off &&
         a.v_off == b.v_off && a.gate_off == b.gate_off && a.rotary_dim == b.rotary_dim &&
         a.traditional == b.traditional && a.rope_base == b.rope_base && a.eps == b.eps &&
         a.scale == b.scale && a.inv_freq == b.inv_freq && a.qk_norm_whole == b.qk_norm_whole &&
         a.softcap == b.softcap;
}

bool CacheWrite::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const CacheWrite&>(other);
  return same_heads(shape_, o.shape_) && key_ == o.key_ && bias_ == o.bias_ && norm_ == o.norm_;
}

mx::array attention_decode(const mx::array& y, const mx::array& keys, const mx::array& values,
                           const mx::array& position, const std::optional<mx::array>& bias,
                           const std::optional<mx::array>& q_norm, DecodeHeads shape,
                           int threads, mx::StreamOrDevice s) {
  check_decode_inputs("attention_decode", y.shape(), keys, position, bias, q_norm, shape, shape.heads, true);
  if (values.shape() != keys.shape() || values.dtype() != keys.dtype()) {
    throw std::invalid_argument("[attention_decode] keys and values must be alike");
  }
  shape.capacity = keys.shape(2);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs = {as_f32(y, stream), keys, values, as_shape(position, {y.shape(0)}, stream)};
  if (bias) {
    inputs.push_back(as_f32(*bias, stream));
  }
  if (q_norm) {
    inputs.push_back(as_f32(*q_norm, stream));
  }
  return mx::array({y.shape(0), static_cast<int>(shape.heads * shape.head_dim)}, mx::float32,
                   std::make_shared<AttentionDecode>(stream, shape, bias.has_value(),
                                                     q_norm.has_value(), threads),
                   inputs);
}

void AttentionDecode::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  encoder.set_output_array(outputs[0]);
  size_t i = 4;
  const float* bias = bias_ ? row_major<float>(inputs[i++], encoder) : nullptr;
  const float* q_norm = q_norm_ ? row_major<float>(inputs[i++], encoder) : nullptr;
  int threads = threads_ > 0 ? threads_ : all_cores();
  const float* y = row_major<float>(inputs[0], encoder);
  const int32_t* position = inputs[3].data<int32_t>();
  const int64_t rows = inputs[0].shape(0), width = inputs[0].shape(1);
  const int64_t row_size = shape_.kv_heads * shape_.capacity * shape_.head_dim;
  auto attend = [&](const auto* keys, const auto* values) {
    encoder.dispatch([=, out = outputs[0].data<float>(), shape = shape_]() {
      if (rows == 1) {
        attention_decode(y, bias, q_norm, position[0], keys, values, out, shape, threads);
        return;
      }
      // A batched step's rows: one row a task, each over its own keys.
      const int64_t out_size = shape.heads * shape.head_dim;
      ThreadPool::instance().run(static_cast<int>(rows), threads, [&](int b) {
        attention_decode(y + b * width, bias, q_norm, position[b], keys + b * row_size,
                         values + b * row_size, out + b * out_size, shape, 1);
      });
    });
  };
#ifdef MUSER_HALF_CACHE
  if (inputs[1].dtype() == mx::float16) {
    return attend(reinterpret_cast<const half*>(row_major<mx::float16_t>(inputs[1], encoder)),
                  reinterpret_cast<const half*>(row_major<mx::float16_t>(inputs[2], encoder)));
  }
#endif
  attend(row_major<float>(inputs[1], encoder), row_major<float>(inputs[2], encoder));
}

void AttentionDecode::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[attention_decode] runs on the CPU only; a GPU has kernels/*.metal");
}

bool AttentionDecode::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const AttentionDecode&>(other);
  return same_heads(shape_, o.shape_) && bias_ == o.bias_ && q_norm_ == o.q_norm_ &&
         threads_ == o.threads_;
}

namespace {

// Refuses a layer product whose weight is not uint8 [out, row_bytes] of a format with a product
// here holding rows of in_features values (whole 32-value blocks when rounded).
void check_layer_product(const char* role, const WeightOf& product, int64_t in_features,
                         bool rounded) {
  const auto& [weight, type] = product;
  int values = has_product(type) ? block_values(type) : 0;
  if (values == 0 || weight.ndim() != 2 || weight.dtype() != mx::uint8 || in_features % values ||
      weight.shape(1) != in_features / values * block_bytes(type) || (rounded && in_features % 32)) {
    std::ostringstream message;
    message << "[decode_layer] the " << role << " product needs a uint8 weight [out, row_bytes] "
            << "of a format with a CPU product, rows of " << in_features << " values"
            << (rounded ? " (whole 32-value blocks)" : "") << "; got " << weight.shape() << " "
            << weight.dtype() << " of ggml type " << type;
    throw std::invalid_argument(message.str());
  }
}

} // namespace

std::vector<mx::array> decode_layer(
    const mx::array& x, const mx::array& h, const mx::array& position, const mx::array& keys,
    const mx::array& values, const std::vector<WeightOf>& attention_in,
    const WeightOf& attention_out, const std::vector<WeightOf>& ffn_in, const WeightOf& ffn_out,
    const std::optional<mx::array>& bias, const std::optional<mx::array>& q_norm,
    const std::optional<mx::array>& k_norm, const std::optional<mx::array>& post_attention_norm,
    const std::optional<mx::array>& ffn_norm, const std::optional<mx::array>& post_ffw_norm,
    const std::optional<mx::array>& next_norm, DecodeHeads shape, float eps, float post_eps, bool gelu,
    bool rounded, int threads, bool in_place, mx::StreamOrDevice s) {
  const int64_t hidden = x.ndim() == 2 ? x.shape(1) : -1;
  if (x.ndim() != 2 || x.shape(0) < 1 || h.shape() != x.shape() || hidden < 1) {
    std::ostringstream message;
    message << "[decode_layer] expected x and h [B, hidden], got x " << x.shape() << " and h "
            << h.shape();
    throw std::invalid_argument(message.str());
  }
  if (attention_in.empty() || ffn_in.empty() || ffn_in.size() > 2 || threads < 0) {
    throw std::invalid_argument("[decode_layer] expected one or more attention input products, "
                                "one or two feed-forward input products and threads >= 0");
  }
  int64_t y_width = 0, ffn_width = 0;
  std::vector<int> types;
  for (const auto& product : attention_in) {
    check_layer_product("attention input", product, hidden, rounded);
    y_width += product.first.shape(0);
    types.push_back(product.second);
  }
  check_layer_product("attention output", attention_out, shape.heads * shape.head_dim, rounded);
  types.push_back(attention_out.second);
  for (const auto& product : ffn_in) {
    check_layer_product("feed-forward input", product, hidden, rounded);
    ffn_width += product.first.shape(0);
    types.push_back(product.second);
  }
  if (ffn_width % 2 || (ffn_in.size() == 2 && ffn_in[0].first.shape(0) != ffn_in[1].first.shape(0)) ||
      attention_out.first.shape(0) != hidden || ffn_out.first.shape(0) != hidden) {
    std::ostringstream message;
    message << "[decode_layer] the feed-forward's gate and up must be of one width and both "
            << "output products " << hidden << " rows; got gate|up " << ffn_width
            << " rows, attention output " << attention_out.first.shape(0)
            << ", feed-forward output " << ffn_out.first.shape(0);
    throw std::invalid_argument(message.str());
  }
  check_layer_product("feed-forward output", ffn_out, ffn_width / 2, rounded);
  types.push_back(ffn_out.second);
  const mx::Shape y_shape = {x.shape(0), static_cast<int>(y_width)};
  check_decode_inputs("decode_layer", y_shape, keys, position, bias, q_norm, shape, shape.heads, true);
  check_decode_inputs("decode_layer", y_shape, keys, position, std::nullopt, k_norm, shape, shape.kv_heads, true);
  if (values.shape() != keys.shape() || values.dtype() != keys.dtype()) {
    throw std::invalid_argument("[decode_layer] keys and values must be alike");
  }
  auto vector_of = [&](const std::optional<mx::array>& w) {
    return !w || (w->ndim() == 1 && w->shape(0) == hidden);
  };
  if (!vector_of(post_attention_norm) || !vector_of(ffn_norm) || !vector_of(post_ffw_norm) ||
      !vector_of(next_norm)) {
    std::ostringstream message;
    message << "[decode_layer] the norm weights must be [" << hidden << "]";
    for (const auto& [name, norm] : {std::pair{"post_attention_norm", &post_attention_norm},
                                     std::pair{"ffn_norm", &ffn_norm}, std::pair{"post_ffw_norm", &post_ffw_norm},
                                     std::pair{"next_norm", &next_norm}}) {
      if (*norm) {
        message << ", " << name << " " << (*norm)->shape();
      }
    }
    throw std::invalid_argument(message.str());
  }
  shape.capacity = keys.shape(2);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs = {as_f32(x, stream), as_f32(h, stream), as_shape(position, {x.shape(0)}, stream),
                                   keys, values};
  for (const auto& product : attention_in) {
    inputs.push_back(product.first);
  }
  inputs.push_back(attention_out.first);
  for (const auto& product : ffn_in) {
    inputs.push_back(product.first);
  }
  inputs.push_back(ffn_out.first);
  for (const auto* vector : {&bias, &q_norm, &k_norm, &post_attention_norm, &ffn_norm, &post_ffw_norm,
                             &next_norm}) {
    if (*vector) {
      inputs.push_back(as_f32(**vector, stream));
    }
  }
  return mx::array::make_arrays(
      {x.shape(), x.shape(), keys.shape(), values.shape()},
      {mx::float32, mx::float32, keys.dtype(), values.dtype()},
      std::make_shared<LayerDecode>(stream, shape, std::move(types),
                                    static_cast<int>(attention_in.size()),
                                    static_cast<int>(ffn_in.size()), bias.has_value(),
                                    q_norm.has_value(), k_norm.has_value(),
                                    post_attention_norm.has_value(), ffn_norm.has_value(),
                                    post_ffw_norm.has_value(), next_norm.has_value(), eps, post_eps,
                                    gelu, rounded, threads, in_place),
      inputs);
}

void LayerDecode::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  // Each output of a multi-output primitive holds its own copy of the inputs
  // (array::make_arrays), so MLX would count the caches as held four times and never donate
  // them (a copy of every cache each step): the other outputs' copies
  // are dropped while the caches are taken, then made again.
  for (auto& output : outputs) {
    if (&output.inputs() != &inputs) {
      output.inputs().clear();
    }
  }
  auto copy_keys = take_or_copy(inputs[3], outputs[2], in_place_);
  auto copy_values = take_or_copy(inputs[4], outputs[3], in_place_);
  for (auto& output : outputs) {
    if (&output.inputs() != &inputs) {
      output.inputs() = inputs;
    }
  }
  for (int i = 0; i < 2; ++i) {
    outputs[i].set_data(mx::allocator::malloc(outputs[i].nbytes()));
  }
  for (auto& output : outputs) {
    encoder.set_output_array(output);
  }
  DecodeLayer layer{};
  layer.heads = shape_;
  layer.hidden = inputs[0].shape(1);
  size_t i = 5, type = 0;
  auto product = [&] {
    const mx::array& weight = inputs[i++];
    return LayerProduct{row_major<uint8_t>(weight, encoder), types_[type++], weight.shape(0)};
  };
  for (int p = 0; p < attention_in_; ++p) {
    layer.attention_in.push_back(product());
  }
  layer.attention_out = product();
  for (int p = 0; p < ffn_in_; ++p) {
    layer.ffn_in.push_back(product());
  }
  layer.ffn_out = product();
  auto vector = [&](bool present) { return present ? row_major<float>(inputs[i++], encoder) : nullptr; };
  layer.bias = vector(bias_);
  layer.q_norm = vector(q_norm_);
  layer.k_norm = vector(k_norm_);
  layer.post_attention_norm = vector(post_attention_norm_);
  layer.ffn_norm = vector(ffn_norm_);
  layer.post_ffw_norm = vector(post_ffw_norm_);
  layer.next_norm = vector(next_norm_);
  layer.eps = eps_;
  layer.post_eps = post_eps_;
  layer.gelu = gelu_;
  layer.rounded = rounded_;
  layer.threads = threads_ > 0 ? threads_ : all_cores();
  const float* x = row_major<float>(inputs[0], encoder);
  const float* h = row_major<float>(inputs[1], encoder);
  const int32_t* position = inputs[2].data<int32_t>();
  const int64_t rows = inputs[0].shape(0);
  auto run = [&](auto* keys, auto* values) {
    encoder.dispatch([=, layer = std::move(layer), x_out = outputs[0].data<float>(),
                      h_out = outputs[1].data<float>()]() {
      copy_keys();
      copy_values();
      decode_layer(x, h, position, rows, keys, values, layer, x_out, h_out);
    });
  };
#ifdef MUSER_HALF_CACHE
  if (outputs[2].dtype() == mx::float16) {
    return run(reinterpret_cast<half*>(outputs[2].data<mx::float16_t>()),
               reinterpret_cast<half*>(outputs[3].data<mx::float16_t>()));
  }
#endif
  run(outputs[2].data<float>(), outputs[3].data<float>());
}

void LayerDecode::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[decode_layer] runs on the CPU only; a GPU has kernels/*.metal");
}

bool LayerDecode::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const LayerDecode&>(other);
  return same_heads(shape_, o.shape_) && types_ == o.types_ && attention_in_ == o.attention_in_ &&
         ffn_in_ == o.ffn_in_ && bias_ == o.bias_ && q_norm_ == o.q_norm_ && k_norm_ == o.k_norm_ &&
         post_attention_norm_ == o.post_attention_norm_ && ffn_norm_ == o.ffn_norm_ &&
         post_ffw_norm_ == o.post_ffw_norm_ && next_norm_ == o.next_norm_ &&
         eps_ == o.eps_ && post_eps_ == o.post_eps_ && gelu_ == o.gelu_ && rounded_ == o.rounded_ &&
         threads_ == o.threads_ && in_place_ == o.in_place_;
}

mx::array norm_rope_heads(const mx::array& y, const std::optional<mx::array>& norm, int heads,
                          int head_dim, int offset, float eps, int start, int rotary_dim,
                          float base, bool traditional, const std::vector<double>& inv_freq,
                          mx::StreamOrDevice s) {
  if (y.ndim() != 3 || heads < 1 || head_dim < 1 || offset < 0 ||
      offset + static_cast<int64_t>(heads) * head_dim > y.shape(2) || rotary_dim < 0 ||
      rotary_dim > head_dim || rotary_dim % 2 || start < 0 ||
      (!inv_freq.empty() && static_cast<int64_t>(inv_freq.size()) != rotary_dim / 2) ||
      (norm && (norm->ndim() != 1 || norm->shape(0) != head_dim))) {
    std::ostringstream message;
    message << "[norm_rope_heads] expected y [batch, tokens, width] holding " << heads
            << " heads of " << head_dim << " values from " << offset << ", an even rotary_dim "
            << "<= head_dim and a norm [head_dim], got y " << y.shape() << ", rotary_dim "
            << rotary_dim;
    if (norm) {
      message << ", norm " << norm->shape();
    }
    throw std::invalid_argument(message.str());
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs{as_f32(y, stream)};
  if (norm) {
    inputs.push_back(as_f32(*norm, stream));
  }
  return mx::array({y.shape(0), heads, y.shape(1), head_dim}, mx::float32,
                   std::make_shared<NormRopeHeads>(stream, heads, head_dim, offset, eps, start,
                                                   rotary_dim, base, traditional, norm.has_value(),
                                                   inv_freq),
                   inputs);
}

void NormRopeHeads::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_output_array(out);
  auto [y, stride] = rows_of(inputs[0], encoder);
  const float* norm = norm_ ? row_major<float>(inputs[1], encoder) : nullptr;
  encoder.dispatch([=, out_data = out.data<float>(), batch = inputs[0].shape(0),
                    tokens = inputs[0].shape(1), heads = heads_, head_dim = head_dim_,
                    offset = offset_, eps = eps_, start = start_, rotary_dim = rotary_dim_,
                    base = base_, traditional = traditional_, inv_freq = inv_freq_]() {
    norm_rope_heads(y, stride, offset, norm, out_data, batch, tokens, heads, head_dim, eps, start,
                    rotary_dim, base, traditional, inv_freq.empty() ? nullptr : inv_freq.data());
  });
}

void NormRopeHeads::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[norm_rope_heads] runs on the CPU only");
}

bool NormRopeHeads::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const NormRopeHeads&>(other);
  return heads_ == o.heads_ && head_dim_ == o.head_dim_ && offset_ == o.offset_ &&
         eps_ == o.eps_ && start_ == o.start_ && rotary_dim_ == o.rotary_dim_ &&
         base_ == o.base_ && traditional_ == o.traditional_ && norm_ == o.norm_ &&
         inv_freq_ == o.inv_freq_;
}

} // namespace muser::cpu
