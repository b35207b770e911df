// Vector operations for the SIMD linear kernels, one struct per instruction set. Included only
// after a `#pragma GCC target(...)` and inside an anonymous namespace, so each translation unit
// gets its own copies compiled for its instruction set.
#pragma once

#include <immintrin.h>

#ifdef LLMOPT_VEC_AVX2
struct Vec {
  static constexpr int W = 8;  // float lanes per vector
  using F = __m256;
  using I = __m256i;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load_bf16(const uint16_t* p) {  // bfloat16 bit patterns widened exactly
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F bcast(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static I loadi(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static I set1i(int32_t v) { return _mm256_set1_epi32(v); }
  static I andi(I a, I b) { return _mm256_and_si256(a, b); }
  static I subi(I a, I b) { return _mm256_sub_epi32(a, b); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F as_float(I v) { return _mm256_castsi256_ps(v); }
  template <int S> static I srli(I v) { return _mm256_srli_epi32(v, S); }
  template <int S> static I slli(I v) { return _mm256_slli_epi32(v, S); }
  template <int S> static I srai(I v) { return _mm256_srai_epi32(v, S); }
  static I zeroi() { return _mm256_setzero_si256(); }
  static I loadi32(const int32_t* p) { return loadi(p); }

  // int8 dot products of 4-byte groups: acc += sum_i x[i] * w[i] per 32-bit lane, with x the
  // same 4 signed bytes in every lane. AVX2 has no u8 x s8 -> s32 instruction: |w| (u8) times
  // x with w's sign (s8) keeps maddubs' pair sums within int16 (2 * 128 * 127 < 32768).
  struct WPrep { I absw, w; };
  static WPrep wprep(I w) { return {_mm256_abs_epi8(w), w}; }
  static I xprep(int32_t x4) { return _mm256_set1_epi32(x4); }
  static I dot(I acc, I x, const WPrep& w) {
    I signed_x = _mm256_sign_epi8(x, w.w);
    I pairs = _mm256_maddubs_epi16(w.absw, signed_x);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static constexpr int kDotBias = 0;  // dot() is exact: nothing to subtract

  // Unsigned nibbles (u8 <= 15) times signed bytes, two pairs of operands, summed into int32
  // lanes. Each maddubs pair sum is at most 2 * 15 * 128, so both fit one int16 add.
  static I dot_u4(I acc, I w0, I x0, I w1, I x1) {
    I pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  // Only exact while pair sums fit int16 (so not for 8-bit codes): the int8 integer GEMV is
  // never dispatched to AVX2.
  static I dot_u8(I acc, I w, I x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
  }
  // Bytes holding 4-bit indices (< 16) replaced by the 16-entry byte table's entries.
  static I lut_bytes(I idx, const uint8_t* table) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))), idx);
  }
  // Float table[u] for 32-bit lanes holding u < 16 (table: 16 floats).
  static F lut_floats(I u, const float* table) {
    F low = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), u);
    F high = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 8), u);
    return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(u, 28)));  // bit 3 of u picks
  }
  // -- activation levels (split_levels_all): maxima, sums, rounding to int8 codes
  static F absf(F v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
  static F maxf(F a, F b) { return _mm256_max_ps(a, b); }
  static float hmax(F v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
  static F round127(F v) {  // to nearest (ties to even), within [-127, 127]
    const F r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
  }
  // The W integral values of v as bytes at p; nibble_order: each 8 stored as 0, 2, 4, 6, 1, 3, 5, 7.
  static void store_i8(int8_t* p, F v, bool nibble_order) {
    const __m256i i = _mm256_cvtps_epi32(v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    __m128i b = _mm_packs_epi16(w, w);
    if (nibble_order) b = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), b);
  }
};
#endif

#ifdef LLMOPT_VEC_AVX512
struct Vec {
  static constexpr int W = 16;
  using F = __m512;
  using I = __m512i;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F bcast(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static I loadi(const void* p) { return _mm512_loadu_si512(p); }
  static I set1i(int32_t v) { return _mm512_set1_epi32(v); }
  static I andi(I a, I b) { return _mm512_and_si512(a, b); }
  static I subi(I a, I b) { return _mm512_sub_epi32(a, b); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F as_float(I v) { return _mm512_castsi512_ps(v); }
  template <int S> static I srli(I v) { return _mm512_srli_epi32(v, S); }
  template <int S> static I slli(I v) { return _mm512_slli_epi32(v, S); }
  template <int S> static I srai(I v) { return _mm512_srai_epi32(v, S); }
  static I zeroi() { return _mm512_setzero_si512(); }
  static I loadi32(const int32_t* p) { return loadi(p); }

  // VNNI: vpdpbusd multiplies u8 by s8 into int32 without saturation. x is made unsigned by
  // adding 128 (xor of the sign bit); the caller subtracts 128 * sum(w) afterwards.
  struct WPrep { I w; };
  static WPrep wprep(I w) { return {w}; }
  static I xprep(int32_t x4) { return _mm512_set1_epi32(x4 ^ static_cast<int32_t>(0x80808080u)); }
  static I dot(I acc, I x, const WPrep& w) { return _mm512_dpbusd_epi32(acc, x, w.w); }
  static constexpr int kDotBias = 128;

  static I dot_u4(I acc, I w0, I x0, I w1, I x1) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, w0, x0), w1, x1);
  }
  static I dot_u8(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }  // u8 w, s8 x
  static I lut_bytes(I idx, const uint8_t* table) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))), idx);
  }
  static F lut_floats(I u, const float* table) { return _mm512_permutexvar_ps(u, _mm512_loadu_ps(table)); }
  // -- activation levels (split_levels_all), as in the AVX2 struct
  static F absf(F v) { return _mm512_abs_ps(v); }
  static F maxf(F a, F b) { return _mm512_max_ps(a, b); }
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F round127(F v) {
    const F r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
  }
  static void store_i8(int8_t* p, F v, bool nibble_order) {
    __m128i b = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v));
    if (nibble_order) b = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
  }
};
#endif
