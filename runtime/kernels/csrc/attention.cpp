// Paged decode attention for CPUs: one query token per sequence against its cached context,
// read through the block table in place (no gather copies).
//
// Cache layout per layer (see kernels/reference.py): [kv_heads, num_blocks * block_size, head_dim];
// the block_size rows of block b for head h are contiguous. Caches hold float32 / bfloat16 /
// float16 values, or quantized codes (int8, or float8 e4m3 bytes as uint8) with one float32 scale
// per token and KV head ([kv_heads, num_blocks * block_size]), or int4 codes packed two per byte
// (last dimension head_dim / 2, element 2i in the low nibble of byte i) with a float16 (scale,
// minimum) pair per group of values of a token and KV head ([kv_heads, num_blocks * block_size,
// groups, 2]; groups of 32, or one for a head_dim 32 does not divide).
//
// Work items are (sequence, KV head, context split). An item reads each block of its KV head
// once for all the query heads sharing it (grouped-query attention), converts it to float32,
// scores it, updates an online softmax (running max, running sum, rescaled accumulator) and
// accumulates V. Long contexts are split across items when there are fewer (sequence, head)
// pairs than threads; their partial results are merged at the end. AVX2+FMA+F16C code is chosen
// at run time; a portable scalar path serves every other CPU (and the tests).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define LLMOPT_X86 1
#include <immintrin.h>
#define LLMOPT_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kMinTaskMacs = 1 << 18;

// Shapes and strides of one call.
struct Shape {
  int64_t heads, kv_heads, group, dim, block_size, num_slots;
  int64_t int4_group;  // values per (scale, minimum) pair of an int4 cache
};

// Per-item scratch: the item's queries (pre-scaled), softmax state and accumulators.
struct State {
  float* q;    // [group, dim]
  float* acc;  // [group, dim]
  float* m;    // [group] running max
  float* l;    // [group] running sum
  float* s;    // [group, block_size] scores / probabilities
  float* kf;   // [block_size, dim] a block converted to float32
  float* vf;   // [block_size, dim]
};

// ------------------------------------------------------------------------------------------
// Scalar conversions (portable path, queries and outputs)

float fp8_value(uint8_t code) {
  // float8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal.
  const int exponent = (code >> 3) & 0xF, mantissa = code & 0x7;
  const float magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6)
                                        : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  return (code & 0x80) ? -magnitude : magnitude;
}

const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) t[i] = fp8_value(static_cast<uint8_t>(i));
    return t;
  }();
  return table.data();
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(uint8_t x) { return fp8_table()[x]; }

template <typename T>
constexpr bool is_float32() { return std::is_same<T, float>::value; }

// Two int4 codes in one byte (the int4 cache's element type).
struct Int4Pair {
  uint8_t bits;
};

// Head values per stored element and scales per token-head of a cache element type.
template <typename T>
constexpr int64_t values_per_element() { return std::is_same<T, Int4Pair>::value ? 2 : 1; }
// Scales per token-head of a cache, in float32 units: int4's float16 pairs, one per group, take
// one float32's room each.
template <typename T>
int64_t scales_per_token(const Shape& sh) { return std::is_same<T, Int4Pair>::value ? sh.dim / sh.int4_group : 1; }

// An int4 block's float16 (scale, minimum) pairs, passed through the float32 scale pointer.
inline const c10::Half* int4_pairs(const float* scales) { return reinterpret_cast<const c10::Half*>(scales); }

// n rows of dim int4 codes with their (scale, minimum) pairs, one per group values -> float32 values,
// plus ``add`` [dim] (float16) on every row when given (an int4 cache's key offset of the block).
void int4_rows(const Int4Pair* src, const c10::Half* pairs, int64_t n, int64_t dim, int64_t group, const c10::Half* add,
               float* out) {
  for (int64_t t = 0; t < n; ++t) {
    const Int4Pair* row = src + t * dim / 2;
    float* o = out + t * dim;
    for (int64_t start = 0; start < dim; start += group, pairs += 2) {
      const float scale = static_cast<float>(pairs[0]), low = static_cast<float>(pairs[1]);
      for (int64_t i = start / 2; i < (start + group) / 2; ++i) {
        o[2 * i] = static_cast<float>(row[i].bits & 0xF) * scale + low;
        o[2 * i + 1] = static_cast<float>(row[i].bits >> 4) * scale + low;
      }
    }
    if (add)
      for (int64_t d = 0; d < dim; ++d) o[d] += static_cast<float>(add[d]);
  }
}

// ------------------------------------------------------------------------------------------
// One block of one item: scores, online softmax update, V accumulation.
// k, v: the block's n rows of dim values; ks, vs: their scales (nullptr for float caches).

namespace portable {

template <typename T>
const float* rows(const T* src, int64_t count, float* scratch) {
  if (is_float32<T>()) return reinterpret_cast<const float*>(src);
  for (int64_t i = 0; i < count; ++i) scratch[i] = to_float(src[i]);
  return scratch;
}

template <typename T>
void attend_block(const T* k, const T* v, const float* ks, const float* vs, int64_t n, const Shape& sh, State& st) {
  const int64_t G = sh.group, D = sh.dim;
  const float* kf = rows(k, n * D, st.kf);
  for (int64_t g = 0; g < G; ++g) {
    const float* q = st.q + g * D;
    float* s = st.s + g * n;
    float top = st.m[g];
    for (int64_t t = 0; t < n; ++t) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += q[d] * kf[t * D + d];
      s[t] = ks ? dot * ks[t] : dot;
      top = std::max(top, s[t]);
    }
    const float correction = std::exp(st.m[g] - top);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - top);
      sum += s[t];
      if (vs) s[t] *= vs[t];
    }
    st.l[g] = st.l[g] * correction + sum;
    st.m[g] = top;
    float* acc = st.acc + g * D;
    if (correction != 1.f)
      for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
  }
  const float* vf = rows(v, n * D, st.vf);
  for (int64_t g = 0; g < G; ++g) {
    const float* p = st.s + g * n;
    float* acc = st.acc + g * D;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < D; ++d) acc[d] += p[t] * vf[t * D + d];
  }
}

}  // namespace portable

#ifdef LLMOPT_X86
namespace avx2 {

// Eight values as float32. float8 e4m3 bytes are widened to float16 with the same exponent and
// mantissa bits, which is the value / 256 (exact, subnormals included); callers scale by 256.
LLMOPT_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
LLMOPT_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
LLMOPT_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
LLMOPT_AVX2 inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
LLMOPT_AVX2 inline __m256 load8(const uint8_t* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
  const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
  return _mm256_cvtph_ps(_mm_or_si128(sign, magnitude));
}

template <typename T>
constexpr float load_factor() { return std::is_same<T, uint8_t>::value ? 256.f : 1.f; }

LLMOPT_AVX2 inline float hsum(__m256 x) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

LLMOPT_AVX2 inline float hmax(__m256 x) {
  __m128 r = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  r = _mm_max_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// Lane i of the result is the sum of the lanes of a[i].
LLMOPT_AVX2 inline __m256 sum8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

// exp(x) for x <= 0 (softmax arguments), relative error about 2e-7.
LLMOPT_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

template <typename T>
LLMOPT_AVX2 const float* rows(const T* src, int64_t count, float* scratch) {
  if (is_float32<T>()) return reinterpret_cast<const float*>(src);
  const __m256 factor = _mm256_set1_ps(load_factor<T>());
  for (int64_t i = 0; i < count; i += 8) _mm256_storeu_ps(scratch + i, _mm256_mul_ps(load8(src + i), factor));
  return scratch;
}

// Requires dim % 8 == 0 (checked by the caller).
template <typename T>
LLMOPT_AVX2 void attend_block(const T* k, const T* v, const float* ks, const float* vs, int64_t n, const Shape& sh, State& st) {
  const int64_t G = sh.group, D = sh.dim;
  const float* kf = rows(k, n * D, st.kf);
  for (int64_t g = 0; g < G; ++g) {
    const float* q = st.q + g * D;
    float* s = st.s + g * n;
    __m256 tops = _mm256_set1_ps(st.m[g]);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {  // eight tokens at once: one accumulator each, then one reduction
      __m256 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf + (t + i) * D + d), a[i]);
      }
      __m256 dots = sum8(a);
      if (ks) dots = _mm256_mul_ps(dots, _mm256_loadu_ps(ks + t));
      _mm256_storeu_ps(s + t, dots);
      tops = _mm256_max_ps(tops, dots);
    }
    float top = hmax(tops);
    for (; t < n; ++t) {
      const float* row = kf + t * D;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(row + d), acc);
      const float dot = hsum(acc);
      s[t] = ks ? dot * ks[t] : dot;
      top = std::max(top, s[t]);
    }
    const float correction = std::exp(st.m[g] - top);
    const __m256 shift = _mm256_set1_ps(top);
    __m256 total = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
      __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
      total = _mm256_add_ps(total, p);
      if (vs) p = _mm256_mul_ps(p, _mm256_loadu_ps(vs + t));
      _mm256_storeu_ps(s + t, p);
    }
    float sum = hsum(total);
    for (; t < n; ++t) {
      s[t] = std::exp(s[t] - top);
      sum += s[t];
      if (vs) s[t] *= vs[t];
    }
    st.l[g] = st.l[g] * correction + sum;
    st.m[g] = top;
    if (correction != 1.f) {
      float* acc = st.acc + g * D;
      const __m256 c = _mm256_set1_ps(correction);
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), c));
    }
  }
  const float* vf = rows(v, n * D, st.vf);
  for (int64_t g = 0; g < G; ++g) {
    const float* p = st.s + g * n;
    float* acc = st.acc + g * D;
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {  // four accumulators stay in registers across the block's tokens
      __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
      __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 w = _mm256_set1_ps(p[t]);
        const float* row = vf + t * D + d;
        a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row), a0);
        a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8), a1);
        a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 16), a2);
        a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 24), a3);
      }
      _mm256_storeu_ps(acc + d, a0);
      _mm256_storeu_ps(acc + d + 8, a1);
      _mm256_storeu_ps(acc + d + 16, a2);
      _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d < D; d += 8) {
      __m256 a = _mm256_loadu_ps(acc + d);
      for (int64_t t = 0; t < n; ++t) a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(vf + t * D + d), a);
      _mm256_storeu_ps(acc + d, a);
    }
  }
}

// Eight int4 codes (four bytes) as float32 values 0..15.
LLMOPT_AVX2 inline __m256 int4x8(const Int4Pair* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  const __m128i bytes = _mm_cvtsi32_si128(word);
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)));
}

// As int4_rows; group is a multiple of 8 here (paged_decode's vector_path).
LLMOPT_AVX2 void int4_rows_avx2(const Int4Pair* src, const c10::Half* pairs, int64_t n, int64_t dim, int64_t group,
                                const c10::Half* add, float* out) {
  for (int64_t t = 0; t < n; ++t) {
    const Int4Pair* row = src + t * dim / 2;
    for (int64_t start = 0; start < dim; start += group, pairs += 2) {
      const __m256 scale = _mm256_set1_ps(_cvtsh_ss(pairs[0].x)), low = _mm256_set1_ps(_cvtsh_ss(pairs[1].x));  // F16C
      for (int64_t d = start; d < start + group; d += 8) {
        const __m256 x = _mm256_fmadd_ps(int4x8(row + d / 2), scale, low);
        if (add) {
          const __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(add + d)));  // F16C
          _mm256_storeu_ps(out + t * dim + d, _mm256_add_ps(x, offset));
        } else {
          _mm256_storeu_ps(out + t * dim + d, x);
        }
      }
    }
  }
}


}  // namespace avx2

bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return ok;
}
#else
bool cpu_has_avx2() { return false; }
#endif

// ------------------------------------------------------------------------------------------
// The driver: items over (sequence, KV head, split), then a merge of the splits.

// Asks for the cache lines of ``bytes`` bytes at ``p``: the next block of a context is fetched
// while this one is computed (blocks sit anywhere in the cache, so the hardware prefetcher,
// which stops at page boundaries, cannot guess them).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

template <typename Q>
void read_queries(const Q* q, int64_t stride, int64_t group, int64_t dim, float scale, float* out) {
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = to_float(q[g * stride + d]) * scale;
}

template <typename O>
void write_outputs(const float* acc, const float* l, int64_t group, int64_t dim, O* out) {
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / l[g];
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<O>(acc[g * dim + d] * inv);
  }
}

// What an int4 cache adds to its codes. Sinks: float32 K/V [kv_heads, entries, tokens, dim] read in
// place of the first ``tokens`` positions of each sequence whose entry (index[b]) is not -1. Key
// offsets: float16 [kv_heads, offset_rows, dim], row j added back to every key of block j of a
// sequence's context (the cache stored the keys less it).
struct Int4Extras {
  const float* k = nullptr;
  const float* v = nullptr;
  const int64_t* index = nullptr;
  int64_t entries = 0, tokens = 0;
  const c10::Half* offsets = nullptr;
  int64_t offset_rows = 0;
};

template <typename T, typename Q>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const std::optional<torch::Tensor>& k_scale, const std::optional<torch::Tensor>& v_scale,
         const torch::Tensor& tables, const torch::Tensor& lens, const Shape& sh, double scale,
         bool vector_path, int64_t splits, const Int4Extras& extras, torch::Tensor& out) {
  using BlockFn = void (*)(const T*, const T*, const float*, const float*, int64_t, const Shape&, State&);
  using FloatFn = void (*)(const float*, const float*, const float*, const float*, int64_t, const Shape&, State&);
  using Int4RowsFn = void (*)(const Int4Pair*, const c10::Half*, int64_t, int64_t, int64_t, const c10::Half*, float*);
  constexpr bool int4 = std::is_same<T, Int4Pair>::value;  // dequantized below, then the float32 path
  BlockFn block_fn = nullptr;
  if constexpr (!int4) block_fn = portable::attend_block<T>;
  FloatFn float_fn = portable::attend_block<float>;
  Int4RowsFn int4_rows_fn = int4_rows;
#ifdef LLMOPT_X86
  if (vector_path) {
    if constexpr (!int4) block_fn = avx2::attend_block<T>;
    float_fn = avx2::attend_block<float>;
    int4_rows_fn = avx2::int4_rows_avx2;
  }
#endif
  const int64_t B = q.size(0), H = sh.kv_heads, G = sh.group, D = sh.dim, bs = sh.block_size;
  const int64_t num_blocks = sh.num_slots / bs;
  const int64_t row = D / values_per_element<T>(), per_token = scales_per_token<T>(sh);  // elements and scales per token
  const T* k = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* v = reinterpret_cast<const T*>(v_cache.data_ptr());
  const float* ks = k_scale ? reinterpret_cast<const float*>(k_scale->data_ptr()) : nullptr;  // int4: float16 pairs
  const float* vs = v_scale ? reinterpret_cast<const float*>(v_scale->data_ptr()) : nullptr;
  const Q* qp = reinterpret_cast<const Q*>(q.data_ptr());
  Q* op = reinterpret_cast<Q*>(out.data_ptr());
  const int64_t q_stride0 = q.stride(0), q_stride1 = q.stride(1), out_stride = out.stride(0);

  const int64_t* ctx = lens.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t width = tables.size(1);
  // Partial results of split items: [B, H, splits, G] max and sum, [B, H, splits, G, D] accumulators.
  std::vector<float> part_ml, part_acc;
  if (splits > 1) {
    part_ml.resize(B * H * splits * G * 2);
    part_acc.resize(B * H * splits * G * D);
  }
  const int64_t items = B * H * splits;
  // Tasks of at least kMinTaskMacs multiply-adds (q.k and p.v over the contexts): handing a task
  // to another thread costs tens of microseconds on a busy machine, more than a short context.
  int64_t tokens = 0;
  for (int64_t b = 0; b < B; ++b) tokens += ctx[b];
  const int64_t grain = std::max<int64_t>(1, items * kMinTaskMacs / std::max<int64_t>(1, 2 * tokens * H * G * D));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(4 * G * D + 2 * G + G * bs + 2 * bs * D);
    State st{buffer.data(), buffer.data() + G * D, buffer.data() + 2 * G * D, buffer.data() + 2 * G * D + G,
             buffer.data() + 2 * G * D + 2 * G, nullptr, nullptr};
    st.kf = st.s + G * bs;
    st.vf = st.kf + bs * D;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (H * splits), h = (item / splits) % H, split = item % splits;
      const int64_t blocks = (ctx[b] + bs - 1) / bs, per = (blocks + splits - 1) / splits;
      const int64_t first = split * per, last = std::min(blocks, first + per);
      read_queries(qp + b * q_stride0 + h * G * q_stride1, q_stride1, G, D, static_cast<float>(scale), st.q);
      std::fill(st.acc, st.acc + G * D, 0.f);
      std::fill(st.m, st.m + G, kNegInf);
      std::fill(st.l, st.l + G, 0.f);
      for (int64_t j = first; j < last; ++j) {
        const int64_t block = table[b * width + j];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block table entry ", block, " is outside the cache (", num_blocks, " blocks)");
        const int64_t n = std::min(bs, ctx[b] - j * bs);
        const int64_t slot = h * sh.num_slots + block * bs;
        const int64_t next = j + 3 < last ? table[b * width + j + 3] : -1;
        if (next >= 0 && next < num_blocks) {
          const int64_t next_slot = h * sh.num_slots + next * bs;
          prefetch(k + next_slot * row, bs * row * static_cast<int64_t>(sizeof(T)));
          prefetch(v + next_slot * row, bs * row * static_cast<int64_t>(sizeof(T)));
          if (ks) prefetch(ks + next_slot * per_token, bs * per_token * 4);
          if (vs) prefetch(vs + next_slot * per_token, bs * per_token * 4);
        }
        if constexpr (int4) {  // dequantized, sinks read in, offsets added back
          const c10::Half* offset = extras.offsets ? extras.offsets + (h * extras.offset_rows + j) * D : nullptr;
          int4_rows_fn(k + slot * row, int4_pairs(ks + slot * per_token), n, D, sh.int4_group, offset, st.kf);
          int4_rows_fn(v + slot * row, int4_pairs(vs + slot * per_token), n, D, sh.int4_group, nullptr, st.vf);
          const int64_t entry = (j == 0 && extras.index) ? extras.index[b] : -1;
          if (entry >= 0) {  // the block of the first positions: its sinks replace their codes
            const int64_t from = (h * extras.entries + entry) * extras.tokens * D, count = std::min(n, extras.tokens) * D;
            std::copy(extras.k + from, extras.k + from + count, st.kf);
            std::copy(extras.v + from, extras.v + from + count, st.vf);
            for (int64_t i = 0; offset && i < count; ++i) st.kf[i] += static_cast<float>(offset[i % D]);  // rows of D
          }
          float_fn(st.kf, st.vf, nullptr, nullptr, n, sh, st);
          continue;
        }
        block_fn(k + slot * row, v + slot * row, ks ? ks + slot * per_token : nullptr, vs ? vs + slot * per_token : nullptr, n, sh, st);
      }
      if (splits == 1) {
        write_outputs(st.acc, st.l, G, D, op + b * out_stride + h * G * D);
      } else {
        float* ml = part_ml.data() + item * G * 2;
        std::copy(st.m, st.m + G, ml);
        std::copy(st.l, st.l + G, ml + G);
        std::copy(st.acc, st.acc + G * D, part_acc.data() + item * G * D);
      }
    }
  });
  if (splits == 1) return;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(G * D + G);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / H, h = pair % H;
      std::fill(merged.begin(), merged.end(), 0.f);
      float* acc = merged.data();
      float* l = acc + G * D;
      for (int64_t g = 0; g < G; ++g) {
        float top = kNegInf;
        for (int64_t s = 0; s < splits; ++s) top = std::max(top, part_ml[((pair * splits + s) * G * 2) + g]);
        for (int64_t s = 0; s < splits; ++s) {
          const float* ml = part_ml.data() + (pair * splits + s) * G * 2;
          if (ml[G + g] == 0.f) continue;  // an empty split (context shorter than the others)
          const float w = std::exp(ml[g] - top);
          l[g] += ml[G + g] * w;
          const float* part = part_acc.data() + (pair * splits + s) * G * D + g * D;
          for (int64_t d = 0; d < D; ++d) acc[g * D + d] += part[d] * w;
        }
      }
      write_outputs(acc, l, G, D, op + b * out_stride + h * G * D);
    }
  });
}

template <typename T>
void run_for_query(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const std::optional<torch::Tensor>& k_scale, const std::optional<torch::Tensor>& v_scale,
                   const torch::Tensor& tables, const torch::Tensor& lens, const Shape& sh, double scale,
                   bool vector_path, int64_t splits, const Int4Extras& extras, torch::Tensor& out) {
  switch (q.scalar_type()) {
    case torch::kFloat: return run<T, float>(q, k_cache, v_cache, k_scale, v_scale, tables, lens, sh, scale, vector_path, splits, extras, out);
    case torch::kBFloat16: return run<T, c10::BFloat16>(q, k_cache, v_cache, k_scale, v_scale, tables, lens, sh, scale, vector_path, splits, extras, out);
    case torch::kHalf: return run<T, c10::Half>(q, k_cache, v_cache, k_scale, v_scale, tables, lens, sh, scale, vector_path, splits, extras, out);
    default: TORCH_CHECK(false, "queries must be float32, bfloat16 or float16, not ", q.scalar_type());
  }
}

int64_t auto_splits(int64_t pairs, int64_t longest, int64_t block_size) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || pairs >= 2 * threads) return 1;
  const int64_t wanted = (2 * threads + pairs - 1) / pairs;
  const int64_t blocks = (longest + block_size - 1) / block_size;
  const int64_t min_blocks = std::max<int64_t>(1, 256 / block_size);  // at least ~256 tokens per split
  return std::max<int64_t>(1, std::min(wanted, blocks / min_blocks));
}

}  // namespace

// q [B, heads, dim] (last dim contiguous); caches [kv_heads, slots, dim] contiguous (int4: dim / 2
// uint8); scales [kv_heads, slots] float32 for int8 / uint8 (float8 e4m3) caches, float16
// [kv_heads, slots, groups, 2] for int4 (groups: head_dim / 32, or 1); tables [B, width] and lens [B]
// int32 or int64; out [B, heads * dim] of q's dtype (written, not read). splits 0: automatic.
// sink_k / sink_v float32 [kv_heads, entries, tokens, dim] and sink_index [B] int64 (int4 caches
// only; all three or none): sequence b reads its first tokens from entry sink_index[b] (-1: none).
// key_offsets float16 [kv_heads, rows, dim] (int4 caches only): row j added to block j's keys.
torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const std::optional<torch::Tensor>& k_scale, const std::optional<torch::Tensor>& v_scale,
                           const torch::Tensor& tables, const torch::Tensor& lens, int64_t block_size, double scale,
                           torch::Tensor out, bool portable, int64_t splits,
                           const std::optional<torch::Tensor>& sink_k, const std::optional<torch::Tensor>& sink_v,
                           const std::optional<torch::Tensor>& sink_index, const std::optional<torch::Tensor>& key_offsets) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [batch, heads, dim] with a contiguous last dimension");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous [kv_heads, slots, dim] tensors of one shape");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  const int64_t B = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(0), slots = k_cache.size(1);
  const bool int4 = k_scale.has_value() && k_scale->dim() == 4;
  const int64_t int4_groups = int4 ? k_scale->size(2) : 1;  // pairs per token-head, as the scales were written
  TORCH_CHECK(int4_groups > 0 && dim % int4_groups == 0 && (dim / int4_groups) % 2 == 0,
              "int4 scales must split head_dim into groups of an even size");
  const int64_t int4_group = dim / int4_groups;
  TORCH_CHECK(k_cache.size(2) * (int4 ? 2 : 1) == dim, "head_dim of q (", dim, ") and cache (", k_cache.size(2),
              int4 ? " packed int4 pairs" : "", ") differ");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads (", heads, ") must be a multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK(block_size > 0 && slots % block_size == 0, "cache slots must be whole blocks");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && lens.dim() == 1 && lens.size(0) == B, "tables [B, width] and lens [B] expected");
  for (const auto* t : {&tables, &lens})
    TORCH_CHECK(t->scalar_type() == torch::kInt || t->scalar_type() == torch::kLong, "block tables and lengths must be int32 or int64");
  const bool quantized = k_cache.scalar_type() == torch::kChar || k_cache.scalar_type() == torch::kByte;
  TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()), "quantized caches need K and V scales; float caches take none");
  if (quantized)
    for (const auto* t : {&*k_scale, &*v_scale})
      TORCH_CHECK(t->scalar_type() == (int4 ? torch::kHalf : torch::kFloat) && t->is_contiguous() && t->dim() == (int4 ? 4 : 2) &&
                  t->size(0) == kv_heads && t->size(1) == slots &&
                  (!int4 || (t->size(2) == int4_groups && t->size(3) == 2 && k_cache.scalar_type() == torch::kByte)),
                  "scales must be contiguous float32 [kv_heads, slots] (int4 uint8 caches: float16 [kv_heads, slots, groups, 2])");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == B && out.size(1) == heads * dim && out.stride(1) == 1 && out.scalar_type() == q.scalar_type(),
              "out must be [batch, heads * dim] of q's dtype");
  Int4Extras extras;
  torch::Tensor index64;
  TORCH_CHECK(sink_k.has_value() == sink_v.has_value() && sink_k.has_value() == sink_index.has_value(),
              "sink_k, sink_v and sink_index come together");
  if (sink_k) {
    TORCH_CHECK(int4, "attention sinks are kept for int4 caches only");
    for (const auto* t : {&*sink_k, &*sink_v})
      TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->dim() == 4 && t->size(0) == kv_heads &&
                  t->size(3) == dim && t->sizes() == sink_k->sizes(),
                  "sinks must be contiguous float32 [kv_heads, entries, tokens, head_dim], K and V alike");
    TORCH_CHECK(sink_index->dim() == 1 && sink_index->size(0) == B, "sink_index must be [batch]");
    index64 = sink_index->to(torch::kLong).contiguous();
    const int64_t entries = sink_k->size(1);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t e = index64.data_ptr<int64_t>()[b];
      TORCH_CHECK(e >= -1 && e < entries, "sink entry ", e, " of sequence ", b, " is outside the store (", entries, " entries)");
    }
    extras.k = sink_k->data_ptr<float>();
    extras.v = sink_v->data_ptr<float>();
    extras.index = index64.data_ptr<int64_t>();
    extras.entries = entries;
    extras.tokens = sink_k->size(2);
  }
  if (key_offsets) {
    TORCH_CHECK(int4, "key offsets are kept for int4 caches only");
    TORCH_CHECK(key_offsets->scalar_type() == torch::kHalf && key_offsets->is_contiguous() && key_offsets->dim() == 3 &&
                key_offsets->size(0) == kv_heads && key_offsets->size(2) == dim,
                "key offsets must be contiguous float16 [kv_heads, blocks, head_dim]");
    extras.offsets = key_offsets->data_ptr<c10::Half>();
    extras.offset_rows = key_offsets->size(1);
  }
  const torch::Tensor tables64 = tables.to(torch::kLong).contiguous(), lens64 = lens.to(torch::kLong).contiguous();
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lens64.data_ptr<int64_t>()[b];
    TORCH_CHECK(n >= 1 && n <= tables.size(1) * block_size, "context length ", n, " of sequence ", b, " does not fit its block table");
    TORCH_CHECK(!key_offsets || n <= extras.offset_rows * block_size, "context length ", n, " of sequence ", b,
                " is longer than the key offsets cover (", extras.offset_rows, " blocks)");
    longest = std::max(longest, n);
  }
  if (B == 0) return out;
  const Shape sh{heads, kv_heads, heads / kv_heads, dim, block_size, slots, int4_group};
  if (splits <= 0) splits = auto_splits(B * kv_heads, longest, block_size);
  const bool vector_path = !portable && cpu_has_avx2() && dim % 8 == 0 && (!int4 || int4_group % 8 == 0);
  switch (k_cache.scalar_type()) {
    case torch::kFloat: run_for_query<float>(q, k_cache, v_cache, k_scale, v_scale, tables64, lens64, sh, scale, vector_path, splits, extras, out); break;
    case torch::kBFloat16: run_for_query<c10::BFloat16>(q, k_cache, v_cache, k_scale, v_scale, tables64, lens64, sh, scale, vector_path, splits, extras, out); break;
    case torch::kHalf: run_for_query<c10::Half>(q, k_cache, v_cache, k_scale, v_scale, tables64, lens64, sh, scale, vector_path, splits, extras, out); break;
    case torch::kChar: run_for_query<int8_t>(q, k_cache, v_cache, k_scale, v_scale, tables64, lens64, sh, scale, vector_path, splits, extras, out); break;
    case torch::kByte:
      if (int4) {
        run_for_query<Int4Pair>(q, k_cache, v_cache, k_scale, v_scale, tables64, lens64, sh, scale, vector_path, splits, extras, out);
        break;
      }
      run_for_query<uint8_t>(q, k_cache, v_cache, k_scale, v_scale, tables64, lens64, sh, scale, vector_path, splits, extras, out); break;
    default: TORCH_CHECK(false, "unsupported cache dtype ", k_cache.scalar_type());
  }
  return out;
}

bool has_avx2() { return cpu_has_avx2(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention through block tables");
  m.def("has_avx2", &has_avx2, "whether the AVX2+FMA+F16C path runs on this CPU");
}
