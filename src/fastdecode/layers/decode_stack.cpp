// Every Llama-family block of a pure decode step as ONE op.
//
// A batch-1 step of SmolLM2-135M is 30 blocks of a few tens of microseconds of products each. Called one by
// one from Python (decode_block.cpp's op), each call marshals an 18-entry weight list and a dozen more
// arguments and runs the model's loop body in Python: about 10% of the step on this CPU. DecodeStack holds
// every block's weight list, packed once per model by models/llama_decode.py; decode_stack runs
// decode_block.cpp's block over them in order with the arguments the per-block calls get, so its results
// are theirs bit for bit (tests/unit/test_decode_block.py). It serves models whose layers share one
// attention kind and window: the step's slots, table, key starts and positions are then every layer's.
// Arguments:
//   stack: each block's decode_block weight list (18 or 22 entries) and kind, in block order;
//   ints: each kind's decode_block ints (27, or 32 where its blocks have a second qkv product), kinds in order;
//   floats, cos, sin, slots, table, key_start, positions: decode_block's;
//   keys, values: every layer's pool [slots, Hkv, D] (written in place), in block order.
// Returns (x, h) [1, N, C] after the last block (h: normed by the final norm).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "decode_block.h"

namespace {

using OptionalTensor = c10::optional<at::Tensor>;
constexpr int64_t kBlockEntries = 18;  // 4 products x 4 entries, the MLP norm, the next norm
constexpr int64_t kSplitEntries = 22;  // then a second qkv product's 4
constexpr int64_t kBlockInts = 27;     // 7 head ints + 5 per product
constexpr int64_t kSplitInts = 32;

struct DecodeStack : torch::CustomClassHolder {
  std::vector<c10::List<OptionalTensor>> weights;  // per block
  std::vector<int64_t> kinds;                      // per block: its kind, numbered in order of first use
  std::vector<int64_t> kind_ints;                  // per kind: how many ints it takes

  void add_block(c10::List<OptionalTensor> block, int64_t kind) {
    const int64_t entries = static_cast<int64_t>(block.size());
    TORCH_CHECK(entries == kBlockEntries || entries == kSplitEntries,
                "DecodeStack: a block has 18 or 22 weight entries, got ", entries);
    const int64_t known = static_cast<int64_t>(kind_ints.size());
    TORCH_CHECK(kind >= 0 && kind <= known, "DecodeStack: kinds are numbered in order of first use; got ", kind,
                " after ", known);
    const int64_t ints = entries == kSplitEntries ? kSplitInts : kBlockInts;
    if (kind == known) kind_ints.push_back(ints);
    TORCH_CHECK(kind_ints[kind] == ints, "DecodeStack: the blocks of kind ", kind, " differ in their products");
    weights.push_back(std::move(block));
    kinds.push_back(kind);
  }

  int64_t blocks() const { return static_cast<int64_t>(weights.size()); }
};

std::tuple<at::Tensor, at::Tensor> decode_stack(const c10::intrusive_ptr<DecodeStack>& stack, const at::Tensor& x,
                                                const at::Tensor& h, at::IntArrayRef ints, at::ArrayRef<double> floats,
                                                const at::Tensor& cos, const at::Tensor& sin, at::TensorList keys,
                                                at::TensorList values, const at::Tensor& slots, const at::Tensor& table,
                                                const at::Tensor& key_start, const at::Tensor& positions) {
  const int64_t blocks = stack->blocks();
  TORCH_CHECK(blocks > 0, "decode_stack: the stack has no blocks");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == blocks && static_cast<int64_t>(values.size()) == blocks,
              "decode_stack: one keys and one values pool per block (", blocks, " blocks), got ", keys.size(), " and ",
              values.size());
  std::vector<int64_t> starts;  // each kind's first int
  int64_t total = 0;
  for (const int64_t count : stack->kind_ints) {
    starts.push_back(total);
    total += count;
  }
  TORCH_CHECK(static_cast<int64_t>(ints.size()) == total, "decode_stack: ", total, " ints for the stack's kinds, got ",
              ints.size());
  at::Tensor out = x, normed = h;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t kind = stack->kinds[b];
    std::tie(out, normed) = fastdecode::llama_decode_block(out, normed, stack->weights[b],
                                                           ints.slice(starts[kind], stack->kind_ints[kind]), floats,
                                                           cos, sin, keys[b], values[b], slots, table, key_start,
                                                           positions);
  }
  return {out, normed};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_block", &DecodeStack::add_block)
      .def("blocks", &DecodeStack::blocks);
  m.def("decode_stack(__torch__.torch.classes.fastdecode_kernels.DecodeStack stack, Tensor x, Tensor h, int[] ints, "
        "float[] floats, Tensor cos, Tensor sin, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor slots, Tensor table, "
        "Tensor key_start, Tensor positions) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("decode_stack", &decode_stack); }
