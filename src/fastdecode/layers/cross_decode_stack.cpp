// Every Whisper decoder layer of a pure decode step as ONE op.
//
// decode_block.cpp's cross_decode_block runs one layer; called once per layer from Python, each call marshals a
// 30-entry weight list, a dozen more arguments and the step's per-layer attention operands: some 50 us a layer,
// about 5% of a tiny.en int8 greedy step on one core. CrossDecodeStack holds every layer's weight list, packed
// once per model by models/whisper_decode.py; cross_decode_stack runs cross_decode_block over them in order,
// each layer with the arguments its own call gets, so its result is theirs bit for bit
// (tests/speech/test_whisper_decode_stack.py).
// Arguments:
//   stack: each layer's cross_decode_block weight list (30 entries), in layer order;
//   ints: the 5 head ints of cross_decode_block, then each layer's 30 product ints (layer order), then the 3
//     ints of each source (first flat row, rows, threads);
//   floats, slots, table, key_start, positions: cross_decode_block's (the layers share one attention kind);
//   keys, values: every layer's pool [slots, H, D] (written in place), in layer order;
//   source_keys, source_values: layer-major, each layer's sources in order ([1, H, S, D] each);
//   source_lengths: per source [1].
// Returns x [1, N, C] after the last layer.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "decode_block.h"

namespace {

using OptionalTensor = c10::optional<at::Tensor>;
constexpr int64_t kLayerEntries = 30;  // 6 products x 4 entries, 3 norms x (weight, bias)
constexpr int64_t kHeadInts = 5;
constexpr int64_t kLayerInts = 30;  // 6 products x 5 ints

struct CrossDecodeStack : torch::CustomClassHolder {
  std::vector<c10::List<OptionalTensor>> weights;  // per layer

  void add_layer(c10::List<OptionalTensor> layer) {
    TORCH_CHECK(static_cast<int64_t>(layer.size()) == kLayerEntries, "CrossDecodeStack: a layer has ",
                kLayerEntries, " weight entries, got ", layer.size());
    weights.push_back(std::move(layer));
  }

  int64_t layers() const { return static_cast<int64_t>(weights.size()); }
};

at::Tensor cross_decode_stack(const c10::intrusive_ptr<CrossDecodeStack>& stack, const at::Tensor& x,
                              at::IntArrayRef ints, at::ArrayRef<double> floats, at::TensorList keys,
                              at::TensorList values, const at::Tensor& slots, const at::Tensor& table,
                              const at::Tensor& key_start, const at::Tensor& positions, at::TensorList source_keys,
                              at::TensorList source_values, at::TensorList source_lengths) {
  const int64_t layers = stack->layers();
  TORCH_CHECK(layers > 0, "cross_decode_stack: the stack has no layers");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == layers && static_cast<int64_t>(values.size()) == layers,
              "cross_decode_stack: one keys and one values pool per layer (", layers, " layers), got ", keys.size(),
              " and ", values.size());
  const int64_t sources = static_cast<int64_t>(source_lengths.size());
  TORCH_CHECK(sources >= 1 && static_cast<int64_t>(source_keys.size()) == layers * sources &&
                  source_values.size() == source_keys.size(),
              "cross_decode_stack: each layer's keys and values of ", sources, " sources (", layers * sources,
              " each), got ", source_keys.size(), " and ", source_values.size());
  const int64_t source_ints = 3 * sources, layer_ints = kHeadInts + layers * kLayerInts;
  TORCH_CHECK(static_cast<int64_t>(ints.size()) == layer_ints + source_ints, "cross_decode_stack: ",
              layer_ints + source_ints, " ints for ", layers, " layers and ", sources, " sources, got ", ints.size());
  // one layer's cross_decode_block ints: the head's, its products', the sources'
  std::vector<int64_t> block_ints(ints.begin(), ints.begin() + kHeadInts);
  block_ints.resize(kHeadInts + kLayerInts);
  block_ints.insert(block_ints.end(), ints.end() - source_ints, ints.end());
  at::Tensor out = x;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* layer = ints.data() + kHeadInts + l * kLayerInts;
    std::copy(layer, layer + kLayerInts, block_ints.begin() + kHeadInts);
    out = fastdecode::whisper_decode_block(out, stack->weights[l], block_ints, floats, keys[l], values[l], slots,
                                           table, key_start, positions, source_keys.slice(l * sources, sources),
                                           source_values.slice(l * sources, sources), source_lengths);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.class_<CrossDecodeStack>("CrossDecodeStack")
      .def(torch::init<>())
      .def("add_layer", &CrossDecodeStack::add_layer)
      .def("layers", &CrossDecodeStack::layers);
  m.def("cross_decode_stack(__torch__.torch.classes.fastdecode_kernels.CrossDecodeStack stack, Tensor x, int[] ints, "
        "float[] floats, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor slots, Tensor table, Tensor key_start, "
        "Tensor positions, Tensor[] source_keys, Tensor[] source_values, Tensor[] source_lengths) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("cross_decode_stack", &cross_decode_stack); }
