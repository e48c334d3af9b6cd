#include "linear.h"

#include <sstream>
#include <stdexcept>
#include <thread>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/utils.h"

#include "products.h"

namespace muser::cpu {

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
  int threads = threads_ > 0 ? threads_ : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
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

} // namespace muser::cpu
