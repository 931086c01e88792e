// The int8 prompt GEMM of qprompt.cpp with AVX-512 VNNI: a pair tile's 16 outputs in one register.
//
// Bit for bit the AVX2 kernel (isa.h): the activations enter dpbusd as its unsigned operand, offset by 128
// (avx512::offset_rows), the codes as the signed one, and the pair tile's code_sum (128 x the codes' sum per
// 16) taken off gives sum a * code exactly in int32, the AVX2 kernel's dot products; every float operation
// after them is that kernel's, lane for lane (qprompt.h).
#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "qprompt.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

namespace fastdecode {
namespace avx512 {
namespace {

using prompt::PAIR;

inline __m512i broadcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int RB>
void pair_block(const prompt::PairTile& tile, const quant::QuantizedRows& q, const uint8_t* offset, int64_t m0,
                float* y, int64_t N, int64_t n0, __mmask16 valid) {
  const int64_t K = q.K, blocks = K / 32;
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* w = tile.codes.data() + b * 8 * PAIR * 4;
    __m512i dot[2][RB];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < RB; ++r) dot[h][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_loadu_si512(w + c * PAIR * 4);
      for (int r = 0; r < RB; ++r)
        dot[c / 4][r] = _mm512_dpbusd_epi32(dot[c / 4][r], broadcast4(offset + (m0 + r) * K + 32 * b + 4 * c), v);
    }
    const __m512i sum0 = _mm512_loadu_si512(tile.code_sum.data() + (2 * b) * PAIR);
    const __m512i sum1 = _mm512_loadu_si512(tile.code_sum.data() + (2 * b + 1) * PAIR);
    const __m512 s0 = _mm512_loadu_ps(tile.scale.data() + (2 * b) * PAIR);
    const __m512 s1 = _mm512_loadu_ps(tile.scale.data() + (2 * b + 1) * PAIR);
    for (int r = 0; r < RB; ++r) {
      const __m512 d = _mm512_set1_ps(q.scale[(m0 + r) * blocks + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[0][r], sum0)), _mm512_mul_ps(s0, d), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[1][r], sum1)), _mm512_mul_ps(s1, d), acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, valid, acc[r]);
}

}  // namespace

void pair_code_sums(prompt::PairTile& tile, int64_t blocks) {
  tile.code_sum.resize(blocks * 2 * PAIR);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t g = 0; g < 2 * blocks; ++g) {  // group g: chunks 4g .. 4g + 3 of the tile
    __m512i sum = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) sum = _mm512_dpbusd_epi32(sum, ones, _mm512_loadu_si512(tile.codes.data() + (4 * g + c) * PAIR * 4));
    _mm512_storeu_si512(tile.code_sum.data() + g * PAIR, _mm512_slli_epi32(sum, 7));
  }
}

void prompt_pair_rows(const prompt::PairTile& tile, const quant::QuantizedRows& q, const uint8_t* offset, int64_t M,
                      float* y, int64_t N, int64_t n0, int64_t valid) {
  const __mmask16 mask = valid >= PAIR ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) pair_block<8>(tile, q, offset, m, y, N, n0, mask);
  for (; m + 2 <= M; m += 2) pair_block<2>(tile, q, offset, m, y, N, n0, mask);
  for (; m < M; ++m) pair_block<1>(tile, q, offset, m, y, N, n0, mask);
}

}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
