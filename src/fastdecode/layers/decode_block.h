// decode_block.cpp's Llama-family block for a pure decode step, for the other ops of the extension that
// run blocks (decode_stack.cpp); its arguments are decode_block.cpp's (see the top of that file).
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

}  // namespace fastdecode
