// The bfloat16 panel (matmul precision "medium"): like the float panel (cpu_linear_simd.h), a
// tile pair's weights for kPanelK inputs are dequantized exactly into float32, then rounded to
// bfloat16 and interleaved in pairs of inputs; vdpbf16ps multiplies them by the activations (also
// rounded to bfloat16, in pairs) and sums in float32: 32 products per instruction where an FMA
// does 16. Both operands carry bfloat16's 8-bit mantissa, as a W4A16 matmul on a GPU does.
// Include inside the anonymous namespace after cpu_linear_simd.h, in a unit built with
// LLMOPT_BF16 (cpu_linear_avx512bf16.cpp).
#pragma once

// Rows [0, rows) of a dequantized buffer buf[k][16 * NV] as bfloat16 pairs: pairs[p][16 * NV]
// holds inputs 2p (low half) and 2p + 1 (high half; zero past `rows`) of each column.
template <int NV>
inline void bf16_pairs(const float* buf, int64_t rows, uint32_t* pairs) {
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kInterleave);
  for (int64_t p = 0; 2 * p < rows; ++p) {
    const float* even = buf + 2 * p * NV * 16;
    const bool odd = 2 * p + 1 < rows;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __m512 lo = _mm512_loadu_ps(even + v * 16);
      const __m512 hi = odd ? _mm512_loadu_ps(even + NV * 16 + v * 16) : _mm512_setzero_ps();
      const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // lo's 16 values, then hi's
      _mm512_storeu_si512(pairs + (p * NV + v) * 16, _mm512_permutexvar_epi16(order, both));
    }
  }
}

template <int MR, int NV>
void micro_bf16(const Job& j, int64_t m0, int64_t col0, int64_t p0, int64_t p1, const uint32_t* pairs) {
  __m512 c[MR][NV];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
    const __m512 b = p0 == 0 ? load_bias(j, col0 + v * 16) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) c[m][v] = p0 == 0 ? b : load_out(j, m0 + m, col0 + v * 16);
  }
  const uint32_t* x = j.xb + m0 * j.Kb;
  for (int64_t p = p0; p < p1; ++p) {
    const uint32_t* row = pairs + (p - p0) * NV * 16;
    __m512bh w[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) w[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(row + v * 16));
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(x[m * j.Kb + p])));
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) c[m][v] = _mm512_dpbf16_ps(c[m][v], a, w[v]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) put_out(j, m0 + m, col0 + v * 16, c[m][v]);
}

template <int NV>
void micro_rows_bf16(const Job& j, int64_t col0, int64_t p0, int64_t p1, const uint32_t* pairs) {
  for_row_blocks(j, [&](auto rows, int64_t m) { micro_bf16<decltype(rows)::value, NV>(j, m, col0, p0, p1, pairs); });
}

// `work` holds kWorkFloats floats (the dequantized panel) then kWorkFloats / 2 pairs.
template <int BITS, int KIND>
void panel_bf16_format(const Job& j, int64_t t0, int64_t t1, float* work) {
  uint32_t* pairs = reinterpret_cast<uint32_t*>(work + llmopt_linear::kWorkFloats);
  for (int64_t t = t0; t < t1; t += 2) {
    const bool whole = t + 2 <= t1;
    for (int64_t k0 = 0; k0 < j.K; k0 += kPanelK) {  // kPanelK is even: a pair never straddles two panels
      const int64_t k1 = min64(j.K, k0 + kPanelK), p0 = k0 / 2, p1 = (k1 + 1) / 2;
      if (whole) {
        dequantize<BITS, KIND, 2>(j, t, k0, k1, work);
        bf16_pairs<2>(work, k1 - k0, pairs);
        micro_rows_bf16<2>(j, t * 16, p0, p1, pairs);
      } else {
        dequantize<BITS, KIND, 1>(j, t, k0, k1, work);
        bf16_pairs<1>(work, k1 - k0, pairs);
        micro_rows_bf16<1>(j, t * 16, p0, p1, pairs);
      }
    }
  }
}

inline void panel_bf16_entry(const Job& j, int64_t t0, int64_t t1, float* work) {
  for_format(j, [&](auto bits, auto kind) { panel_bf16_format<decltype(bits)::value, decltype(kind)::value>(j, t0, t1, work); });
}

// A float weight packed at load as bfloat16 pairs (format kBf16Pairs, [tile pairs][Kb][32]): no
// dequantization, the micro-kernel reads the pairs in place, kPanelK inputs at a time (32 KiB).
inline void pairs_bf16_entry(const Job& j, int64_t tp0, int64_t tp1) {
  constexpr int64_t kPanelPairs = kPanelK / 2;
  for (int64_t tp = tp0; tp < tp1; ++tp)
    for (int64_t p0 = 0; p0 < j.Kb; p0 += kPanelPairs)
      micro_rows_bf16<2>(j, tp * 32, p0, min64(j.Kb, p0 + kPanelPairs), j.data + (tp * j.Kb + p0) * 32);
}
