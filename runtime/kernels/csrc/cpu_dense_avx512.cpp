// The float GEMV built for AVX-512 (F, BW, VL, DQ; selected at run time; see dense.cpp).
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#include "cpu_dense.h"

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#define LLMOPT_VEC_AVX512

namespace {
#include "cpu_linear_vec.h"
#include "cpu_dense_simd.h"
}  // namespace

namespace llmopt_dense::avx512 {
void run(const Job& job, int64_t n0, int64_t n1) { dense_entry(job, n0, n1); }
}  // namespace llmopt_dense::avx512
#endif  // __x86_64__
