// The float GEMV built for AVX-512 (F, BW, VL, DQ; selected at run time; see dense.cpp).
#define LLMOPT_ISA avx512
#define LLMOPT_VEC_AVX512
#include "cpu_dense_isa.h"
