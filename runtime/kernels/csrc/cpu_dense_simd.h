// SIMD float GEMV, written once over the `Vec` operations of cpu_linear_vec.h and compiled per
// instruction set (cpu_dense_avx2.cpp, cpu_dense_avx512.cpp). Include inside an anonymous
// namespace after the target pragma and cpu_linear_vec.h.
#pragma once

#include <cstring>

#include "cpu_dense.h"

using llmopt_dense::Job;

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

inline float to_float(float v) { return v; }
inline float to_float(Bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float to_float(F16 v) { return _cvtsh_ss(v.bits); }

#ifdef LLMOPT_VEC_AVX512
inline Vec::F load_w(const float* p) { return _mm512_loadu_ps(p); }
inline Vec::F load_w(const Bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec::F load_w(const F16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline float hsum(Vec::F v) { return _mm512_reduce_add_ps(v); }
#endif

#ifdef LLMOPT_VEC_AVX2
inline Vec::F load_w(const float* p) { return _mm256_loadu_ps(p); }
inline Vec::F load_w(const Bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec::F load_w(const F16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float hsum(Vec::F v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// Outputs rows[0 .. RB) (weight rows = output columns) for activation rows m0 ... m0 + MR - 1:
// MR * RB vector accumulators run along K (one weight vector feeds MR FMAs), then each is
// summed horizontally; a K tail shorter than a vector is added in scalar code.
template <class T, int MR, int RB>
inline void dense_step(const Job& j, const int64_t* rows, int64_t m0) {
  const int64_t K = j.K;
  const T* w[RB];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) w[r] = static_cast<const T*>(j.w) + rows[r] * K;
  const float* x = j.x + m0 * K;
  Vec::F acc[MR][RB];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) acc[m][r] = Vec::zero();
  int64_t k = 0;
  for (; k + Vec::W <= K; k += Vec::W) {
    Vec::F wv[RB];
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) wv[r] = load_w(w[r] + k);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const Vec::F xv = Vec::load(x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) acc[m][r] = Vec::fma(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < RB; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t t = k; t < K; ++t) s += x[m * K + t] * to_float(w[r][t]);
      j.out[(m0 + m) * j.N + rows[r]] = s + (j.bias ? j.bias[rows[r]] : 0.0f);
    }
  }
}

// A step reads kStreams weight rows from far-apart parts of the range at once: independent
// sequential streams keep more memory requests in flight than one, and a single core then
// reaches about twice the bandwidth of reading the rows in order.
constexpr int kStreams = 6;

// Weight rows per step for MR activation rows: MR * H accumulators, H weights and one
// activation vector within the register file (32 vectors with AVX-512, 16 with AVX2).
template <int MR>
constexpr int dense_rows() {
  if constexpr (Vec::W == 16) return kStreams;
  else return MR == 1 ? kStreams : MR <= 3 ? kStreams / 2 : kStreams / 3;
}

template <class T, int MR>
inline void dense_split(const Job& j, const int64_t* rows, int64_t m0) {
  constexpr int H = dense_rows<MR>();
#pragma GCC unroll 6
  for (int h = 0; h < kStreams; h += H) dense_step<T, MR, H>(j, rows + h, m0);
}

// Output features [n0, n1) for every row: kStreams segments of `len` rows advance together
// (each step's rows stay in cache while every group of four activation rows uses them); the
// rows left over run one at a time.
template <class T>
inline void dense_type(const Job& j, int64_t n0, int64_t n1) {
  const int64_t len = (n1 - n0) / kStreams;
  int64_t rows[kStreams];
  for (int64_t i = 0; i < len; ++i) {
    for (int s = 0; s < kStreams; ++s) rows[s] = n0 + s * len + i;
    for (int64_t m = 0; m < j.M; m += 4) {
      switch (j.M - m < 4 ? j.M - m : 4) {
        case 1: dense_split<T, 1>(j, rows, m); break;
        case 2: dense_split<T, 2>(j, rows, m); break;
        case 3: dense_split<T, 3>(j, rows, m); break;
        default: dense_split<T, 4>(j, rows, m); break;
      }
    }
  }
  for (int64_t n = n0 + kStreams * len; n < n1; ++n)
    for (int64_t m = 0; m < j.M; ++m) dense_step<T, 1, 1>(j, &n, m);
}

inline void dense_entry(const Job& j, int64_t n0, int64_t n1) {
  switch (j.wtype) {
    case llmopt_dense::kBF16: return dense_type<Bf16>(j, n0, n1);
    case llmopt_dense::kF16: return dense_type<F16>(j, n0, n1);
    default: return dense_type<float>(j, n0, n1);
  }
}
