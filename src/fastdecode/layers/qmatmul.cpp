// Quantized matrix products for fastdecode (AVX2 + FMA + F16C; a scalar path elsewhere).
//
// A quantized weight is [N outputs, K inputs] in groups of G consecutive inputs of one output row:
//   w[n, k] = scale[n, g] * code[n, k] + min[n, g]         (g = k / G; min may be absent = 0)
// codes are int8 [N, K] (bits 8) or 4-bit nibbles [N, K/2] (bits 4; byte j of a 32-group holds
// element j in its low nibble and element j + 16 in its high nibble: GGUF's Q4_0/Q4_1 order).
// scale/min are float16 (exact copies of GGUF's fp16 block scales) or float32 (K-quant products).
//
// y[m, n] = sum_k w[n, k] x[m, k] in float32; activations are not quantized and weights are decoded
// exactly, so the result equals dequantize-then-matmul up to summation order (and FMA rounding).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cstdint>
#include <algorithm>
#include <vector>

namespace {

inline float load_scale(const at::Half* p) { return _cvtsh_ss(reinterpret_cast<const uint16_t&>(*p)); }
inline float load_scale(const float* p) { return *p; }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The G weights of one group decoded to float codes (not yet scaled): G / 8 vectors.
template <int BITS, int G>
inline void decode_group(const uint8_t* codes, __m256* w) {
  if constexpr (BITS == 8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(codes);
    for (int i = 0; i < G / 8; ++i)
      w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * i))));
  } else {  // 16 bytes -> elements 0..15 (low nibbles), 16..31 (high nibbles)
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
}

// Rows [m0, m0 + RB) of y for outputs [n0, n1).
// Few rows (RB <= 2): per group, the dot product of the codes with x, then times the scale; the mins
// term is sum_g min[n,g] * xsum[r,g] (xsum: x summed per group). Fewest operations per weight.
// More rows: each group is decoded to its float32 weights once (scale * code + min, the same two
// roundings as dequantize(): bit-identical weights) and reused for all RB rows.
template <int BITS, int G, typename S, int RB>
void rows_block(const float* x, const float* xsum, int64_t K, const uint8_t* codes, const S* scale,
                const S* mins, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t groups = K / G;
  const int64_t row_bytes = K * BITS / 8;
  const int64_t group_bytes = G * BITS / 8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * row_bytes;
    const S* sc = scale + n * groups;
    const S* mn = mins != nullptr ? mins + n * groups : nullptr;
    __m256 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 w[G / 8];
      decode_group<BITS, G>(c + g * group_bytes, w);
      const __m256 s = _mm256_set1_ps(load_scale(sc + g));
      if constexpr (RB <= 2) {
        for (int r = 0; r < RB; ++r) {
          const float* xr = x + r * K + g * G;
          __m256 d = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
          for (int i = 1; i < G / 8; ++i) d = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), d);
          acc[r] = _mm256_fmadd_ps(d, s, acc[r]);
        }
      } else {
        if (mn != nullptr) {
          const __m256 m = _mm256_set1_ps(load_scale(mn + g));
          for (int i = 0; i < G / 8; ++i) w[i] = _mm256_add_ps(_mm256_mul_ps(w[i], s), m);
        } else {
          for (int i = 0; i < G / 8; ++i) w[i] = _mm256_mul_ps(w[i], s);
        }
        for (int r = 0; r < RB; ++r) {
          const float* xr = x + r * K + g * G;
          for (int i = 0; i < G / 8; ++i) acc[r] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), acc[r]);
        }
      }
    }
    for (int r = 0; r < RB; ++r) {
      float total = hsum(acc[r]);
      if (RB <= 2 && mn != nullptr) {
        const float* xs = xsum + r * groups;
        for (int64_t g = 0; g < groups; ++g) total += load_scale(mn + g) * xs[g];
      }
      y[r * N + n] = total;
    }
  }
}

// Outputs per chunk: a chunk's codes (32 x K/2 bytes for 4 bits, 18 KB at K = 576) stay in L1/L2
// while every row block of x passes over them, so each weight byte comes from memory once per call.
constexpr int64_t OUTPUT_CHUNK = 32;

template <int BITS, int G, typename S>
void chunk_all_rows(const float* x, const float* xsum, int64_t M, int64_t K, const uint8_t* codes, const S* scale,
                    const S* mins, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t groups = K / G;
  int64_t m = 0;
  // 8 rows per decoded group: 8 accumulators + G/8 weight vectors + scale + partial fit in 16 ymm registers
  for (; m + 8 <= M; m += 8)
    rows_block<BITS, G, S, 8>(x + m * K, xsum ? xsum + m * groups : nullptr, K, codes, scale, mins, y + m * N, N, n0, n1);
  for (; m + 4 <= M; m += 4)
    rows_block<BITS, G, S, 4>(x + m * K, xsum ? xsum + m * groups : nullptr, K, codes, scale, mins, y + m * N, N, n0, n1);
  for (; m + 2 <= M; m += 2)
    rows_block<BITS, G, S, 2>(x + m * K, xsum ? xsum + m * groups : nullptr, K, codes, scale, mins, y + m * N, N, n0, n1);
  for (; m < M; ++m)
    rows_block<BITS, G, S, 1>(x + m * K, xsum ? xsum + m * groups : nullptr, K, codes, scale, mins, y + m * N, N, n0, n1);
}

template <int BITS, int G, typename S>
at::Tensor matmul_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& mins, int64_t grain) {
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0), groups = K / G;
  at::Tensor y = at::empty({M, N}, x.options());
  const bool has_min = mins.has_value() && mins->defined();
  // per-group sums of the rows that take the few-rows path (M % 4 of them, the last ones)
  at::Tensor xsum = has_min && M % 4 ? x.view({M, groups, G}).sum(2).contiguous() : at::Tensor();  // [M, K/G]
  const float* xp = x.data_ptr<float>();
  const float* xsp = xsum.defined() ? xsum.data_ptr<float>() : nullptr;
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const S* sp = scale.data_ptr<S>();
  const S* mp = has_min ? mins->data_ptr<S>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t c = n0; c < n1; c += OUTPUT_CHUNK)
      chunk_all_rows<BITS, G, S>(xp, xsp, M, K, cp, sp, mp, yp, N, c, std::min(c + OUTPUT_CHUNK, n1));
  });
  return y;
}

template <int BITS, int G, typename S>
at::Tensor dequantize_impl(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                           int64_t grain) {
  const int64_t N = scale.size(0), groups = scale.size(1), K = groups * G;
  at::Tensor w = at::empty({N, K}, scale.options().dtype(at::kFloat));
  const bool has_min = mins.has_value() && mins->defined();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const S* sp = scale.data_ptr<S>();
  const S* mp = has_min ? mins->data_ptr<S>() : nullptr;
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < groups; ++g) {
        __m256 v[G / 8];
        decode_group<BITS, G>(cp + (n * groups + g) * (G * BITS / 8), v);
        const __m256 s = _mm256_set1_ps(load_scale(sp + n * groups + g));
        float* out = wp + n * K + g * G;
        if (mp != nullptr) {  // scale * code + min: the same two roundings as quantized.dequantize()
          const __m256 m = _mm256_set1_ps(load_scale(mp + n * groups + g));
          for (int i = 0; i < G / 8; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_add_ps(_mm256_mul_ps(v[i], s), m));
        } else {
          for (int i = 0; i < G / 8; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(v[i], s));
        }
      }
  });
  return w;
}

// codes, scale, mins of [N, K] -> float32 [N, K] (for products with many rows: then a float GEMM).
at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                      int64_t bits, int64_t group, int64_t grain) {
  TORCH_CHECK(codes.is_contiguous() && scale.is_contiguous(), "codes and scales must be contiguous");
  const bool half = scale.scalar_type() == at::kHalf;
#define FD_CASE(B, GS)                                                                               \
  if (bits == B && group == GS)                                                                      \
    return half ? dequantize_impl<B, GS, at::Half>(codes, scale, mins, grain)                       \
                : dequantize_impl<B, GS, float>(codes, scale, mins, grain);
  FD_CASE(8, 32)
  FD_CASE(8, 16)
  FD_CASE(4, 32)
#undef FD_CASE
  TORCH_CHECK(false, "no kernel for bits=", bits, " group=", group);
}

// x [M, K] float32 -> y [M, N] float32.
at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t grain) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(codes.is_contiguous() && scale.is_contiguous(), "codes and scales must be contiguous");
  TORCH_CHECK(x.size(1) == scale.size(1) * group, "x has ", x.size(1), " inputs, the weight ", scale.size(1) * group);
  const bool half = scale.scalar_type() == at::kHalf;
#define FD_CASE(B, GS)                                                                               \
  if (bits == B && group == GS)                                                                      \
    return half ? matmul_impl<B, GS, at::Half>(x, codes, scale, mins, grain)                        \
                : matmul_impl<B, GS, float>(x, codes, scale, mins, grain);
  FD_CASE(8, 32)
  FD_CASE(8, 16)
  FD_CASE(4, 32)
#undef FD_CASE
  TORCH_CHECK(false, "no kernel for bits=", bits, " group=", group);
}

}  // namespace

// A CPU kernel (not a composite one), so kernels.py can give the op a fake kernel for torch.compile.
TORCH_LIBRARY(fastdecode_kernels, m) {
  m.def("qmatmul(Tensor x, Tensor codes, Tensor scale, Tensor? mins, int bits, int group, int grain) -> Tensor");
  m.def("dequantize(Tensor codes, Tensor scale, Tensor? mins, int bits, int group, int grain) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) {
  m.impl("qmatmul", &qmatmul);
  m.impl("dequantize", &dequantize);
}
