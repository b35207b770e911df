// The SIMD linear kernels built for AVX2 + FMA (selected at run time; see linear.cpp).
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#include "cpu_linear.h"

#pragma GCC target("avx2,fma")
#define LLMOPT_VEC_AVX2

namespace {
#include "cpu_linear_vec.h"
#include "cpu_linear_simd.h"
}  // namespace

namespace llmopt_linear::avx2 {
void split_levels(const Job& job, int8_t* xq, float* xls, float* xbsum) { split_levels_all(job, xq, xls, xbsum); }
void igemv(const Job& job, int64_t t0, int64_t t1) { igemv_entry(job, t0, t1); }
void gemv(const Job& job, int64_t t0, int64_t t1) { gemv_entry(job, t0, t1); }
void panel(const Job& job, int64_t t0, int64_t t1, float* work) { panel_entry(job, t0, t1, work); }
void w8a8(const Job& job, int64_t t0, int64_t t1) { w8a8_all(job, t0, t1); }
}  // namespace llmopt_linear::avx2
#endif  // __x86_64__
