// float_matmul's arithmetic contract (fmatmul.cpp) and its AVX-512 kernel for several rows
// (fmatmul_avx512.cpp), called by fmatmul.cpp where isa.h's use_avx512() holds.
#pragma once

#include <cstdint>

namespace fastdecode {

// Inputs per partial sum: each output sums k = 0..63, 64..127, ... each in one chain of fused
// multiply-adds in k order from 0, then adds the segment sums in order, then the bias.
constexpr int64_t FLOAT_SEGMENT = 64;

namespace avx512 {

// y[m, n] for rows [0, M) and columns [n0, n1) of x [M, K] @ w [K, N] (+ bias [N] when not null), every
// output by the contract above (bit for bit fmatmul.cpp's AVX2 kernel), accumulators in registers:
// 8 rows x 48 columns per pass over a segment of w's rows.
void float_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1);
// The same with w held in float16 (IEEE half bits), each element widened to its float32 value as it is loaded.
void float_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1);

}  // namespace avx512
}  // namespace fastdecode
