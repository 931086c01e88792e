// The prompt attention kernel's two products (prompt_attention.h) with AVX-512: 16 lanes a register where the
// AVX2 kernels have 8, each lane the same chain of FMAs in the same order (scores over d, values over the keys),
// so the same bits (isa.h).
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "prompt_attention.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

namespace fastdecode {
namespace avx512 {
namespace {

// R rows x the block's 32 keys: 2R accumulators of 16 keys.
template <int R>
inline void scores_rows(const float* const* q, const float* kt, int64_t D, float* p, int64_t W) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * KEY_BLOCK), k1 = _mm512_loadu_ps(kt + d * KEY_BLOCK + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(q[r][d]);
      a0[r] = _mm512_fmadd_ps(x, k0, a0[r]);
      a1[r] = _mm512_fmadd_ps(x, k1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(p + r * W, a0[r]);
    _mm512_storeu_ps(p + r * W + 16, a1[r]);
  }
}

// R rows x NV registers of dims from d (MASKED: the last register's lanes under `last`, a head dim not a multiple
// of 16); SUM: the rows' sums of p too (every lane the same sum), into sums. (The masks are compile-time choices:
// with a run-time one GCC kept the accumulators in memory, storing all of them every key.)
template <int R, int NV, bool SUM, bool MASKED = false>
inline void values_rows(const float* p, int64_t W, int64_t n, const float* v, int64_t v_stride, float* const* out,
                        int64_t d, float* sums, __mmask16 last = 0xFFFF) {
  __m512 a[R][NV], l[R];
  for (int r = 0; r < R; ++r) {
    l[r] = _mm512_setzero_ps();
    for (int i = 0; i < NV; ++i) a[r][i] = _mm512_setzero_ps();
  }
  for (int64_t u = 0; u < n; ++u) {
    const float* vu = v + u * v_stride + d;
    __m512 x[NV];
    for (int i = 0; i + (MASKED ? 1 : 0) < NV; ++i) x[i] = _mm512_loadu_ps(vu + 16 * i);
    if constexpr (MASKED) x[NV - 1] = _mm512_maskz_loadu_ps(last, vu + 16 * (NV - 1));
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * W + u]);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_fmadd_ps(w, x[i], a[r][i]);
      if constexpr (SUM) l[r] = _mm512_add_ps(l[r], w);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i + (MASKED ? 1 : 0) < NV; ++i) _mm512_storeu_ps(out[r] + d + 16 * i, a[r][i]);
    if constexpr (MASKED) _mm512_mask_storeu_ps(out[r] + d + 16 * (NV - 1), last, a[r][NV - 1]);
    if constexpr (SUM) sums[r] = _mm512_cvtss_f32(l[r]);
  }
}

// The rows' sums ride with the first 16 dims alone (6 more registers beside 4 x 6 accumulators would spill).
template <int R>
inline void values_all(const float* p, int64_t W, int64_t n, const float* v, int64_t v_stride, int64_t D,
                       float* const* out, float* sums) {
  const auto lanes = [](int64_t count) { return static_cast<__mmask16>((1u << count) - 1); };
  if (D < 16) return values_rows<R, 1, true, true>(p, W, n, v, v_stride, out, 0, sums, lanes(D));
  values_rows<R, 1, true>(p, W, n, v, v_stride, out, 0, sums);
  int64_t d = 16;
  for (; d + 64 <= D; d += 64) values_rows<R, 4, false>(p, W, n, v, v_stride, out, d, sums);
  if (d + 48 <= D) values_rows<R, 3, false>(p, W, n, v, v_stride, out, d, sums), d += 48;
  if (d + 32 <= D) values_rows<R, 2, false>(p, W, n, v, v_stride, out, d, sums), d += 32;
  if (d + 16 <= D) values_rows<R, 1, false>(p, W, n, v, v_stride, out, d, sums), d += 16;
  if (d < D) values_rows<R, 1, false, true>(p, W, n, v, v_stride, out, d, sums, lanes(D - d));
}

// vec_math.h's exp8 on 16 lanes: the same operations lane by lane (the same bits).
inline __m512 exp16(__m512 x) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_mul_ps(y, _mm512_castsi512_ps(two_n)));
}

}  // namespace

float attention_numerators(float* s, const float* m, int64_t n, float scale) {
  const __m512 sv = _mm512_set1_ps(scale), hidden = _mm512_set1_ps(-INFINITY);
  __m512 top = hidden;
  for (int64_t u = 0; u < n; u += 16) {
    const __mmask16 in = n - u >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - u)) - 1);
    __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, s + u), sv);
    if (m) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(in, m + u));
    x = _mm512_mask_blend_ps(in, hidden, x);
    _mm512_mask_storeu_ps(s + u, in, x);
    top = _mm512_max_ps(x, top);
  }
  const float best = _mm512_reduce_max_ps(top);
  if (best == -INFINITY) {
    for (int64_t u = 0; u < n; ++u) s[u] = 0.0f;
    return best;
  }
  const __m512 bv = _mm512_set1_ps(best);
  for (int64_t u = 0; u < n; u += 16) {
    const __mmask16 in = n - u >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - u)) - 1);
    _mm512_mask_storeu_ps(s + u, in, exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(hidden, in, s + u), bv)));
  }
  return best;
}

void attention_scores(const float* const* q, int64_t R, const float* kt, int64_t D, float* p, int64_t W) {
  switch (R) {
    case 1: scores_rows<1>(q, kt, D, p, W); break;
    case 2: scores_rows<2>(q, kt, D, p, W); break;
    case 3: scores_rows<3>(q, kt, D, p, W); break;
    case 4: scores_rows<4>(q, kt, D, p, W); break;
    case 5: scores_rows<5>(q, kt, D, p, W); break;
    default: scores_rows<6>(q, kt, D, p, W); break;
  }
}

void attention_values(const float* p, int64_t W, int64_t R, int64_t n, const float* v, int64_t v_stride, int64_t D,
                      float* const* out, float* sums) {
  switch (R) {
    case 1: values_all<1>(p, W, n, v, v_stride, D, out, sums); break;
    case 2: values_all<2>(p, W, n, v, v_stride, D, out, sums); break;
    case 3: values_all<3>(p, W, n, v, v_stride, D, out, sums); break;
    case 4: values_all<4>(p, W, n, v, v_stride, D, out, sums); break;
    case 5: values_all<5>(p, W, n, v, v_stride, D, out, sums); break;
    default: values_all<6>(p, W, n, v, v_stride, D, out, sums); break;
  }
}

}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
