// The float GEMV built for AVX2 + FMA + F16C (selected at run time; see dense.cpp).
#define LLMOPT_ISA avx2
#define LLMOPT_VEC_AVX2
#include "cpu_dense_isa.h"
