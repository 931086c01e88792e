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

// 32 code bytes of output a at x and 32 of output b at y, their 4-byte words spread over the 128-bit lanes:
// [a's even words, a's odd words, b's even words, b's odd words] (one two-source permute), so that the 8
// codes 8i .. 8i + 7 of each output are one byte shuffle away from their 32-bit lanes (eighth_index).
inline __m512i spread_words(const uint8_t* x, const uint8_t* y) {
  const __m512i words = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 16, 18, 20, 22, 17, 19, 21, 23);
  return _mm512_permutex2var_epi32(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), words,
                                   _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(y))));
}

// vpshufb's index for codes 8i .. 8i + 7 of each output of spread_words' register: 32-bit lane 4q + t (t < 4)
// gets byte 4i + t of its 128-bit lane, code 8i + t of a (q = 0), 8i + 4 + t of a (q = 1), the same of b
// (q = 2, 3): lanes 0-7 hold a's codes 8i .. 8i + 7, lanes 8-15 b's (rows_avx512.cpp's lanes of w[p][i]).
inline __m512i eighth_index(int i) {
  alignas(64) int8_t bytes[64] = {};
  for (int lane = 0; lane < 16; ++lane) bytes[4 * lane] = static_cast<int8_t>(4 * i + lane % 4);
  return _mm512_load_si512(bytes);
}

// The codes u - OFFSET of the unsigned bytes u that `index` (eighth_index) picks, as float32, by the exponent
// trick: u as the low byte of 0x4B000000 is the float 2^23 + u, and (2^23 + u) - (2^23 + OFFSET) = u - OFFSET
// exactly (both in [2^23, 2^24)): the value and bits (+0 for u = OFFSET) that converting the int8 code gives,
// from one byte shuffle and one subtraction per 16 codes (no vpmovsxbd, no vcvtdq2ps: rows6_avx512.cpp).
template <int OFFSET>
inline __m512 shuffled_codes(__m512i codes, __m512i index) {
  const __m512i exponent = _mm512_set1_epi32(0x4B000000);
  constexpr __mmask64 low_bytes = 0x1111111111111111ull;  // byte 0 of each 32-bit lane from `codes`
  return _mm512_sub_ps(_mm512_castsi512_ps(_mm512_mask_shuffle_epi8(exponent, low_bytes, codes, index)),
                       _mm512_set1_ps(8388608.0f + OFFSET));
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
