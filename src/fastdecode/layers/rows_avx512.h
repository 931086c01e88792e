// The rows layout's float32-activation products with AVX-512 (rows_avx512.cpp), called by qmatmul.cpp's
// outputs_range for 8-bit codes without mins (Q6_K: the logits layer) when isa.h's use_avx512() holds.
#pragma once

#include <ATen/ATen.h>
#include <cstdint>

namespace fastdecode {
namespace avx512 {

// Rows [0, RB) of x [RB, K] (float32) x outputs [n0, n1) of 8-bit rows-layout codes [N, K] with scales
// [N, K/G] and no mins -> y [RB, N] (row stride N): qmatmul.cpp's float_rows<8, G, S, RB>, bit for bit,
// two outputs per register. Returns where it stopped: n1, or n1 - 1 when n1 - n0 is odd (the last output
// is left to the AVX2 kernel).
template <int G, typename S, int RB>
int64_t float_row_pairs(const float* x, int64_t K, const uint8_t* codes, const S* scale, float* y, int64_t N,
                        int64_t n0, int64_t n1);

}  // namespace avx512
}  // namespace fastdecode
