// tiled_gated_gemm: a gated MLP's first half in one op, x [M, K] x the tiled [gate | up] weight -> act(gate) * up
// [M, I], the bits of the gated op on tiled_gemm's product (layers/elementwise.py's gated(tiled_gemm(...))).
//
// Where the rows-in-lanes kernel runs (qlanes.h: 4-bit codes, AVX-512 VNNI, no AMX, from LANES_MIN_ROWS rows, I a
// multiple of 16), each pass computes 16 gate outputs and their 16 up outputs for every row and applies the
// activation to them while they are in L1 (gated_avx512.cpp's gated_row: the gated op's own 16-lane code), so the
// [M, 2I] product is never written to memory and read back; elsewhere it runs the two ops.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>

#include "amx.h"
#include "isa.h"
#include "kscales.h"
#include "parallel.h"
#include "qlanes.h"
#include "qrows.h"
#include "qtiles.h"

namespace {

using namespace fastdecode;

at::Tensor two_ops(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& mins, int64_t bits, int64_t outputs, int64_t threads,
                   int64_t kind) {
  static const auto gemm = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("fastdecode_kernels::tiled_gemm", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const c10::optional<at::Tensor>&, int64_t, int64_t, int64_t,
                                                 const c10::optional<at::Tensor>&)>();
  static const auto gated = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("fastdecode_kernels::gated", "split")
                                .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>();
  return gated.call(gemm.call(x, codes, scale, mins, bits, outputs, threads, c10::nullopt), kind, threads);
}

template <typename S>
at::Tensor lanes_gated(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& mins, int64_t outputs, int64_t threads, int64_t kind) {
  const int64_t M = x.size(0), K = x.size(1), I = outputs / 2;
  const bool has_min = mins.has_value() && mins->defined();
  const quant::QuantizedRows q = quant::quantize_rows<32>(x.data_ptr<float>(), M, K, has_min, threads);  // tiled_gemm's
  const lanes::LaneRows rows = avx512::lane_rows(q, 0, M, has_min);
  at::Tensor y = at::empty({M, I}, x.options());
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const S* sp = quant::scale_data<S>(scale);
  const S* mp = has_min ? quant::scale_data<S>(*mins) : nullptr;
  float* yp = y.data_ptr<float>();
  parallel_chunks(I / 16, 1, threads, [&](int64_t p0, int64_t p1) {
    thread_local lanes::LaneTiles buffer;
    for (int64_t p = p0; p < p1; ++p)
      avx512::lanes_gated_pass<S>(rows, cp, sp, mp, 2 * p, I / 8 + 2 * p, kind, yp, I, buffer);
  }, 32 * M * K);
  return y;
}

// x [M, K] float32, a tiled weight of `outputs` = 2I outputs ([gate | up]) -> [M, I] (kind 0: SiLU, 1: GELU tanh).
at::Tensor tiled_gated_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& mins, int64_t bits, int64_t outputs, int64_t threads,
                            int64_t kind) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous float32 [M, K]");
  TORCH_CHECK(kind == 0 || kind == 1, "activation is 0 (SiLU) or 1 (GELU tanh), not ", kind);
  TORCH_CHECK(outputs > 0 && outputs % 2 == 0, "a [gate | up] weight has an even number of outputs, not ", outputs);
  check_tiled(codes, scale, mins, bits, outputs);
  TORCH_CHECK(x.size(1) == 32 * codes.size(1), "x has ", x.size(1), " inputs, the weight ", 32 * codes.size(1));
  if (!(bits == 4 && use_avx512() && !use_amx() && x.size(0) >= lanes::LANES_MIN_ROWS && outputs % 32 == 0))
    return two_ops(x, codes, scale, mins, bits, outputs, threads, kind);
  if (quant::is_compact(scale)) return lanes_gated<quant::KScale>(x, codes, scale, mins, outputs, threads, kind);
  if (scale.scalar_type() == at::kHalf) return lanes_gated<at::Half>(x, codes, scale, mins, outputs, threads, kind);
  return lanes_gated<float>(x, codes, scale, mins, outputs, threads, kind);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("tiled_gated_gemm(Tensor x, Tensor codes, Tensor scale, Tensor? mins, int bits, int outputs, int threads, "
        "int activation) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("tiled_gated_gemm", &tiled_gated_gemm); }
