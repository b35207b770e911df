// Float GEMV for a few rows (decode): the job description shared by the instruction-set variants.
//
// The weight is the plain row-major [N][K] matrix (float32, bfloat16 or float16; the 16-bit
// types are widened to float32 in registers), activations are float32 [M][K], outputs float32
// [M][N]. Each output is the dot product of an activation row with a weight row: every weight
// row is read once from memory, and a block of rows stays in cache while all M activation rows
// use it. Like cpu_linear.h this header holds plain data only (no inline code), since it is
// included by translation units built for different instruction sets.
#pragma once

#include <cstdint>

namespace llmopt_dense {

enum WeightType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct Job {
  int wtype;
  int64_t M, N, K;
  const void* w;      // [N][K] of wtype
  const float* x;     // [M][K]
  const float* bias;  // [N] or nullptr
  float* out;         // [M][N]
};

// Each variant computes output features [n0, n1) for every row.
namespace scalar {
void run(const Job& job, int64_t n0, int64_t n1);
}
namespace avx2 {
void run(const Job& job, int64_t n0, int64_t n1);
}
namespace avx512 {
void run(const Job& job, int64_t n0, int64_t n1);
}

}  // namespace llmopt_dense
