#include "primitives.h"

#include <sstream>
#include <stdexcept>
#include <thread>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/utils.h"

#include "attention.h"
#include "products.h"

namespace muser::cpu {

namespace {

int all_cores() {
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

} // namespace

mx::array linear(const mx::array& x, const mx::array& weight, int ggml_type, int threads,
                 mx::StreamOrDevice s) {
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
  auto stream = mx::to_stream(s, mx::Device::cpu);
  auto x32 = mx::contiguous(mx::astype(x, mx::float32, stream), false, stream);
  auto rows = mx::contiguous(weight, false, stream);
  return mx::array({x.shape(0), weight.shape(0)}, mx::float32,
                   std::make_shared<GGUFLinear>(stream, ggml_type, threads), {x32, rows});
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
  encoder.dispatch([x_data = x.data<float>(), weight_data = weight.data<uint8_t>(),
                    out_data = out.data<float>(), type = ggml_type_, tokens = x.shape(0),
                    in_features = x.shape(1), out_features = weight.shape(0), threads]() {
    linear_from_blocks(x_data, weight_data, out_data, type, tokens, in_features, out_features,
                       threads);
  });
}

void GGUFLinear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[gguf_linear] runs on the CPU only; the GPU has kernels/*.metal");
}

bool GGUFLinear::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GGUFLinear&>(other);
  return ggml_type_ == o.ggml_type_ && threads_ == o.threads_;
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
  auto as_rows = [&](const mx::array& a) {
    return mx::contiguous(mx::astype(a, mx::float32, stream), false, stream);
  };
  std::vector<mx::array> inputs = {as_rows(q), as_rows(k), as_rows(v)};
  if (mask) {
    inputs.push_back(mx::contiguous(*mask, false, stream));
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
  encoder.dispatch([q = q.data<float>(), k = k.data<float>(), v = v.data<float>(),
                    mask = masked_ ? inputs[3].data<bool>() : nullptr, out = out.data<float>(),
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

} // namespace muser::cpu
