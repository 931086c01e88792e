// A Llama-family decoder block for a step in which every row decodes one token, as ONE op.
//
// At batch 1 the block's products read a few MB and take microseconds each; a Python forward then
// spends more time dispatching its ten ops (about 150 us per block on this CPU) than computing. This
// op runs the same ops, through the dispatcher, with the same arguments in the same order as
// models/llama.py's loop body with engine/plan.py's pure-decode attention, so its results are the
// Python path's bit for bit (tests/unit/test_decode_block.py):
//   qkv = h @ Wqkv (+ bias)            qmatmul (two products concatenated where Q, K and V are of two
//                                      formats, as layers/fused.py's FusedProjection runs them)
//   q, k, v = heads, RoPE              qkv_heads
//   a = attention over the row's slots paged_attention (k, v written into their slots first)
//   x, h = x + a @ Wo (+ bias), norm   qmatmul, add_rms_norm
//   g = act(h @ Wgate) * (h @ Wup)     qmatmul, gated
//   x, h = x + g @ Wdown (+ bias), norm qmatmul, add_rms_norm (the next block's input norm)
//
// Arguments (packed once per model by models/llama_decode.py; lists keep the schema short):
//   x, h [1, N, C]: the residual stream and its normed copy;
//   weights: for qkv, o, gate_up, down in turn (codes, scale, mins?, bias?) of a quantized weight or
//     ([in, out] float32 buffer, None, None, bias?) of a float one, then the MLP norm and the next
//     norm [C]: 18 entries; or 22: then the last 4 are a second qkv product (e.g. a Q6_K V beside a
//     Q4_K Q + K), whose outputs follow the first one's;
//   ints: H, Hkv, activation (0 SiLU, 1 GELU tanh), block, window (0: none), caller threads, the
//     attention's parallel threshold (multiply-adds), then per product (bits, group, activation bits,
//     outputs, threads; bits 0: a float32 weight): 7 + 20 entries (7 + 25 with the second qkv product);
//   floats: norm eps, attention scale;
//   cos, sin [1, N, 1, rot]; keys, values [slots, Hkv, D] of the layer (written in place); slots [N];
//   table [N, n]; key_start, positions [N].
// Returns (x, h) [1, N, C] for the next block.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "decode_block.h"

namespace {

using OptionalTensor = c10::optional<at::Tensor>;
constexpr int64_t kProducts = 4;
constexpr int64_t kHeadInts = 7;
constexpr int64_t kProductInts = 5;
constexpr int64_t kProductTensors = 4;

at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const OptionalTensor& mins,
                   int64_t bits, int64_t group, int64_t threads, int64_t activation_bits, int64_t outputs,
                   const OptionalTensor& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastdecode_kernels::qmatmul", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const OptionalTensor&, int64_t, int64_t, int64_t, int64_t, int64_t,
                                               const OptionalTensor&)>();
  return op.call(x, codes, scale, mins, bits, group, threads, activation_bits, outputs, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_heads(const at::Tensor& qkv, int64_t H, int64_t Hkv,
                                                         const at::Tensor& cos, const at::Tensor& sin) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastdecode_kernels::qkv_heads", "")
                             .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                                 const at::Tensor&, int64_t, int64_t, const OptionalTensor&, double, const at::Tensor&,
                                 const at::Tensor&)>();
  return op.call(qkv, H, Hkv, c10::nullopt, 0.0, cos, sin);
}

at::Tensor paged_attention(const at::Tensor& q, at::Tensor keys, at::Tensor values,
                           const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& slots,
                           const at::Tensor& table, const at::Tensor& key_start, const at::Tensor& positions,
                           int64_t block, int64_t window, double scale) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastdecode_kernels::paged_attention", "")
          .typed<at::Tensor(const at::Tensor&, at::Tensor, at::Tensor, const OptionalTensor&,
                            const OptionalTensor&, const OptionalTensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, int64_t, int64_t, double, const OptionalTensor&)>();
  return op.call(q, keys, values, k_new, v_new, slots, table, key_start, positions, block, window, scale, c10::nullopt);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastdecode_kernels::add_rms_norm", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                       const OptionalTensor&, const at::Tensor&, double)>();
  return op.call(x, delta, c10::nullopt, weight, eps);
}

at::Tensor gated(const at::Tensor& gate_up, int64_t kind) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastdecode_kernels::gated", "")
                             .typed<at::Tensor(const at::Tensor&, int64_t)>();
  return op.call(gate_up, kind);
}

at::Tensor float_matmul(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias, int64_t threads,
                        int64_t in_place_rows, int64_t aliased_in_place_rows) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastdecode_kernels::float_matmul", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, int64_t, int64_t, int64_t)>();
  return op.call(x, weight, bias, threads, in_place_rows, aliased_in_place_rows);
}

// layers/attention.py's paged_attention (q [N, H, D]; k_new, v_new [N, Hkv, D] written first) -> [N, H, D], on
// the caller's threads from the pool's minimum work (pool_threads_for), else one.
at::Tensor paged_attention_on(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                              const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& slots,
                              const at::Tensor& table, const at::Tensor& key_start, const at::Tensor& positions,
                              int64_t block, int64_t window, double scale, int64_t caller_threads,
                              int64_t parallel_min_work) {
  const int64_t work = 2 * q.numel() * table.size(1) * block;
  const int64_t wanted = work >= parallel_min_work ? caller_threads : 1;
  const int previous = at::get_num_threads();
  if (wanted != previous) at::set_num_threads(static_cast<int>(wanted));
  at::Tensor attended = paged_attention(q, keys, values, k_new, v_new, slots, table, key_start, positions, block,
                                        window, scale);
  if (wanted != previous) at::set_num_threads(previous);
  return attended;
}

// rows [M, K] @ a product's weight (+ its bias) -> [M, N]: a quantized weight as layers/quantized.py's
// quantized_linear runs it, a float32 one (bits 0: its [in, out] buffer, no scale; then float_matmul's two in-place
// row limits) as layers/linear.py runs generated rows (float_matmul, the bias added inside); its 5 ints start at
// ints' entry i, its 4 tensors at weights' entry t.
at::Tensor product_at(const at::Tensor& rows, const c10::List<OptionalTensor>& weights, at::IntArrayRef ints, int64_t i,
                      int64_t t) {
  const OptionalTensor codes = weights.get(t), scale = weights.get(t + 1), bias = weights.get(t + 3);
  TORCH_CHECK(codes.has_value(), "decode block: the product at weight entry ", t, " has no weight");
  if (ints[i] == 0) return float_matmul(rows, *codes, bias, ints[i + 4], ints[i + 1], ints[i + 2]);
  TORCH_CHECK(scale.has_value(), "decode block: the quantized product at weight entry ", t, " has no scales");
  // a float32 bias is added inside (as quantized_linear passes it), another after (promoted the same way)
  const bool inside = bias.has_value() && bias->scalar_type() == at::kFloat && bias->is_contiguous();
  at::Tensor out = qmatmul(rows, *codes, *scale, weights.get(t + 2), ints[i], ints[i + 1], ints[i + 4], ints[i + 2],
                           ints[i + 3], inside ? bias : c10::nullopt);
  if (bias.has_value() && !inside) out.add_(*bias);
  return out;
}

at::Tensor product(const at::Tensor& rows, const c10::List<OptionalTensor>& weights, at::IntArrayRef ints, int64_t p) {
  return product_at(rows, weights, ints, kHeadInts + p * kProductInts, p * kProductTensors);
}

std::tuple<at::Tensor, at::Tensor> decode_block(const at::Tensor& x, const at::Tensor& h,
                                                const c10::List<OptionalTensor>& weights, at::IntArrayRef ints,
                                                at::ArrayRef<double> floats, const at::Tensor& cos, const at::Tensor& sin,
                                                const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots,
                                                const at::Tensor& table, const at::Tensor& key_start,
                                                const at::Tensor& positions) {
  const bool split_qkv = weights.size() == (kProducts + 1) * kProductTensors + 2;
  TORCH_CHECK(split_qkv || weights.size() == kProducts * kProductTensors + 2, "decode_block: 18 or 22 weight entries, got ",
              weights.size());
  TORCH_CHECK(ints.size() == static_cast<size_t>(kHeadInts + (kProducts + split_qkv) * kProductInts),
              "decode_block: 27 ints (32 with a second qkv product), got ", ints.size());
  TORCH_CHECK(floats.size() == 2, "decode_block: 2 floats (eps, scale), got ", floats.size());
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.sizes() == h.sizes() && h.is_contiguous(),
              "decode_block: x and h must be [1, N, C] (h contiguous)");
  const int64_t H = ints[0], Hkv = ints[1], activation = ints[2], block = ints[3], window = ints[4];
  const int64_t caller_threads = ints[5], parallel_min_work = ints[6];
  const double eps = floats[0], scale = floats[1];
  const int64_t N = h.size(1), C = h.size(2);
  const OptionalTensor mlp_norm = weights.get(16), next_norm = weights.get(17);
  TORCH_CHECK(mlp_norm.has_value() && next_norm.has_value(), "decode_block: the norms are required");

  at::Tensor qkv = product(h.view({N, C}), weights, ints, 0);  // [N, (H + 2 Hkv) D], or its first part
  if (split_qkv) qkv = at::cat({qkv, product_at(h.view({N, C}), weights, ints, kHeadInts + kProducts * kProductInts,
                                               kProducts * kProductTensors + 2)}, 1);
  auto [q, k, v] = qkv_heads(qkv.view({1, N, qkv.size(1)}), H, Hkv, cos, sin);  // [1, H or Hkv, N, D]
  const int64_t D = q.size(3);
  const at::Tensor attended = paged_attention_on(q[0].transpose(0, 1), keys, values, k[0].transpose(0, 1),
                                                 v[0].transpose(0, 1), slots, table, key_start, positions, block,
                                                 window, scale, caller_threads, parallel_min_work);  // [N, H, D]
  at::Tensor o = product(attended.view({N, H * D}), weights, ints, 1);  // [N, C]
  auto [x1, h1] = add_rms_norm(x, o.view({1, N, C}), *mlp_norm, eps);
  at::Tensor gate_up = product(h1.view({N, C}), weights, ints, 2);  // [N, 2I]
  at::Tensor mlp = product(gated(gate_up.view({1, N, gate_up.size(1)}), activation).view({N, -1}), weights, ints, 3);
  return add_rms_norm(x1, mlp.view({1, N, C}), *next_norm, eps);
}

// ---- an encoder-decoder decoder layer (pre-LayerNorm, GELU MLP: Whisper's) -------------------------------
// models/whisper_decode.py hands each layer of a pure decode step over encoded windows to this op. It runs
// the ops of models/bart.py's decode loop body (pre_norm), engine/plan.py's pure-decode attention and
// engine/speech_source.py's cross-attention with the same arguments in the same order, so its results are
// the Python path's bit for bit (tests/speech/test_whisper_decode_block.py):
//   h = LN(x); qkv = h @ Wqkv + b; q, k, v heads; a = paged attention (k, v written first); x = x + (a @ Wo + b)
//   h = LN(x); c = h @ Wq + b; each source's rows over its window's keys (cross_attention); x = x + (c @ Wo + b)
//   h = LN(x); x = x + (gelu(h @ Wup + b) @ Wdown + b)
// Arguments:
//   x [1, N, C];
//   weights: for qkv, o, cross_q, cross_o, up, down in turn (codes, scale, mins?, bias?) of a quantized weight
//     or ([in, out] float32 buffer, None, None, bias?), then the weight and bias of the self-attention,
//     cross-attention and MLP norms: 30 entries;
//   ints: H, block, window (0: none), caller threads, the attention's parallel threshold (multiply-adds), then
//     per product (bits, group, activation bits, outputs, threads; bits 0: float32): 5 + 30, then per source
//     (first flat row, rows, threads of its cross-attention), the sources covering rows 0 .. N-1 in order;
//   floats: norm eps, attention scale (self and cross);
//   keys, values [slots, H, D] of the layer (written in place); slots [N]; table [N, n]; key_start, positions [N];
//   source_keys, source_values [1, H, S, D] (float32 or float16) and source_lengths [1] per source.
// Returns x [1, N, C] for the next layer.
constexpr int64_t kCrossProducts = 6;
constexpr int64_t kCrossHeadInts = 5;

at::Tensor cross_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& lengths, double scale, int64_t threads) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastdecode_kernels::cross_attention", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, double, int64_t)>();
  return op.call(q, keys, values, lengths, scale, threads);
}

at::Tensor cross_decode_block(const at::Tensor& x, const c10::List<OptionalTensor>& weights, at::IntArrayRef ints,
                              at::ArrayRef<double> floats, const at::Tensor& keys, const at::Tensor& values,
                              const at::Tensor& slots, const at::Tensor& table, const at::Tensor& key_start,
                              const at::Tensor& positions, at::TensorList source_keys, at::TensorList source_values,
                              at::TensorList source_lengths) {
  constexpr int64_t norms = kCrossProducts * kProductTensors;
  const int64_t sources = static_cast<int64_t>(source_keys.size());
  TORCH_CHECK(weights.size() == static_cast<size_t>(norms + 6), "cross_decode_block: 30 weight entries, got ",
              weights.size());
  TORCH_CHECK(sources >= 1 && source_values.size() == source_keys.size() && source_lengths.size() == source_keys.size(),
              "cross_decode_block: one keys, values and lengths tensor per source");
  const int64_t source_ints = kCrossHeadInts + kCrossProducts * kProductInts;
  TORCH_CHECK(ints.size() == static_cast<size_t>(source_ints + 3 * sources), "cross_decode_block: ",
              source_ints + 3 * sources, " ints for ", sources, " sources, got ", ints.size());
  TORCH_CHECK(floats.size() == 2, "cross_decode_block: 2 floats (eps, scale), got ", floats.size());
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "cross_decode_block: x must be [1, N, C]");
  const int64_t H = ints[0], block = ints[1], window = ints[2], caller_threads = ints[3], parallel_min_work = ints[4];
  const double eps = floats[0], scale = floats[1];
  const int64_t N = x.size(1), C = x.size(2), D = C / H;
  TORCH_CHECK(H * D == C, "cross_decode_block: ", H, " heads do not divide ", C);
  std::vector<c10::optional<at::Tensor>> norm(6);
  for (int64_t i = 0; i < 6; ++i) {
    norm[i] = weights.get(norms + i);
    TORCH_CHECK(norm[i].has_value(), "cross_decode_block: the norms' weights and biases are required");
  }
  const auto run = [&](const at::Tensor& rows, int64_t p) {  // product p (qkv, o, cross_q, cross_o, up, down)
    return product_at(rows, weights, ints, kCrossHeadInts + p * kProductInts, p * kProductTensors);
  };
  const auto layer_norm = [&](const at::Tensor& in, int64_t which) {  // F.layer_norm(in, (C,), weight, bias, eps)
    return at::layer_norm(in, {C}, norm[2 * which], norm[2 * which + 1], eps);
  };

  // self-attention
  at::Tensor qkv = run(layer_norm(x, 0).view({N, C}), 0).view({N, 3, H, D});  // [N, 3C] -> q, k, v [N, H, D]
  const at::Tensor attended = paged_attention_on(qkv.select(1, 0), keys, values, qkv.select(1, 1), qkv.select(1, 2),
                                                 slots, table, key_start, positions, block, window, scale,
                                                 caller_threads, parallel_min_work);  // [N, H, D]
  at::Tensor out = x + run(attended.view({N, C}), 1).view({1, N, C});

  // cross-attention: each source's rows (a window's beams folded into its query axis) over its own keys
  const at::Tensor q = run(layer_norm(out, 1).view({N, C}), 2).view({1, N, H, D}).transpose(1, 2);  // [1, H, N, D]
  std::vector<at::Tensor> parts;
  parts.reserve(sources);
  int64_t next = 0;
  for (int64_t s = 0; s < sources; ++s) {
    const int64_t first = ints[source_ints + 3 * s], rows = ints[source_ints + 3 * s + 1];
    TORCH_CHECK(first == next && rows >= 1 && first + rows <= N, "cross_decode_block: source ", s, " covers rows ",
                first, "..", first + rows - 1, ", expected from ", next);
    next = first + rows;
    parts.push_back(cross_attention(q.narrow(2, first, rows), source_keys[s], source_values[s], source_lengths[s],
                                    scale, ints[source_ints + 3 * s + 2])[0]);  // [H, rows, D]
  }
  TORCH_CHECK(next == N, "cross_decode_block: the sources cover ", next, " of ", N, " rows");
  const at::Tensor crossed = sources == 1 ? parts[0] : at::cat(parts, 1);  // [H, N, D]
  out = out + run(crossed.transpose(0, 1).reshape({N, C}), 3).view({1, N, C});

  // MLP
  const at::Tensor up = at::gelu(run(layer_norm(out, 2).view({N, C}), 4));  // [N, I]
  return out + run(up, 5).view({1, N, C});
}

}  // namespace

namespace fastdecode {
DecodeBlockOp* const llama_decode_block = &decode_block;
BlockProductOp* const block_product = &product_at;
CrossDecodeBlockOp* const whisper_decode_block = &cross_decode_block;
}  // namespace fastdecode

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("cross_decode_block(Tensor x, Tensor?[] weights, int[] ints, float[] floats, Tensor(a!) keys, "
        "Tensor(b!) values, Tensor slots, Tensor table, Tensor key_start, Tensor positions, Tensor[] source_keys, "
        "Tensor[] source_values, Tensor[] source_lengths) -> Tensor");
  m.def("decode_block(Tensor x, Tensor h, Tensor?[] weights, int[] ints, float[] floats, Tensor cos, Tensor sin, "
        "Tensor(a!) keys, Tensor(b!) values, Tensor slots, Tensor table, Tensor key_start, Tensor positions) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) {
  m.impl("decode_block", &decode_block);
  m.impl("cross_decode_block", &cross_decode_block);
}
