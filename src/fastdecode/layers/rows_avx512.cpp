// The rows layout's products on 8-bit codes (Q6_K) with AVX-512: two outputs per register, output n in the
// low 256 bits and n + 1 in the high ones.
//
// float32 activations (qmatmul.cpp's float_rows: the logits layer, exact up to summation order):
// Bit for bit the AVX2 kernel (isa.h): there, per (row, output), each group's G codes are decoded to float
// (exact), dot = w[0] * x[0..7], then dot = fma(w[i], x[8i..8i+7], dot) for i < G/8, acc = fma(dot, scale,
// acc) in group order, and the 8 lanes are added by quant::hsum. Here each half of a register runs those
// very operations on its output's lanes (the row's 8 inputs broadcast to both halves, each half its own
// scale), and each half is reduced by the same hsum. Per 32 multiply-adds about half the AVX2 kernel's
// instructions: the 151936 x 1536 Q6_K logits layer of Qwen2.5-Coder-1.5B ran at ~7 GB/s of codes on one
// core with AVX2 (compute-bound), below what the memory delivers.
//
// int8 activations (qmatmul.cpp's dot_tile for groups of 16: V and down matrices): there each 32-input block
// gives 8 exact int32 lanes (lane l: inputs 4l..4l+3), converted, times [scale of inputs 0-15 in lanes 0-3,
// of 16-31 in lanes 4-7] x the activation scale, FMA'd into the output's 8-lane accumulator in block order,
// reduced by quant::hsum. Here VNNI's dpbusd makes the same int32 lanes exactly (activations + 128 as the
// unsigned operand, minus 128 x the codes' sum, as qtiles_avx512.cpp), and each half runs the same float
// operations.
#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>

#include "pairs_avx512.h"
#include "qrows.h"
#include "rows_avx512.h"

// Everything below may use AVX-512; it runs only where isa.h's use_avx512() holds.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

namespace fastdecode {
namespace avx512 {
namespace {

using quant::hsum;
using quant::load_scale;

// Float32 activations (the logits layer): codes qrows.h's FLOAT_PREFETCH_BYTES ahead in each output's row are
// prefetched, non-temporal (see there), as the AVX2 kernel does.
using quant::FLOAT_PREFETCH_BYTES;
using pairs::eight_scales;
using pairs::PAIRS;

// Rows [0, RB) x outputs n .. n + 2 * PAIRS - 1.
template <int G, typename S, int RB>
inline void pairs_block(const float* x, int64_t K, const uint8_t* codes, const S* scale, float* y, int64_t N,
                        int64_t n) {
  const int64_t groups = K / G;
  const uint8_t* rows[2 * PAIRS];
  const S* scales[2 * PAIRS];
  for (int j = 0; j < 2 * PAIRS; ++j) {
    rows[j] = codes + (n + j) * K;
    scales[j] = scale + (n + j) * groups;
  }
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);  // + j: group g8 + j's
  __m512 acc[RB][PAIRS];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < PAIRS; ++p) acc[r][p] = _mm512_setzero_ps();
  __m512 eight[PAIRS];  // each pair's scales of groups g8 .. g8 + 7: output 2p in lanes 0-7, 2p + 1 in 8-15
  __m512i index = spread;  // group g's lanes in them: g - g8 and 8 + g - g8
  for (int64_t g = 0; g < groups; ++g) {
    if ((g * G) % 64 == 0)  // prefetches never fault
      for (int j = 0; j < 2 * PAIRS; ++j) _mm_prefetch(reinterpret_cast<const char*>(rows[j] + g * G + FLOAT_PREFETCH_BYTES), _MM_HINT_NTA);
    const int64_t g8 = g & ~int64_t{7};
    const bool by_eight = g8 + 8 <= groups;  // the group's scale from eight converted at once (the same value)
    if (by_eight && g == g8) {
      for (int p = 0; p < PAIRS; ++p) eight[p] = eight_scales(scales[2 * p] + g8, scales[2 * p + 1] + g8);
      index = spread;
    }
    __m512 w[PAIRS][G / 8], s[PAIRS];
    for (int p = 0; p < PAIRS; ++p) {
      for (int h = 0; h < G / 16; ++h) {  // 16 codes of each output: inputs 16h .. 16h + 15 of the group
        const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * p] + g * G + 16 * h));
        const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * p + 1] + g * G + 16 * h));
        w[p][2 * h] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(low, high)));
        w[p][2 * h + 1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi64(low, high)));
      }
      s[p] = by_eight ? _mm512_permutexvar_ps(index, eight[p])
                      : _mm512_insertf32x8(_mm512_set1_ps(load_scale(scales[2 * p] + g)),
                                           _mm256_set1_ps(load_scale(scales[2 * p + 1] + g)), 1);
    }
    index = _mm512_add_epi32(index, _mm512_set1_epi32(1));
    for (int r = 0; r < RB; ++r) {
      const float* xr = x + r * K + g * G;
      __m512 dot[PAIRS];
      const __m512 x0 = _mm512_broadcast_f32x8(_mm256_loadu_ps(xr));
      for (int p = 0; p < PAIRS; ++p) dot[p] = _mm512_mul_ps(w[p][0], x0);
      for (int i = 1; i < G / 8; ++i) {
        const __m512 xi = _mm512_broadcast_f32x8(_mm256_loadu_ps(xr + 8 * i));
        for (int p = 0; p < PAIRS; ++p) dot[p] = _mm512_fmadd_ps(w[p][i], xi, dot[p]);
      }
      for (int p = 0; p < PAIRS; ++p) acc[r][p] = _mm512_fmadd_ps(dot[p], s[p], acc[r][p]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < PAIRS; ++p) {
      y[r * N + n + 2 * p] = hsum(_mm512_castps512_ps256(acc[r][p]));
      y[r * N + n + 2 * p + 1] = hsum(_mm512_extractf32x8_ps(acc[r][p], 1));
    }
}

// Rows [m0, m0 + RB) x outputs n .. n + 2 * PAIRS - 1, int8 activations, groups of 16.
template <int RB>
inline void int8_pairs_block(const quant::QuantizedRows& q, const uint8_t* offset_codes, int64_t m0,
                             const uint8_t* codes, const float* scale, float* y, int64_t N, int64_t n) {
  const int64_t K = q.K, blocks = K / 32, groups = K / 16;
  const uint8_t* rows[2 * PAIRS];
  const float* scales[2 * PAIRS];
  for (int j = 0; j < 2 * PAIRS; ++j) {
    rows[j] = codes + (n + j) * K;
    scales[j] = scale + (n + j) * groups;
  }
  const __m512i ones = _mm512_set1_epi8(1);
  // lanes 0-3: output n's scale of inputs 0-15, 4-7: of 16-31; 8-15: the same for output n + 1
  const __m512i lane_scale = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int64_t prefetch_offset = 2 * 2 * PAIRS * K;  // two passes ahead: these rows' successors
  __m512 acc[RB][PAIRS];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < PAIRS; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    if (b % 2 == 0)  // one cache line of each row per two blocks (prefetches never fault)
      for (int j = 0; j < 2 * PAIRS; ++j) _mm_prefetch(reinterpret_cast<const char*>(rows[j] + 32 * b + prefetch_offset), _MM_HINT_T0);
    __m512i w[PAIRS], correction[PAIRS];
    __m512 w_scale[PAIRS];
    for (int p = 0; p < PAIRS; ++p) {
      w[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[2 * p] + 32 * b))),
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[2 * p + 1] + 32 * b)), 1);
      correction[p] = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w[p]), 7);  // 128 x code sums
      const __m128 pair = _mm_castpd_ps(_mm_unpacklo_pd(_mm_castsi128_pd(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales[2 * p] + 2 * b))),
                                                        _mm_castsi128_pd(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales[2 * p + 1] + 2 * b)))));
      w_scale[p] = _mm512_permutexvar_ps(lane_scale, _mm512_castps128_ps512(pair));
    }
    for (int r = 0; r < RB; ++r) {
      const __m512i a = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset_codes + (m0 + r) * K + 32 * b)));
      const __m512 d = _mm512_set1_ps(q.scale[(m0 + r) * blocks + b]);
      for (int p = 0; p < PAIRS; ++p) {
        const __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), a, w[p]), correction[p]);
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w_scale[p], d), acc[r][p]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < PAIRS; ++p) {
      y[(m0 + r) * N + n + 2 * p] = hsum(_mm512_castps512_ps256(acc[r][p]));
      y[(m0 + r) * N + n + 2 * p + 1] = hsum(_mm512_extractf32x8_ps(acc[r][p], 1));
    }
}

}  // namespace

template <int RB>
int64_t int8_row_pairs16(const quant::QuantizedRows& q, const uint8_t* offset_codes, int64_t m0, const uint8_t* codes,
                         const float* scale, float* y, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 * PAIRS <= n1; n += 2 * PAIRS) int8_pairs_block<RB>(q, offset_codes, m0, codes, scale, y, N, n);
  return n;
}

template int64_t int8_row_pairs16<1>(const quant::QuantizedRows&, const uint8_t*, int64_t, const uint8_t*, const float*,
                                     float*, int64_t, int64_t, int64_t);
template int64_t int8_row_pairs16<2>(const quant::QuantizedRows&, const uint8_t*, int64_t, const uint8_t*, const float*,
                                     float*, int64_t, int64_t, int64_t);
template int64_t int8_row_pairs16<4>(const quant::QuantizedRows&, const uint8_t*, int64_t, const uint8_t*, const float*,
                                     float*, int64_t, int64_t, int64_t);

template <int G, typename S, int RB>
int64_t float_row_pairs(const float* x, int64_t K, const uint8_t* codes, const S* scale, float* y, int64_t N,
                        int64_t n0, int64_t n1) {
  static_assert(G % 16 == 0, "groups of 16 or 32 inputs");
  int64_t n = n0;
  for (; n + 2 * PAIRS <= n1; n += 2 * PAIRS) pairs_block<G, S, RB>(x, K, codes, scale, y, N, n);
  return n;  // (the AVX2 kernel takes the last outputs: fewer than 2 * PAIRS)
}

#define FD_INSTANCE(G, S, RB) \
  template int64_t float_row_pairs<G, S, RB>(const float*, int64_t, const uint8_t*, const S*, float*, int64_t, int64_t, int64_t);
#define FD_INSTANCES(G, S) \
  FD_INSTANCE(G, S, 1) FD_INSTANCE(G, S, 2) FD_INSTANCE(G, S, 3) FD_INSTANCE(G, S, 4) FD_INSTANCE(G, S, 5) \
  FD_INSTANCE(G, S, 6) FD_INSTANCE(G, S, 7) FD_INSTANCE(G, S, 8)
FD_INSTANCES(16, float)
FD_INSTANCES(16, at::Half)
FD_INSTANCES(32, float)
FD_INSTANCES(32, at::Half)
#undef FD_INSTANCES
#undef FD_INSTANCE

}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
