// float_matmul's arithmetic contract (fmatmul.cpp) and its AVX-512 kernel for several rows
// (fmatmul_avx512.cpp), called by fmatmul.cpp where isa.h's use_avx512() holds.
#pragma once

#include <cstdint>

namespace fastdecode {

// Inputs per partial sum: each output sums k = 0..63, 64..127, ... each in one chain of fused
// multiply-adds in k order from 0, then adds the segment sums in order, then the bias.
constexpr int64_t FLOAT_SEGMENT = 64;

// Rows up to which 9 or more rows read w in place (row groups taking turns over runs of w's rows), past them from
// packed copies of w's column blocks: `spread` where w's rows spread over L1's sets, `aliased` where they all
// fall in the same sets (N * sizeof(W) a multiple of 4 KiB, turns of 8 rows). Both paths give every output the
// contract's operations (the same bits): only the speed differs, and where the crossover lies depends on the CPU's
// caches and prefetchers, so the caller passes them (layers/float_rows_choice.py measures them once per machine);
// 8 (no 9+ rows in place) to MAX_IN_PLACE_ROWS.
struct InPlaceRows {
  int64_t spread, aliased;
};
constexpr int64_t MAX_IN_PLACE_ROWS = 64;
// The limits measured on a 2-core AMD EPYC Zen 5 (fmatmul_avx512.cpp), float_rows' without an InPlaceRows (the
// A/B benchmark's, benchmarks/float_kernel_ab.cpp): layers/float_rows_choice.py's DEFAULT_IN_PLACE_ROWS.
constexpr InPlaceRows ZEN5_IN_PLACE_ROWS{64, 32};

namespace avx512 {

// y[m, n] for rows [0, M) and columns [n0, n1) of x [M, K] @ w [K, N] (+ bias [N] when not null), every
// output by the contract above (bit for bit fmatmul.cpp's AVX2 kernel), accumulators in registers:
// 8 rows x 48 columns per pass over a segment of w's rows; 9+ rows in place up to `limits`.
void float_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1, InPlaceRows limits);
// The same with w held in float16 (IEEE half bits), each element widened to its float32 value as it is loaded.
void float_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1, InPlaceRows limits);
// float32 w with ZEN5_IN_PLACE_ROWS (benchmarks/float_kernel_ab.cpp's entry: one signature in every tree).
void float_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1);

}  // namespace avx512
}  // namespace fastdecode
