// One instruction set's build of the float GEMV. Included (once each) by cpu_dense_avx2.cpp and
// cpu_dense_avx512.cpp, which define LLMOPT_ISA (the namespace of the entry point) and the
// LLMOPT_VEC_* macro of cpu_isa_target.h.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#include "cpu_dense.h"
#include "cpu_isa_target.h"

namespace {
#include "cpu_linear_vec.h"
#include "cpu_dense_simd.h"
}  // namespace

namespace llmopt_dense::LLMOPT_ISA {
void run(const Job& job, int64_t n0, int64_t n1) { dense_entry(job, n0, n1); }
}  // namespace llmopt_dense::LLMOPT_ISA
#endif  // __x86_64__
