// A batch-1 decode step's parallel_chunks calls on the pool of one source tree (layers/parallel.h, the include path
// given), for benchmarks/pool_loaded_ab.py: SmolLM2-135M-like shapes (30 layers of Q/K/V 576 x 960, O 576 x 576,
// gate/up 576 x 3072 and down 1536 x 576, each followed by a few microseconds of the caller's own work, as the
// elementwise layers and Python between products; then a 576 x 49152 logits layer), 4-bit weights (two to a byte,
// unpacked, multiplied by int8 activations and scaled per block in float), chunks and work sizes as qmatmul.cpp gives them.
//
// COPIES copies of the weights, each step reading the next (4 copies: 270 MB, past any L3 cache: the weights stream
// from memory as a model's do).
//
//     pool_loaded_ab SECONDS ROUNDS COPIES  ->  per round, lines "THREADS STEPS_PER_SECOND" for 1, 2, 2 and 1 threads
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "parallel.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kLayers = 30;
constexpr int64_t kLayerBytes = 576 * (960 + 576 + 3072) / 2 + 1536 * 576 / 2;  // one layer's 4 products
constexpr int64_t kStepBytes = kLayers * kLayerBytes + 49152 * 576 / 2;         // and the logits layer

std::vector<uint8_t> weights;
int8_t x[1536];
float y[49152], scales[64];

// y[n] = the dot product of x with row n, K 4-bit weights in K / 2 bytes (low nibbles the first half of the row,
// high nibbles the second), for n in [0, N).
void product(const uint8_t* w, int64_t K, int64_t N, int threads) {
  const int64_t bytes = K / 2, chunk = fastdecode::chunk_outputs(K, 32);  // qmatmul.cpp's chunk for one row
  fastdecode::parallel_chunks(N, chunk, threads, [&](int64_t n0, int64_t n1) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * bytes;
      __m256 sums = _mm256_setzero_ps();
      int64_t k = 0;
      for (; k + 32 <= bytes; k += 32) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
        const __m256i low = _mm256_maddubs_epi16(_mm256_and_si256(packed, nibble),
                                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k)));
        const __m256i high = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble),
                                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + bytes + k)));
        const __m256i group = _mm256_madd_epi16(_mm256_add_epi16(low, high), ones);  // a 4-bit block's scale, as Q4 has
        sums = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group), _mm256_set1_ps(scales[(n * bytes + k) / 16 % 64]), sums);
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, sums);
      float total = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
      for (; k < bytes; ++k) total += static_cast<float>((row[k] & 0x0F) * x[k] + (row[k] >> 4) * x[bytes + k]);
      y[n] = total;
    }
  }, chunk * K);
}

void caller_work(int microseconds) {  // the caller's own work between products
  const auto until = Clock::now() + std::chrono::microseconds(microseconds);
  while (Clock::now() < until) {
  }
}

void step(int threads, int64_t copy) {
  const uint8_t* w = weights.data() + copy * kStepBytes;
  for (int64_t layer = 0; layer < kLayers; ++layer, w += kLayerBytes) {
    product(w, 576, 960, threads);
    caller_work(10);
    product(w + 576 * 960 / 2, 576, 576, threads);
    caller_work(5);
    product(w + 576 * 1536 / 2, 576, 3072, threads);
    caller_work(5);
    product(w + 576 * 4608 / 2, 1536, 576, threads);
    caller_work(5);
  }
  product(w, 576, 49152, threads);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s SECONDS ROUNDS COPIES\n", argv[0]);
    return 2;
  }
  const double seconds = std::atof(argv[1]);
  const int rounds = std::atoi(argv[2]);
  const int64_t copies = std::max(1, std::atoi(argv[3]));
  weights.assign(copies * kStepBytes, 1);
  int64_t steps_run = 0;
  for (int8_t& value : x) value = 3;
  for (int i = 0; i < 64; ++i) scales[i] = 0.5f + i / 64.0f;
  for (uint8_t& value : weights) value = 0x21;
  for (int threads = 1; threads <= 2; ++threads)
    for (int i = 0; i < 20; ++i) step(threads, steps_run++ % copies);  // warm-up: pages, the helper thread
  for (int round = 0; round < rounds; ++round) {
    for (int threads : {1, 2, 2, 1}) {
      const auto start = Clock::now();
      int steps = 0;
      double elapsed = 0;
      while (elapsed < seconds) {
        step(threads, steps_run++ % copies);
        ++steps;
        elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      }
      std::printf("%d %.2f\n", threads, steps / elapsed);
    }
  }
  return 0;
}
