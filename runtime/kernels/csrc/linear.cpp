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

#include "cpu_isa.h"
#include "cpu_linear.h"

namespace lin = llmopt_linear;

namespace {

using namespace llmopt_isa;  // kScalar, kAvx2, kAvx512
enum Path : int64_t { kAuto = -1, kGemv = 0, kPanel = 1, kFloatGemv = 2 };
constexpr int64_t kMinTaskMacs = 1 << 18;  // a few microseconds: smaller tasks cost more to hand out than to run
// GEMV tasks stream at least this many weight bytes per activation row; kMinTaskMacs bounds
// them too (about 130 KB of int4 weights at 576 inputs). A lower bound than that changes nothing:
// decoding a 135M int4 model with 1 MiB tasks (every decode linear on one thread) runs at 0.92x
// the speed of 64 KiB tasks on a 2-core Zen 4 (bench/gemv_task_size.py).
int64_t min_task_bytes = 1 << 16;  // set_min_task_bytes changes it (benchmarks)
// Up to these many rows, the GEMVs (weights streamed once, unpacked in registers) beat the
// dequantized panel; the integer GEMV holds four rows per pass with AVX-512, one with AVX2.
constexpr int64_t kGemvRows = 4, kIntGemvRowsAvx512 = 16, kIntGemvRowsAvx2 = 2;
constexpr int64_t kMinSplitInputs = 1 << 14;  // activations split into levels per task, at least

// Per-thread scratch reused across calls (fresh large buffers would page-fault every call).
float* scratch(std::vector<float>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// max |x| of each row of x [M, K] (16 partial maxima per row, so the loop vectorizes).
const float* row_absmax(const torch::Tensor& x, std::vector<float>& buf) {
  const int64_t M = x.size(0), K = x.size(1);
  float* out = scratch(buf, M);
  const float* p = x.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, kMinSplitInputs / std::max<int64_t>(1, K)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* r = p + m * K;
      float lane[16] = {};
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        for (int i = 0; i < 16; ++i) lane[i] = std::max(lane[i], std::fabs(r[k + i]));
      for (; k < K; ++k) lane[0] = std::max(lane[0], std::fabs(r[k]));
      float top = 0.0f;
      for (int i = 0; i < 16; ++i) top = std::max(top, lane[i]);
      out[m] = top;
    }
  });
  return out;
}

// x [M, K] rounded to int8 per row (codes round(x * 127 / max|x|), times max|x| / 127): the
// per-token activations of W4A8 where the integer GEMV does not run, as the split computes them.
torch::Tensor round_per_row(const torch::Tensor& x, std::vector<float>& buf) {
  const float* top = row_absmax(x, buf);
  torch::Tensor out = torch::empty_like(x);
  const int64_t M = x.size(0), K = x.size(1);
  const float* p = x.data_ptr<float>();
  float* q = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, kMinSplitInputs / std::max<int64_t>(1, K)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float scale = top[m] / 127.0f, inv = top[m] > 0.0f ? 127.0f / top[m] : 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        float v = __builtin_nearbyintf(p[m * K + k] * inv);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[m * K + k] = v * scale;
      }
    }
  });
  return out;
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
      const bool exact = j.format == lin::kFp8 || j.format == lin::kNl4 || i == vpl - 1;  // see decode_scaled
      row[k] = exact ? x[k] : std::ldexp(x[k], -bits * i);
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

// Integer GEMV activation blocks: the largest of 256, 128, ... inputs dividing the weight group
// into whole lanes (int32 sums stay far from overflow: 255 * 127 * 256 < 2^23).
int64_t activation_block(int64_t gs, int vpl, int64_t largest) {
  for (int64_t b = largest; b >= vpl; b /= 2)
    if (gs % b == 0 && b % vpl == 0) return b;
  return 0;
}

void check(bool ok, const std::string& what) { TORCH_CHECK(ok, "llmopt cpu linear: ", what); }

// The bfloat16 panel's activations: x rounded to bfloat16 (nearest even), inputs 2p and 2p + 1
// in the low and high half of pair p (a zero pads an odd K).
void prepare_bf16(lin::Job& j, std::vector<uint32_t>& pair_buf) {
  j.Kb = (j.K + 1) / 2;
  if (static_cast<int64_t>(pair_buf.size()) < j.M * j.Kb) pair_buf.resize(j.M * j.Kb);
  auto bits = [](float v) { return static_cast<uint32_t>(c10::BFloat16(v).x); };
  for (int64_t m = 0; m < j.M; ++m) {
    const float* x = j.x + m * j.K;
    uint32_t* row = pair_buf.data() + m * j.Kb;
    for (int64_t p = 0; p < j.Kb; ++p)
      row[p] = bits(x[2 * p]) | (2 * p + 1 < j.K ? bits(x[2 * p + 1]) << 16 : 0u);
  }
  j.xb = pair_buf.data();
}

}  // namespace

std::vector<std::string> supported_isas() { return llmopt_isa::supported_names(true); }

// A weight packed by cpu_linear.py: data [tiles, Kp / VPL, 16] int32; scale (and offset)
// [tiles, groups, 16] float32; wsum [tiles * 16] int32 (w8a8). Checked once, here.
struct Packed {
  torch::Tensor data, scale;
  std::optional<torch::Tensor> offset, wsum;
  int64_t format, n, k, group_size;  // group_size 0: one group

  Packed(torch::Tensor data_, torch::Tensor scale_, std::optional<torch::Tensor> offset_,
         std::optional<torch::Tensor> wsum_, int64_t format_, int64_t n_, int64_t k_, int64_t group_size_)
      : data(std::move(data_)), scale(std::move(scale_)), offset(std::move(offset_)), wsum(std::move(wsum_)),
        format(format_), n(n_), k(k_), group_size(group_size_) {
    check(format >= lin::kInt4 && format <= lin::kBf16Pairs, "unknown format");
    const int vpl = lin::values_per_lane(static_cast<int>(format));
    const int64_t tiles = (n + 15) / 16, kp = (k + vpl - 1) / vpl * vpl;
    const int64_t lane_tiles = format == lin::kBf16Pairs ? (n + 31) / 32 * 2 : tiles;  // bf16 pairs: whole tile pairs
    check(data.scalar_type() == torch::kInt && data.is_contiguous() && data.numel() == lane_tiles * (kp / vpl) * 16,
          "packed weights do not match the layer's size");
    check((scale.scalar_type() == torch::kFloat || scale.scalar_type() == torch::kBFloat16) && scale.is_contiguous() &&
              scale.dim() == 3 && scale.size(0) == tiles && scale.size(2) == 16, "scales do not match the packed weights");
    const int64_t groups = scale.size(1);
    check(groups == 1 || (group_size > 0 && groups * group_size == k), "group size does not divide the input size");
    if (offset)
      check(offset->sizes() == scale.sizes() && offset->scalar_type() == torch::kFloat && offset->is_contiguous(),
            "offsets do not match the scales");
    if (format == lin::kW8A8)
      check(groups == 1 && wsum && wsum->numel() == tiles * 16 && wsum->scalar_type() == torch::kInt &&
                wsum->is_contiguous(), "w8a8 needs per-channel scales and code sums");
  }
};

// y = x @ W.T (+ bias) for x [..., K] of any float dtype (computed in float32, returned in x's
// dtype), written to `out_in` when given (float32 x only). isa / path: -1 chooses. bf16: the
// panel path (many rows) multiplies bfloat16-rounded weights and activations with float32 sums
// (matmul precision "medium"; AVX-512 with BF16 only); the GEMVs stay exact. levels: the int8
// levels of the integer GEMV's activations, 3 (exact) or 1 (matmul precision "low": activations
// rounded to int8 per block of at most 32 inputs, as llama.cpp's Q8_0; the integer GEMV then
// runs at every row count, prefill included) or 0 (the checkpoint's per-token int8 activations,
// W4A8: one scale max|x| / 127 per row; the integer GEMV's single level where it runs, else the
// activations rounded in place first and the exact path).
torch::Tensor linear(const torch::Tensor& x_in, const Packed& w, const std::optional<torch::Tensor>& bias_in,
                     int64_t isa, int64_t path, const std::optional<torch::Tensor>& out_in, bool bf16, int64_t levels) {
  check(x_in.dim() >= 1 && x_in.size(-1) == w.k, "input features do not match the layer");
  const bool is_float = x_in.scalar_type() == torch::kFloat;
  const torch::Tensor x = (is_float ? x_in.reshape({-1, w.k}) : x_in.reshape({-1, w.k}).to(torch::kFloat)).contiguous();
  std::optional<torch::Tensor> bias;
  if (bias_in) {
    check(bias_in->numel() == w.n, "bias must have one value per output feature");
    bias = bias_in->to(torch::kFloat).contiguous();
  }
  const int64_t format = w.format, n = w.n, group_size = w.group_size;
  const int vpl = lin::values_per_lane(static_cast<int>(format));
  const int64_t M = x.size(0), K = w.k, tiles = (n + 15) / 16, Kp = (K + vpl - 1) / vpl * vpl;
  const int64_t groups = w.scale.size(1);
  check(llmopt_isa::resolve(isa, true), "this CPU lacks the requested instruction set");
  check(levels == 0 || levels == 1 || levels == 3, "levels must be 0, 1 or 3");

  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = n;
  torch::Tensor out;
  if (out_in) {
    check(is_float && out_in->scalar_type() == torch::kFloat && out_in->is_contiguous() && out_in->numel() == M * n,
          "out must be a contiguous float32 tensor of the output's size (float32 inputs only)");
    out = out_in->view({M, n});
  } else {
    out = torch::empty({M, n}, x.options());
  }
  auto result = [&] { return is_float ? out.view(shape) : out.view(shape).to(x_in.scalar_type()); };
  if (M == 0 || n == 0) return result();
  lin::Job j{};
  torch::Tensor rounded;  // per-token int8 activations where the integer GEMV does not run (levels 0)
  j.format = static_cast<int>(format);
  j.M = M, j.N = n, j.K = K, j.Kp = Kp, j.groups = groups, j.gs = groups == 1 ? Kp : group_size;
  j.data = reinterpret_cast<const uint32_t*>(w.data.data_ptr<int32_t>());
  if (w.scale.scalar_type() == torch::kBFloat16)
    j.scale16 = reinterpret_cast<const uint16_t*>(w.scale.data_ptr());
  else
    j.scale = w.scale.data_ptr<float>();
  j.half = format == lin::kInt4 ? -8.0f : format == lin::kInt8 || format == lin::kNl4 ? -128.0f : 0.0f;
  j.x = x.data_ptr<float>();
  j.out = out.data_ptr<float>();
  if (w.offset) j.offset = w.offset->data_ptr<float>();
  if (bias) j.bias = bias->data_ptr<float>();

  thread_local std::vector<float> xs_buf, sum_buf, scale_buf, row_buf;
  thread_local std::vector<int8_t> q_buf;
  thread_local std::vector<uint32_t> pair_buf;
  bool gemv = false, igemv = false, bf16_panel = false;
  if (format == lin::kBf16Pairs) {
    check(bf16 && isa == kAvx512 && llmopt_isa::supports_bf16(),
          "bfloat16 pairs run the bfloat16 panel only (bf16=True, AVX-512 with BF16)");
    prepare_bf16(j, pair_buf);
    at::parallel_for(0, (n + 31) / 32, std::max<int64_t>(1, kMinTaskMacs / std::max<int64_t>(1, 32 * K * M)),
                     [&](int64_t tp0, int64_t tp1) {
#if defined(__x86_64__)
                       lin::avx512bf16::pairs(j, tp0, tp1);
#endif
                     });
    return result();
  }
  if (format == lin::kW8A8) {
    j.wsum = w.wsum->data_ptr<int32_t>();
    prepare_w8a8(j, q_buf, scale_buf);
  } else if (isa == kScalar && levels == 0) {
    rounded = round_per_row(x, row_buf);
    j.x = rounded.data_ptr<float>();
  } else if (isa != kScalar) {
    const bool fits = j.gs % vpl == 0;
    check((path != kGemv && path != kFloatGemv) || fits, "the GEMV paths need groups of whole lanes");
    // Integer GEMV: int4 everywhere, int8 and nl4 (grid bytes up to 241) with VNNI only (AVX2's
    // maddubs would saturate).
    const bool int_ok = format == lin::kInt4 || ((format == lin::kInt8 || format == lin::kNl4) && isa == kAvx512);
    const int64_t int_rows = isa == kAvx512 ? kIntGemvRowsAvx512 : kIntGemvRowsAvx2;
    igemv = fits && int_ok && (path == kGemv || (path == kAuto && (M <= int_rows || levels <= 1)));
    gemv = igemv || path == kGemv || path == kFloatGemv || (path == kAuto && fits && M <= kGemvRows);
    if (igemv) {
      if (levels == 0) j.xrow = row_absmax(x, row_buf);  // one level, scaled per row
      levels = std::max<int64_t>(levels, 1);
      j.levels = static_cast<int>(levels);
      j.xblock = activation_block(j.gs, vpl, levels == 1 && !j.xrow ? 32 : 256);
      const int64_t blocks = Kp / j.xblock;
      if (static_cast<int64_t>(q_buf.size()) < levels * M * Kp) q_buf.resize(levels * M * Kp);
      float* levels = scratch(xs_buf, M * blocks * 3);
      float* sums = scratch(sum_buf, M * blocks);
#if defined(__x86_64__)
      int8_t* codes = q_buf.data();
      at::parallel_for(0, M, std::max<int64_t>(1, kMinSplitInputs / K), [&](int64_t m0, int64_t m1) {
        if (isa == kAvx512) lin::avx512::split_levels(j, codes, levels, sums, m0, m1);
        else lin::avx2::split_levels(j, codes, levels, sums, m0, m1);
      });
#endif
      j.xq = q_buf.data(), j.xls = levels, j.xbsum = sums;
    } else if (levels == 0) {
      rounded = round_per_row(x, row_buf);  // per-token int8 values, then the exact paths
      j.x = rounded.data_ptr<float>();
      if (gemv) prepare_gemv(j, xs_buf, sum_buf);
    } else if (gemv) {
      prepare_gemv(j, xs_buf, sum_buf);
    } else if (bf16) {
      check(isa == kAvx512 && llmopt_isa::supports_bf16(), "bfloat16 products need AVX-512 with BF16 (avx512_bf16)");
      bf16_panel = true;
      prepare_bf16(j, pair_buf);
    }
  }

  int64_t grain = std::max<int64_t>(1, kMinTaskMacs / std::max<int64_t>(1, 16 * K * M));
  if (gemv) {
    const int64_t tile_bytes = 16 * (Kp * 4 / vpl + groups * (w.scale.element_size() + (w.offset ? 4 : 0)));
    grain = std::max(grain, min_task_bytes / std::max<int64_t>(1, tile_bytes * M));
  }
  // the bf16 panel keeps its bfloat16 pairs after the float panel
  const int64_t work_floats = std::max<int64_t>(K, lin::kWorkFloats) + (bf16_panel ? lin::kWorkFloats / 2 : 0);
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> work_buf;
    if (isa == kScalar) return lin::scalar::run(j, t0, t1, scratch(work_buf, work_floats));
#if defined(__x86_64__)
    const bool wide = isa == kAvx512;
    if (format == lin::kW8A8) return wide ? lin::avx512::w8a8(j, t0, t1) : lin::avx2::w8a8(j, t0, t1);
    if (igemv) return wide ? lin::avx512::igemv(j, t0, t1) : lin::avx2::igemv(j, t0, t1);
    if (gemv) return wide ? lin::avx512::gemv(j, t0, t1) : lin::avx2::gemv(j, t0, t1);
    float* work = scratch(work_buf, work_floats);
    if (bf16_panel) return lin::avx512bf16::panel(j, t0, t1, work);
    return wide ? lin::avx512::panel(j, t0, t1, work) : lin::avx2::panel(j, t0, t1, work);
#endif
  });
  return result();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Packed>(m, "Packed")
      .def(pybind11::init<torch::Tensor, torch::Tensor, std::optional<torch::Tensor>, std::optional<torch::Tensor>,
                          int64_t, int64_t, int64_t, int64_t>());
  m.def("linear", &linear, "quantized linear on packed weights (see cpu_linear.h)", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("bias"), pybind11::arg("isa"), pybind11::arg("path"),
        pybind11::arg("out") = pybind11::none(), pybind11::arg("bf16") = false, pybind11::arg("levels") = 3);
  m.def("bf16_supported", &llmopt_isa::supports_bf16, "whether this CPU runs the bfloat16 panel (AVX-512 BF16)");
  m.def("set_min_task_bytes", [](int64_t n) { min_task_bytes = std::max<int64_t>(1, n); },
        "weight bytes per GEMV task below which a linear stays on one thread");
  m.def("supported_isas", &supported_isas, "instruction sets this CPU can run, slowest first");
}
