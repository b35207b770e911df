// The quantized linear kernels built for AVX-512 (F, BW, VL, DQ, VNNI; selected at run time; see linear.cpp).
#define LLMOPT_ISA avx512
#define LLMOPT_VEC_AVX512
#define LLMOPT_VNNI
#include "cpu_linear_isa.h"
