// The bfloat16 panel (cpu_linear_bf16.h) built for AVX-512 with BF16 (selected at run time when
// the matmul precision allows bfloat16 products; see linear.cpp).
#define LLMOPT_VEC_AVX512
#define LLMOPT_VNNI
#define LLMOPT_BF16
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "cpu_linear.h"
#include "cpu_isa_target.h"

namespace {
#include "cpu_linear_vec.h"
#include "cpu_linear_simd.h"
#include "cpu_linear_bf16.h"
}  // namespace

namespace llmopt_linear::avx512bf16 {
void panel(const Job& job, int64_t t0, int64_t t1, float* work) { panel_bf16_entry(job, t0, t1, work); }
void pairs(const Job& job, int64_t tp0, int64_t tp1) { pairs_bf16_entry(job, tp0, tp1); }
}  // namespace llmopt_linear::avx512bf16
#endif  // __x86_64__
