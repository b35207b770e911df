// Quantized linear kernels for CPUs: the job description shared by the instruction-set variants.
//
// Packed weight layout (made once at load by llmopt/runtime/kernels/cpu_linear.py):
//   output features in tiles of 16; within a tile, for each chunk of VPL = 32 / bits input
//   features, 16 uint32 lanes (lane j = feature 16 * tile + j). Value i of a lane (bits
//   i * bits ... i * bits + bits - 1) is input feature chunk * VPL + i.
//     int4 / int8 weight-only: unsigned codes u = q + 2^(bits-1), weight = u * scale + offset
//     fp8 e4m3: the raw bytes, weight = e4m3(byte) * scale
//     nl4: 4-bit indices u into llama.cpp's IQ4_NL grid, weight = (kNl4Bytes[u] + half) * scale
//          with kNl4Bytes = grid + 128 (u8) and half = -128
//     w8a8: the signed int8 codes, weight = q * scale (per output feature)
//     bf16 pairs (a float weight rounded to bfloat16, for the bf16 panel only): laid out per pair
//       of tiles, [ceil(N / 32)][Kb = ceil(K / 2)][32] uint32, word (p, j) holding inputs 2p (low
//       half) and 2p + 1 (high half) of feature 32 * pair + j; no scales (the scale tensor is unused)
//   scale / offset: [tiles][groups][16] float32 (scales in bfloat16 when they all are bfloat16
//   values: fewer bytes per decoded token). Without an offset tensor, offset = half * scale.
// This header holds plain data only: it is included by translation units built for different
// instruction sets, which must not share any inline code.
#pragma once

#include <cstdint>

namespace llmopt_linear {

enum Format : int { kInt4 = 0, kInt8 = 1, kFp8 = 2, kW8A8 = 3, kNl4 = 4, kBf16Pairs = 5 };

// IQ4_NL's grid values plus 128: unsigned bytes for the integer dot products.
constexpr uint8_t kNl4Bytes[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

struct Job {
  int format;
  int64_t M, N, K;
  int64_t Kp;      // K rounded up to a whole chunk
  int64_t groups;  // scale groups along K
  int64_t gs;      // group size (Kp for one group)
  const uint32_t* data;
  const float* scale;       // float32 scales, or nullptr when scale16 holds them
  const uint16_t* scale16;  // bfloat16 scales (bit patterns), when every scale is one exactly (half the bytes)
  const float* offset;  // nullptr: offset = half * scale
  float half;           // -2^(bits-1) for weight-only integers, 0 otherwise
  const float* x;       // [M][K] activations
  const float* xs;      // [M][Kp] activations scaled for the SIMD GEMV (see simd kernels)
  const float* xsum;    // [M][groups] sums of the activations per group
  const int8_t* xq;     // [M][Kp] int8 activations (w8a8); [levels][M][Kp] levels (integer GEMV)
  int64_t xblock;       // integer GEMV: inputs per activation block (divides gs)
  int levels;           // integer GEMV: int8 levels of the activations (3: exact to float32 rounding; 1: one int8 code per input)
  const float* xls;     // [M][Kp / xblock][3] the levels' scales (integer GEMV)
  const float* xbsum;   // [M][Kp / xblock] sums of the activations per block (integer GEMV)
  const float* xrow;    // [M] max |x| of each row: one int8 scale per row instead of per block (per-token int8 activations), or nullptr
  const float* xscale;  // [M] their per-token scale (w8a8)
  const int32_t* wsum;  // [tiles * 16] sum of each feature's int8 codes (w8a8)
  const uint32_t* xb;   // [M][Kb] activations as bfloat16 pairs (bf16 panel: low half input 2p, high 2p + 1)
  int64_t Kb;           // (K + 1) / 2
  const float* bias;    // [N] or nullptr
  float* out;           // [M][N]
};

inline int values_per_lane(int format) { return format == kInt4 || format == kNl4 ? 8 : format == kBf16Pairs ? 2 : 4; }

// Each variant computes output features [16 * t0, 16 * t1) for every row.
namespace scalar {
void run(const Job& job, int64_t t0, int64_t t1, float* work);
}
namespace avx2 {
void split_levels(const Job& job, int8_t* xq, float* xls, float* xbsum, int64_t m0, int64_t m1);
void igemv(const Job& job, int64_t t0, int64_t t1);
void gemv(const Job& job, int64_t t0, int64_t t1);
void panel(const Job& job, int64_t t0, int64_t t1, float* work);
void w8a8(const Job& job, int64_t t0, int64_t t1);
}
namespace avx512 {
void split_levels(const Job& job, int8_t* xq, float* xls, float* xbsum, int64_t m0, int64_t m1);
void igemv(const Job& job, int64_t t0, int64_t t1);
void gemv(const Job& job, int64_t t0, int64_t t1);
void panel(const Job& job, int64_t t0, int64_t t1, float* work);
void w8a8(const Job& job, int64_t t0, int64_t t1);
}

// The panel with bfloat16 products and float32 sums (matmul precision "medium"; AVX512-BF16).
namespace avx512bf16 {
void panel(const Job& job, int64_t t0, int64_t t1, float* work);
void pairs(const Job& job, int64_t tp0, int64_t tp1);  // bf16 pairs: tile pairs [tp0, tp1)
}

constexpr int64_t kPanelK = 256;  // K chunk of the panel path: a dequantized tile pair is 32 KiB
constexpr int64_t kWorkFloats = kPanelK * 32;  // the float panel; the bf16 panel adds half as many pairs

}  // namespace llmopt_linear
