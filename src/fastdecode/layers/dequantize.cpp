// dequantize: a quantized weight's exact float32 values [N, K], bit-identical to quantized.dequantize() (the
// products with many rows: layers/exact_matmul.cpp decodes 64 outputs at a time through it, or a float GEMM
// takes the whole matrix). Both layouts: 3-D codes are the tiled one (qtiles.cpp's tiled_dequantize).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cstdint>

#include "kscales.h"
#include "parallel.h"
#include "qrows.h"
#include "qtiles.h"

namespace fastdecode {
namespace {

using namespace quant;

template <int BITS, int G, typename S>
at::Tensor dequantize_impl(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                           int64_t threads) {
  const int64_t N = scale.size(0), groups = scale.size(1), K = groups * G;
  at::Tensor w = at::empty({N, K}, scale.options().dtype(at::kFloat));
  const bool has_min = mins.has_value() && mins->defined();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const S* sp = scale.data_ptr<S>();
  const S* mp = has_min ? mins->data_ptr<S>() : nullptr;
  float* wp = w.data_ptr<float>();
  parallel_chunks(N, chunk_outputs(K, 8), threads, [&](int64_t n0, int64_t n1) {
    alignas(32) int8_t unpacked[256];  // 6 bits: the current super-block's codes
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < groups; ++g) {
        __m256 v[G / 8];
        six_or_decode_group<BITS, G>(cp + n * (K * BITS / 8), g, unpacked, v);
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
                      int64_t bits, int64_t group, int64_t threads, int64_t outputs) {
  if (codes.dim() == 3) {  // the tiled layout (qtiles.cpp)
    TORCH_CHECK(group == 32, "tiled codes have groups of 32, not ", group);
    return tiled_dequantize(codes, scale, mins, bits, outputs, threads);
  }
  TORCH_CHECK(codes.is_contiguous() && scale.is_contiguous(), "codes and scales must be contiguous");
  if (is_compact(scale)) {  // decoded once to the float32 layout's values (kscales.h): the same bits
    const c10::optional<at::Tensor> expanded_mins =
        mins.has_value() && mins->defined() ? c10::optional<at::Tensor>(expanded_scales(*mins, group, false)) : c10::nullopt;
    return dequantize(codes, expanded_scales(scale, group, false), expanded_mins, bits, group, threads, outputs);
  }
  check_code_rows(codes, scale, scale.size(1) * group, bits);
  const bool half = scale.scalar_type() == at::kHalf;
#define FD_CASE(B, GS)                                                                               \
  if (bits == B && group == GS)                                                                      \
    return half ? dequantize_impl<B, GS, at::Half>(codes, scale, mins, threads)                       \
                : dequantize_impl<B, GS, float>(codes, scale, mins, threads);
  FD_FOR_EACH_ROWS_FORMAT(FD_CASE)
#undef FD_CASE
  TORCH_CHECK(false, "no kernel for bits=", bits, " group=", group);
}

}  // namespace
}  // namespace fastdecode

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("dequantize", &fastdecode::dequantize); }
