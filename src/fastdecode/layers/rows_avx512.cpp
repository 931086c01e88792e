// The rows layout's float32-activation products (qmatmul.cpp's float_rows: the logits layer, exact up to
// summation order) with AVX-512: two outputs per register, output n in the low 256 bits and n + 1 in the
// high ones.
//
// Bit for bit the AVX2 kernel (isa.h): there, per (row, output), each group's G codes are decoded to float
// (exact), dot = w[0] * x[0..7], then dot = fma(w[i], x[8i..8i+7], dot) for i < G/8, acc = fma(dot, scale,
// acc) in group order, and the 8 lanes are added by quant::hsum. Here each half of a register runs those
// very operations on its output's lanes (the row's 8 inputs broadcast to both halves, each half its own
// scale), and each half is reduced by the same hsum. Per 32 multiply-adds about half the AVX2 kernel's
// instructions: the 151936 x 1536 Q6_K logits layer of Qwen2.5-Coder-1.5B ran at ~7 GB/s of codes on one
// core with AVX2 (compute-bound), below what the memory delivers.
#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>

#include "qrows.h"
#include "rows_avx512.h"

// Everything below may use AVX-512; it runs only where isa.h's use_avx512() holds.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

namespace fastdecode {
namespace avx512 {
namespace {

using quant::hsum;
using quant::load_scale;

// Codes this far ahead in each output's row are prefetched (as qmatmul.cpp's FLOAT_PREFETCH_BYTES).
constexpr int64_t PREFETCH_BYTES = 8192;
constexpr int PAIRS = 2;  // output pairs side by side: each row's broadcast inputs serve 4 outputs

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
  __m512 acc[RB][PAIRS];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < PAIRS; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if ((g * G) % 64 == 0)  // prefetches never fault
      for (int j = 0; j < 2 * PAIRS; ++j) _mm_prefetch(reinterpret_cast<const char*>(rows[j] + g * G + PREFETCH_BYTES), _MM_HINT_T0);
    __m512 w[PAIRS][G / 8], s[PAIRS];
    for (int p = 0; p < PAIRS; ++p) {
      for (int h = 0; h < G / 16; ++h) {  // 16 codes of each output: inputs 16h .. 16h + 15 of the group
        const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * p] + g * G + 16 * h));
        const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * p + 1] + g * G + 16 * h));
        w[p][2 * h] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(low, high)));
        w[p][2 * h + 1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi64(low, high)));
      }
      s[p] = _mm512_insertf32x8(_mm512_set1_ps(load_scale(scales[2 * p] + g)),
                                _mm256_set1_ps(load_scale(scales[2 * p + 1] + g)), 1);
    }
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

}  // namespace

template <int G, typename S, int RB>
int64_t float_row_pairs(const float* x, int64_t K, const uint8_t* codes, const S* scale, float* y, int64_t N,
                        int64_t n0, int64_t n1) {
  static_assert(G % 16 == 0, "groups of 16 or 32 inputs");
  int64_t n = n0;
  for (; n + 2 * PAIRS <= n1; n += 2 * PAIRS) pairs_block<G, S, RB>(x, K, codes, scale, y, N, n);
  return n;  // (the AVX2 kernel takes the last outputs: fewer than 2 * PAIRS)
}

#define FD_INSTANCES(G, S)                                                                                  \
  template int64_t float_row_pairs<G, S, 1>(const float*, int64_t, const uint8_t*, const S*, float*, int64_t, \
                                            int64_t, int64_t);                                              \
  template int64_t float_row_pairs<G, S, 4>(const float*, int64_t, const uint8_t*, const S*, float*, int64_t, \
                                            int64_t, int64_t);                                              \
  template int64_t float_row_pairs<G, S, 8>(const float*, int64_t, const uint8_t*, const S*, float*, int64_t, \
                                            int64_t, int64_t);
FD_INSTANCES(16, float)
FD_INSTANCES(16, at::Half)
FD_INSTANCES(32, float)
FD_INSTANCES(32, at::Half)
#undef FD_INSTANCES

}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
