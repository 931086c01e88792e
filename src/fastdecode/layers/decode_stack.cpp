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
//
// decode_stack_logits is the whole step of a model whose embedding table and logits layer the kernels run
// (set once per model with set_ends): the tokens' embedding rows (the dequantize op on the rows looked up, as
// layers/quantized.py's embed), the first block's input norm (rms_norm), every block, then the logits layer
// on the final-normed rows (decode_block.cpp's product, as linear() runs generated rows) -> logits [1, N, V],
// the Python forward's bit for bit (tests/unit/test_decode_step_logits.py). Its ints: the table's (bits,
// group), then the logits layer's 5 product ints; the others are decode_stack's.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
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
// set_ends' entries: the embedding table's codes, scale, mins?; the first block's input norm; the logits
// layer's 4 product entries (decode_block.cpp's)
constexpr int64_t kEnds = 8;
constexpr int64_t kEndInts = 7;

struct DecodeStack : torch::CustomClassHolder {
  std::vector<c10::List<OptionalTensor>> weights;  // per block
  std::vector<int64_t> kinds;                      // per block: its kind, numbered in order of first use
  std::vector<int64_t> kind_ints;                  // per kind: how many ints it takes
  c10::List<OptionalTensor> ends;                  // decode_stack_logits' tensors (kEnds), once set

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

  void set_ends(c10::List<OptionalTensor> entries) {
    TORCH_CHECK(static_cast<int64_t>(entries.size()) == kEnds, "DecodeStack: ", kEnds, " end entries, got ",
                entries.size());
    for (const int64_t required : {0, 1, 3, 4})
      TORCH_CHECK(entries.get(required).has_value(), "DecodeStack: end entry ", required, " is required");
    ends = std::move(entries);
  }
};

at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scale, const OptionalTensor& mins, int64_t bits,
                      int64_t group, int64_t threads, int64_t outputs) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastdecode_kernels::dequantize", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, int64_t,
                                               int64_t, int64_t, int64_t)>();
  return op.call(codes, scale, mins, bits, group, threads, outputs);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastdecode_kernels::rms_norm", "")
                             .typed<at::Tensor(const at::Tensor&, const OptionalTensor&, double)>();
  return op.call(x, weight, eps);
}

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

// tokens [N] (int64) -> logits [1, N, V]: the embedding rows, the first norm, every block, the logits layer
at::Tensor decode_stack_logits(const c10::intrusive_ptr<DecodeStack>& stack, const at::Tensor& tokens,
                               at::IntArrayRef end_ints, at::IntArrayRef ints, at::ArrayRef<double> floats,
                               const at::Tensor& cos, const at::Tensor& sin, at::TensorList keys, at::TensorList values,
                               const at::Tensor& slots, const at::Tensor& table, const at::Tensor& key_start,
                               const at::Tensor& positions) {
  const c10::List<OptionalTensor>& ends = stack->ends;
  TORCH_CHECK(static_cast<int64_t>(ends.size()) == kEnds, "decode_stack_logits: the stack's ends are not set");
  TORCH_CHECK(static_cast<int64_t>(end_ints.size()) == kEndInts, "decode_stack_logits: ", kEndInts, " end ints, got ",
              end_ints.size());
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong, "decode_stack_logits: tokens must be [N] int64");
  TORCH_CHECK(!floats.empty(), "decode_stack_logits: the floats start with the norm eps");
  const int64_t N = tokens.size(0);
  const OptionalTensor mins = ends.get(2);
  const at::Tensor x = dequantize(ends.get(0)->index_select(0, tokens), ends.get(1)->index_select(0, tokens),
                                  mins.has_value() ? OptionalTensor(mins->index_select(0, tokens)) : c10::nullopt,
                                  end_ints[0], end_ints[1], 1, N);  // [N, C]
  const int64_t C = x.size(1);
  const at::Tensor x3 = x.view({1, N, C});
  const at::Tensor h = rms_norm(x3, *ends.get(3), floats[0]);
  const at::Tensor normed =
      std::get<1>(decode_stack(stack, x3, h, ints, floats, cos, sin, keys, values, slots, table, key_start, positions));
  const at::Tensor logits = fastdecode::block_product(normed.view({N, C}), ends, end_ints, 2, 4);  // [N, V]
  return logits.view({1, N, logits.size(1)});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_block", &DecodeStack::add_block)
      .def("blocks", &DecodeStack::blocks)
      .def("set_ends", &DecodeStack::set_ends);
  m.def("decode_stack(__torch__.torch.classes.fastdecode_kernels.DecodeStack stack, Tensor x, Tensor h, int[] ints, "
        "float[] floats, Tensor cos, Tensor sin, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor slots, Tensor table, "
        "Tensor key_start, Tensor positions) -> (Tensor, Tensor)");
  m.def("decode_stack_logits(__torch__.torch.classes.fastdecode_kernels.DecodeStack stack, Tensor tokens, "
        "int[] end_ints, int[] ints, float[] floats, Tensor cos, Tensor sin, Tensor(a!)[] keys, Tensor(b!)[] values, "
        "Tensor slots, Tensor table, Tensor key_start, Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) {
  m.impl("decode_stack", &decode_stack);
  m.impl("decode_stack_logits", &decode_stack_logits);
}
