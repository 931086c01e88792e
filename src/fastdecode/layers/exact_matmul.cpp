// Prompt rows' exact products (layers/quantized.py's prompt-row role): x [M, K] float32 times the
// quantized weight's exact float32 values -> [M, N], without the whole dense matrix.
//
// The weights go through the `dequantize` op a slice of OUTPUT_CHUNK outputs at a time (the same
// float32 values as quantized.dequantize(), bit for bit) into a buffer that stays in L2, and a
// register-blocked loop multiplies them with blocks of rows: 4 rows x 3 outputs, 12 accumulators of 8 lanes
// (the last 1-3 rows in one block; AVX-512: 6 rows x 8 outputs, the last 1-5 rows in one block, the 8 outputs'
// decoded slice held in L1 while the row blocks go by, in passes of ~512 inputs for wide rows, the 8-lane sums
// carried between passes as they are),
// lane l summing the products at inputs k = l (mod 8) in increasing k with FMA, then the 8 lanes
// added by one fixed tree. So every (row, output) result is computed by the same operations in the
// same order whatever M, N, the blocking and the threads: a prompt row gets the same bits alone, in a
// batch, or in a chunk of any size. (oneDNN's GEMM on a dequantized copy did the same multiplications,
// but wrote and read that copy, 4 bytes per weight, at every prompt: 540 MB for SmolLM2-135M, most of a
// short prompt's time, and it changes kernels below 4 rows.)
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "isa.h"
#include "kscales.h"
#include "parallel.h"
#include "qrows.h"
#include "qtiles.h"

namespace fastdecode {
namespace avx512 {
// Rows [0, M) x the first n - n % 2 decoded outputs (exact_matmul_avx512.cpp: these kernels' bits, two
// outputs per register); returns that count.
int64_t exact_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t n, float* y, int64_t N);
// The first n - n % 2 decoded outputs w [n, K] as pairs wi [n / 2][K / 8][2][8] (each 8 inputs of both outputs
// side by side), and exact_rows on them (the same bits, one load per pair and 8 inputs).
void interleave_pairs(const float* w, int64_t n, int64_t K, float* wi);
int64_t exact_rows_paired(const float* x, int64_t M, int64_t K, const float* wi, int64_t n, float* y, int64_t N);
}  // namespace avx512
}  // namespace fastdecode

namespace {

constexpr int64_t OUTPUT_CHUNK = 64;  // decoded outputs per piece: 64 x K floats (147 KB at K = 576)
// Narrower products (SmolLM2's 576 and 960 outputs: 9 and 15 pieces of 64) in pieces of 32, which two threads
// share evenly (each output computed alone: the same bits).
constexpr int64_t NARROW_OUTPUTS = 1024, NARROW_CHUNK = 32;
// rows per pass over a piece (x: 48 x K floats beside it in L2); the AVX-512 kernel's most rows per call (its
// MAX_ROWS: it walks a chunk's rows once per group of 8 outputs and pass over the inputs)
constexpr int64_t ROW_CHUNK = 48;
constexpr int64_t PAIRED_MIN_ROWS = 12;  // from this many rows the AVX-512 kernel reads its piece interleaved

// A thread's reusable buffer as `count` floats from a 64-byte boundary: the AVX-512 kernel's loads of interleaved
// pairs are then whole cache lines (a vector's 16-byte alignment split them: 1-3% slower at K = 1536 on Zen 5).
float* line_aligned(std::vector<float>& buffer, int64_t count) {
  buffer.resize(count + 15);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
}

at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                      int64_t bits, int64_t group, int64_t outputs) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastdecode_kernels::dequantize", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                               int64_t, int64_t, int64_t, int64_t)>();
  return op.call(codes, scale, mins, bits, group, 1, outputs);
}

// y[r, j] = x[r] . w[j] for RB rows and NB outputs (w rows K floats apart): RB x NB accumulators, NB weight
// vectors and one row vector in the 16 registers.
template <int RB, int NB>
inline void dot_block(const float* x, int64_t x_stride, const float* w, int64_t K, float* y, int64_t y_stride) {
  __m256 acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int r = 0; r < RB; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * x_stride + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j) y[r * y_stride + j] = fastdecode::quant::hsum(acc[r][j]);
}

// rows [0, M) x the decoded outputs w [n, K] -> y[:, 0:n] (y rows N apart)
template <int RB>
inline void rows_times_outputs(const float* x, int64_t K, const float* w, int64_t n, float* y, int64_t N) {
  int64_t j = 0;
  for (; j + 3 <= n; j += 3) dot_block<RB, 3>(x, K, w + j * K, K, y + j, N);
  for (; j < n; ++j) dot_block<RB, 1>(x, K, w + j * K, K, y + j, N);
}

at::Tensor exact_qmatmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t threads,
                         int64_t outputs) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const bool tiled = codes.dim() == 3;
  const int64_t tile = tiled ? 8 : 1;  // outputs per leading index of codes / scale
  const int64_t N = tiled ? (outputs >= 0 ? outputs : scale.size(0) * 8) : scale.size(0);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 8 == 0 && K == fastdecode::quant::scale_inputs(scale, group, tiled), "x has ", K,
              " inputs, the weight another count");
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t chunk = N > NARROW_OUTPUTS ? OUTPUT_CHUNK : NARROW_CHUNK;  // a multiple of 8: whole tiles
  const int64_t pieces = (N + chunk - 1) / chunk;
  const bool wide = fastdecode::use_avx512();  // read once: the whole product on one kernel
  const bool paired = wide && M >= PAIRED_MIN_ROWS;
  // chunk_work: a prompt's product is a long job (512 x 1536 x 1792, Qwen's Q/K: 27 ms on one core) in few pieces,
  // handed out even while the helpers sleep; without it it ran on the caller alone (the same 27 ms on 2 threads)
  fastdecode::parallel_chunks(pieces, 1, threads, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> interleaved, decoded;  // (reused: a piece of K = 8960 is 2.3 MB)
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * chunk, n = std::min(chunk, N - n0);
      const int64_t lead0 = n0 / tile, lead1 = (n0 + n + tile - 1) / tile;  // chunk is a multiple of 8
      // [n, K]: a tiled weight's tiles decoded straight into this thread's buffer (the dequantize op's code and
      // bits, without its dispatch, slices and allocation: a short prompt's products are hundreds of pieces)
      at::Tensor w;
      const float* wp = nullptr;
      if (tiled) {
        float* buffer = line_aligned(decoded, n * K);
        if (fastdecode::tiled_dequantize_range(codes, scale, mins, bits, N, lead0, lead1, buffer)) wp = buffer;
      }
      if (wp == nullptr) {
        const c10::optional<at::Tensor> piece_mins =
            mins.has_value() && mins->defined() ? c10::optional<at::Tensor>(mins->slice(0, lead0, lead1)) : c10::nullopt;
        w = dequantize(codes.slice(0, lead0, lead1), scale.slice(0, lead0, lead1), piece_mins, bits, group,
                       tiled ? n : -1);
        wp = w.data_ptr<float>();
      }
      float* pairs = paired ? line_aligned(interleaved, n * K) : nullptr;
      if (paired) fastdecode::avx512::interleave_pairs(wp, n, K, pairs);
      for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
        const int64_t m1 = std::min(M, m0 + ROW_CHUNK);
        if (wide) {  // AVX-512: the same bits, two outputs per register; an odd last output here
          const int64_t done =
              paired ? fastdecode::avx512::exact_rows_paired(xp + m0 * K, m1 - m0, K, pairs, n, yp + m0 * N + n0, N)
                     : fastdecode::avx512::exact_rows(xp + m0 * K, m1 - m0, K, wp, n, yp + m0 * N + n0, N);
          if (done < n)
            for (int64_t m = m0; m < m1; ++m) dot_block<1, 1>(xp + m * K, K, wp + done * K, K, yp + m * N + n0 + done, N);
          continue;
        }
        int64_t m = m0;
        for (; m + 4 <= m1; m += 4) rows_times_outputs<4>(xp + m * K, K, wp, n, yp + m * N + n0, N);
        if (m1 - m == 3) rows_times_outputs<3>(xp + m * K, K, wp, n, yp + m * N + n0, N);  // the last rows in one block
        if (m1 - m == 2) rows_times_outputs<2>(xp + m * K, K, wp, n, yp + m * N + n0, N);
        if (m1 - m == 1) rows_times_outputs<1>(xp + m * K, K, wp, n, yp + m * N + n0, N);
      }
    }
  }, M * K * chunk);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("exact_qmatmul(Tensor x, Tensor codes, Tensor scale, Tensor? mins, int bits, int group, int threads, "
        "int outputs=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("exact_qmatmul", &exact_qmatmul); }
