// The exact prompt-row kernel's inner products (exact_matmul.cpp) with AVX-512: two outputs per register.
//
// Bit for bit the AVX2 kernel (isa.h): there each (row, output) sums in 8 lanes, lane l taking the inputs
// k = l (mod 8) in increasing k with one FMA each, then one fixed tree adds the lanes. Here a register
// holds that 8-lane accumulator for output j in its low half and for output j + 1 in its high half (the
// row's 8 inputs broadcast to both halves), so every lane sees the same FMAs in the same order, and each
// half is reduced by the same tree (quant::hsum).
#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>

#include "qrows.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

namespace fastdecode {
namespace avx512 {
namespace {

// y[r, 2p], y[r, 2p + 1] = x[r] . w[2p], x[r] . w[2p + 1] for RB rows and NP output pairs (w rows K floats apart).
template <int RB, int NP>
inline void pair_block(const float* x, int64_t x_stride, const float* w, int64_t K, float* y, int64_t y_stride) {
  __m512 acc[RB][NP];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m512 wv[NP];
    for (int p = 0; p < NP; ++p)
      wv[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(w + 2 * p * K + k)),
                                 _mm256_loadu_ps(w + (2 * p + 1) * K + k), 1);
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * x_stride + k));
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < NP; ++p) {
      y[r * y_stride + 2 * p] = quant::hsum(_mm512_castps512_ps256(acc[r][p]));
      y[r * y_stride + 2 * p + 1] = quant::hsum(_mm512_extractf32x8_ps(acc[r][p], 1));
    }
}

// pair_block on interleaved outputs (interleave_pairs): pair p's 8 inputs k..k+7 of both outputs in one
// 16-float run, loaded as one register (no insert: a vector op fewer per NP x RB FMAs). The same FMAs in the
// same order: the same bits.
template <int RB, int NP>
inline void paired_block(const float* x, int64_t x_stride, const float* wi, int64_t K, float* y, int64_t y_stride) {
  __m512 acc[RB][NP];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m512 wv[NP];
    for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_ps(wi + 2 * p * K + 2 * k);
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * x_stride + k));
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < NP; ++p) {
      y[r * y_stride + 2 * p] = quant::hsum(_mm512_castps512_ps256(acc[r][p]));
      y[r * y_stride + 2 * p + 1] = quant::hsum(_mm512_extractf32x8_ps(acc[r][p], 1));
    }
}

template <int RB>
inline void rows_times_paired(const float* x, int64_t K, const float* wi, int64_t pairs, float* y, int64_t N) {
  int64_t p = 0;
  for (; p + 4 <= pairs; p += 4) paired_block<RB, 4>(x, K, wi + 2 * p * K, K, y + 2 * p, N);
  for (; p < pairs; ++p) paired_block<RB, 1>(x, K, wi + 2 * p * K, K, y + 2 * p, N);
}

template <int RB>
inline void rows_times_pairs(const float* x, int64_t K, const float* w, int64_t pairs, float* y, int64_t N) {
  int64_t p = 0;
  for (; p + 4 <= pairs; p += 4) pair_block<RB, 4>(x, K, w + 2 * p * K, K, y + 2 * p, N);
  for (; p < pairs; ++p) pair_block<RB, 1>(x, K, w + 2 * p * K, K, y + 2 * p, N);
}

}  // namespace

int64_t exact_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t n, float* y, int64_t N) {
  const int64_t pairs = n / 2;
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) rows_times_pairs<6>(x + m * K, K, w, pairs, y + m * N, N);
  // the last 1-5 rows in one block: each decoded output is read from L2 once for them, not once per row
  // (a short prompt's rows were five passes of one row: loads, not FMAs, bounded them)
  x += m * K;
  y += m * N;
  switch (M - m) {
    case 5: rows_times_pairs<5>(x, K, w, pairs, y, N); break;
    case 4: rows_times_pairs<4>(x, K, w, pairs, y, N); break;
    case 3: rows_times_pairs<3>(x, K, w, pairs, y, N); break;
    case 2: rows_times_pairs<2>(x, K, w, pairs, y, N); break;
    case 1: rows_times_pairs<1>(x, K, w, pairs, y, N); break;
    default: break;
  }
  return 2 * pairs;
}

void interleave_pairs(const float* w, int64_t n, int64_t K, float* wi) {
  for (int64_t p = 0; p < n / 2; ++p)
    for (int64_t k = 0; k < K; k += 8) {
      _mm256_storeu_ps(wi + 2 * p * K + 2 * k, _mm256_loadu_ps(w + 2 * p * K + k));
      _mm256_storeu_ps(wi + 2 * p * K + 2 * k + 8, _mm256_loadu_ps(w + (2 * p + 1) * K + k));
    }
}

int64_t exact_rows_paired(const float* x, int64_t M, int64_t K, const float* wi, int64_t n, float* y, int64_t N) {
  const int64_t pairs = n / 2;
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) rows_times_paired<6>(x + m * K, K, wi, pairs, y + m * N, N);
  x += m * K;
  y += m * N;
  switch (M - m) {
    case 5: rows_times_paired<5>(x, K, wi, pairs, y, N); break;
    case 4: rows_times_paired<4>(x, K, wi, pairs, y, N); break;
    case 3: rows_times_paired<3>(x, K, wi, pairs, y, N); break;
    case 2: rows_times_paired<2>(x, K, wi, pairs, y, N); break;
    case 1: rows_times_paired<1>(x, K, wi, pairs, y, N); break;
    default: break;
  }
  return 2 * pairs;
}

}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
