// The quantized linear kernels built for AVX2 + FMA (selected at run time; see linear.cpp).
#define LLMOPT_ISA avx2
#define LLMOPT_VEC_AVX2
#include "cpu_linear_isa.h"
