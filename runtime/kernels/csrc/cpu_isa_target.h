// The GCC target of an instruction-set variant's translation unit, chosen by the macros it
// defines before including this: LLMOPT_VEC_AVX2 or LLMOPT_VEC_AVX512 (plus LLMOPT_VNNI for the
// integer dot products, LLMOPT_BF16 for bfloat16 dot products). The dispatchers check the same features with __builtin_cpu_supports.
#if defined(LLMOPT_VEC_AVX512) && defined(LLMOPT_BF16)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16")
#elif defined(LLMOPT_VEC_AVX512) && defined(LLMOPT_VNNI)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#elif defined(LLMOPT_VEC_AVX512)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#elif defined(LLMOPT_VEC_AVX2)
#pragma GCC target("avx2,fma,f16c")
#endif
