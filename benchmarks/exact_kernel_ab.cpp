// The exact prompt-row kernel (layers/exact_matmul_avx512.cpp) of two source trees in one process, calls
// alternating (A, B, A, B...), so that the load of a shared machine hits both alike: built by
// benchmarks/exact_prompt_ab.py (--jobs kernel), each tree's file compiled with its namespace renamed
// (-Davx512=avx512_a / avx512_b). Per shape: random decoded weights (the decode, ~3% of a 512-row product, is
// left out), pieces of `chunk` outputs interleaved and multiplied by chunks of 48 rows as exact_matmul.cpp does;
// thread CPU time; prints "label a_best a_median b_best b_median equal" (GFLOP/s; equal: the same bits). The rows
// and the interleaved piece start on 64-byte boundaries, as the op's do (torch's tensors; exact_matmul.cpp's
// line_aligned): a std::vector's 16-byte alignment split their loads across cache lines, 5-8% slower at K = 1536.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

namespace fastdecode {
namespace avx512_a {
void interleave_pairs(const float* w, int64_t n, int64_t K, float* wi);
int64_t exact_rows_paired(const float* x, int64_t M, int64_t K, const float* wi, int64_t n, float* y, int64_t N);
}  // namespace avx512_a
namespace avx512_b {
void interleave_pairs(const float* w, int64_t n, int64_t K, float* wi);
int64_t exact_rows_paired(const float* x, int64_t M, int64_t K, const float* wi, int64_t n, float* y, int64_t N);
}  // namespace avx512_b
}  // namespace fastdecode

namespace {

using Interleave = void (*)(const float*, int64_t, int64_t, float*);
using Rows = int64_t (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t);

// `count` floats from a 64-byte boundary of `buffer`
float* line_aligned(std::vector<float>& buffer, int64_t count) {
  buffer.resize(count + 15);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
}

double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// y [M, N] = x [M, K] . w [N, K] rows, as exact_matmul.cpp walks it on one thread (N a multiple of chunk)
double product(Interleave interleave, Rows rows, const float* x, int64_t M, int64_t K, const float* w, int64_t N,
               int64_t chunk, float* y, float* wi) {
  const double start = thread_seconds();
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    interleave(w + n0 * K, chunk, K, wi);
    for (int64_t m0 = 0; m0 < M; m0 += 48)
      rows(x + m0 * K, std::min<int64_t>(48, M - m0), K, wi, chunk, y + m0 * N + n0, N);
  }
  return thread_seconds() - start;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s label K N M chunk reps\n", argv[0]);
    return 2;
  }
  const int64_t K = std::atol(argv[2]), N = std::atol(argv[3]), M = std::atol(argv[4]), chunk = std::atol(argv[5]);
  const int reps = std::atoi(argv[6]);
  std::vector<float> x_buffer, w(N * K), ya(M * N), yb(M * N), wi_buffer;
  float* x = line_aligned(x_buffer, M * K);
  float* wi = line_aligned(wi_buffer, chunk * K);
  std::srand(1);
  for (int64_t i = 0; i < M * K; ++i) x[i] = std::rand() / static_cast<float>(RAND_MAX) - 0.5f;
  for (float& v : w) v = std::rand() / static_cast<float>(RAND_MAX) - 0.5f;
  std::vector<double> a, b;
  for (int r = 0; r < reps; ++r) {
    a.push_back(product(fastdecode::avx512_a::interleave_pairs, fastdecode::avx512_a::exact_rows_paired, x, M, K, w.data(), N,
                        chunk, ya.data(), wi));
    b.push_back(product(fastdecode::avx512_b::interleave_pairs, fastdecode::avx512_b::exact_rows_paired, x, M, K, w.data(), N,
                        chunk, yb.data(), wi));
  }
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  const double gflop = 2.0 * M * N * K / 1e9;
  std::printf("%s %.1f %.1f %.1f %.1f %d\n", argv[1], gflop / a[0], gflop / a[reps / 2], gflop / b[0],
              gflop / b[reps / 2], std::memcmp(ya.data(), yb.data(), sizeof(float) * M * N) == 0);
  return 0;
}
