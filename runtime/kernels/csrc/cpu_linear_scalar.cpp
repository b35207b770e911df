// Portable linear kernels: plain C++ over the same packed layout, for CPUs without AVX2 and as
// a check of the SIMD paths. One output feature at a time: its weights are dequantized into
// `work` (K floats) once, then dotted with every row.
#include <cstdint>
#include <cstring>

#include "cpu_linear.h"

namespace llmopt_linear::scalar {
namespace {

uint32_t code(const Job& j, int64_t tile, int64_t lane, int64_t k) {
  const int vpl = values_per_lane(j.format), bits = 32 / vpl;
  const uint32_t word = j.data[(tile * (j.Kp / vpl) + k / vpl) * 16 + lane];
  return (word >> (bits * (k % vpl))) & ((1u << bits) - 1);
}

float fp8_value(uint32_t byte) {
  const uint32_t bits = ((byte & 0x80u) << 24) | ((byte & 0x7Fu) << 20);
  float f;
  std::memcpy(&f, &bits, 4);
  return f * 0x1p120f;
}

float scale_at(const Job& j, int64_t at) {
  if (!j.scale16) return j.scale[at];
  const uint32_t bits = static_cast<uint32_t>(j.scale16[at]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void weight_only(const Job& j, int64_t tile, int64_t lane, float* w) {
  for (int64_t k = 0; k < j.K; ++k) {
    const int64_t at = (tile * j.groups + k / j.gs) * 16 + lane;
    const float s = scale_at(j, at);
    const uint32_t q = j.format == kNl4 ? kNl4Bytes[code(j, tile, lane, k)] : code(j, tile, lane, k);
    if (j.format == kFp8) {
      w[k] = fp8_value(q) * s;
    } else {
      const float offset = j.offset ? j.offset[at] : j.half * s;
      w[k] = static_cast<float>(q) * s + offset;
    }
  }
}

void w8a8_feature(const Job& j, int64_t tile, int64_t lane, int64_t n) {
  const float s = scale_at(j, tile * 16 + lane);
  for (int64_t m = 0; m < j.M; ++m) {
    int32_t dot = 0;
    for (int64_t k = 0; k < j.K; ++k)
      dot += static_cast<int32_t>(static_cast<int8_t>(code(j, tile, lane, k))) * j.xq[m * j.Kp + k];
    const float b = j.bias ? j.bias[n] : 0.0f;
    j.out[m * j.N + n] = static_cast<float>(dot) * (s * j.xscale[m]) + b;
  }
}

}  // namespace

void run(const Job& j, int64_t t0, int64_t t1, float* work) {
  for (int64_t tile = t0; tile < t1; ++tile) {
    for (int64_t lane = 0; lane < 16; ++lane) {
      const int64_t n = tile * 16 + lane;
      if (n >= j.N) return;
      if (j.format == kW8A8) {
        w8a8_feature(j, tile, lane, n);
        continue;
      }
      weight_only(j, tile, lane, work);
      for (int64_t m = 0; m < j.M; ++m) {
        const float* x = j.x + m * j.K;
        float dot = 0.0f;
        for (int64_t k = 0; k < j.K; ++k) dot += x[k] * work[k];
        j.out[m * j.N + n] = dot + (j.bias ? j.bias[n] : 0.0f);
      }
    }
  }
}

}  // namespace llmopt_linear::scalar
