// What the AVX-512 rows-layout kernels (rows_avx512.cpp: 8-bit codes; rows6_avx512.cpp: packed 6-bit ones)
// share: two outputs per register, output n in the low 256 bits, n + 1 in the high ones. Include only from
// files built for AVX-512 use (their code runs where isa.h's use_avx512() holds).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>

#include "qrows.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

namespace fastdecode {
namespace avx512 {
namespace pairs {

constexpr int PAIRS = 2;  // output pairs side by side: each row's broadcast inputs serve 4 outputs

// The scales of eight consecutive groups of two outputs as float32 (float16: F16C's exact conversion, the
// value load_scale gives): output a's in lanes 0-7, b's in 8-15. A group's scale pair is then one permute
// (pairs_block) instead of two scalar conversions, two broadcasts and an insert.
inline __m512 eight_scales(const at::Half* a, const at::Half* b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}
inline __m512 eight_scales(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

// y[0], y[1] = the 8-lane sums of acc's halves (quant::hsum: the AVX2 kernels' reduction).
inline void store_pair(__m512 acc, float* y) {
  y[0] = quant::hsum(_mm512_castps512_ps256(acc));
  y[1] = quant::hsum(_mm512_extractf32x8_ps(acc, 1));
}

}  // namespace pairs
}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
