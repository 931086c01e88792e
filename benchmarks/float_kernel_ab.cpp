// The float kernel for several rows (layers/fmatmul_avx512.cpp) of two source trees in one process, calls alternating
// (A, B, A, B...), so that the load of a shared machine hits both alike: built by benchmarks/float_kernel_ab.py, each
// tree's file compiled with its namespace renamed (-Davx512=avx512_a / avx512_b). `copies` copies of a K x N matrix
// (random float32, as many as a model's layers: the weights stream from memory, as in a decode step), each multiplied
// by the same M rows over all its columns on one thread, `chunk` columns per call (float_matmul's pieces, whole: a
// thread's claim); thread CPU time; prints
// "a_best a_median b_best b_median equal" (G multiply-adds/s; equal: the same bits).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
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
               int64_t copies, int64_t chunk, std::vector<float>& y) {
  const double start = thread_seconds();
  for (int64_t c = 0; c < copies; ++c)
    for (int64_t n0 = 0; n0 < N; n0 += chunk)
      rows(x.data(), M, K, w.data() + c * K * N, N, nullptr, y.data(), n0, std::min(N, n0 + chunk));
  return thread_seconds() - start;
}

}  // namespace

// count floats uniform in [-0.5, 0.5), the same for a seed
std::vector<float> uniform(int64_t count, unsigned seed) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> value(-0.5f, 0.5f);
  std::vector<float> out(count);
  for (float& v : out) v = value(generator);
  return out;
}

int main(int argc, char** argv) {
  int64_t arg[6];  // K N M copies reps chunk
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s K N M copies reps chunk\n", argv[0]);
    return 2;
  }
  for (int i = 0; i < 6; ++i) arg[i] = std::atol(argv[i + 1]);
  const auto [K, N, M, copies, reps, chunk] = arg;
  const std::vector<float> x = uniform(M * K, 1), w = uniform(copies * K * N, 2);
  std::vector<float> ya(M * N), yb(M * N);
  std::vector<double> a, b;  // seconds per call, each tree's
  for (int64_t r = 0; r < reps; ++r) {
    a.push_back(product(fastdecode::avx512_a::float_rows, x, M, K, w, N, copies, chunk, ya));
    b.push_back(product(fastdecode::avx512_b::float_rows, x, M, K, w, N, copies, chunk, yb));
  }
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  const double gmacs = static_cast<double>(M) * K * N * copies / 1e9;
  std::printf("%.1f %.1f %.1f %.1f %d\n", gmacs / a[0], gmacs / a[reps / 2], gmacs / b[0], gmacs / b[reps / 2],
              std::memcmp(ya.data(), yb.data(), sizeof(float) * M * N) == 0);
  return 0;
}
