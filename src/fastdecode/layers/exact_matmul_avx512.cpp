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

// y[r, 2p], y[r, 2p + 1] = x[r] . w[2p], x[r] . w[2p + 1] for RB rows and NP output pairs, pair p's 2K floats
// from w + 2pK: as decoded (the two outputs' rows, K floats apart), or PAIRED (interleave_pairs: each 8 inputs of
// both outputs in one 16-float run, loaded as one register: a vector op fewer per NP x RB FMAs). The same FMAs
// in the same order either way: the same bits.
template <int RB, int NP, bool PAIRED>
inline void pair_block(const float* x, int64_t x_stride, const float* w, int64_t K, float* y, int64_t y_stride) {
  __m512 acc[RB][NP];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m512 wv[NP];
    for (int p = 0; p < NP; ++p)
      wv[p] = PAIRED ? _mm512_loadu_ps(w + 2 * p * K + 2 * k)
                     : _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(w + 2 * p * K + k)),
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

template <int RB, bool PAIRED>
inline void rows_times_pairs(const float* x, int64_t K, const float* w, int64_t pairs, float* y, int64_t N) {
  int64_t p = 0;
  for (; p + 4 <= pairs; p += 4) pair_block<RB, 4, PAIRED>(x, K, w + 2 * p * K, K, y + 2 * p, N);
  for (; p < pairs; ++p) pair_block<RB, 1, PAIRED>(x, K, w + 2 * p * K, K, y + 2 * p, N);
}

template <bool PAIRED>
int64_t rows_of(const float* x, int64_t M, int64_t K, const float* w, int64_t n, float* y, int64_t N) {
  const int64_t pairs = n / 2;
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) rows_times_pairs<6, PAIRED>(x + m * K, K, w, pairs, y + m * N, N);
  // the last 1-5 rows in one block: each decoded output is read from L2 once for them, not once per row
  // (a short prompt's rows were five passes of one row: loads, not FMAs, bounded them)
  x += m * K;
  y += m * N;
  switch (M - m) {
    case 5: rows_times_pairs<5, PAIRED>(x, K, w, pairs, y, N); break;
    case 4: rows_times_pairs<4, PAIRED>(x, K, w, pairs, y, N); break;
    case 3: rows_times_pairs<3, PAIRED>(x, K, w, pairs, y, N); break;
    case 2: rows_times_pairs<2, PAIRED>(x, K, w, pairs, y, N); break;
    case 1: rows_times_pairs<1, PAIRED>(x, K, w, pairs, y, N); break;
    default: break;
  }
  return 2 * pairs;
}

}  // namespace

int64_t exact_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t n, float* y, int64_t N) {
  return rows_of<false>(x, M, K, w, n, y, N);
}

int64_t exact_rows_paired(const float* x, int64_t M, int64_t K, const float* wi, int64_t n, float* y, int64_t N) {
  return rows_of<true>(x, M, K, wi, n, y, N);
}

void interleave_pairs(const float* w, int64_t n, int64_t K, float* wi) {
  for (int64_t p = 0; p < n / 2; ++p)
    for (int64_t k = 0; k < K; k += 8) {
      _mm256_storeu_ps(wi + 2 * p * K + 2 * k, _mm256_loadu_ps(w + 2 * p * K + k));
      _mm256_storeu_ps(wi + 2 * p * K + 2 * k + 8, _mm256_loadu_ps(w + (2 * p + 1) * K + k));
    }
}

}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
