// Small AVX2 + FMA helpers the attention and beam search ops share: lane sums, exp of 8 floats, softmax.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// The lane sums of 8 vectors -> one vector: lane u = sum of a[u]'s lanes.
inline __m256 eight_sums(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// exp(x) for 8 floats (Cephes' range reduction and polynomial, relative error ~2e-7); x below
// -87.3 (including -inf) gives 0.
inline __m256 exp8(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(two_n)));
}

// Softmax numerators in place over scores s[0 .. padded) whose first `count` are real and the rest
// -inf (padded: a multiple of 8): s[j] = exp(s[j] - max), padding -> 0. Returns 1 / their sum.
inline float softmax_numerators(float* s, int64_t count, int64_t padded) {
  // The largest score, 8 lanes at a time (a cross-attention query's 1,500 keys were a chain of 1,500
  // dependent compares): the same value in any order, each step `s > m ? s : m` as before (max_ps's
  // rule, a NaN score skipped as before).
  __m256 lanes = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(s + i), lanes);
  alignas(32) float lane[8];
  _mm256_store_ps(lane, lanes);
  float m = -INFINITY;
  for (int u = 0; u < 8; ++u) m = lane[u] > m ? lane[u] : m;
  for (; i < count; ++i) m = s[i] > m ? s[i] : m;
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  return 1.0f / hsum(sum);
}
