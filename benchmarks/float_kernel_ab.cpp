// The float kernel for several rows (layers/fmatmul_avx512.cpp) of two source trees in one process, calls alternating
// (A, B, A, B...), so that the load of a shared machine hits both alike: built by benchmarks/float_kernel_ab.py, each
// tree's file compiled with its namespace renamed (-Davx512=avx512_a / avx512_b). `copies` copies of a K x N matrix
// (random float32, as many as a model's layers: the weights stream from memory, as in a decode step), each multiplied
// by the same M rows over all its columns on one thread (as float_matmul's pieces, whole); thread CPU time; prints
// "a_best a_median b_best b_median equal" (G multiply-adds/s; equal: the same bits).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

namespace fastdecode {
namespace avx512_a {
void float_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1);
}  // namespace avx512_a
namespace avx512_b {
void float_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1);
}  // namespace avx512_b
}  // namespace fastdecode

namespace {

using Rows = void (*)(const float*, int64_t, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);

double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

double product(Rows rows, const std::vector<float>& x, int64_t M, int64_t K, const std::vector<float>& w, int64_t N,
               int copies, std::vector<float>& y) {
  const double start = thread_seconds();
  for (int c = 0; c < copies; ++c) rows(x.data(), M, K, w.data() + c * K * N, N, nullptr, y.data(), 0, N);
  return thread_seconds() - start;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s K N M copies reps\n", argv[0]);
    return 2;
  }
  const int64_t K = std::atol(argv[1]), N = std::atol(argv[2]), M = std::atol(argv[3]);
  const int copies = std::atoi(argv[4]), reps = std::atoi(argv[5]);
  std::vector<float> x(M * K), w(copies * K * N), ya(M * N), yb(M * N);
  std::srand(1);
  for (float& v : x) v = std::rand() / static_cast<float>(RAND_MAX) - 0.5f;
  for (float& v : w) v = std::rand() / static_cast<float>(RAND_MAX) - 0.5f;
  std::vector<double> a, b;
  for (int r = 0; r < reps; ++r) {
    a.push_back(product(fastdecode::avx512_a::float_rows, x, M, K, w, N, copies, ya));
    b.push_back(product(fastdecode::avx512_b::float_rows, x, M, K, w, N, copies, yb));
  }
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  const double gmacs = static_cast<double>(M) * K * N * copies / 1e9;
  std::printf("%.1f %.1f %.1f %.1f %d\n", gmacs / a[0], gmacs / a[reps / 2], gmacs / b[0], gmacs / b[reps / 2],
              std::memcmp(ya.data(), yb.data(), sizeof(float) * M * N) == 0);
  return 0;
}
