// Small fused steps of the decoder's float32 forward, one C++ call each where plain torch takes
// several tensor operations (a decode step is hundreds of tiny ops, so their dispatch and
// temporaries cost more than their arithmetic):
//   add_rms_norm  h += delta (the residual add, in place), out = rms_norm(h) * weight
//   silu_mul      out = silu(gate) * up, from the merged gate/up projection's output
//   rope          q / k rotated in place inside the merged q/k/v output (after the optional
//                 per-head q/k norm of Qwen3), and k / v written to the KV cache slots
//   store_kv      k / v quantized into an int8 / float8 / int4 KV cache (kernels/kv_quant.py's
//                 arithmetic, bit for bit), keys less their offset
//   argmax        greedy sampling's row-wise argmax over the vocabulary (torch's is scalar)
//   hadamard      x V for block-diagonal Sylvester Hadamard blocks scaled by 1/sqrt(block): an
//                 online transform on a Linear's input, as a fast Walsh-Hadamard transform
//                 (log2(block) butterfly passes per block instead of a block x block product)
// Rows are split across torch's intra-op threads when there are many (prefill). The row loops
// are written for the compiler's vectorizer (partial sums, a branch-free exp) and built for
// AVX-512, AVX2 and baseline x86-64, chosen at load (GCC target_clones). Arithmetic follows the
// plain-torch forward (runtime/model.py) operation by operation; results agree up to float32
// rounding (a fused multiply-add where torch rounds twice; exp within 2 units in the last place).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>
#include <string>

namespace {

constexpr int64_t kMinTaskValues = 1 << 15;  // values per thread task at least

void check(bool ok, const std::string& what) { TORCH_CHECK(ok, "llmopt fused ops: ", what); }

bool is_f32_contiguous(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu();
}

int64_t grain(int64_t values_per_row) { return std::max<int64_t>(1, kMinTaskValues / std::max<int64_t>(1, values_per_row)); }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LLMOPT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LLMOPT_CLONES
#endif
#define LLMOPT_INLINE inline __attribute__((always_inline))

// Sum of squares in 16 partial sums (a vector's worth), so the loop vectorizes.
LLMOPT_INLINE float sum_squares(const float* x, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += x[i + j] * x[i + j];
  for (; i < n; ++i) part[0] += x[i] * x[i];
  float ss = 0.0f;
  for (int j = 0; j < 16; ++j) ss += part[j];
  return ss;
}

// exp(x) without branches or calls (vectorizable): x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial for e^r (Cephes' expf coefficients), times 2^n built in the exponent bits.
LLMOPT_INLINE float exp_vec(float x) {
  const bool big = x > 88.72283f;
  x = x < -87.33654f ? -87.33654f : (x > 88.72283f ? 88.72283f : x);
  const float n = __builtin_rintf(x * 1.44269504088896341f);
  float r = __builtin_fmaf(n, -0.693359375f, x);
  r = __builtin_fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = __builtin_fmaf(p, r, 1.3981999507e-3f);
  p = __builtin_fmaf(p, r, 8.3334519073e-3f);
  p = __builtin_fmaf(p, r, 4.1665795894e-2f);
  p = __builtin_fmaf(p, r, 1.6666665459e-1f);
  p = __builtin_fmaf(p, r, 5.0000001201e-1f);
  p = __builtin_fmaf(p * r, r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  const float y = p * scale;
  return big ? __builtin_inff() : y;
}

// x <- x * rsqrt(mean(x^2) + eps) (* weight), like F.rms_norm in float32.
LLMOPT_INLINE void rms_norm_row(const float* x, float* out, const float* weight, int64_t n, float eps) {
  const float ss = sum_squares(x, n);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  if (weight) {
    for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * r) * weight[i];
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r;
  }
}

LLMOPT_CLONES void add_rms_norm_rows(float* hp, const float* dp, const float* wp, float* op, int64_t t0, int64_t t1,
                                     int64_t H, float eps) {
  for (int64_t t = t0; t < t1; ++t) {
    float* x = hp + t * H;
    if (dp)
      for (int64_t i = 0; i < H; ++i) x[i] += dp[t * H + i];
    rms_norm_row(x, op + t * H, wp, H, eps);
  }
}

LLMOPT_CLONES void silu_mul_rows(const float* gp, float* op, int64_t t0, int64_t t1, int64_t I) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* __restrict g = gp + t * 2 * I;
    const float* __restrict u = g + I;
    float* __restrict o = op + t * I;
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.0f + exp_vec(-g[i])) * u[i];
  }
}

// Index of the largest value (the first of equal ones; the first NaN if any, as torch.argmax):
// the maximum, then its first position.
int64_t argmax_portable(const float* x, int64_t n) {
  float top = -HUGE_VALF;
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] != x[i]) return i;
    top = x[i] > top ? x[i] : top;
  }
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == top) return i;
  return 0;
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) int64_t argmax_avx512(const float* x, int64_t n) {
  __m512 best = _mm512_set1_ps(-HUGE_VALF);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  float top = _mm512_reduce_max_ps(best);
  for (int64_t k = i; k < n; ++k) {
    if (x[k] != x[k]) nan = 1;
    top = x[k] > top ? x[k] : top;
  }
  if (nan) return argmax_portable(x, n);
  const __m512 t = _mm512_set1_ps(top);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + k), t, _CMP_EQ_OQ);
    if (hit) return k + __builtin_ctz(hit);
  }
  for (; k < n; ++k)
    if (x[k] == top) return k;
  return 0;
}
#endif

int64_t argmax_row(const float* x, int64_t n) {
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512) return argmax_avx512(x, n);
#endif
  return argmax_portable(x, n);
}

}  // namespace

// Row-wise argmax of float32 logits [rows, vocab] (vocab >= 1) as int64 [rows].
torch::Tensor argmax(const torch::Tensor& logits) {
  check(logits.dim() == 2 && is_f32_contiguous(logits) && logits.size(1) > 0, "logits must be contiguous float32 [rows, vocab]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  torch::Tensor out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) o[r] = argmax_row(x + r * n, n);
  return out;
}

// h [T, H] += delta (when given); out [T, H] = rms_norm(h) * weight. All float32, contiguous.
void add_rms_norm(torch::Tensor& h, const std::optional<torch::Tensor>& delta, const torch::Tensor& weight, double eps,
                  torch::Tensor& out) {
  check(h.dim() == 2 && is_f32_contiguous(h) && is_f32_contiguous(out) && out.sizes() == h.sizes(),
        "h and out must be contiguous float32 CPU [tokens, hidden] tensors of one shape");
  const int64_t T = h.size(0), H = h.size(1);
  check(is_f32_contiguous(weight) && weight.numel() == H, "weight must be float32 [hidden]");
  if (delta) check(is_f32_contiguous(*delta) && delta->sizes() == h.sizes(), "delta must match h");
  float* hp = h.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* dp = delta ? delta->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, grain(H), [&](int64_t t0, int64_t t1) { add_rms_norm_rows(hp, dp, wp, op, t0, t1, H, e); });
}

// gate_up [T, 2I] -> out [T, I] = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check(gate_up.dim() == 2 && is_f32_contiguous(gate_up) && gate_up.size(1) % 2 == 0,
        "gate_up must be a contiguous float32 [tokens, 2 * intermediate] tensor");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  torch::Tensor out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(2 * I), [&](int64_t t0, int64_t t1) { silu_mul_rows(gp, op, t0, t1, I); });
  return out;
}

// qkv [T, (heads + 2 * kv_heads) * D] float32 contiguous: q and k heads normalized per head
// (qk_norm [heads + kv_heads, D], optional) and rotated in place with cos / sin [T, D] (sin
// signed: x * cos + rotate_half(x) * sin); then k and v stored at `slots` [T] (int64) of the
// caches [kv_heads, slots, D] when they are given.
void rope(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads, int64_t kv_heads,
          const std::optional<torch::Tensor>& qk_norm, double eps, const std::optional<torch::Tensor>& k_cache,
          const std::optional<torch::Tensor>& v_cache, const std::optional<torch::Tensor>& slots) {
  check(qkv.dim() == 2 && is_f32_contiguous(qkv), "qkv must be a contiguous float32 [tokens, features] tensor");
  const int64_t T = qkv.size(0), rows = heads + 2 * kv_heads;
  check(rows > 0 && qkv.size(1) % rows == 0, "qkv's width is not (heads + 2 * kv_heads) * head_dim");
  const int64_t D = qkv.size(1) / rows, half = D / 2;
  check(D % 2 == 0 && D <= 1024, "head_dim must be even and at most 1024");
  check(is_f32_contiguous(cos) && is_f32_contiguous(sin) && cos.numel() == T * D && sin.numel() == T * D,
        "cos and sin must be contiguous float32 [tokens, head_dim]");
  if (qk_norm) check(is_f32_contiguous(*qk_norm) && qk_norm->numel() == (heads + kv_heads) * D, "qk_norm must be [heads + kv_heads, head_dim]");
  const bool write = k_cache.has_value();
  int64_t capacity = 0;
  if (write) {
    check(v_cache && slots, "writing the cache needs k_cache, v_cache and slots");
    check(is_f32_contiguous(*k_cache) && is_f32_contiguous(*v_cache) && k_cache->dim() == 3 &&
              k_cache->sizes() == v_cache->sizes() && k_cache->size(0) == kv_heads && k_cache->size(2) == D,
          "caches must be contiguous float32 [kv_heads, slots, head_dim]");
    check(slots->scalar_type() == torch::kLong && slots->is_contiguous() && slots->numel() == T, "slots must be int64 [tokens]");
    capacity = k_cache->size(1);
  }
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float* np = qk_norm ? qk_norm->data_ptr<float>() : nullptr;
  float* kc = write ? k_cache->data_ptr<float>() : nullptr;
  float* vc = write ? v_cache->data_ptr<float>() : nullptr;
  const int64_t* sl = write ? slots->data_ptr<int64_t>() : nullptr;
  const float e = static_cast<float>(eps);
  bool bad_slot = false;
  at::parallel_for(0, T, grain(rows * D), [&](int64_t t0, int64_t t1) {
    float tmp[1024];
    for (int64_t t = t0; t < t1; ++t) {
      float* row = base + t * rows * D;
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* x = row + h * D;
        if (np) rms_norm_row(x, x, nullptr, D, e);
        for (int64_t i = 0; i < D; ++i) tmp[i] = np ? x[i] * np[h * D + i] : x[i];
        for (int64_t i = 0; i < half; ++i) {
          x[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
          x[i + half] = tmp[i + half] * c[i + half] + tmp[i] * s[i + half];
        }
      }
      if (!write) continue;
      const int64_t slot = sl[t];
      if (slot < 0 || slot >= capacity) {
        bad_slot = true;
        continue;
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* k = row + (heads + h) * D;
        const float* v = row + (heads + kv_heads + h) * D;
        float* kd = kc + (h * capacity + slot) * D;
        float* vd = vc + (h * capacity + slot) * D;
        for (int64_t i = 0; i < D; ++i) kd[i] = k[i], vd[i] = v[i];
      }
    }
  });
  check(!bad_slot, "a slot is outside the cache");
}

// One token-head of a quantized KV cache, as kernels/kv_quant.py writes it (the same float32
// operations in the same order, so the codes and scales are bit-identical):
//   int8 / fp8  codes = x / s with s = max(max|x| / QMAX, FLT_MIN): int8 rounded half to even and
//               clamped to +-127; e4m3 clamped to +-448, then converted (torch's rounding)
//   int4        per group: of eleven candidate pairs, low = minimum + trim and step = (maximum -
//               trim - low) / 15 with trim = (maximum - minimum) * 0.0125 c (c = 0..10), each
//               rounded to float16 (low first), the one whose codes round((x - low) / max(step,
//               FLT_MIN)) in 0..15 reconstruct the group with the least squared error (summed in
//               float64; the first of equal ones), codes two per byte (even element low)
enum class KvKind { Int8, Fp8, Int4 };

constexpr int kInt4Candidates = 11;

// Squared error (float64) of a group's values rounded to int4 codes on a (step, low) pair.
double int4_error(const float* x, int64_t n, float step16, float low, float step) {
  double error = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float code = std::min(std::max(std::nearbyint((x[i] - low) / step), 0.0f), 15.0f);
    const double e = static_cast<double>(code) * static_cast<double>(step16) + static_cast<double>(low) - static_cast<double>(x[i]);
    error += e * e;
  }
  return error;
}

void quantize_token_head(const float* x, int64_t D, KvKind kind, int64_t group, void* codes, void* scales) {
  constexpr float tiny = std::numeric_limits<float>::min();
  if (kind == KvKind::Int4) {
    constexpr float largest = 65504.0f;
    auto* packed = static_cast<uint8_t*>(codes);
    auto* pairs = static_cast<c10::Half*>(scales);
    for (int64_t g0 = 0; g0 < D; g0 += group, pairs += 2) {
      float low = x[g0], high = x[g0];
      for (int64_t i = g0 + 1; i < g0 + group; ++i) low = std::min(low, x[i]), high = std::max(high, x[i]);
      c10::Half best_low(0.0f), best_step(0.0f);
      double best_error = std::numeric_limits<double>::infinity();
      for (int c = 0; c < kInt4Candidates; ++c) {
        const float trim = (high - low) * static_cast<float>(0.0125 * c);
        const c10::Half low16(std::min(std::max(low + trim, -largest), largest));
        const float lowf = static_cast<float>(low16);
        const c10::Half step16(std::min((high - trim - lowf) / 15.0f, largest));
        const float stepf = static_cast<float>(step16);
        const double error = int4_error(x + g0, group, stepf, lowf, std::max(stepf, tiny));
        if (error < best_error) best_error = error, best_low = low16, best_step = step16;
      }
      const float lowf = static_cast<float>(best_low);
      const float step = std::max(static_cast<float>(best_step), tiny);
      pairs[0] = best_step, pairs[1] = best_low;
      for (int64_t i = g0; i < g0 + group; i += 2) {
        const float a = std::min(std::max(std::nearbyint((x[i] - lowf) / step), 0.0f), 15.0f);
        const float b = std::min(std::max(std::nearbyint((x[i + 1] - lowf) / step), 0.0f), 15.0f);
        packed[i / 2] = static_cast<uint8_t>(a) | static_cast<uint8_t>(static_cast<uint8_t>(b) << 4);
      }
    }
    return;
  }
  float amax = 0.0f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float qmax = kind == KvKind::Int8 ? 127.0f : 448.0f;
  const float scale = std::max(amax / qmax, tiny);
  *static_cast<float*>(scales) = scale;
  if (kind == KvKind::Int8) {
    auto* out = static_cast<int8_t*>(codes);
    for (int64_t i = 0; i < D; ++i) out[i] = static_cast<int8_t>(std::min(std::max(std::nearbyint(x[i] / scale), -127.0f), 127.0f));
    return;
  }
  auto* out = static_cast<uint8_t*>(codes);
  for (int64_t i = 0; i < D; ++i) {
    const c10::Float8_e4m3fn value(std::min(std::max(x[i] / scale, -448.0f), 448.0f));
    out[i] = value.x;
  }
}

// k / v [T, kv_heads, D] float32 (last dimension contiguous; any row strides), keys less their
// block's offset when given (k_offsets float16 [kv_heads, blocks, D], token t's row key_blocks[t]
// int64 [T]), quantized into the caches at `slots` [T] (int64):
// int8 caches (int8, float32 scales [kv_heads, slots]), float8 e4m3 as bytes (uint8, float32
// scales [kv_heads, slots]) or packed int4 (uint8 [kv_heads, slots, D / 2], float16 pairs
// [kv_heads, slots, D / group, 2]).
void store_kv(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& slots, torch::Tensor& k_cache,
              torch::Tensor& v_cache, torch::Tensor& k_scale, torch::Tensor& v_scale,
              const std::optional<torch::Tensor>& k_offsets, const std::optional<torch::Tensor>& key_blocks) {
  check(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat &&
            k.stride(2) == 1 && v.stride(2) == 1 && k.device().is_cpu() && v.device().is_cpu(),
        "k and v must be float32 [tokens, kv_heads, head_dim] with a contiguous last dimension");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  const bool int4 = k_scale.dim() == 4;
  const KvKind kind = int4 ? KvKind::Int4 : k_cache.scalar_type() == torch::kChar ? KvKind::Int8 : KvKind::Fp8;
  const int64_t group = int4 ? D / k_scale.size(2) : D, stored = int4 ? D / 2 : D;
  check(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 3 &&
            k_cache.size(0) == H && k_cache.size(2) == stored && k_cache.scalar_type() == v_cache.scalar_type() &&
            (k_cache.scalar_type() == torch::kChar || k_cache.scalar_type() == torch::kByte),
        "caches must be contiguous int8 / uint8 [kv_heads, slots, head_dim] (int4: head_dim / 2)");
  const int64_t capacity = k_cache.size(1);
  check(k_scale.is_contiguous() && v_scale.is_contiguous() && k_scale.sizes() == v_scale.sizes() && k_scale.size(0) == H &&
            k_scale.size(1) == capacity && k_scale.scalar_type() == (int4 ? torch::kHalf : torch::kFloat) &&
            (!int4 || (D % k_scale.size(2) == 0 && group % 2 == 0 && k_scale.size(3) == 2)) && (int4 || k_scale.dim() == 2),
        "scales must be float32 [kv_heads, slots] (int4: float16 [kv_heads, slots, groups, 2])");
  check(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == T, "slots must be int64 [tokens]");
  check(k_offsets.has_value() == key_blocks.has_value(), "k_offsets and key_blocks come together");
  const int64_t offset_rows = k_offsets ? k_offsets->size(1) : 0;
  if (k_offsets) {
    check(k_offsets->scalar_type() == torch::kHalf && k_offsets->is_contiguous() && k_offsets->device().is_cpu() &&
              k_offsets->dim() == 3 && k_offsets->size(0) == H && k_offsets->size(2) == D,
          "k_offsets must be contiguous float16 [kv_heads, blocks, head_dim]");
    check(key_blocks->scalar_type() == torch::kLong && key_blocks->is_contiguous() && key_blocks->numel() == T,
          "key_blocks must be int64 [tokens]");
    const int64_t* rows = key_blocks->data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t)
      check(rows[t] >= 0 && rows[t] < offset_rows, "a key's block is outside the key offsets");
  }
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const c10::Half* off = k_offsets ? k_offsets->data_ptr<c10::Half>() : nullptr;
  const int64_t* key_rows = key_blocks ? key_blocks->data_ptr<int64_t>() : nullptr;
  const int64_t* sl = slots.data_ptr<int64_t>();
  auto* kc = static_cast<uint8_t*>(k_cache.data_ptr());
  auto* vc = static_cast<uint8_t*>(v_cache.data_ptr());
  auto* ks = static_cast<uint8_t*>(k_scale.data_ptr());
  auto* vs = static_cast<uint8_t*>(v_scale.data_ptr());
  const int64_t code_bytes = stored, scale_bytes = int4 ? (D / group) * 2 * 2 : 4;
  bool bad_slot = false;
  at::parallel_for(0, T * H, grain(2 * D), [&](int64_t i0, int64_t i1) {
    float centred[1024];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H, h = i % H, slot = sl[t];
      if (slot < 0 || slot >= capacity) {
        bad_slot = true;
        continue;
      }
      const float* key = kp + t * k.stride(0) + h * k.stride(1);
      if (off) {
        const c10::Half* row = off + (h * offset_rows + key_rows[t]) * D;
        for (int64_t d = 0; d < D; ++d) centred[d] = key[d] - static_cast<float>(row[d]);
        key = centred;
      }
      const int64_t at = h * capacity + slot;
      quantize_token_head(key, D, kind, group, kc + at * code_bytes, ks + at * scale_bytes);
      quantize_token_head(vp + t * v.stride(0) + h * v.stride(1), D, kind, group, vc + at * code_bytes, vs + at * scale_bytes);
    }
  });
  check(!bad_slot, "a slot is outside the cache");
}

// One block of a fast Walsh-Hadamard transform in place: Sylvester's order (the matrix
// [[H, H], [H, -H]] at every doubling), then the 1/sqrt(n) scale.
LLMOPT_CLONES void fwht_block(float* x, int64_t n, float scale) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  for (int64_t j = 0; j < n; ++j) x[j] *= scale;
}

torch::Tensor hadamard(const torch::Tensor& x, int64_t block) {
  check(is_f32_contiguous(x), "hadamard takes a contiguous float32 CPU tensor");
  check(block > 0 && (block & (block - 1)) == 0, "the block must be a power of two");
  const int64_t width = x.dim() ? x.size(-1) : 0;
  check(width % block == 0, "the block must divide the last dimension");
  torch::Tensor out = x.clone();
  const int64_t blocks = width ? out.numel() / block : 0;
  float* data = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(block));
  at::parallel_for(0, blocks, grain(block), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) fwht_block(data + b * block, block, scale);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("store_kv", &store_kv, "k / v quantized into an int8 / fp8 / int4 KV cache at slots, keys less their block's offset",
        pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("slots"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("k_scale"), pybind11::arg("v_scale"), pybind11::arg("k_offsets"), pybind11::arg("key_blocks"));
  m.def("hadamard", &hadamard, "x V: block-diagonal Sylvester Hadamard blocks / sqrt(block), a fast Walsh-Hadamard transform",
        pybind11::arg("x"), pybind11::arg("block"));
  m.def("add_rms_norm", &add_rms_norm, "h += delta; out = rms_norm(h) * weight", pybind11::arg("h"),
        pybind11::arg("delta"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("out"));
  m.def("argmax", &argmax, "row-wise argmax of float32 logits (first maximum; first NaN, as torch)", pybind11::arg("logits"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a merged gate/up output", pybind11::arg("gate_up"));
  m.def("rope", &rope, "per-head q/k norm, rotary embedding in place, k/v to the cache", pybind11::arg("qkv"),
        pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("heads"), pybind11::arg("kv_heads"),
        pybind11::arg("qk_norm"), pybind11::arg("eps"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("slots"));
}
