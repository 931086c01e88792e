// decode_block.cpp's blocks for a pure decode step, for the other ops of the extension that run blocks
// (decode_stack.cpp, cross_decode_stack.cpp); their arguments are decode_block.cpp's (see that file).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace fastdecode {

// (x, h, weights, ints, floats, cos, sin, keys, values, slots, table, key_start, positions) -> (x, h)
using DecodeBlockOp = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const c10::List<c10::optional<at::Tensor>>&, at::IntArrayRef,
    at::ArrayRef<double>, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
extern DecodeBlockOp* const llama_decode_block;

// decode_block.cpp's product: rows [M, K] @ the weight whose 4 entries start at weights' entry t, with the 5 ints
// (bits, group, activation bits, outputs, threads; bits 0: a float32 [in, out] buffer) from ints' entry i -> [M, N]
using BlockProductOp = at::Tensor(const at::Tensor&, const c10::List<c10::optional<at::Tensor>>&, at::IntArrayRef,
                                  int64_t, int64_t);
extern BlockProductOp* const block_product;

// decode_block.cpp's Whisper decoder layer (cross_decode_block): (x, weights, ints, floats, keys, values, slots,
// table, key_start, positions, source_keys, source_values, source_lengths) -> x
using CrossDecodeBlockOp = at::Tensor(const at::Tensor&, const c10::List<c10::optional<at::Tensor>>&, at::IntArrayRef,
                                      at::ArrayRef<double>, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList,
                                      at::TensorList, at::TensorList);
extern CrossDecodeBlockOp* const whisper_decode_block;

}  // namespace fastdecode
