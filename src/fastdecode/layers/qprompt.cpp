// prompt_qmatmul: prompt rows (int8-rounded, as llama.cpp runs a prompt) times a rows-layout weight with 8-bit
// codes in groups of 16 (Q6_K: layers/quantized.py keeps it in the rows layout). The arithmetic and the
// pair-tile layout are in qprompt.h; here the repacking, the AVX2 kernel and the op (the AVX-512 VNNI kernel,
// the same bits: qprompt_avx512.cpp, used where isa.h's use_avx512() holds).
//
// Why a kernel of its own: the decode kernel for this layout (qmatmul.cpp's dot_tile) sums each output in
// 8 lanes and adds them horizontally, fine for a few rows; a prompt's hundreds of rows ran it at 15 GMAC/s
// (one core, 8960 x 1536), below the exact float kernel. Repacked 16 outputs at a time, each weight byte is
// decoded once per call and each activation load feeds 16 outputs.
//
// AVX2 has no unsigned x signed dot product without int16 saturation for 8-bit codes: maddubs takes |code|
// as the unsigned operand and the activation with the code's sign (|pair sum| <= 2 * 128 * 127 < 2^15, the
// sign trick of qmatmul.cpp), then madd to int32: the same exact int32 dot products as VNNI's.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "isa.h"
#include "kscales.h"
#include "parallel.h"
#include "qprompt.h"
#include "qrows.h"
#include "qtiles_avx512.h"
#include "six_bit.h"

namespace fastdecode {
namespace prompt {
namespace {

using quant::QuantizedRows;

constexpr int64_t AMX_MIN_ROWS = 8;  // fewer rows: the AVX2 / VNNI kernels (AMX's tiles of 16 rows mostly empty)

// Outputs [n0, n0 + 16) of the rows-layout weight (codes [N, K] int8, or packed 6-bit [N, 3K/4]: six_bit.h,
// scale [N, K/16]) into `tile`: per 8 outputs and block, their 8 x 32 code bytes transposed as 8 x 8 dwords in
// registers; wide: the code sums too (only the VNNI kernel reads them).
template <typename S>
void pack_pair(const uint8_t* codes, bool six, const S* scale, int64_t N, int64_t K, int64_t n0, bool wide,
               PairTile& tile) {
  const int64_t row_bytes = six ? K * 6 / 8 : K;
  const int64_t blocks = K / 32, valid = std::min<int64_t>(PAIR, N - n0);
  tile.codes.resize(blocks * 8 * PAIR * 4);
  tile.scale.resize(blocks * 2 * PAIR);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* rows[8];
    for (int o = 0; o < 8; ++o) rows[o] = 8 * half + o < valid ? codes + (n0 + 8 * half + o) * row_bytes : nullptr;
    alignas(32) int8_t unpacked[8][256];  // six: the 8 outputs' codes of the current super-block
    for (int64_t b = 0; b < blocks; ++b) {
      if (six && b % 8 == 0)
        for (int o = 0; o < 8; ++o)
          if (rows[o] != nullptr) quant::six_super(rows[o] + b / 8 * quant::SIX_SUPER_BYTES, unpacked[o]);
      __m256 v[8];  // dwords as float lanes: moved, never computed on
      for (int o = 0; o < 8; ++o)
        v[o] = rows[o] == nullptr ? _mm256_setzero_ps()
               : _mm256_loadu_ps(reinterpret_cast<const float*>(six ? unpacked[o] + 32 * (b % 8) : reinterpret_cast<const int8_t*>(rows[o]) + 32 * b));
      quant::transpose8(v);  // v[c]: inputs 4c..4c+3 of the 8 outputs
      for (int c = 0; c < 8; ++c)
        _mm256_storeu_ps(reinterpret_cast<float*>(tile.codes.data() + (b * 8 + c) * PAIR * 4 + 32 * half), v[c]);
    }
  }
  for (int64_t o = 0; o < PAIR; ++o)
    for (int64_t g = 0; g < 2 * blocks; ++g)
      tile.scale[g * PAIR + o] = o < valid ? quant::load_scale(scale + (n0 + o) * 2 * blocks + g) : 0.0f;
  if (wide) avx512::pair_code_sums(tile, blocks);
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Rows [m0, m0 + RB) x the 8 outputs of half `half` (0: outputs 0-7, 1: 8-15) of the pair tile.
template <int RB>
void half_rows(const PairTile& tile, const QuantizedRows& q, int64_t m0, int half, float* y, int64_t N, int64_t n0,
               int64_t valid) {
  const int64_t K = q.K, blocks = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* w = tile.codes.data() + b * 8 * PAIR * 4 + half * 32;
    __m256i dot[2][RB];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * PAIR * 4));
      const __m256i magnitude = _mm256_sign_epi8(v, v);  // |code|; -128 stays 0x80 = 128 unsigned
      for (int r = 0; r < RB; ++r) {
        const __m256i a = _mm256_sign_epi8(broadcast4(q.codes.data() + (m0 + r) * K + 32 * b + 4 * c), v);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, a), ones);
        dot[c / 4][r] = c % 4 == 0 ? p : _mm256_add_epi32(dot[c / 4][r], p);
      }
    }
    const __m256 s0 = _mm256_loadu_ps(tile.scale.data() + (2 * b) * PAIR + 8 * half);
    const __m256 s1 = _mm256_loadu_ps(tile.scale.data() + (2 * b + 1) * PAIR + 8 * half);
    for (int r = 0; r < RB; ++r) {
      const __m256 d = _mm256_set1_ps(q.scale[(m0 + r) * blocks + b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[0][r]), _mm256_mul_ps(s0, d), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[1][r]), _mm256_mul_ps(s1, d), acc[r]);
    }
  }
  const int64_t lanes = std::min<int64_t>(8, valid - 8 * half);
  for (int r = 0; r < RB; ++r) {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[r]);
    std::copy(out, out + lanes, y + (m0 + r) * N + n0 + 8 * half);
  }
}

void pair_rows(const PairTile& tile, const QuantizedRows& q, int64_t M, float* y, int64_t N, int64_t n0,
               int64_t valid) {
  for (int half = 0; half < 2 && 8 * half < valid; ++half) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) half_rows<4>(tile, q, m, half, y, N, n0, valid);
    for (; m < M; ++m) half_rows<1>(tile, q, m, half, y, N, n0, valid);
  }
}

// y[m, n0 + o] += bias[n0 + o] for every row, o < valid (the pair's outputs, still in cache).
void add_bias(const float* bias, int64_t M, float* y, int64_t N, int64_t n0, int64_t valid) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t o = 0; o < valid; ++o) y[m * N + n0 + o] += bias[n0 + o];
}

template <typename S>
at::Tensor prompt_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, int64_t threads,
                       const float* bias) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  const bool six = codes.size(1) != K;  // packed 6-bit codes (checked by prompt_qmatmul)
  if (M >= AMX_MIN_ROWS && use_amx()) return amx::rows16_gemm(x, codes, six, scale, threads, bias);  // the same bits
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedRows q = quant::quantize_rows<16>(x.data_ptr<float>(), M, K, false, threads);
  const bool wide = use_avx512();  // read once: the whole product on one kernel
  const std::vector<uint8_t> offset = wide ? avx512::offset_rows(q) : std::vector<uint8_t>();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const S* sp = scale.data_ptr<S>();
  float* yp = y.data_ptr<float>();
  const int64_t pairs = (N + PAIR - 1) / PAIR;
  parallel_chunks(pairs, 1, threads, [&](int64_t p0, int64_t p1) {
    PairTile tile;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * PAIR, valid = std::min<int64_t>(PAIR, N - n0);
      pack_pair<S>(cp, six, sp, N, K, n0, wide, tile);
      if (wide)
        avx512::prompt_pair_rows(tile, q, offset.data(), M, yp, N, n0, valid);
      else
        pair_rows(tile, q, M, yp, N, n0, valid);
      if (bias != nullptr) add_bias(bias, M, yp, N, n0, valid);
    }
  }, PAIR * M * K);
  return y;
}

// x [M, K] float32 -> y [M, N] float32 (+ bias [N] float32, added to each output once it is summed: the same
// float addition as adding it after): codes int8 [N, K] or packed 6-bit uint8 [N, 3K/4] (six_bit.h), scale
// [N, K/16] (float32 or float16), no mins.
at::Tensor prompt_qmatmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, int64_t threads,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t K = x.size(1);
  const bool six = codes.dim() == 2 && codes.scalar_type() == at::kByte && K % 256 == 0 && codes.size(1) * 4 == 3 * K;
  TORCH_CHECK(codes.dim() == 2 && (codes.scalar_type() == at::kChar || six) && codes.is_contiguous() && scale.is_contiguous(),
              "prompt_qmatmul takes rows-layout int8 codes [N, K] or packed 6-bit ones [N, 3K/4] and their scales [N, K/16]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->device().is_cpu() &&
                    bias->numel() == codes.size(0),
                "bias must be contiguous float32 [", codes.size(0), "] on the CPU, not ", bias->sizes());
  if (quant::is_compact(scale))  // decoded once to the float32 layout's values (kscales.h): the same bits
    return prompt_qmatmul(x, codes, quant::expanded_scales(scale, 16, false), threads, bias);
  const int64_t inputs = six ? codes.size(1) * 4 / 3 : codes.size(1);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == codes.size(0) && scale.size(1) * 16 == inputs,
              "scales ", scale.sizes(), " are not one per 16 codes of ", codes.sizes());
  TORCH_CHECK(K == inputs, "x has ", K, " inputs, the weight ", inputs);
  TORCH_CHECK(x.size(1) % 32 == 0, "activations are quantized in blocks of 32: ", x.size(1), " inputs");
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  if (scale.scalar_type() == at::kHalf) return prompt_impl<at::Half>(x, codes, scale, threads, bp);
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "scales are float32 or float16");
  return prompt_impl<float>(x, codes, scale, threads, bp);
}

}  // namespace
}  // namespace prompt
}  // namespace fastdecode

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("prompt_qmatmul(Tensor x, Tensor codes, Tensor scale, int threads, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("prompt_qmatmul", &fastdecode::prompt::prompt_qmatmul); }
