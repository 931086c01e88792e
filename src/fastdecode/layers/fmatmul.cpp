// float_matmul: float32 products for generated (decode) rows, y [M, N] = x [M, K] @ w [K, N] (+ bias),
// on the canonical [in, out] buffers the models hold (read in place: no copy, no repacked layout).
//
// Why: a decode step's products are a few rows against the whole matrix, memory-bound. oneDNN's GEMM
// runs them well on one thread, but splitting them over OpenMP threads makes the step wait at a
// barrier for a busy core (layers/threads.py), so they ran on one thread and left the second core's
// memory bandwidth unused. Here the columns are cut into chunks that the kernel thread pool (parallel.h)
// hands out, so helpers take part only while they have a core. Each chunk streams the rows of w (runs of
// its columns, k in order) past accumulators kept in cache: every weight is read once per call, in long
// sequential runs, and for up to 8 rows at a time.
//
// Arithmetic: each output is one chain of fused multiply-adds over k = 0 .. K-1 in order, starting at
// 0, then + bias[n] (one rounding). Every (row, column) gets exactly these operations whatever M is,
// however rows are grouped (8, 4, 2 or 1 at a time, to load each weight vector once for several rows)
// and however columns are split between threads or masked at the tail, so a row's result never
// depends on the other rows of its product (batch composition) nor on the thread count.
// It differs from a blocked GEMM only by summation order (error ~ K * 2^-24 relative).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "parallel.h"

namespace fastdecode {
namespace {

// Accumulators of one pass (rows x columns), in L1 while the rows of w stream past: 512 columns at 8 rows.
// One row (batch 1, memory-bound) takes far longer runs of each row of w (accumulators in L2): the hardware
// prefetcher then streams w at its best (measured on one loaded core: 5.7 ms for the 576 x 49152 logits
// layer with runs of 49152 columns, 6.1 ms with 16384, 7.8 ms with 512; oneDNN's GEMM 5.4-6.1 ms).
constexpr int64_t ACCUMULATORS = 4096;
constexpr int64_t ONE_ROW_ACCUMULATORS = 32768;
constexpr int MAX_ROWS = 8;  // rows of x per pass over the weights
// Rows of w prefetched ahead of the ones being read, with several rows per pass (compute keeps the
// hardware prefetcher behind; with one row software prefetches only slowed it down).
constexpr int64_t PREFETCH_ROWS = 8;

inline __m256i lanes_below(int64_t valid) {  // lane i set where i < valid
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// acc[r][c] += sum over k in [k0, k0 + KS) of x[m0 + r, k] * w[k, n + c] (c < 8 * vectors), one fused
// multiply-add per k in order; the last vector masked to `mask` when `masked`.
template <int RB, int KS>
void rows_pass(const float* x, int64_t K, const float* w, int64_t N, int64_t m0, int64_t k0, int64_t n, int64_t stride,
               int64_t vectors, bool masked, __m256i mask, float* acc) {
  const int64_t ahead = RB == 1 ? 0 : std::min<int64_t>(PREFETCH_ROWS, K - k0 - KS);  // rows to prefetch past these (none at the end)
  const float* next = w + (k0 + ahead) * N + n;
  __m256 xs[RB][KS];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < KS; ++j) xs[r][j] = _mm256_broadcast_ss(x + (m0 + r) * K + k0 + j);
  const float* wk = w + k0 * N + n;
  for (int64_t v = 0; v < vectors; ++v) {
    if (ahead > 0 && v % 2 == 0)  // one line of each of the KS rows PREFETCH_ROWS further down
      for (int j = 0; j < KS; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * N + 8 * v), _MM_HINT_T0);
    __m256 wv[KS];
    if (masked && v == vectors - 1) {
      for (int j = 0; j < KS; ++j) wv[j] = _mm256_maskload_ps(wk + j * N + 8 * v, mask);
    } else {
      for (int j = 0; j < KS; ++j) wv[j] = _mm256_loadu_ps(wk + j * N + 8 * v);
    }
    for (int r = 0; r < RB; ++r) {
      float* a = acc + r * stride + 8 * v;
      __m256 sum = _mm256_load_ps(a);
      for (int j = 0; j < KS; ++j) sum = _mm256_fmadd_ps(xs[r][j], wv[j], sum);
      _mm256_store_ps(a, sum);
    }
  }
}

// Rows [m0, m0 + RB) x columns [n, n + width), RB * width <= the accumulators (width a multiple of 8 but at the end).
template <int RB>
void block(const float* x, int64_t K, const float* w, int64_t N, const float* bias, float* y, int64_t m0, int64_t n,
           int64_t width) {
  alignas(32) float acc[RB == 1 ? ONE_ROW_ACCUMULATORS : ACCUMULATORS];  // [RB, stride]
  const int64_t vectors = (width + 7) / 8, stride = 8 * vectors;
  const bool masked = width % 8 != 0;
  const __m256i mask = lanes_below(width % 8);
  for (int r = 0; r < RB; ++r)
    for (int64_t v = 0; v < vectors; ++v) _mm256_store_ps(acc + r * stride + 8 * v, _mm256_setzero_ps());
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) rows_pass<RB, 4>(x, K, w, N, m0, k, n, stride, vectors, masked, mask, acc);
  for (; k < K; ++k) rows_pass<RB, 1>(x, K, w, N, m0, k, n, stride, vectors, masked, mask, acc);
  for (int r = 0; r < RB; ++r) {
    float* out = y + (m0 + r) * N + n;
    for (int64_t v = 0; v < vectors; ++v) {
      const bool partial = masked && v == vectors - 1;
      __m256 sum = _mm256_load_ps(acc + r * stride + 8 * v);
      if (bias != nullptr)
        sum = _mm256_add_ps(sum, partial ? _mm256_maskload_ps(bias + n + 8 * v, mask) : _mm256_loadu_ps(bias + n + 8 * v));
      if (partial) _mm256_maskstore_ps(out + 8 * v, mask, sum);
      else _mm256_storeu_ps(out + 8 * v, sum);
    }
  }
}

void columns(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y,
             int64_t n0, int64_t n1) {
  // a multiple of 8: aligned accumulator rows (the one-row blocks of M > 1 use the narrower width too)
  const int64_t widest = M == 1 ? ONE_ROW_ACCUMULATORS : ACCUMULATORS / std::min<int64_t>(M, MAX_ROWS) / 8 * 8;
  for (int64_t n = n0; n < n1; n += widest) {
    const int64_t width = std::min(widest, n1 - n);
    int64_t m = 0;
    static_assert(MAX_ROWS == 8, "the row groups below");
    for (; m + 8 <= M; m += 8) block<8>(x, K, w, N, bias, y, m, n, width);
    for (; m + 4 <= M; m += 4) block<4>(x, K, w, N, bias, y, m, n, width);
    for (; m + 2 <= M; m += 2) block<2>(x, K, w, N, bias, y, m, n, width);
    for (; m < M; ++m) block<1>(x, K, w, N, bias, y, m, n, width);
  }
}

at::Tensor float_matmul(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        int64_t threads) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "float_matmul takes float32 x [M, K] and weight [K, N]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "float_matmul needs contiguous x and weight [K, N]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(1);
  TORCH_CHECK(weight.size(0) == K, "x has ", K, " inputs, the weight ", weight.size(0));
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be float32 [", N, "]");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Columns per claimed chunk: an eighth of N in multiples of 64 (runs of >= 256 bytes per row of w), at most 512.
  const int64_t chunk = std::clamp<int64_t>((N / 8 + 63) / 64 * 64, 64, 512);
  parallel_chunks(N, chunk, threads, [&](int64_t n0, int64_t n1) {
    columns(xp, M, K, wp, N, bp, yp, n0, n1);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("float_matmul(Tensor x, Tensor weight, Tensor? bias, int threads) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("float_matmul", &float_matmul); }

}  // namespace fastdecode
