// Float linear layers for few rows (decode): y = x @ W.T + b with W the plain row-major
// [out, in] weight (float32, bfloat16 or float16; layout and kernels in cpu_dense.h). This
// file converts the activations, picks the instruction set at run time (AVX-512, AVX2 + FMA +
// F16C, or portable C++), and splits the output features across torch's intra-op threads.
// More rows than `max_rows` go to torch's own linear (BLAS): it wins once the weight is reused
// by enough rows.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_dense.h"
#include "cpu_isa.h"

namespace dense = llmopt_dense;

namespace {

using namespace llmopt_isa;  // kScalar, kAvx2, kAvx512
constexpr int64_t kDefaultRows = 32;       // GEMV up to these many rows (see linear())
// Tasks stream at least this many weight bytes per activation row (about 50 us from memory):
// waking a second thread costs tens of microseconds on a busy machine.
constexpr int64_t kMinTaskBytes = 1 << 20;

void check(bool ok, const std::string& what) { TORCH_CHECK(ok, "llmopt dense linear: ", what); }

}  // namespace

// ---- portable path: one weight row at a time, four partial sums (independent FMA chains)

namespace llmopt_dense::scalar {
namespace {

float value(const Job& j, int64_t at) {
  if (j.wtype == kF32) return static_cast<const float*>(j.w)[at];
  const uint16_t bits = static_cast<const uint16_t*>(j.w)[at];
  if (j.wtype == kBF16) return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

}  // namespace

void run(const Job& j, int64_t n0, int64_t n1) {
  std::vector<float> row(j.K);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t k = 0; k < j.K; ++k) row[k] = value(j, n * j.K + k);
    for (int64_t m = 0; m < j.M; ++m) {
      const float* x = j.x + m * j.K;
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      int64_t k = 0;
      for (; k + 4 <= j.K; k += 4)
        for (int i = 0; i < 4; ++i) s[i] += x[k + i] * row[k + i];
      for (; k < j.K; ++k) s[0] += x[k] * row[k];
      j.out[m * j.N + n] = (s[0] + s[1]) + (s[2] + s[3]) + (j.bias ? j.bias[n] : 0.0f);
    }
  }
}

}  // namespace llmopt_dense::scalar

std::vector<std::string> supported_isas() { return llmopt_isa::supported_names(false); }

// y = x @ w.T (+ bias) for x [..., K] of any float dtype and w [N, K] contiguous float32 /
// bfloat16 / float16, returned in x's dtype. Up to `max_rows` rows (-1: the default) run the
// GEMV, computed in float32; more rows run torch's linear in the weight's dtype. isa: -1
// chooses. `out_in` (float32 x only) receives the result.
torch::Tensor linear(const torch::Tensor& x_in, const torch::Tensor& w, const std::optional<torch::Tensor>& bias_in,
                     int64_t isa, int64_t max_rows, const std::optional<torch::Tensor>& out_in) {
  check(w.dim() == 2 && w.is_contiguous(), "the weight must be a contiguous [out, in] matrix");
  check(w.device().is_cpu() && x_in.device().is_cpu(), "CPU tensors only");
  const int64_t N = w.size(0), K = w.size(1);
  check(x_in.dim() >= 1 && x_in.size(-1) == K, "input features do not match the layer");
  check(x_in.is_floating_point(), "the input must be a float tensor");
  if (bias_in) check(bias_in->numel() == N, "bias must have one value per output feature");
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x_in.dim(); ++d) M *= x_in.size(d);
  const bool is_float = x_in.scalar_type() == torch::kFloat;
  if (out_in)
    check(is_float && out_in->scalar_type() == torch::kFloat && out_in->is_contiguous() && out_in->numel() == M * N,
          "out must be a contiguous float32 tensor of the output's size (float32 inputs only)");
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  if (M > (max_rows < 0 ? kDefaultRows : max_rows)) {  // in the weight's dtype, as torch requires
    const auto wt = w.scalar_type();
    std::optional<torch::Tensor> bias;
    if (bias_in) bias = bias_in->to(wt);
    torch::Tensor y = at::linear(x_in.to(wt), w, bias).to(x_in.scalar_type());
    return out_in ? out_in->view(shape).copy_(y) : y;
  }
  int wtype;
  switch (w.scalar_type()) {
    case torch::kFloat: wtype = dense::kF32; break;
    case torch::kBFloat16: wtype = dense::kBF16; break;
    case torch::kHalf: wtype = dense::kF16; break;
    default: check(false, "the weight must be float32, bfloat16 or float16"); return {};
  }
  check(llmopt_isa::resolve(isa, false), "this CPU lacks the requested instruction set");

  const torch::Tensor x = (is_float ? x_in.reshape({M, K}) : x_in.reshape({M, K}).to(torch::kFloat)).contiguous();
  torch::Tensor out = out_in ? out_in->view({M, N}) : torch::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    std::optional<torch::Tensor> bias;
    if (bias_in) bias = bias_in->to(torch::kFloat).contiguous();
    dense::Job j{};
    j.wtype = wtype;
    j.M = M, j.N = N, j.K = K;
    j.w = w.data_ptr();
    j.x = x.data_ptr<float>();
    j.bias = bias ? bias->data_ptr<float>() : nullptr;
    j.out = out.data_ptr<float>();
    const int64_t blocks = (N + 15) / 16;
    const int64_t grain = std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(1, 16 * K * w.element_size() * M));
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      const int64_t n0 = b0 * 16, n1 = std::min(N, b1 * 16);
#if defined(__x86_64__)
      if (isa == kAvx512) return dense::avx512::run(j, n0, n1);
      if (isa == kAvx2) return dense::avx2::run(j, n0, n1);
#endif
      dense::scalar::run(j, n0, n1);
    });
  }
  return is_float ? out.view(shape) : out.view(shape).to(x_in.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "float linear: GEMV for few rows, torch's linear for more (see cpu_dense.h)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("isa"),
        pybind11::arg("max_rows"), pybind11::arg("out") = pybind11::none());
  m.def("supported_isas", &supported_isas, "instruction sets this CPU can run, slowest first");
}
