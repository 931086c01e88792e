// The tiled layout's kernels (qtiles.cpp), called by qmatmul.cpp's ops when the codes are 3-D.
#pragma once

#include <ATen/ATen.h>

namespace fastdecode {

// TORCH_CHECKs that codes, scale and mins are a tiled weight of `bits`-bit codes and `outputs` outputs.
void check_tiled(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& mins, int64_t bits,
                 int64_t outputs);

// x [M, K] float32 -> y [M, outputs] float32 (see qtiles.cpp for the layout and the arithmetic).
at::Tensor tiled_qmatmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& mins, int64_t bits, int64_t outputs, int64_t threads,
                         int64_t activation_bits, const float* bias = nullptr, int64_t bias_size = 0);

// The float32 weights [outputs, K], bit-identical to quantized.dequantize() (qtiles_dequantize.cpp).
at::Tensor tiled_dequantize(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                            int64_t bits, int64_t outputs, int64_t threads);

// Tiles [t0, t1) of those weights (rows t0 * 8 .. min(outputs, t1 * 8) - 1, the same bits) into `out`, K floats
// apart, on this thread, without a tensor: false (nothing written) for compact K-quant scales.
bool tiled_dequantize_range(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                            int64_t bits, int64_t outputs, int64_t t0, int64_t t1, float* out);

}  // namespace fastdecode
