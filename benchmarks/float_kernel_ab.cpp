// The float kernel for several rows (layers/fmatmul_avx512.cpp) of two source trees in one process, calls alternating
// (A, B, A, B...), so that the load of a shared machine hits both alike: built by benchmarks/float_kernel_ab.py, each
// tree's file compiled with its namespace renamed (-Davx512=avx512_a / avx512_b). `copies` copies of a K x N matrix
// (random float32, as many as a model's layers: the weights stream from memory, as in a decode step; `half` 1: held
// in float16, as Whisper's decoder products are, each value rounded to its float16) each multiplied by the same M rows
// over all its columns on one thread, `chunk` columns per call (float_matmul's pieces, whole: a thread's claim);
// thread CPU time; prints "a_best a_median b_best b_median equal" (G multiply-adds/s; equal: the same bits).
#include <immintrin.h>

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
void float_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1);
}  // namespace avx512_a
namespace avx512_b {
void float_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1);
void float_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1);
}  // namespace avx512_b
}  // namespace fastdecode

namespace {

template <typename W>
using Rows = void (*)(const float*, int64_t, int64_t, const W*, int64_t, const float*, float*, int64_t, int64_t);

double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

template <typename W>
double product(Rows<W> rows, const std::vector<float>& x, int64_t M, int64_t K, const std::vector<W>& w, int64_t N,
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

// floats -> their float16 bits (round to nearest even)
std::vector<uint16_t> halves(const std::vector<float>& values) {
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = _cvtss_sh(values[i], _MM_FROUND_TO_NEAREST_INT);
  return out;
}

// Each tree's kernel on `copies` K x N matrices of W, calls alternating: seconds per rep, sorted; ya/yb the last outputs
template <typename W>
void time_trees(const std::vector<float>& x, int64_t M, int64_t K, const std::vector<W>& w, int64_t N, int64_t copies,
                int64_t reps, int64_t chunk, std::vector<float>& ya, std::vector<float>& yb, std::vector<double>& a,
                std::vector<double>& b) {
  for (int64_t r = 0; r < reps; ++r) {
    a.push_back(product<W>(fastdecode::avx512_a::float_rows, x, M, K, w, N, copies, chunk, ya));
    b.push_back(product<W>(fastdecode::avx512_b::float_rows, x, M, K, w, N, copies, chunk, yb));
  }
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
}

int main(int argc, char** argv) {
  int64_t arg[7];  // K N M copies reps chunk half
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s K N M copies reps chunk half\n", argv[0]);
    return 2;
  }
  for (int i = 0; i < 7; ++i) arg[i] = std::atol(argv[i + 1]);
  const auto [K, N, M, copies, reps, chunk, half] = arg;
  const std::vector<float> x = uniform(M * K, 1), w = uniform(copies * K * N, 2);
  std::vector<float> ya(M * N), yb(M * N);
  std::vector<double> a, b;  // seconds per call, each tree's
  if (half != 0) time_trees(x, M, K, halves(w), N, copies, reps, chunk, ya, yb, a, b);
  else time_trees(x, M, K, w, N, copies, reps, chunk, ya, yb, a, b);
  const double gmacs = static_cast<double>(M) * K * N * copies / 1e9;
  std::printf("%.1f %.1f %.1f %.1f %d\n", gmacs / a[0], gmacs / a[reps / 2], gmacs / b[0], gmacs / b[reps / 2],
              std::memcmp(ya.data(), yb.data(), sizeof(float) * M * N) == 0);
  return 0;
}
