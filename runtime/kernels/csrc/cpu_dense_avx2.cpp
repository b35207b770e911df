// The float GEMV built for AVX2 + FMA + F16C (selected at run time; see dense.cpp).
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#include "cpu_dense.h"

#pragma GCC target("avx2,fma,f16c")
#define LLMOPT_VEC_AVX2

namespace {
#include "cpu_linear_vec.h"
#include "cpu_dense_simd.h"
}  // namespace

namespace llmopt_dense::avx2 {
void run(const Job& job, int64_t n0, int64_t n1) { dense_entry(job, n0, n1); }
}  // namespace llmopt_dense::avx2
#endif  // __x86_64__
