// The rows layout's products on 8-bit codes without mins (Q6_K: V, down and the logits layer) with AVX-512
// (rows_avx512.cpp), called by qmatmul.cpp's outputs_range when isa.h's use_avx512() holds.
#pragma once

#include <ATen/ATen.h>
#include <cstdint>

#include "kscales.h"
#include "qrows.h"

namespace fastdecode {
namespace avx512 {

// Rows [0, RB) of x [RB, K] (float32) x outputs [n0, n1) of 8-bit rows-layout codes [N, K] with scales
// [N, K/G] and no mins -> y [RB, N] (row stride N): qmatmul.cpp's float_rows<8, G, S, RB>, bit for bit,
// two outputs per register, four outputs at a time. Returns where it stopped: the last (n1 - n0) % 4
// outputs are left to the AVX2 kernel.
template <int G, typename S, int RB>
int64_t float_row_pairs(const float* x, int64_t K, const uint8_t* codes, const S* scale, float* y, int64_t N,
                        int64_t n0, int64_t n1);

// Rows [m0, m0 + RB) of q (int8 activations) x outputs [n0, n1) of 8-bit rows-layout codes [N, K] in groups
// of 16 with float32 scales [N, K/16] and no mins -> y [M, N]: qmatmul.cpp's dot_tile<8, 16, float, NR, RB>,
// bit for bit, two outputs per register; offset_codes: q's codes + 128 as unsigned bytes (qtiles_avx512.h's
// offset_rows). Returns where it stopped: the last (n1 - n0) % 4 outputs are left to the AVX2 kernel.
template <int RB>
int64_t int8_row_pairs16(const quant::QuantizedRows& q, const uint8_t* offset_codes, int64_t m0, const uint8_t* codes,
                         const float* scale, float* y, int64_t N, int64_t n0, int64_t n1);

// The same two kernels on packed 6-bit codes (Q6_K, six_bit.h: codes [N, 3K/4], groups of 16), bit for bit
// the 8-bit kernels on the unpacked codes (rows6_avx512.cpp). six_int8_row_pairs reads q.six (qrows.h's
// six_corrections). Both also take compact scales (S = quant::KScale, kscales.h's rows records), decoded in
// registers per super-block to the float32 layout's values: the same bits as on the expanded scales.
template <typename S, int RB>
int64_t six_float_row_pairs(const float* x, int64_t K, const uint8_t* codes, const S* scale, float* y, int64_t N,
                            int64_t n0, int64_t n1);
template <typename S, int RB>
int64_t six_int8_row_pairs(const quant::QuantizedRows& q, int64_t m0, const uint8_t* codes, const S* scale, float* y,
                           int64_t N, int64_t n0, int64_t n1);
// Outputs [n0, n1) x every row of 6-bit codes with compact scales (x: float32 activations [M, K], or null: q's
// int8 ones): qmatmul.cpp's outputs_range on the expanded scales, bit for bit, without expanding them. Returns
// where it stopped: the last (n1 - n0) % 4 outputs are left to the caller.
int64_t six_compact_outputs(const quant::QuantizedRows& q, const float* x, int64_t M, int64_t K, const uint8_t* codes,
                            const quant::KScale* scale, float* y, int64_t N, int64_t n0, int64_t n1);

}  // namespace avx512
}  // namespace fastdecode
