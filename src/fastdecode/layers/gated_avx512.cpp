// The gated activation's rows with AVX-512 (elementwise.cpp's gated, where isa.h's use_avx512() holds): 16
// lanes at a time, each lane the AVX2 loop's operations in its order (silu x / (1 + exp(0 - x)); gelu
// 0.5 x (1 + tanh(c (x + 0.044715 x^3)))), with SLEEF's 16-lane expf / tanhf (u10), which PyTorch carries beside
// the 8-lane ones the AVX2 loop calls and which give the same bits: checked on every float32 input for expf and
// for the whole SiLU, on 2^28 inputs spread over the range for tanhf. About half the AVX2 loop's instructions per
// element: SmolLM2-135M's 512-row prompt spends ~5% of its time in this op.
#include <immintrin.h>
#include <cmath>
#include <cstdint>

// Everything below may use AVX-512; it runs only where isa.h's use_avx512() holds.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

extern "C" __m512 Sleef_expf16_u10avx512f(__m512);
extern "C" __m512 Sleef_tanhf16_u10avx512f(__m512);

namespace fastdecode {
namespace avx512 {

// y[i] = act(g[i]) * u[i] for i below the largest multiple of 16 <= n (kind 0: SiLU, 1: GELU tanh) -> that count.
int64_t gated_row(const float* g, const float* u, float* y, int64_t n, int64_t kind) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 coefficient = _mm512_set1_ps(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    __m512 a;
    if (kind == 0) {
      a = _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10avx512f(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    } else {
      const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      const __m512 inner = _mm512_mul_ps(coefficient, _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(0.044715f), cube)));
      a = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, Sleef_tanhf16_u10avx512f(inner)));
    }
    _mm512_storeu_ps(y + i, _mm512_mul_ps(a, _mm512_loadu_ps(u + i)));
  }
  return i;
}

}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
