// float_matmul: float32 products for generated (decode) rows, y [M, N] = x [M, K] @ w [K, N] (+ bias),
// on the canonical [in, out] buffers the models hold (read in place: no copy, no repacked layout).
//
// Why: a decode step's products are a few rows against the whole matrix, memory-bound. oneDNN's GEMM
// runs them well on one thread, but splitting them over OpenMP threads makes the step wait at a
// barrier for a busy core (layers/threads.py), so they ran on one thread and left the second core's
// memory bandwidth unused. Here the work is cut into pieces that the kernel thread pool (parallel.h)
// hands out, so helpers take part only while they have a core. Every weight is read once per call:
// - one row (batch 1): pieces are segments of SEGMENT rows of w, whole rows wide, so a thread's claim is
//   one sequential stream of memory, read row after row (the SmolLM2-135M float32 step's products:
//   45 GB/s on two threads, against 34 GB/s when the columns were split and each thread read short runs
//   of every row; 29 against 25 GB/s on one thread);
// - several rows: pieces are blocks of columns; each streams the rows of w (runs of its columns, 4 rows
//   at a time) past accumulators kept in cache, for up to 8 rows at a time; with AVX-512
//   (fmatmul_avx512.cpp), 8 rows x 48 columns of sums in registers per pass over a segment.
//
// Arithmetic: each output sums its inputs in segments of SEGMENT (k = 0..63, 64..127, ...), each segment
// one chain of fused multiply-adds in k order starting at 0; then the segment sums are added in order
// (((s0 + s1) + s2) + ...) and bias[n] (one rounding each). Every (row, column) gets exactly these
// operations whatever M is, however rows are grouped (8, 4, 2 or 1 at a time), whichever piece a segment
// or column falls in and however the pieces are split between threads or masked at the tail, so a row's
// result never depends on the other rows of its product (batch composition) nor on the thread count.
// It differs from a blocked GEMM only by summation order (error ~ K * 2^-24 relative).
//
// The weight may be held in float16 (a float32 model's matrix whose every value is a float16 value, as the
// float16 checkpoints of CTranslate2's Whisper: models/whisper.py): each element is widened to its float32
// value as it is loaded (exact), then takes the same operations, so the result equals the float32 buffer's
// bit for bit while a step streams half the bytes.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fmatmul.h"
#include "isa.h"
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
constexpr int64_t SEGMENT = FLOAT_SEGMENT;  // inputs per partial sum (the arithmetic: see the top)
constexpr int64_t SEQUENTIAL_COLUMNS = 8192;  // one row: rows of w up to this wide are read one after another
// Rows of w prefetched ahead of the ones being read, with several rows per pass (compute keeps the
// hardware prefetcher behind; with one row software prefetches only slowed it down).
constexpr int64_t PREFETCH_ROWS = 8;

inline __m256i lanes_below(int64_t valid) {  // lane i set where i < valid
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 weights as float32: a float32 buffer's as they are, a float16 buffer's widened (exact). The masked loads
// read the first `valid` (= the lanes of `mask`) and give 0 in the other lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8_masked(const float* p, __m256i mask, int64_t) { return _mm256_maskload_ps(p, mask); }
inline __m256 load8_masked(const at::Half* p, __m256i, int64_t valid) {
  alignas(16) at::Half part[8] = {};
  std::memcpy(part, p, valid * sizeof(at::Half));
  return load8(part);
}

// acc[r][c] += sum over k in [k0, k0 + KS) of x[m0 + r, k] * w[k, n + c] (c < 8 * vectors), one fused
// multiply-add per k in order; the last vector masked to `mask` (its first `tail` lanes) when `masked`.
template <int RB, int KS, typename W>
void rows_pass(const float* x, int64_t K, const W* w, int64_t N, int64_t m0, int64_t k0, int64_t n, int64_t stride,
               int64_t vectors, bool masked, __m256i mask, int64_t tail, float* acc) {
  const int64_t ahead = RB == 1 ? 0 : std::min<int64_t>(PREFETCH_ROWS, K - k0 - KS);  // rows to prefetch past these (none at the end)
  const W* next = w + (k0 + ahead) * N + n;
  __m256 xs[RB][KS];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < KS; ++j) xs[r][j] = _mm256_broadcast_ss(x + (m0 + r) * K + k0 + j);
  const W* wk = w + k0 * N + n;
  for (int64_t v = 0; v < vectors; ++v) {
    if (ahead > 0 && v % 2 == 0)  // one line of each of the KS rows PREFETCH_ROWS further down
      for (int j = 0; j < KS; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * N + 8 * v), _MM_HINT_T0);
    __m256 wv[KS];
    if (masked && v == vectors - 1) {
      for (int j = 0; j < KS; ++j) wv[j] = load8_masked(wk + j * N + 8 * v, mask, tail);
    } else {
      for (int j = 0; j < KS; ++j) wv[j] = load8(wk + j * N + 8 * v);
    }
    for (int r = 0; r < RB; ++r) {
      float* a = acc + r * stride + 8 * v;
      __m256 sum = _mm256_load_ps(a);
      for (int j = 0; j < KS; ++j) sum = _mm256_fmadd_ps(xs[r][j], wv[j], sum);
      _mm256_store_ps(a, sum);
    }
  }
}

// Rows [m0, m0 + RB) x columns [n, n + width) over the inputs [k0, k1) (k0 a multiple of SEGMENT), RB * width
// <= the accumulators (width a multiple of 8 but at the end), into out[(m0 + r) * N + n ...] (+ bias when
// given): each segment of SEGMENT inputs summed from 0, the segment sums added in order. One row streams the
// rows of w one after another (`sequential`: one long read, measured faster than 4 rows at a time for rows
// of up to SEQUENTIAL_COLUMNS), several rows take 4 rows of w per pass (fewer accumulator loads).
template <int RB, typename W>
void block(const float* x, int64_t K, const W* w, int64_t N, int64_t k0, int64_t k1, const float* bias,
           float* out, int64_t m0, int64_t n, int64_t width, bool sequential) {
  constexpr int64_t SIZE = RB == 1 ? ONE_ROW_ACCUMULATORS : ACCUMULATORS;
  alignas(32) float total[SIZE];  // [RB, stride]: the first segment's sums, then the running total
  alignas(32) float acc[SIZE];  // a later segment's sums
  const int64_t vectors = (width + 7) / 8, stride = 8 * vectors;
  const bool masked = width % 8 != 0;
  const __m256i mask = lanes_below(width % 8);
  for (int64_t s0 = k0; s0 < k1; s0 += SEGMENT) {
    const int64_t s1 = std::min(k1, s0 + SEGMENT);
    float* sums = s0 == k0 ? total : acc;
    for (int r = 0; r < RB; ++r)
      for (int64_t v = 0; v < vectors; ++v) _mm256_store_ps(sums + r * stride + 8 * v, _mm256_setzero_ps());
    int64_t k = s0;
    if (!sequential)
      for (; k + 4 <= s1; k += 4) rows_pass<RB, 4>(x, K, w, N, m0, k, n, stride, vectors, masked, mask, width % 8, sums);
    for (; k < s1; ++k) rows_pass<RB, 1>(x, K, w, N, m0, k, n, stride, vectors, masked, mask, width % 8, sums);
    if (s0 != k0)
      for (int64_t i = 0; i < RB * stride; i += 8)
        _mm256_store_ps(total + i, _mm256_add_ps(_mm256_load_ps(total + i), _mm256_load_ps(acc + i)));
  }
  for (int r = 0; r < RB; ++r) {
    float* row = out + (m0 + r) * N + n;
    for (int64_t v = 0; v < vectors; ++v) {
      const bool partial = masked && v == vectors - 1;
      __m256 sum = _mm256_load_ps(total + r * stride + 8 * v);
      if (bias != nullptr)
        sum = _mm256_add_ps(sum, partial ? _mm256_maskload_ps(bias + n + 8 * v, mask) : _mm256_loadu_ps(bias + n + 8 * v));
      if (partial) _mm256_maskstore_ps(row + 8 * v, mask, sum);
      else _mm256_storeu_ps(row + 8 * v, sum);
    }
  }
}

template <typename W>
void columns(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t k0, int64_t k1,
             const float* bias, float* out, int64_t n0, int64_t n1) {
  // a multiple of 8: aligned accumulator rows (the one-row blocks of M > 1 use the narrower width too)
  const int64_t widest = M == 1 ? ONE_ROW_ACCUMULATORS : ACCUMULATORS / std::min<int64_t>(M, MAX_ROWS) / 8 * 8;
  for (int64_t n = n0; n < n1; n += widest) {
    const int64_t width = std::min(widest, n1 - n);
    const bool sequential = width <= SEQUENTIAL_COLUMNS;
    int64_t m = 0;
    static_assert(MAX_ROWS == 8, "the row groups below");
    for (; m + 8 <= M; m += 8) block<8>(x, K, w, N, k0, k1, bias, out, m, n, width, false);
    for (; m + 4 <= M; m += 4) block<4>(x, K, w, N, k0, k1, bias, out, m, n, width, false);
    for (; m + 2 <= M; m += 2) block<2>(x, K, w, N, k0, k1, bias, out, m, n, width, false);
    for (; m < M; ++m) block<1>(x, K, w, N, k0, k1, bias, out, m, n, width, sequential);
  }
}

// avx512::float_rows for either weight element (fmatmul.h)
void rows_avx512(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y,
                 int64_t n0, int64_t n1, InPlaceRows limits) {
  avx512::float_rows(x, M, K, w, N, bias, y, n0, n1, limits);
}
void rows_avx512(const float* x, int64_t M, int64_t K, const at::Half* w, int64_t N, const float* bias, float* y,
                 int64_t n0, int64_t n1, InPlaceRows limits) {
  avx512::float_rows(x, M, K, reinterpret_cast<const uint16_t*>(w), N, bias, y, n0, n1, limits);
}

// y [M, N] = x [M, K] @ w [K, N] (+ bias), w float32 or float16 (W): the pieces below, on `threads`; `limits`: the
// AVX-512 kernel's rows read in place (fmatmul.h; speed only, the same bits).
template <typename W>
void multiply(const float* xp, int64_t M, int64_t K, const W* wp, int64_t N, const float* bp, float* yp,
              int64_t threads, InPlaceRows limits, const at::TensorOptions& options) {
  const int64_t segments = (K + SEGMENT - 1) / SEGMENT;
  if (M == 1 && segments > 1) {
    // One row (memory-bound): pieces of whole rows of w, (segment, block of up to ONE_ROW_ACCUMULATORS columns),
    // segments inner, so that a thread's claim is consecutive rows, read as one stream; each piece's sums go to
    // its segment's partial row. The partial rows are added into y in segment order (((0 + 1) + 2) ... + bias: the
    // same additions as block's) while the pieces run, not in a serial pass after them: the thread that finishes a
    // piece adds every finished row next in order, its own still in cache (add_ready).
    const int64_t width = ONE_ROW_ACCUMULATORS, blocks = (N + width - 1) / width;
    at::Tensor partial = at::empty({segments, N}, options);
    float* pp = partial.data_ptr<float>();
    std::vector<std::atomic<bool>> ready(segments * blocks);  // [blocks, segments]: the piece's partial row is written
    std::vector<std::atomic<bool>> adding(blocks);  // per block: a thread is adding its rows into y
    std::vector<int64_t> added(blocks, 0);  // per block: segments added so far (written under its `adding`)
    for (auto& r : ready) r.store(false, std::memory_order_relaxed);
    for (auto& a : adding) a.store(false, std::memory_order_relaxed);
    // Block b's finished rows, next in order, added into y by one thread at a time (the one holding adding[b]). A
    // thread that finds the block held leaves its row to the holder, which looks again after letting go: every
    // row is added by the time the last piece's body returns (sequentially consistent flags: no row is missed).
    auto add_ready = [&](int64_t b) {
      const int64_t n0 = b * width, n1 = std::min(N, n0 + width);
      for (;;) {
        if (adding[b].exchange(true, std::memory_order_seq_cst)) return;  // held: the holder adds our row
        int64_t s = added[b];
        for (; s < segments && ready[b * segments + s].load(std::memory_order_seq_cst); ++s) {
          const bool last = s == segments - 1;
          for (int64_t n = n0; n < n1; n += 8) {
            const int64_t valid = std::min<int64_t>(8, n1 - n);
            const __m256i lanes = lanes_below(valid);
            auto load = [&](const float* p) { return valid == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes); };
            __m256 sum = load(pp + s * N + n);
            if (s > 0) sum = _mm256_add_ps(load(yp + n), sum);
            if (last && bp != nullptr) sum = _mm256_add_ps(sum, load(bp + n));
            if (valid == 8) _mm256_storeu_ps(yp + n, sum);
            else _mm256_maskstore_ps(yp + n, lanes, sum);
          }
        }
        added[b] = s;
        adding[b].store(false, std::memory_order_seq_cst);
        // the next row finished while we held the block: its thread left it to us
        if (s == segments || !ready[b * segments + s].load(std::memory_order_seq_cst)) return;
      }
    };
    parallel_chunks(segments * blocks, 1, threads, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t s = p % segments, b = p / segments;
        columns(xp, 1, K, wp, N, s * SEGMENT, std::min(K, (s + 1) * SEGMENT), nullptr, pp + s * N, b * width,
                std::min(N, (b + 1) * width));
        ready[p].store(true, std::memory_order_seq_cst);
        add_ready(b);
      }
    });
    return;
  }
  if (use_avx512()) {  // several rows, sums in registers (fmatmul_avx512.cpp): chunks of 48-column passes, up to
    // 1536 columns (each segment reads runs of a chunk's width from each row of w); past 64 rows (a prompt) chunks of
    // one pass, each already long (256 x 576 x 48 multiply-adds), so that two threads end together (a 960-wide
    // product in 7 chunks of 144 columns split 4 : 3)
    const int64_t chunk = M > MAX_IN_PLACE_ROWS ? 48 : std::clamp<int64_t>((N / 8 + 47) / 48 * 48, 48, 1536);
    parallel_chunks(N, chunk, threads,
                    [&](int64_t n0, int64_t n1) { rows_avx512(xp, M, K, wp, N, bp, yp, n0, n1, limits); },
                    M * K * chunk);  // a long job (16 rows x 576 x 3072) is handed out even while the helpers sleep
    return;
  }
  // Several rows: columns per claimed chunk, an eighth of N in multiples of 64 (runs of >= 256 bytes per row
  // of w), at most 512; each chunk sums its segments itself.
  const int64_t chunk = std::clamp<int64_t>((N / 8 + 63) / 64 * 64, 64, 512);
  parallel_chunks(N, chunk, threads, [&](int64_t n0, int64_t n1) {
    columns(xp, M, K, wp, N, 0, K, bp, yp, n0, n1);
  });
}

at::Tensor float_matmul(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        int64_t threads, int64_t in_place_rows, int64_t aliased_in_place_rows) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.scalar_type() == at::kFloat &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kHalf),
              "float_matmul takes float32 x [M, K] and a float32 or float16 weight [K, N]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "float_matmul needs contiguous x and weight [K, N]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(1);
  TORCH_CHECK(weight.size(0) == K, "x has ", K, " inputs, the weight ", weight.size(0));
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be float32 [", N, "]");
  for (const int64_t limit : {in_place_rows, aliased_in_place_rows})
    TORCH_CHECK(limit >= 8 && limit <= MAX_IN_PLACE_ROWS, "float_matmul's rows read in place must be 8 to ",
                MAX_IN_PLACE_ROWS, ", got ", limit);
  const InPlaceRows limits{in_place_rows, aliased_in_place_rows};
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (weight.scalar_type() == at::kHalf)
    multiply(xp, M, K, weight.data_ptr<at::Half>(), N, bp, yp, threads, limits, x.options());
  else
    multiply(xp, M, K, weight.data_ptr<float>(), N, bp, yp, threads, limits, x.options());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("float_matmul(Tensor x, Tensor weight, Tensor? bias, int threads, int in_place_rows, "
        "int aliased_in_place_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("float_matmul", &float_matmul); }

}  // namespace fastdecode
