// The exact prompt-row kernel's inner products (exact_matmul.cpp) with AVX-512: two outputs per register.
//
// Bit for bit the AVX2 kernel (isa.h): there each (row, output) sums in 8 lanes, lane l taking the inputs
// k = l (mod 8) in increasing k with one FMA each, then one fixed tree adds the lanes. Here a register
// holds that 8-lane accumulator for output j in its low half and for output j + 1 in its high half (the
// row's 8 inputs broadcast to both halves), so every lane sees the same FMAs in the same order, and each
// half is reduced by the same tree (quant::hsum).
#include <ATen/ATen.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

#include "qrows.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

namespace fastdecode {
namespace avx512 {
namespace {

// registers of pairs (p, q) -> per 128-bit lane: [p.l0-3 + p.l4-7][p'.l0-3 + p'.l4-7][q ...][q' ...] (p' the
// pair's second output): lanes (s0, s1, s2, s3) = (l0 + l4, l1 + l5, l2 + l6, l3 + l7)
inline __m512 add_halves(__m512 p, __m512 q) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x88), _mm512_shuffle_f32x4(p, q, 0xDD));
}
// two of those (c: outputs 0-3, d: outputs 4-7) -> per 128-bit lane i: (s0 + s2, s1 + s3) of output i, then of i + 4
inline __m512 add_quarters(__m512 c, __m512 d) {
  return _mm512_add_ps(_mm512_shuffle_ps(c, d, 0x44), _mm512_shuffle_ps(c, d, 0xEE));
}

// The sums of 2 rows x 4 output pairs (a: row 0's pairs, b: row 1's) -> y0[0..8), y1[0..8) (or only y0 where
// y1 is null), each by quant::hsum's tree on its 8 lanes l0..l7, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)),
// every addition with the same operands in the same order: the same bits. The 16 sums are formed side by side
// (7 vector additions, 14 shuffles and a permutation, against 16 x (3 additions, 4 shuffles) one at a time: at
// K = 576 the one-at-a-time sums were a seventh of the kernel's time).
inline void reduce_rows_2x4(const __m512* a, const __m512* b, float* y0, float* y1) {
  const __m512 ta = add_quarters(add_halves(a[0], a[1]), add_halves(a[2], a[3]));
  const __m512 tb = add_quarters(add_halves(b[0], b[1]), add_halves(b[2], b[3]));
  // per 128-bit lane i: the sums of outputs i, i + 4 of row 0, then of row 1
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(ta, tb, 0x88), _mm512_shuffle_ps(ta, tb, 0xDD));
  const __m512 ordered =  // [row 0: outputs 0..7][row 1: outputs 0..7]
      _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
  _mm256_storeu_ps(y0, _mm512_castps512_ps256(ordered));
  if (y1 != nullptr) _mm256_storeu_ps(y1, _mm512_extractf32x8_ps(ordered, 1));
}

// Inputs per pass over a group's weights: the 4 pairs' slice (4 x 2 x KC floats, 16 KB at KC = 512) stays in L1
// while the row blocks of a chunk go by; up to MAX_PASS inputs in one pass (K = 576: SmolLM2's whole rows), else
// passes of about PASS_INPUTS (K = 1536: 3 of 512; passes of 256, 384, 768 or one pass were slower there).
constexpr int64_t PASS_INPUTS = 512, MAX_PASS = 640;
constexpr int64_t MAX_ROWS = 48;  // rows per call of rows_of (exact_matmul.cpp's ROW_CHUNK): the carried sums' room

inline int64_t pass_inputs(int64_t K) {  // a multiple of 8
  if (K <= MAX_PASS) return K;
  const int64_t passes = (K + PASS_INPUTS - 1) / PASS_INPUTS;
  return ((K + passes - 1) / passes + 7) / 8 * 8;
}

// y[r, 2p], y[r, 2p + 1] = x[r] . w[2p], x[r] . w[2p + 1] for RB rows and NP output pairs, pair p's 2K floats
// from w + 2pK: as decoded (the two outputs' rows, K floats apart), or PAIRED (interleave_pairs: each 8 inputs of
// both outputs in one 16-float run, loaded as one register: a vector op fewer per NP x RB FMAs). One pass over the
// inputs [k0, k1): the 8-lane sums start at 0 (`first`) or from `carry` [RB][NP] (stored there by the pass before,
// exact float32 values), and are stored back there, or (`last`) reduced into y. The same FMAs in the same order
// whatever the passes and either layout: the same bits.
template <int RB, int NP, bool PAIRED>
inline void pair_block(const float* x, int64_t x_stride, const float* w, int64_t K, int64_t k0, int64_t k1,
                       __m512* carry, bool first, bool last, float* y, int64_t y_stride) {
  __m512 acc[RB][NP];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = first ? _mm512_setzero_ps() : carry[r * NP + p];
  for (int64_t k = k0; k < k1; k += 8) {
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
  if (!last) {
    for (int r = 0; r < RB; ++r)
      for (int p = 0; p < NP; ++p) carry[r * NP + p] = acc[r][p];
    return;
  }
  if constexpr (NP == 4) {  // rows two at a time (an odd last row alone), 16 sums side by side
    int r = 0;
    for (; r + 2 <= RB; r += 2) reduce_rows_2x4(acc[r], acc[r + 1], y + r * y_stride, y + (r + 1) * y_stride);
    if (r < RB) reduce_rows_2x4(acc[r], acc[r], y + r * y_stride, nullptr);
  } else {
    for (int r = 0; r < RB; ++r)
      for (int p = 0; p < NP; ++p) {
        y[r * y_stride + 2 * p] = quant::hsum(_mm512_castps512_ps256(acc[r][p]));
        y[r * y_stride + 2 * p + 1] = quant::hsum(_mm512_extractf32x8_ps(acc[r][p], 1));
      }
  }
}

// Rows [0, M) (M <= MAX_ROWS) x NP pairs over the inputs [k0, k1): blocks of 6 rows, the last 1-5 rows in one block
// (each pass of the group's weights is read for them once, not once per row); carry [M][NP].
template <int NP, bool PAIRED>
void rows_pass(const float* x, int64_t M, int64_t K, const float* w, int64_t k0, int64_t k1, __m512* carry,
               float* y, int64_t N) {
  const bool first = k0 == 0, last = k1 == K;
  int64_t m = 0;
  for (; m + 6 <= M; m += 6)
    pair_block<6, NP, PAIRED>(x + m * K, K, w, K, k0, k1, carry + m * NP, first, last, y + m * N, N);
  x += m * K;
  y += m * N;
  carry += m * NP;
  switch (M - m) {
    case 5: pair_block<5, NP, PAIRED>(x, K, w, K, k0, k1, carry, first, last, y, N); break;
    case 4: pair_block<4, NP, PAIRED>(x, K, w, K, k0, k1, carry, first, last, y, N); break;
    case 3: pair_block<3, NP, PAIRED>(x, K, w, K, k0, k1, carry, first, last, y, N); break;
    case 2: pair_block<2, NP, PAIRED>(x, K, w, K, k0, k1, carry, first, last, y, N); break;
    case 1: pair_block<1, NP, PAIRED>(x, K, w, K, k0, k1, carry, first, last, y, N); break;
    default: break;
  }
}

// Groups of 4 pairs (then single pairs) outer, passes over the inputs, then the row blocks: the group's slice of
// weights is reused by every row block from L1, and the rows stream from L2.
template <bool PAIRED>
int64_t rows_of(const float* x, int64_t M, int64_t K, const float* w, int64_t n, float* y, int64_t N) {
  TORCH_CHECK(M <= MAX_ROWS, "exact_rows: at most ", MAX_ROWS, " rows per call");
  alignas(64) __m512 carry[MAX_ROWS * 4];  // the 8-lane sums carried between passes, [M][NP]
  const int64_t pairs = n / 2, step = pass_inputs(K);
  for (int64_t p = 0; p < pairs;) {
    const bool four = p + 4 <= pairs;
    const float* wp = w + 2 * p * K;
    for (int64_t k0 = 0; k0 < K; k0 += step) {
      const int64_t k1 = std::min(K, k0 + step);
      if (four) rows_pass<4, PAIRED>(x, M, K, wp, k0, k1, carry, y + 2 * p, N);
      else rows_pass<1, PAIRED>(x, M, K, wp, k0, k1, carry, y + 2 * p, N);
    }
    p += four ? 4 : 1;
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
