// Shared by the quantized kernels (qmatmul.cpp: rows layout; qtiles.cpp: tiled layout): scale loads,
// horizontal sums, and the activation rows quantized to int8 once per call.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>
#include <vector>

namespace fastdecode {
namespace quant {

inline float load_scale(const at::Half* p) { return _cvtsh_ss(reinterpret_cast<const uint16_t&>(*p)); }
inline float load_scale(const float* p) { return *p; }
inline __m256 load8_scales(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8_scales(const float* p) { return _mm256_loadu_ps(p); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// An 8 x 8 float block transposed in registers (v[i][j] -> v[j][i]).
inline void transpose8(__m256 v[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
    s[4 * h + 0] = _mm256_shuffle_ps(t[4 * h + 0], t[4 * h + 2], 0x44);
    s[4 * h + 1] = _mm256_shuffle_ps(t[4 * h + 0], t[4 * h + 2], 0xEE);
    s[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    s[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x20);
    v[4 + j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x31);
  }
}

// ---- activations: rows quantized once per call ------------------------------------------------------
struct QuantizedRows {
  int64_t K;
  std::vector<int8_t> codes;  // [M, K]
  std::vector<float> scale;   // [M, K/32]: d, x ~ d * code
  std::vector<float> sums;    // [M, K/G]: d * (sum of the codes) per weight group, for the mins term (or empty)
};

// with_sums: the code sums too (read only by weights with mins: a third of the quantization's time).
template <int G>
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, bool with_sums = true) {
  const int64_t blocks = K / 32;
  QuantizedRows q{K, std::vector<int8_t>(M * K), std::vector<float>(M * blocks),
                  std::vector<float>(with_sums ? M * K / G : 0)};
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t i = 0; i < M * blocks; ++i) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + 32 * i + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
    }
    const float top = hmax(amax), d = top / 127.0f;
    const __m256 inverse = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i c[4];  // |x * 127 / max| <= 127 (+ one rounding): never -128
    for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));  // nearest even
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(packed, order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.codes.data() + 32 * i), ordered);
    q.scale[i] = d;
    if (!with_sums) continue;
    // code sums per group: lanes 0-3 of `fours` sum inputs 0..15, lanes 4-7 inputs 16..31 (exact in float)
    const __m256 fours = _mm256_cvtepi32_ps(
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), ordered), _mm256_set1_epi16(1)));
    const float low = hsum(_mm256_blend_ps(fours, _mm256_setzero_ps(), 0xF0)), high = hsum(fours) - low;
    if constexpr (G == 32) {
      q.sums[i] = d * (low + high);
    } else {  // G == 16
      q.sums[2 * i] = d * low;
      q.sums[2 * i + 1] = d * high;
    }
  }
  return q;
}

// x summed per group of G inputs (float32 activations: the mins term of the exact products).
template <int G>
std::vector<float> group_sums(const float* x, int64_t M, int64_t K) {
  std::vector<float> sums(M * K / G);
  for (int64_t i = 0; i < M * K / G; ++i) {
    __m256 v = _mm256_loadu_ps(x + G * i);
    for (int j = 1; j < G / 8; ++j) v = _mm256_add_ps(v, _mm256_loadu_ps(x + G * i + 8 * j));
    sums[i] = hsum(v);
  }
  return sums;
}

}  // namespace quant
}  // namespace fastdecode
