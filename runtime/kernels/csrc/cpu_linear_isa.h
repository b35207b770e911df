// One instruction set's build of the quantized linear kernels. Included (once each) by
// cpu_linear_avx2.cpp and cpu_linear_avx512.cpp, which define LLMOPT_ISA (the namespace of the
// entry points) and the LLMOPT_VEC_* macro of cpu_isa_target.h.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "cpu_linear.h"
#include "cpu_isa_target.h"

namespace {
#include "cpu_linear_vec.h"
#include "cpu_linear_simd.h"
}  // namespace

namespace llmopt_linear::LLMOPT_ISA {
void split_levels(const Job& job, int8_t* xq, float* xls, float* xbsum, int64_t m0, int64_t m1) {
  split_levels_all(job, xq, xls, xbsum, m0, m1);
}
void igemv(const Job& job, int64_t t0, int64_t t1) { igemv_entry(job, t0, t1); }
void gemv(const Job& job, int64_t t0, int64_t t1) { gemv_entry(job, t0, t1); }
void panel(const Job& job, int64_t t0, int64_t t1, float* work) { panel_entry(job, t0, t1, work); }
void w8a8(const Job& job, int64_t t0, int64_t t1) { w8a8_all(job, t0, t1); }
}  // namespace llmopt_linear::LLMOPT_ISA
#endif  // __x86_64__
