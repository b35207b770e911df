// Quantized linear layers for CPUs: y = x @ W.T + b with W packed by cpu_linear.py (layout in
// cpu_linear.h). This file prepares the activations, picks the instruction set at run time
// (AVX-512 with VNNI, AVX2 + FMA, or portable C++) and the path (GEMV for a few rows, a
// dequantized panel with an FMA micro-kernel for many, integer dot products for W8A8), and
// splits the output features across torch's intra-op threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_linear.h"

namespace lin = llmopt_linear;

namespace {

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
enum Path : int64_t { kAuto = -1, kGemv = 0, kPanel = 1 };
constexpr int64_t kMinTaskMacs = 1 << 16;  // smaller tasks cost more to hand out than to run
constexpr int64_t kGemvRows = 4;           // up to this many rows, stream the weights once in registers

bool isa_supported(int64_t isa) {
#if defined(__x86_64__)
  if (isa == kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == kAvx512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && isa_supported(kAvx2);
#endif
  return isa == kScalar;
}

int64_t best_isa() {
  for (int64_t isa : {kAvx512, kAvx2})
    if (isa_supported(isa)) return isa;
  return kScalar;
}

// Per-thread scratch reused across calls (fresh large buffers would page-fault every call).
float* scratch(std::vector<float>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// GEMV activations: value i of a lane is read as u * 2^(bits * i), so activation k is scaled by
// 2^-(bits * (k % VPL)) (the top value is shifted down instead); zero padding up to Kp.
void prepare_gemv(lin::Job& j, std::vector<float>& xs_buf, std::vector<float>& sum_buf) {
  const int vpl = lin::values_per_lane(j.format), bits = 32 / vpl;
  float* xs = scratch(xs_buf, j.M * j.Kp);
  float* xsum = scratch(sum_buf, j.M * j.groups);
  for (int64_t m = 0; m < j.M; ++m) {
    const float* x = j.x + m * j.K;
    float* row = xs + m * j.Kp;
    for (int64_t k = 0; k < j.K; ++k) {
      const int i = static_cast<int>(k % vpl);
      row[k] = (j.format == lin::kFp8 || i == vpl - 1) ? x[k] : std::ldexp(x[k], -bits * i);
    }
    std::fill(row + j.K, row + j.Kp, 0.0f);
    for (int64_t g = 0; g < j.groups; ++g) {
      double sum = 0.0;
      for (int64_t k = g * j.gs; k < std::min(j.K, (g + 1) * j.gs); ++k) sum += x[k];
      xsum[m * j.groups + g] = static_cast<float>(sum);
    }
  }
  j.xs = xs;
  j.xsum = xsum;
}

// W8A8 activations, per token as fake_quantize_activations does: scale = max|x| / 127,
// q = round-half-even(x / scale) (the same float division, so the same ties).
void prepare_w8a8(lin::Job& j, std::vector<int8_t>& q_buf, std::vector<float>& scale_buf) {
  if (static_cast<int64_t>(q_buf.size()) < j.M * j.Kp) q_buf.resize(j.M * j.Kp);
  int8_t* q = q_buf.data();
  float* scales = scratch(scale_buf, j.M);
  for (int64_t m = 0; m < j.M; ++m) {
    const float* x = j.x + m * j.K;
    float absmax = 0.0f;
    for (int64_t k = 0; k < j.K; ++k) absmax = std::max(absmax, std::fabs(x[k]));
    const float scale = std::max(absmax, 1e-12f) / 127.0f;
    int8_t* row = q + m * j.Kp;
    for (int64_t k = 0; k < j.K; ++k) {
      const float r = std::nearbyint(x[k] / scale);
      row[k] = static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, r)));
    }
    std::fill(row + j.K, row + j.Kp, int8_t{0});
    scales[m] = scale;
  }
  j.xq = q;
  j.xscale = scales;
}

void check(bool ok, const std::string& what) { TORCH_CHECK(ok, "llmopt cpu linear: ", what); }

}  // namespace

std::vector<std::string> supported_isas() {
  std::vector<std::string> names{"scalar"};
  if (isa_supported(kAvx2)) names.push_back("avx2");
  if (isa_supported(kAvx512)) names.push_back("avx512");
  return names;
}

// x [M, K] float32; data [tiles, Kp / VPL, 16] int32; scale (and offset) [tiles, groups, 16]
// float32; wsum [tiles * 16] int32 (w8a8); bias [N] float32. isa / path: -1 chooses.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& data, const torch::Tensor& scale,
                     const std::optional<torch::Tensor>& offset, const std::optional<torch::Tensor>& wsum,
                     const std::optional<torch::Tensor>& bias, int64_t format, int64_t n, int64_t group_size,
                     int64_t isa, int64_t path) {
  check(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be a contiguous 2-D float32 tensor");
  check(format >= lin::kInt4 && format <= lin::kW8A8, "unknown format");
  const int vpl = lin::values_per_lane(static_cast<int>(format));
  const int64_t M = x.size(0), K = x.size(1), tiles = (n + 15) / 16, Kp = (K + vpl - 1) / vpl * vpl;
  check(data.scalar_type() == torch::kInt && data.is_contiguous() && data.numel() == tiles * (Kp / vpl) * 16,
        "packed weights do not match the input size");
  check(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.dim() == 3 && scale.size(0) == tiles &&
            scale.size(2) == 16, "scales do not match the packed weights");
  const int64_t groups = scale.size(1);
  check(groups == 1 || (group_size > 0 && groups * group_size == K), "group size does not divide the input size");
  if (isa < 0) isa = best_isa();
  check(isa_supported(isa), "this CPU lacks the requested instruction set");

  auto out = torch::empty({M, n}, x.options());
  if (M == 0 || n == 0) return out;
  lin::Job j{};
  j.format = static_cast<int>(format);
  j.M = M, j.N = n, j.K = K, j.Kp = Kp, j.groups = groups, j.gs = groups == 1 ? Kp : group_size;
  j.data = reinterpret_cast<const uint32_t*>(data.data_ptr<int32_t>());
  j.scale = scale.data_ptr<float>();
  j.half = format == lin::kInt4 ? -8.0f : format == lin::kInt8 ? -128.0f : 0.0f;
  j.x = x.data_ptr<float>();
  j.out = out.data_ptr<float>();
  if (offset) {
    check(offset->sizes() == scale.sizes() && offset->scalar_type() == torch::kFloat && offset->is_contiguous(),
          "offsets do not match the scales");
    j.offset = offset->data_ptr<float>();
  }
  if (bias) {
    check(bias->numel() == n && bias->scalar_type() == torch::kFloat && bias->is_contiguous(), "bias must be float32 [N]");
    j.bias = bias->data_ptr<float>();
  }

  thread_local std::vector<float> xs_buf, sum_buf, scale_buf;
  thread_local std::vector<int8_t> q_buf;
  bool gemv = false;
  if (format == lin::kW8A8) {
    check(groups == 1 && wsum && wsum->numel() == tiles * 16 && wsum->scalar_type() == torch::kInt,
          "w8a8 needs per-channel scales and code sums");
    j.wsum = wsum->data_ptr<int32_t>();
    prepare_w8a8(j, q_buf, scale_buf);
  } else if (isa != kScalar) {
    const bool fits = j.gs % vpl == 0;
    check(path != kGemv || fits, "the GEMV path needs groups of whole lanes");
    gemv = path == kGemv || (path == kAuto && fits && M <= kGemvRows);
    if (gemv) prepare_gemv(j, xs_buf, sum_buf);
  }

  const int64_t grain = std::max<int64_t>(1, kMinTaskMacs / std::max<int64_t>(1, 16 * K * M));
  const int64_t work_floats = std::max<int64_t>(K, lin::kWorkFloats);
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> work_buf;
    if (isa == kScalar) return lin::scalar::run(j, t0, t1, scratch(work_buf, work_floats));
#if defined(__x86_64__)
    const bool wide = isa == kAvx512;
    if (format == lin::kW8A8) return wide ? lin::avx512::w8a8(j, t0, t1) : lin::avx2::w8a8(j, t0, t1);
    if (gemv) return wide ? lin::avx512::gemv(j, t0, t1) : lin::avx2::gemv(j, t0, t1);
    float* work = scratch(work_buf, work_floats);
    return wide ? lin::avx512::panel(j, t0, t1, work) : lin::avx2::panel(j, t0, t1, work);
#endif
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "quantized linear on packed weights (see cpu_linear.h)");
  m.def("supported_isas", &supported_isas, "instruction sets this CPU can run, slowest first");
}
