// float_matmul for several rows with AVX-512 (fmatmul.h): the same operations per output as fmatmul.cpp's
// AVX2 kernel, in another order across outputs.
//
// The AVX2 kernel keeps its sums in L1 and loads and stores them at every 4 inputs (a decode step of 8 to
// 32 rows is compute-bound there: ~20 memory operations per 32 multiply-adds). Here a pass holds 8 rows x
// 48 columns of one segment's sums in 24 registers while the segment's 64 rows of w stream by (3 loads and
// 8 broadcasts per 24 multiply-adds), then adds them to the running totals (in y, once per segment). The
// passes go along a thread's whole column range segment by segment, so each row of w is read in one run
// of the range (a beam step's logits layer: 5 rows x 51865 columns), not 48 columns at a time. Each
// output's arithmetic is the contract's: one FMA chain per segment from 0 in k order, the segment sums
// added in order, then the bias, so a row's bits depend neither on the other rows nor on the ISA.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "fmatmul.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

namespace fastdecode {
namespace avx512 {
namespace {

constexpr int NV = 3;  // vectors of 16 columns per pass
constexpr int64_t WIDTH = 16 * NV;
// Each pass prefetches the columns of the pass this many later, wrapping into the next segment's rows at the
// end of the range (a range of 2 passes, a 768-column matrix's, used to prefetch only in its first, and none
// for the next segment's first). One pass ahead left a decode step's products memory-latency bound on a
// loaded 2-core Xeon (8 rows, one thread, medians: bart-base's 768 x 50265 logits layer 56 -> 36 ms,
// 768 x 3072 5.5 -> 1.6 ms, 768 x 2304 1.9 -> 1.2 ms, 3072 x 768 6.0 -> 2.3 ms with 2 passes ahead; 3 or
// 4 ahead no better): a distance in passes, each some hundreds of cycles of FMAs whatever the CPU.
constexpr int64_t PASSES_AHEAD = 2;

// 16 weights as float32 (the lanes of `mask` only, 0 elsewhere, when not `full`): float32 as they are, float16
// (IEEE half bits) widened, exactly.
inline __m512 load16(const float* p, bool full, __mmask16 mask) {
  return full ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask, p);
}
inline __m512 load16(const uint16_t* p, bool full, __mmask16 mask) {
  return _mm512_cvtph_ps(full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(mask, p));
}

// One segment [s0, s1) of rows [m0, m0 + RB) x columns [n, n + width) (width <= WIDTH; lanes past it masked
// off): the segment's sums (one FMA chain per output from 0, in k order) stored into y as the running total
// (the first segment) or added to it. Prefetches the WIDTH columns `ahead` elements past each row k it reads
// while k < `ahead_until` (a later pass's: PASSES_AHEAD in `rows`; ahead_until <= s0: none).
template <int RB, typename W>
void tile_segment(const float* x, int64_t K, const W* w, int64_t N, float* y, int64_t m0, int64_t n, int64_t width,
                  int64_t s0, int64_t s1, int64_t ahead_until, int64_t ahead) {
  __mmask16 mask[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t valid = std::clamp<int64_t>(width - 16 * v, 0, 16);
    mask[v] = static_cast<__mmask16>(valid == 16 ? 0xFFFF : (1u << valid) - 1);
  }
  const bool full = width == WIDTH;
  __m512 acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = s0; k < s1; ++k) {
    const W* wk = w + k * N + n;
    if (k < ahead_until)  // a later pass's WIDTH columns (PASSES_AHEAD): the rows of w stream in runs along the chunk
      for (int64_t byte = 0; byte < WIDTH * static_cast<int64_t>(sizeof(W)); byte += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wk + ahead) + byte, _MM_HINT_T0);
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load16(wk + 16 * v, full, mask[v]);
    for (int r = 0; r < RB; ++r) {
      const __m512 xb = _mm512_set1_ps(x[(m0 + r) * K + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) {
      float* t = y + (m0 + r) * N + n + 16 * v;
      const __m512 sum = s0 == 0 ? acc[r][v] : _mm512_add_ps(_mm512_maskz_loadu_ps(mask[v], t), acc[r][v]);
      _mm512_mask_storeu_ps(t, mask[v], sum);
    }
}

// Columns [n0, n1), every row: segment after segment, each over the whole range 48 columns at a time (so each
// row of w is read in one run of the range per segment, not 48 columns at a time down all K rows: a wide
// matrix, a logits layer of 51865 columns, streams at memory speed), row groups of 8, 4, 2, 1 per pass; the
// running totals in y, then the bias.
template <typename W>
void rows(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* bias, float* y, int64_t n0,
          int64_t n1) {
  const int64_t passes = (n1 - n0 + WIDTH - 1) / WIDTH;  // per segment
  for (int64_t s0 = 0; s0 < K; s0 += FLOAT_SEGMENT) {
    const int64_t s1 = std::min(K, s0 + FLOAT_SEGMENT);
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t n = n0 + p * WIDTH, width = std::min(WIDTH, n1 - n);
      // the pass PASSES_AHEAD later in this order (segment after segment, passes along the range in each), in
      // a later segment's rows past the range's last pass: its columns are in flight by the time it runs
      const int64_t later = p + PASSES_AHEAD, rows_down = later / passes * FLOAT_SEGMENT;
      const int64_t ahead = rows_down * N + (later % passes - p) * WIDTH, until = K - rows_down;
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) tile_segment<8>(x, K, w, N, y, m, n, width, s0, s1, m == 0 ? until : 0, ahead);
      for (; m + 4 <= M; m += 4) tile_segment<4>(x, K, w, N, y, m, n, width, s0, s1, m == 0 ? until : 0, ahead);
      for (; m + 2 <= M; m += 2) tile_segment<2>(x, K, w, N, y, m, n, width, s0, s1, m == 0 ? until : 0, ahead);
      for (; m < M; ++m) tile_segment<1>(x, K, w, N, y, m, n, width, s0, s1, m == 0 ? until : 0, ahead);
    }
  }
  if (bias == nullptr) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; n += 16) {
      const int64_t valid = std::min<int64_t>(16, n1 - n);
      const __mmask16 mask = static_cast<__mmask16>(valid == 16 ? 0xFFFF : (1u << valid) - 1);
      float* t = y + m * N + n;
      _mm512_mask_storeu_ps(t, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, t), _mm512_maskz_loadu_ps(mask, bias + n)));
    }
}

}  // namespace

void float_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1) {
  rows(x, M, K, w, N, bias, y, n0, n1);
}

void float_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1) {
  rows(x, M, K, w, N, bias, y, n0, n1);
}

}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
