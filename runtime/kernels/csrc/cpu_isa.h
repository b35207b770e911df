// Run-time choice of an instruction-set variant, shared by the dispatchers (linear.cpp,
// dense.cpp; built for the baseline target). The features checked match cpu_isa_target.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace llmopt_isa {
namespace {

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// `vnni`: the AVX-512 variant also needs the VNNI integer dot products.
bool supported(int64_t isa, bool vnni) {
#if defined(__x86_64__)
  if (isa == kAvx2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == kAvx512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           (!vnni || __builtin_cpu_supports("avx512vnni")) && supported(kAvx2, vnni);
#endif
  return isa == kScalar;
}

// AVX-512 with VNNI and BF16: the kernels with bfloat16 products (matmul precision "medium").
bool supports_bf16() {
#if defined(__x86_64__)
  static const bool ok = supported(kAvx512, true) && __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

// Names of the supported variants, slowest first (the Python side's codes are their indices).
std::vector<std::string> supported_names(bool vnni) {
  std::vector<std::string> names{"scalar"};
  if (supported(kAvx2, vnni)) names.push_back("avx2");
  if (supported(kAvx512, vnni)) names.push_back("avx512");
  return names;
}

// `requested` (-1: the best supported one), or false when this CPU cannot run it.
bool resolve(int64_t& requested, bool vnni) {
  static const int64_t best_plain = supported(kAvx512, false) ? kAvx512 : supported(kAvx2, false) ? kAvx2 : kScalar;
  static const int64_t best_vnni = supported(kAvx512, true) ? kAvx512 : supported(kAvx2, true) ? kAvx2 : kScalar;
  const int64_t best = vnni ? best_vnni : best_plain;
  if (requested < 0) requested = best;
  return requested == best || supported(requested, vnni);
}

}  // namespace
}  // namespace llmopt_isa
