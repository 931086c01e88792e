// The int8 prompt GEMM for 8-bit codes in groups of 16 kept in the rows layout (Q6_K), shared by its AVX2
// kernel (qprompt.cpp) and its AVX-512 VNNI one (qprompt_avx512.cpp).
//
// A pair tile is 16 consecutive outputs repacked from the rows layout once per call into a buffer that
// stays in L2 while every row passes over it (layout: PairTile). Both kernels compute, per (row, output),
//   dot_h(b) = sum_{k in half h of block b} code[n, k] * a[m, k]              exact int32, h = 0, 1
//   y = 0; for b: y = fma(float(dot_0(b)), scale[n, 2b] * d[m, b], y); y = fma(float(dot_1(b)), scale[n, 2b+1] * d[m, b], y)
// one output per float lane, so no horizontal sum and the same float operations in the same order on
// both ISAs and for every row count: a row's result never depends on the other rows (|dot| <= 16 * 128 *
// 127 < 2^24: exact in float32 too).
#pragma once

#include <ATen/ATen.h>
#include <cstdint>
#include <vector>

#include "qrows.h"

namespace fastdecode {
namespace prompt {

constexpr int PAIR = 16;  // outputs per pair tile: 16 int32 lanes of an AVX-512 register, two AVX2 ones

// One pair tile of a [N, K] weight (outputs n0 .. n0 + 16, rows past N zero):
//   codes[b][c][o][i] = code[n0 + o, 32 b + 4 c + i]   (blocks b of 32 inputs, chunks c of 4 inputs)
//   scale[b][h][o]    = scale[n0 + o, 2 b + h]          (h: inputs 0-15, 16-31 of the block)
//   code_sum[b][h][o] = 128 * sum of those 16 codes     (the VNNI kernel's correction for offset activations;
//                                                        made by avx512::pair_code_sums, for that kernel only)
struct PairTile {
  std::vector<int8_t> codes;     // [blocks, 8, 16, 4]
  std::vector<float> scale;      // [blocks, 2, 16]
  std::vector<int32_t> code_sum; // [blocks, 2, 16]
};

}  // namespace prompt

namespace avx512 {
// The pair tile's code_sum from its codes (dpbusd of ones with the codes).
void pair_code_sums(prompt::PairTile& tile, int64_t blocks);

// Rows [0, M) x the pair tile's 16 outputs -> y[m, n0 + o] for o < valid (y rows N apart); offset: the
// activation codes + 128 as unsigned bytes [M, K] (avx512::offset_rows).
void prompt_pair_rows(const prompt::PairTile& tile, const quant::QuantizedRows& q, const uint8_t* offset, int64_t M,
                      float* y, int64_t N, int64_t n0, int64_t valid);
}  // namespace avx512

namespace amx {
// The same product on AMX's tile unit (qprompt_amx.cpp): x [M, K] float32, codes int8 [N, K] (six: packed
// 6-bit [N, 3K/4], six_bit.h), scale float32 or float16 [N, K/16] (+ bias [N] float32 or nullptr, added as each
// output is stored) -> y [M, N], the AVX2 / VNNI kernels' bits.
at::Tensor rows16_gemm(const at::Tensor& x, const at::Tensor& codes, bool six, const at::Tensor& scale, int64_t threads,
                       const float* bias);
}  // namespace amx

}  // namespace fastdecode
