// The tiled layout's kernels (qtiles.cpp), called by qmatmul.cpp's ops when the codes are 3-D.
#pragma once

#include <ATen/ATen.h>

namespace fastdecode {

// x [M, K] float32 -> y [M, outputs] float32 (see qtiles.cpp for the layout and the arithmetic).
at::Tensor tiled_qmatmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& mins, int64_t bits, int64_t outputs, int64_t threads,
                         int64_t activation_bits, const float* bias = nullptr, int64_t bias_size = 0);

// The float32 weights [outputs, K], bit-identical to quantized.dequantize().
at::Tensor tiled_dequantize(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                            int64_t bits, int64_t outputs, int64_t threads);

}  // namespace fastdecode
