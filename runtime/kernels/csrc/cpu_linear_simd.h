// SIMD quantized-linear kernels, written once over the `Vec` operations of cpu_linear_vec.h and
// compiled per instruction set (cpu_linear_avx2.cpp, cpu_linear_avx512.cpp). Include inside an
// anonymous namespace after the target pragma.
//
// Four paths, each computing output features [16 * t0, 16 * t1) for every row:
//   igemv  few rows (decode), int4 / int8 / nl4 codes: integer dot products with the activations
//          split into three int8 levels (see "integer GEMV" below).
//   gemv   few rows, any format: the packed weights are read once and unpacked in registers.
//          Integer value i of a lane is isolated with one AND (no shift) and converted, which
//          gives u * 2^(bits * i); the caller pre-scales activation k by 2^-(bits * (k % VPL)),
//          so each weight costs an AND, a convert and one FMA per row. Scales apply per group:
//          sum_k x_k w_k = scale * sum_k x_k u_k + offset * sum_k x_k.
//   panel  many rows (prefill): a tile pair's weights for kPanelK inputs are dequantized into a
//          float buffer, then a 6-row register-blocked FMA micro-kernel runs over every row.
//   w8a8   int8 activations times int8 weights with integer dot products, scaled at the end.
#pragma once

#include "cpu_linear.h"

using llmopt_linear::Job;
using llmopt_linear::kPanelK;

constexpr int VT = 16 / Vec::W;  // vectors per 16-feature tile

// What a lane's values are: integer codes, e4m3 bytes, or 4-bit indices into kNl4Bytes (nl4).
constexpr int kIntKind = 0, kFp8Kind = 1, kLutKind = 2;
alignas(64) constexpr float kNl4Floats[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

template <int I>
struct Int {
  static constexpr int value = I;
};

template <int N, int I = 0, class Fn>
inline void unroll(const Fn& fn) {
  if constexpr (I < N) {
    fn(Int<I>{});
    unroll<N, I + 1>(fn);
  }
}

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// ---- output helpers (the last tile may be partial: columns past N are neither read nor written)

inline Vec::F load_bias(const Job& j, int64_t col) {
  if (!j.bias) return Vec::zero();
  if (col + Vec::W <= j.N) return Vec::load(j.bias + col);
  alignas(64) float tmp[Vec::W] = {};
  for (int64_t i = 0; col + i < j.N; ++i) tmp[i] = j.bias[col + i];
  return Vec::load(tmp);
}

inline Vec::F load_out(const Job& j, int64_t row, int64_t col) {
  const float* o = j.out + row * j.N + col;
  if (col + Vec::W <= j.N) return Vec::load(o);
  alignas(64) float tmp[Vec::W] = {};
  for (int64_t i = 0; col + i < j.N; ++i) tmp[i] = o[i];
  return Vec::load(tmp);
}

inline void put_out(const Job& j, int64_t row, int64_t col, Vec::F v) {
  float* o = j.out + row * j.N + col;
  if (col + Vec::W <= j.N) {
    Vec::store(o, v);
    return;
  }
  alignas(64) float tmp[Vec::W];
  Vec::store(tmp, v);
  for (int64_t i = 0; col + i < j.N; ++i) o[i] = tmp[i];
}

// ---- decoding lanes

// e4m3 byte I of each lane: sign to bit 31, the 7 magnitude bits to bits 20..26; read as a
// float that is the e4m3 value times 2^-120 (subnormals included), hence the multiply.
template <int I>
inline Vec::F fp8_value(Vec::I lanes) {
  Vec::I top;
  if constexpr (I == 3) {
    top = lanes;
  } else {
    top = Vec::template slli<24 - 8 * I>(lanes);
  }
  Vec::I bits = Vec::andi(Vec::template srai<4>(top), Vec::set1i(static_cast<int32_t>(0x87F00000u)));
  return Vec::mul(Vec::as_float(bits), Vec::bcast(0x1p120f));
}

// Value I of each lane (the panel form).
template <int BITS, int KIND, int I>
inline Vec::F decode_exact(Vec::I lanes) {
  if constexpr (KIND == kFp8Kind) {
    return fp8_value<I>(lanes);
  } else if constexpr (KIND == kLutKind) {
    return Vec::lut_floats(Vec::andi(Vec::template srli<BITS * I>(lanes), Vec::set1i((1 << BITS) - 1)), kNl4Floats);
  } else if constexpr (I == 32 / BITS - 1) {
    return Vec::cvt(Vec::template srli<32 - BITS>(lanes));
  } else if constexpr (I == 0) {
    return Vec::cvt(Vec::andi(lanes, Vec::set1i((1 << BITS) - 1)));
  } else {
    return Vec::cvt(Vec::andi(Vec::template srli<BITS * I>(lanes), Vec::set1i((1 << BITS) - 1)));
  }
}

// Value I of each lane times 2^(BITS * I) (the GEMV form; see the file comment). Table
// entries (nl4) are read exactly: their activations are not pre-scaled.
template <int BITS, int KIND, int I>
inline Vec::F decode_scaled(Vec::I lanes) {
  if constexpr (KIND == kFp8Kind) {
    return fp8_value<I>(lanes);
  } else if constexpr (KIND == kLutKind) {
    return decode_exact<BITS, KIND, I>(lanes);
  } else if constexpr (I == 32 / BITS - 1) {
    return Vec::cvt(Vec::template srli<32 - BITS>(lanes));
  } else {
    return Vec::cvt(Vec::andi(lanes, Vec::set1i(((1 << BITS) - 1) << (BITS * I))));
  }
}

// The scales of one vector of features at `at`, stored in float32 or bfloat16.
inline Vec::F load_scale(const Job& j, int64_t at) {
  return j.scale16 ? Vec::load_bf16(j.scale16 + at) : Vec::load(j.scale + at);
}

inline Vec::F group_offset(const Job& j, int64_t at, Vec::F scale) {
  return j.offset ? Vec::load(j.offset + at) : Vec::mul(scale, Vec::bcast(j.half));
}

// ---- gemv: MR rows from m0, TPS tiles from t

template <int BITS, int KIND, int MR, int TPS>
void gemv_step(const Job& j, int64_t t, int64_t m0) {
  constexpr int VPL = 32 / BITS, NV = TPS * VT;
  const int64_t chunks = j.Kp / VPL, per_group = j.gs / VPL;
  const uint32_t* base = j.data + t * chunks * 16;
  const float* xs = j.xs + m0 * j.Kp;
  Vec::F acc[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[m][v] = Vec::zero();
  for (int64_t g = 0; g < j.groups; ++g) {
    Vec::F part[MR][NV];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) part[m][v] = Vec::zero();
    for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
      Vec::I lanes[NV];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) lanes[v] = Vec::loadi(base + ((v / VT) * chunks + c) * 16 + (v % VT) * Vec::W);
      const float* xc = xs + c * VPL;
      unroll<VPL>([&](auto i) {
        constexpr int I = decltype(i)::value;
        Vec::F w[NV];
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) w[v] = decode_scaled<BITS, KIND, I>(lanes[v]);
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          Vec::F xb = Vec::bcast(xc[m * j.Kp + I]);
#pragma GCC unroll 16
          for (int v = 0; v < NV; ++v) part[m][v] = Vec::fma(xb, w[v], part[m][v]);
        }
      });
    }
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const int64_t at = ((t + v / VT) * j.groups + g) * 16 + (v % VT) * Vec::W;
      Vec::F s = load_scale(j, at);
      if constexpr (KIND == kFp8Kind) {
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) acc[m][v] = Vec::fma(part[m][v], s, acc[m][v]);
      } else {
        Vec::F b = group_offset(j, at, s);
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          acc[m][v] = Vec::fma(part[m][v], s, acc[m][v]);
          acc[m][v] = Vec::fma(b, Vec::bcast(j.xsum[(m0 + m) * j.groups + g]), acc[m][v]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
    const int64_t col = (t + v / VT) * 16 + (v % VT) * Vec::W;
    Vec::F b = load_bias(j, col);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) put_out(j, m0 + m, col, Vec::add(acc[m][v], b));
  }
}

// Tiles per step: enough independent FMA chains (MR * TPS * VT) within the register file.
template <int MR>
constexpr int gemv_tiles() {
  if constexpr (VT == 2) return MR == 1 ? 2 : 1;
  else return MR <= 2 ? 4 : 2;
}

template <int BITS, int KIND, int MR>
void gemv_rows(const Job& j, int64_t t0, int64_t t1, int64_t m0) {
  constexpr int TPS = gemv_tiles<MR>();
  int64_t t = t0;
  for (; t + TPS <= t1; t += TPS) gemv_step<BITS, KIND, MR, TPS>(j, t, m0);
  if constexpr (TPS > 2) {
    for (; t + 2 <= t1; t += 2) gemv_step<BITS, KIND, MR, 2>(j, t, m0);
  }
  for (; t < t1; ++t) gemv_step<BITS, KIND, MR, 1>(j, t, m0);
}

template <int BITS, int KIND>
void gemv_format(const Job& j, int64_t t0, int64_t t1) {
  for (int64_t m = 0; m < j.M; m += 4) {
    switch (min64(4, j.M - m)) {
      case 1: gemv_rows<BITS, KIND, 1>(j, t0, t1, m); break;
      case 2: gemv_rows<BITS, KIND, 2>(j, t0, t1, m); break;
      case 3: gemv_rows<BITS, KIND, 3>(j, t0, t1, m); break;
      default: gemv_rows<BITS, KIND, 4>(j, t0, t1, m); break;
    }
  }
}

// ---- panel: dequantize TPS tiles x [k0, k1) into buf[k - k0][16 * TPS], then FMA micro-kernel

template <int BITS, int KIND, int TPS>
void dequantize(const Job& j, int64_t t, int64_t k0, int64_t k1, float* buf) {
  constexpr int VPL = 32 / BITS, NV = TPS * VT;
  const int64_t chunks = j.Kp / VPL;
  const uint32_t* base = j.data + t * chunks * 16;
  for (int64_t c = k0 / VPL; c * VPL < k1; ++c) {
    Vec::I lanes[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) lanes[v] = Vec::loadi(base + ((v / VT) * chunks + c) * 16 + (v % VT) * Vec::W);
    // At most one group boundary inside a chunk when gs >= VPL; divide per value otherwise.
    const int64_t first = c * VPL, g0 = first / j.gs, boundary = (g0 + 1) * j.gs;
    unroll<VPL>([&](auto i) {
      constexpr int I = decltype(i)::value;
      const int64_t k = first + I;
      if (k >= k1) return;
      const int64_t g = j.gs >= VPL ? g0 + (k >= boundary) : k / j.gs;
      float* row = buf + (k - k0) * 16 * TPS;
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        const int64_t at = ((t + v / VT) * j.groups + g) * 16 + (v % VT) * Vec::W;
        Vec::F s = load_scale(j, at), u = decode_exact<BITS, KIND, I>(lanes[v]);
        if constexpr (KIND == kFp8Kind) {
          Vec::store(row + v * Vec::W, Vec::mul(u, s));
        } else {
          Vec::store(row + v * Vec::W, Vec::fma(u, s, group_offset(j, at, s)));
        }
      }
    });
  }
}

template <int MR, int NV>
void micro(const Job& j, int64_t m0, int64_t col0, int64_t k0, int64_t k1, const float* buf) {
  Vec::F c[MR][NV];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
    Vec::F b = k0 == 0 ? load_bias(j, col0 + v * Vec::W) : Vec::zero();
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) c[m][v] = k0 == 0 ? b : load_out(j, m0 + m, col0 + v * Vec::W);
  }
  const float* x = j.x + m0 * j.K;
  for (int64_t k = k0; k < k1; ++k) {
    const float* row = buf + (k - k0) * NV * Vec::W;
    Vec::F w[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) w[v] = Vec::load(row + v * Vec::W);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      Vec::F a = Vec::bcast(x[m * j.K + k]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) c[m][v] = Vec::fma(a, w[v], c[m][v]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) put_out(j, m0 + m, col0 + v * Vec::W, c[m][v]);
}

// fn(std::integral_constant<int, MR>, m0) for the rows of j in blocks of six (the last one shorter):
// the micro-kernels' row counts are template arguments.
template <class Fn>
inline void for_row_blocks(const Job& j, const Fn& fn) {
  for (int64_t m = 0; m < j.M; m += 6) {
    switch (min64(6, j.M - m)) {
      case 1: fn(std::integral_constant<int, 1>{}, m); break;
      case 2: fn(std::integral_constant<int, 2>{}, m); break;
      case 3: fn(std::integral_constant<int, 3>{}, m); break;
      case 4: fn(std::integral_constant<int, 4>{}, m); break;
      case 5: fn(std::integral_constant<int, 5>{}, m); break;
      default: fn(std::integral_constant<int, 6>{}, m); break;
    }
  }
}

template <int NV>
void micro_rows(const Job& j, int64_t col0, int64_t k0, int64_t k1, const float* buf) {
  for_row_blocks(j, [&](auto rows, int64_t m) { micro<decltype(rows)::value, NV>(j, m, col0, k0, k1, buf); });
}

template <int BITS, int KIND>
void panel_format(const Job& j, int64_t t0, int64_t t1, float* buf) {
  constexpr int TPS = VT == 2 ? 1 : 2;  // two vectors of columns per micro-kernel row
  for (int64_t t = t0; t < t1; t += TPS) {
    const bool whole = t + TPS <= t1;
    for (int64_t k0 = 0; k0 < j.K; k0 += kPanelK) {
      const int64_t k1 = min64(j.K, k0 + kPanelK);
      if (whole) {
        dequantize<BITS, KIND, TPS>(j, t, k0, k1, buf);
        micro_rows<TPS * VT>(j, t * 16, k0, k1, buf);
      } else {
        dequantize<BITS, KIND, 1>(j, t, k0, k1, buf);
        micro_rows<VT>(j, t * 16, k0, k1, buf);
      }
    }
  }
}

// ---- w8a8: integer dot products of int8 activations and int8 weights

template <int MR, int TPS>
void w8a8_step(const Job& j, int64_t t, int64_t m0) {
  constexpr int NV = TPS * VT;
  const int64_t chunks = j.Kp / 4;
  const uint32_t* base = j.data + t * chunks * 16;
  const int8_t* xq = j.xq + m0 * j.Kp;
  Vec::I acc[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[m][v] = Vec::zeroi();
  for (int64_t c = 0; c < chunks; ++c) {
    typename Vec::WPrep w[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) w[v] = Vec::wprep(Vec::loadi(base + ((v / VT) * chunks + c) * 16 + (v % VT) * Vec::W));
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      int32_t x4;
      __builtin_memcpy(&x4, xq + m * j.Kp + c * 4, 4);
      Vec::I xb = Vec::xprep(x4);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[m][v] = Vec::dot(acc[m][v], xb, w[v]);
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
    const int64_t col = (t + v / VT) * 16 + (v % VT) * Vec::W;
    Vec::F s = load_scale(j, col), b = load_bias(j, col);  // one group: scale index = col
    Vec::I bias_sum = Vec::zeroi();
    if constexpr (Vec::kDotBias != 0) bias_sum = Vec::template slli<7>(Vec::loadi32(j.wsum + col));
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      Vec::F dot = Vec::cvt(Vec::subi(acc[m][v], bias_sum));
      put_out(j, m0 + m, col, Vec::fma(dot, Vec::mul(s, Vec::bcast(j.xscale[m0 + m])), b));
    }
  }
}

template <int MR>
void w8a8_rows(const Job& j, int64_t t, int64_t t1, int64_t m0) {
  constexpr int TPS = VT == 2 ? (MR == 1 ? 2 : 1) : 4;
  if constexpr (TPS > 1) {
    if (t + TPS <= t1) return w8a8_step<MR, TPS>(j, t, m0);
  }
  for (; t < t1; ++t) w8a8_step<MR, 1>(j, t, m0);
}

inline void w8a8_all(const Job& j, int64_t t0, int64_t t1) {
  constexpr int step = VT == 2 ? 2 : 4;  // the widest step of w8a8_rows
  for (int64_t t = t0; t < t1; t += step) {
    const int64_t te = min64(t1, t + step);
    for (int64_t m = 0; m < j.M; m += 4) {  // the step's weights stay in cache across row blocks
      switch (min64(4, j.M - m)) {
        case 1: w8a8_rows<1>(j, t, te, m); break;
        case 2: w8a8_rows<2>(j, t, te, m); break;
        case 3: w8a8_rows<3>(j, t, te, m); break;
        default: w8a8_rows<4>(j, t, te, m); break;
      }
    }
  }
}

// ---- integer GEMV: int4 / int8 weight-only codes times activations split into int8 levels
//
// Per row and block of xblock inputs, x = s (q0 + q1 / 254 + q2 / 254^2) + r with int8 q and
// |r| <= s / (2 * 254^2), s = max|x| / 127: the residual is max|x| * 6.1e-8, the size of
// float32's own rounding. With one level (matmul precision "low") x = s q0 + r, |r| <= s / 2:
// the activations rounded to int8 per block, llama.cpp's Q8 arithmetic, three times fewer dot
// products; with j.xrow, one scale per row (per-token int8 activations: W4A8, grouped W8A8). Each level is then an exact integer dot product with the unsigned
// codes (VNNI: 64 multiply-adds per instruction), scaled per block; the code offset uses the
// float sums of x. Int4 lanes split into even and odd nibbles, so activations are stored
// permuted within each 8-input chunk: bytes 0-3 hold inputs 0, 2, 4, 6 and bytes 4-7 inputs 1, 3, 5, 7.

constexpr float kLevel = 254.0f;

// Rows [m0, m1) of the activations as levels (written so the compiler vectorizes each loop:
// per-lane maxima and sums, then one reduction; the rounding loop has no dependence).
inline void split_levels_all(const Job& j, int8_t* xq, float* xls, float* xbsum, int64_t m0, int64_t m1) {
  const bool int4 = j.format == llmopt_linear::kInt4 || j.format == llmopt_linear::kNl4;  // nibble lanes
  const int64_t nblk = j.Kp / j.xblock, xb = j.xblock;
  constexpr int kLanes = 16;
  alignas(64) float r[256];
  alignas(64) int8_t q[256];
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const int64_t k0 = blk * xb, n = min64(xb, j.K - k0);
      const float* x = j.x + m * j.K + k0;
      if (n == xb && xb % Vec::W == 0) {  // a whole block: vector code, the same codes and scales
        Vec::F top = Vec::zero(), total = Vec::zero();
        for (int64_t c = 0; c < xb; c += Vec::W) {
          const Vec::F v = Vec::load(x + c);
          top = Vec::maxf(top, Vec::absf(v));
          total = Vec::add(total, v);
        }
        const float absmax = j.xrow ? j.xrow[m] : Vec::hmax(top);
        float scale = absmax / 127.0f, inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
        Vec::F codes = Vec::zero();  // one level: the block's sum is that of the rounded values
        for (int l = 0; l < j.levels; ++l) {
          int8_t* dst = xq + (l * j.M + m) * j.Kp + k0;
          for (int64_t c = 0; c < xb; c += Vec::W) {
            const Vec::F rest = l == 0 ? Vec::load(x + c) : Vec::load(r + c);
            const Vec::F v = Vec::round127(Vec::mul(rest, Vec::bcast(inv)));
            if (l + 1 < j.levels) Vec::store(r + c, Vec::fnma(v, Vec::bcast(scale), rest));
            else if (j.levels == 1) codes = Vec::add(codes, v);
            Vec::store_i8(dst + c, v, int4);
          }
          xls[(m * nblk + blk) * 3 + l] = scale;
          scale /= kLevel;
          inv *= kLevel;
        }
        xbsum[m * nblk + blk] = j.levels == 1 ? Vec::hsum(codes) * xls[(m * nblk + blk) * 3] : Vec::hsum(total);
        continue;
      }
      for (int64_t i = 0; i < n; ++i) r[i] = x[i];
      for (int64_t i = n; i < xb; ++i) r[i] = 0.0f;
      float lane_max[kLanes] = {}, lane_sum[kLanes] = {};
      for (int64_t c = 0; c + kLanes <= xb; c += kLanes)
        for (int i = 0; i < kLanes; ++i) {
          const float a = r[c + i] < 0.0f ? -r[c + i] : r[c + i];
          lane_max[i] = a > lane_max[i] ? a : lane_max[i];
          lane_sum[i] += r[c + i];
        }
      for (int64_t i = xb / kLanes * kLanes; i < xb; ++i) {  // blocks shorter than kLanes
        const float a = r[i] < 0.0f ? -r[i] : r[i];
        lane_max[0] = a > lane_max[0] ? a : lane_max[0];
        lane_sum[0] += r[i];
      }
      float absmax = 0.0f, sum = 0.0f;
      for (int i = 0; i < kLanes; ++i) {
        absmax = lane_max[i] > absmax ? lane_max[i] : absmax;
        sum += lane_sum[i];
      }
      if (j.xrow) absmax = j.xrow[m];
      float scale = absmax / 127.0f, inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
      float codes = 0.0f;
      for (int l = 0; l < j.levels; ++l) {
        for (int64_t i = 0; i < xb; ++i) {
          float v = __builtin_nearbyintf(r[i] * inv);
          v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
          r[i] = __builtin_fmaf(-v, scale, r[i]);
          q[i] = static_cast<int8_t>(static_cast<int32_t>(v));
          codes += v;
        }
        int8_t* dst = xq + (l * j.M + m) * j.Kp + k0;
        if (int4) {  // inputs 0, 2, 4, 6 then 1, 3, 5, 7 of each chunk (see above)
          for (int64_t c = 0; c < xb; c += 8)
            for (int i = 0; i < 8; ++i) dst[c + (i & 1) * 4 + (i >> 1)] = q[c + i];
        } else {
          __builtin_memcpy(dst, q, xb);
        }
        xls[(m * nblk + blk) * 3 + l] = scale;
        scale /= kLevel;
        inv *= kLevel;
      }
      xbsum[m * nblk + blk] = j.levels == 1 ? codes * xls[(m * nblk + blk) * 3] : sum;
    }
  }
}

inline int32_t load32(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// Tiles tiles[0 .. TPS) (any tiles: the caller streams far-apart ones together, see igemv_format),
// with L activation levels, over activation blocks [b0, b1): the first range writes the output
// (plus the bias), later ones add to it.
template <bool INT4, bool LUT, int L, int MR, int TPS>
void igemv_step(const Job& j, const int64_t* tiles, int64_t m0, int64_t b0, int64_t b1) {
  constexpr int VPL = INT4 ? 8 : 4, NV = TPS * VT;
  const int64_t chunks = j.Kp / VPL, per_block = j.xblock / VPL, nblk = j.Kp / j.xblock;
  const uint32_t* base[TPS];
#pragma GCC unroll 4
  for (int i = 0; i < TPS; ++i) base[i] = j.data + tiles[i] * chunks * 16;
  Vec::F acc[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[m][v] = Vec::zero();
  for (int64_t blk = b0; blk < b1; ++blk) {
    Vec::I part[MR][L][NV];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
      for (int l = 0; l < L; ++l)
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) part[m][l][v] = Vec::zeroi();
    for (int64_t c = blk * per_block; c < (blk + 1) * per_block; ++c) {
      Vec::I w0[NV], w1[NV];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        Vec::I lanes = Vec::loadi(base[v / VT] + c * 16 + (v % VT) * Vec::W);
        if constexpr (INT4) {
          w0[v] = Vec::andi(lanes, Vec::set1i(0x0F0F0F0F));
          w1[v] = Vec::andi(Vec::template srli<4>(lanes), Vec::set1i(0x0F0F0F0F));
          if constexpr (LUT) {  // nl4: indices to grid bytes (<= 241: VNNI only, see igemv_entry)
            w0[v] = Vec::lut_bytes(w0[v], llmopt_linear::kNl4Bytes);
            w1[v] = Vec::lut_bytes(w1[v], llmopt_linear::kNl4Bytes);
          }
        } else {
          w0[v] = lanes;
        }
      }
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 3
        for (int l = 0; l < L; ++l) {
          const int8_t* q = j.xq + (l * j.M + m0 + m) * j.Kp + c * VPL;
          Vec::I x0 = Vec::set1i(load32(q));
          if constexpr (INT4) {
            Vec::I x1 = Vec::set1i(load32(q + 4));
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) part[m][l][v] = Vec::dot_u4(part[m][l][v], w0[v], x0, w1[v], x1);
          } else {
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) part[m][l][v] = Vec::dot_u8(part[m][l][v], w0[v], x0);
          }
        }
      }
    }
    const int64_t g = blk * j.xblock / j.gs;
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const int64_t at = (tiles[v / VT] * j.groups + g) * 16 + (v % VT) * Vec::W;
      Vec::F s = load_scale(j, at), b = group_offset(j, at, s);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const float* ls = j.xls + ((m0 + m) * nblk + blk) * 3;
        Vec::F sum = Vec::mul(Vec::cvt(part[m][0][v]), Vec::bcast(ls[0]));
#pragma GCC unroll 3
        for (int l = 1; l < L; ++l) sum = Vec::fma(Vec::cvt(part[m][l][v]), Vec::bcast(ls[l]), sum);
        acc[m][v] = Vec::fma(sum, s, acc[m][v]);
        acc[m][v] = Vec::fma(b, Vec::bcast(j.xbsum[(m0 + m) * nblk + blk]), acc[m][v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
    const int64_t col = tiles[v / VT] * 16 + (v % VT) * Vec::W;
    const Vec::F b = b0 == 0 ? load_bias(j, col) : Vec::zero();
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
      put_out(j, m0 + m, col, Vec::add(acc[m][v], b0 == 0 ? b : load_out(j, m0 + m, col)));
  }
}

// Tiles per step: at most 12 integer accumulators (MR * L levels * vectors).
template <int MR, int L>
constexpr int igemv_tiles() {
  if constexpr (VT == 2) return 1;
  else return MR * L * 4 <= 12 ? 4 : MR * L * 2 <= 12 ? 2 : 1;
}

// The four tiles of an AVX-512 step for MR rows, as steps of igemv_tiles<MR, L>() tiles.
template <bool INT4, bool LUT, int L, int MR>
void igemv_split(const Job& j, const int64_t* tiles, int64_t m0, int64_t b0, int64_t b1) {
  constexpr int S = igemv_tiles<1, L>(), TPS = igemv_tiles<MR, L>();
#pragma GCC unroll 4
  for (int i = 0; i < S; i += TPS) igemv_step<INT4, LUT, L, MR, TPS>(j, tiles + i, m0, b0, b1);
}

// Weight bytes of a step's tiles that row blocks reuse from L1: longer inputs are taken in
// ranges of activation blocks, each range over every row block before the next.
constexpr int64_t kIgemvRangeBytes = 16 << 10;

// Tiles [t0, t1): a step reads igemv_tiles<1, L>() tiles from far-apart parts of the range at once
// (one per segment of `len` tiles). Independent sequential streams keep more memory requests in
// flight than adjacent tiles, which read as one stream: a single core streams the weights about
// twice as fast. The tiles left over run one at a time.
template <bool INT4, bool LUT, int L>
void igemv_levels(const Job& j, int64_t t0, int64_t t1) {
  constexpr int S = igemv_tiles<1, L>();
  const int64_t len = (t1 - t0) / S, nblk = j.Kp / j.xblock;
  const int64_t step_block_bytes = S * 16 * j.xblock / (INT4 ? 2 : 1);
  const int64_t range = j.M > 4 ? (kIgemvRangeBytes / step_block_bytes > 0 ? kIgemvRangeBytes / step_block_bytes : 1) : nblk;
  int64_t tiles[S];
  for (int64_t i = 0; i < len; ++i) {
    for (int s = 0; s < S; ++s) tiles[s] = t0 + s * len + i;
    for (int64_t b0 = 0; b0 < nblk; b0 += range) {
      const int64_t b1 = min64(nblk, b0 + range);
      if constexpr (VT == 2 && L > 1) {  // AVX2: 16 registers hold one row's accumulators
        for (int64_t m = 0; m < j.M; ++m) igemv_step<INT4, LUT, L, 1, S>(j, tiles, m, b0, b1);
      } else {
        for (int64_t m = 0; m < j.M; m += 4) {  // the step's weights stay in cache across row blocks
          switch (min64(4, j.M - m)) {
            case 1: igemv_split<INT4, LUT, L, 1>(j, tiles, m, b0, b1); break;
            case 2: igemv_split<INT4, LUT, L, 2>(j, tiles, m, b0, b1); break;
            case 3: igemv_split<INT4, LUT, L, 3>(j, tiles, m, b0, b1); break;
            default: igemv_split<INT4, LUT, L, 4>(j, tiles, m, b0, b1); break;
          }
        }
      }
    }
  }
  for (int64_t t = t0 + S * len; t < t1; ++t)
    for (int64_t m = 0; m < j.M; m += 4) {  // the tiles left over: one at a time, rows in blocks
      if constexpr (VT == 2 && L > 1) {
        for (int64_t r = m; r < min64(j.M, m + 4); ++r) igemv_step<INT4, LUT, L, 1, 1>(j, &t, r, 0, nblk);
        continue;
      }
      switch (min64(4, j.M - m)) {
        case 1: igemv_step<INT4, LUT, L, 1, 1>(j, &t, m, 0, nblk); break;
        case 2: igemv_step<INT4, LUT, L, 2, 1>(j, &t, m, 0, nblk); break;
        case 3: igemv_step<INT4, LUT, L, 3, 1>(j, &t, m, 0, nblk); break;
        default: igemv_step<INT4, LUT, L, 4, 1>(j, &t, m, 0, nblk); break;
      }
    }
}

template <bool INT4, bool LUT = false>
void igemv_format(const Job& j, int64_t t0, int64_t t1) {
  if (j.levels == 1) return igemv_levels<INT4, LUT, 1>(j, t0, t1);
  igemv_levels<INT4, LUT, 3>(j, t0, t1);
}

inline void igemv_entry(const Job& j, int64_t t0, int64_t t1) {
  if (j.format == llmopt_linear::kInt4) return igemv_format<true>(j, t0, t1);
  if constexpr (VT == 1) {  // u8 x s8 needs VNNI (AVX2's maddubs saturates): int8 and nl4 bytes
    if (j.format == llmopt_linear::kNl4) return igemv_format<true, true>(j, t0, t1);
    igemv_format<false>(j, t0, t1);
  }
}

// ---- entry points

// fn(std::integral_constant<int, BITS>, std::integral_constant<int, KIND>) for the weight-only
// format of j: the kernels' bits and value kind are template arguments.
template <class Fn>
inline void for_format(const Job& j, const Fn& fn) {
  using std::integral_constant;
  switch (j.format) {
    case llmopt_linear::kInt4: return fn(integral_constant<int, 4>{}, integral_constant<int, kIntKind>{});
    case llmopt_linear::kInt8: return fn(integral_constant<int, 8>{}, integral_constant<int, kIntKind>{});
    case llmopt_linear::kNl4: return fn(integral_constant<int, 4>{}, integral_constant<int, kLutKind>{});
    default: return fn(integral_constant<int, 8>{}, integral_constant<int, kFp8Kind>{});
  }
}

inline void gemv_entry(const Job& j, int64_t t0, int64_t t1) {
  for_format(j, [&](auto bits, auto kind) { gemv_format<decltype(bits)::value, decltype(kind)::value>(j, t0, t1); });
}

inline void panel_entry(const Job& j, int64_t t0, int64_t t1, float* work) {
  for_format(j, [&](auto bits, auto kind) { panel_format<decltype(bits)::value, decltype(kind)::value>(j, t0, t1, work); });
}
