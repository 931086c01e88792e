// Quantized matrix products for fastdecode (AVX2 + FMA + F16C; elsewhere the PyTorch fallback).
//
// A quantized weight is [N outputs, K inputs] in groups of G consecutive inputs of one output row:
//   w[n, k] = scale[n, g] * code[n, k] + min[n, g]         (g = k / G; min may be absent = 0)
// codes are int8 [N, K] (bits 8) or 4-bit nibbles [N, K/2] (bits 4; byte j of a 32-group holds
// element j in its low nibble and element j + 16 in its high nibble: GGUF's Q4_0/Q4_1 order).
// scale/min are float16 (exact copies of GGUF's fp16 block scales) or float32 (K-quant products).
//
// qmatmul (decode steps, few rows): each activation row is quantized once per call to int8 per block
// of 32 inputs, x[k] ~ xq[k] = d[b] * a[k] with d[b] = max|x in block b| / 127 and |a| <= 127 (round
// to nearest even), with the sum of its codes per weight group. Then
//   y[m, n] = sum_b  (sum_{k in b} code[n, k] a[m, k])  * scale[n, g(k)] * d[m, b]     (int32 inside)
//           + sum_g  min[n, g] * d[m, b(g)] * (sum_{k in g} a[m, k])
//           = sum_k  w[n, k] * xq[m, k]           exactly, up to float32 rounding of the sums,
// so the error against the float product is sum_k w[n, k] (xq - x)[m, k], |xq - x| <= d / 2: it scales
// with the weights themselves (with exact x sums in the mins term it would scale with scale * code,
// up to 2x larger for Q4_0/Q4_1's offset codes). The same scheme as llama.cpp's Q8_0/Q8_1 activations.
// The integer products run on AVX2's maddubs (unsigned byte x signed byte, pair sums in int16) and
// madd (to int32). maddubs saturates pair sums beyond 32767: 4-bit codes (<= 15) and 8-bit codes
// through the sign trick (|code| <= 128 as an unsigned byte, activation sign-flipped to match, so
// |pair sum| <= 2 * 128 * 127 = 32512) never reach it. The tolerance derivation is in
// tests/unit/test_quantized.py.
// Each (row, output) result is computed by the same operations in the same order whatever the
// number of rows or the row/output blocking: a row's result never depends on the other rows.
//
// qmatmul with activation_bits = 32 (the logits layer): float32 activations, codes decoded once per
// 8 rows, exact up to summation order (see float_rows).
//
// dequantize (prefill, many rows: dequantize.cpp): codes -> float32 weights bit-identical to
// quantized.dequantize(), for an exact float GEMM.
//
// Both ops dispatch on the codes' layout: 3-D codes are the tiled layout (every 4- and 8-bit format with
// groups of 32 as loaded: qtiles.cpp, 8 outputs per register, ~1.5-2x faster); this file's kernels serve
// the rows layout (Q6_K's groups of 16, and weights built in rows layout by hand).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cstdint>
#include <algorithm>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "kscales.h"
#include "parallel.h"
#include "qrows.h"
#include "qtiles.h"
#include "qtiles_avx512.h"
#include "rows_avx512.h"
#include "six_bit.h"

namespace {

using namespace fastdecode::quant;

// ---- weights: one 32-input block of one output row ---------------------------------------------------
// The block's codes as maddubs' unsigned operand (4 bits: the codes; 8 bits: |code|).
template <int BITS>
inline __m256i unsigned_codes(const uint8_t* p, __m256i& signs) {
  if constexpr (BITS == 4) {  // the 16 bytes in both lanes, the high lane shifted by 4: low | high nibbles
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
  } else {
    signs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_sign_epi8(signs, signs);  // |code|; -128 stays 0x80 = 128 as an unsigned byte
  }
}

// int32 x 8 partial dot products (lane i: inputs 4i..4i+3) of one weight block with one activation block.
template <int BITS>
inline __m256 block_dot(__m256i magnitudes, __m256i signs, const int8_t* a) {
  __m256i act = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  if constexpr (BITS == 8) act = _mm256_sign_epi8(act, signs);  // a * sign(code): 0 where the code is 0
  const __m256i pairs = _mm256_maddubs_epi16(magnitudes, act);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// Blocks per pass: the weight x activation scale products of 8 blocks are made in a few vector ops
// (8 float16 scales converted at once) before the blocks' integer dot products use them.
constexpr int64_t CHUNK_BLOCKS = 8;

// G = 32: combined[j][r][i] = weight scale x activation scale of block b + i, for the blocks
// [b, b + count) of NR outputs and RB rows. Every product is one float multiply of the same two numbers
// whichever way it is made (vector or scalar, or per block for G = 16): bitwise the same.
template <typename S, int NR, int RB>
inline void combine_scales(const S* const* scale_rows, const float* const* act_scales, int64_t b, int64_t count,
                           float (*combined)[RB][CHUNK_BLOCKS]) {
  if (count == CHUNK_BLOCKS) {
    for (int r = 0; r < RB; ++r) {
      const __m256 d = _mm256_loadu_ps(act_scales[r] + b);
      for (int j = 0; j < NR; ++j) _mm256_store_ps(combined[j][r], _mm256_mul_ps(load8_scales(scale_rows[j] + b), d));
    }
    return;
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < RB; ++r)
      for (int64_t i = 0; i < count; ++i) combined[j][r][i] = load_scale(scale_rows[j] + b + i) * act_scales[r][b + i];
}

// G = 16: the weight scales of block b's int32 lanes (lanes 0-3 and 4-7 differ), times the activation
// scale per row in the block loop (two scales per block: measured faster than the combined table at
// 8 rows, where its two broadcasts per row and block cost more loads).
template <typename S>
inline __m256 lane_scales16(const S* scale_row, int64_t b) {
  return _mm256_set_m128(_mm_set1_ps(load_scale(scale_row + 2 * b + 1)), _mm_set1_ps(load_scale(scale_row + 2 * b)));
}

// Software prefetch of the codes PREFETCH_TILES tiles ahead: NR interleaved rows are more streams than
// the hardware prefetcher follows well (measured on the 49152x576 Q8_0 output layer, M = 1: 30% faster
// with 1 or 2 tiles than without, on a loaded machine).
constexpr int64_t PREFETCH_TILES = 2;
// Outputs [n0, n0 + NR) x rows [m0, m0 + RB): each weight block is loaded once for the RB rows, and
// NR outputs run side by side (independent accumulators) for instruction-level parallelism. Per
// (row, output) the operations and their order depend on K only, not on NR, RB or the other rows.
template <int BITS, int G, typename S, int NR, int RB>
void dot_tile(const QuantizedRows& q, int64_t m0, const uint8_t* codes, const S* scale, const S* mins, float* y,
              int64_t N, int64_t n0) {
  constexpr int64_t block_bytes = 32 * BITS / 8, blocks_per_line = 64 / block_bytes;  // (6 bits: 24, 2)
  const int64_t K = q.K, blocks = K / 32, groups = K / G, row_bytes = K * BITS / 8;
  const uint8_t* code_rows[NR];
  const S* scale_rows[NR];
  for (int j = 0; j < NR; ++j) {
    code_rows[j] = codes + (n0 + j) * row_bytes;
    scale_rows[j] = scale + (n0 + j) * groups;
  }
  const int8_t* act_rows[RB];
  const float* act_scales[RB];
  for (int r = 0; r < RB; ++r) {
    act_rows[r] = q.codes.data() + (m0 + r) * K;
    act_scales[r] = q.scale.data() + (m0 + r) * blocks;
  }
  const int64_t prefetch_offset = PREFETCH_TILES * NR * row_bytes;  // prefetches never fault
  __m256 acc[NR][RB];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < RB; ++r) acc[j][r] = _mm256_setzero_ps();
  alignas(32) float combined[NR][RB][CHUNK_BLOCKS];  // G = 32 only
  // block i of the chunk at b
  auto block = [&](int64_t b, int64_t i) __attribute__((always_inline)) {
    const int64_t offset = (b + i) * block_bytes;
    if (i % blocks_per_line == 0)
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(code_rows[j] + offset + prefetch_offset), _MM_HINT_T0);
    for (int j = 0; j < NR; ++j) {
      __m256i signs = _mm256_setzero_si256();  // 8 bits: the codes (their signs); unused for 4 and 6 bits
      // 6 bits: the codes before their -32 (c + 32: 0..63, six_bit.h), the corrections q.six taking the 32 off
      const __m256i magnitudes = BITS == 6 ? six_unsigned(code_rows[j], b + i)
                                           : unsigned_codes<BITS == 6 ? 8 : BITS>(code_rows[j] + offset, signs);
      __m256 w_scales = _mm256_setzero_ps();
      if constexpr (G == 16) w_scales = lane_scales16(scale_rows[j], b + i);
      for (int r = 0; r < RB; ++r) {
        __m256 dots;
        if constexpr (BITS == 6)  // the 8-bit codes' int32 lanes exactly: |pair sum| <= 2 * 63 * 127, then + q.six
          dots = _mm256_cvtepi32_ps(_mm256_add_epi32(
              _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act_rows[r] + 32 * (b + i)))),
                                _mm256_set1_epi16(1)),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.six.data() + (m0 + r) * K / 4 + 8 * (b + i)))));
        else
          dots = block_dot<BITS>(magnitudes, signs, act_rows[r] + 32 * (b + i));
        __m256 scales;
        if constexpr (G == 32) scales = _mm256_broadcast_ss(combined[j][r] + i);
        else scales = _mm256_mul_ps(w_scales, _mm256_broadcast_ss(act_scales[r] + b + i));
        acc[j][r] = _mm256_fmadd_ps(dots, scales, acc[j][r]);
      }
    }
  };
  int64_t b = 0;
  for (; b + CHUNK_BLOCKS <= blocks; b += CHUNK_BLOCKS) {
    if constexpr (G == 32) combine_scales<S, NR, RB>(scale_rows, act_scales, b, CHUNK_BLOCKS, combined);
#pragma GCC unroll 8
    for (int64_t i = 0; i < CHUNK_BLOCKS; ++i) block(b, i);  // (6 bits: b % 8 == 0, each block's unpacking fixed)
  }
  if (b < blocks) {
    if constexpr (G == 32) combine_scales<S, NR, RB>(scale_rows, act_scales, b, blocks - b, combined);
    for (int64_t i = 0; i < blocks - b; ++i) block(b, i);
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < RB; ++r) {
      float total = hsum(acc[j][r]);
      if (mins != nullptr) total += mins_term(mins + (n0 + j) * groups, q.sums.data() + (m0 + r) * groups, groups);
      y[(m0 + r) * N + n0 + j] = total;
    }
}

// All rows for outputs [n0, n1): NR outputs at a time, the tail one by one.
template <int BITS, int G, typename S, int NR, int RB>
void rows_tile(const QuantizedRows& q, int64_t m0, const uint8_t* codes, const S* scale, const S* mins, float* y,
               int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) dot_tile<BITS, G, S, NR, RB>(q, m0, codes, scale, mins, y, N, n);
  for (; n < n1; ++n) dot_tile<BITS, G, S, 1, RB>(q, m0, codes, scale, mins, y, N, n);
}

// Outputs per chunk: a chunk's codes (32 x K/2 bytes for 4 bits, 9 KB at K = 576) stay in L1/L2
// while every row block passes over them, so each weight byte comes from memory once per call.
constexpr int64_t OUTPUT_CHUNK = 32;

// rows_avx512.cpp's int8 kernel for groups of 16 (rows6_avx512.cpp's for 6-bit codes, which reads offset's data as q.six).
template <int BITS, int RB>
int64_t int8_pairs(const QuantizedRows& q, const uint8_t* offset, int64_t m0, const uint8_t* codes, const float* scale,
                   float* y, int64_t N, int64_t n0, int64_t n1) {
  if constexpr (BITS == 6) return fastdecode::avx512::six_int8_row_pairs<float, RB>(q, m0, codes, scale, y, N, n0, n1);
  return fastdecode::avx512::int8_row_pairs16<RB>(q, offset, m0, codes, scale, y, N, n0, n1);
}

// float_rows over outputs [n0, n1); `wide` (AVX-512) with 8-bit codes and no mins: all but the last few
// outputs on rows_avx512.cpp's kernel (two outputs per register, the same bits).
template <int BITS, int G, typename S, int RB>
void float_outputs(bool wide, const float* x, const float* xsum, int64_t K, const uint8_t* codes, const S* scale,
                   const S* mins, float* y, int64_t N, int64_t n0, int64_t n1) {
  if constexpr (BITS == 6)  // (groups of 16: rows6_avx512.cpp)
    if (wide && mins == nullptr) n0 = fastdecode::avx512::six_float_row_pairs<S, RB>(x, K, codes, scale, y, N, n0, n1);
  if constexpr (BITS == 8 && G % 16 == 0)
    if (wide && mins == nullptr) n0 = fastdecode::avx512::float_row_pairs<G, S, RB>(x, K, codes, scale, y, N, n0, n1);
  float_rows<BITS, G, S, RB>(x, xsum, K, codes, scale, mins, y, N, n0, n1);
}

// Outputs [n0, n1), all rows: a chunk of OUTPUT_CHUNK outputs' codes stays in cache while row blocks pass.
// offset: q's codes + 128 where rows_avx512.cpp's int8 kernel serves (else null).
template <int BITS, int G, typename S>
void outputs_range(const QuantizedRows& q, bool wide, const uint8_t* offset, const float* x, const float* xsum, int64_t M,
                   int64_t K, const uint8_t* cp, const S* sp, const S* mp, float* yp, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t c = n0; c < n1; c += OUTPUT_CHUNK) {
    const int64_t c1 = std::min(c + OUTPUT_CHUNK, n1);
    int64_t m = 0;
    if (x != nullptr) {  // float32 activations: 8 accumulators + G/8 weight vectors fit in 16 registers
      const int64_t groups = K / G;
      for (; m + 8 <= M; m += 8) float_outputs<BITS, G, S, 8>(wide, x + m * K, xsum + m * groups, K, cp, sp, mp, yp + m * N, N, c, c1);
      // the last 1-7 rows in one block: the codes decoded once for all of them (a beam-5 step's logits layer
      // ran 4 + 1, decoding twice), each row's operations the same whatever the block (float_rows)
      const float* xm = x + m * K;
      const float* sm = xsum + m * groups;
      float* ym = yp + m * N;
      switch (M - m) {
        case 7: float_outputs<BITS, G, S, 7>(wide, xm, sm, K, cp, sp, mp, ym, N, c, c1); break;
        case 6: float_outputs<BITS, G, S, 6>(wide, xm, sm, K, cp, sp, mp, ym, N, c, c1); break;
        case 5: float_outputs<BITS, G, S, 5>(wide, xm, sm, K, cp, sp, mp, ym, N, c, c1); break;
        case 4: float_outputs<BITS, G, S, 4>(wide, xm, sm, K, cp, sp, mp, ym, N, c, c1); break;
        case 3: float_outputs<BITS, G, S, 3>(wide, xm, sm, K, cp, sp, mp, ym, N, c, c1); break;
        case 2: float_outputs<BITS, G, S, 2>(wide, xm, sm, K, cp, sp, mp, ym, N, c, c1); break;
        case 1: float_outputs<BITS, G, S, 1>(wide, xm, sm, K, cp, sp, mp, ym, N, c, c1); break;
        default: break;
      }
      continue;
    }
    if constexpr ((BITS == 8 || BITS == 6) && G == 16 && std::is_same_v<S, float>) {
      if (offset != nullptr) {  // AVX-512: all but the last few outputs, the same bits
        for (; m + 4 <= M; m += 4)
          rows_tile<BITS, G, S, 2, 4>(q, m, cp, sp, mp, yp, N, int8_pairs<BITS, 4>(q, offset, m, cp, sp, yp, N, c, c1), c1);
        for (; m + 2 <= M; m += 2)
          rows_tile<BITS, G, S, 4, 2>(q, m, cp, sp, mp, yp, N, int8_pairs<BITS, 2>(q, offset, m, cp, sp, yp, N, c, c1), c1);
        for (; m < M; ++m)
          rows_tile<BITS, G, S, 4, 1>(q, m, cp, sp, mp, yp, N, int8_pairs<BITS, 1>(q, offset, m, cp, sp, yp, N, c, c1), c1);
        continue;
      }
    }
    // int8 activations; registers: NR x RB accumulators + NR weight blocks (8 rows: each block decoded once
    // for all of them, ~3% faster than 2 x 4 on the 4-bit matrices, alike on 8-bit ones)
    for (; m + 8 <= M; m += 8) rows_tile<BITS, G, S, 1, 8>(q, m, cp, sp, mp, yp, N, c, c1);
    for (; m + 4 <= M; m += 4) rows_tile<BITS, G, S, 2, 4>(q, m, cp, sp, mp, yp, N, c, c1);
    for (; m + 2 <= M; m += 2) rows_tile<BITS, G, S, 4, 2>(q, m, cp, sp, mp, yp, N, c, c1);
    for (; m < M; ++m) rows_tile<BITS, G, S, 4, 1>(q, m, cp, sp, mp, yp, N, c, c1);
  }
}

// Bytes of decoded scales (and mins) per piece of outputs: within L1 beside the codes' stream.
constexpr int64_t DECODED_SCALE_BYTES = 16 << 10;

// Outputs [n0, n1) of a weight with compact scales (kscales.h): each piece's scales and mins decoded to
// float32 (the float32 layout's values: the same bits) in L1, then outputs_range on them. A piece is
// OUTPUT_CHUNK outputs, or fewer where their scales would not fit DECODED_SCALE_BYTES (a multiple of 4:
// the AVX-512 kernels' step; 4 outputs of the 1536 x 8960 Q6_K down matrix hold 9 KB of scales). Q6_K on
// AVX-512 skips this for all but its last (N % 4) outputs: rows6_avx512.cpp decodes the records in registers.
template <int BITS, int G>
void compact_outputs_range(const QuantizedRows& q, bool wide, const uint8_t* offset, const float* x, const float* xsum,
                           int64_t M, int64_t K, const uint8_t* cp, const KScale* sp, const KScale* mp, float* yp,
                           int64_t N, int64_t n0, int64_t n1) {
  if constexpr (BITS == 6 && G == 16)  // AVX-512: the records decoded in registers, all but the last few outputs
    if (wide && mp == nullptr) n0 = fastdecode::avx512::six_compact_outputs(q, x, M, K, cp, sp, yp, N, n0, n1);
  if (n0 >= n1) return;
  const int64_t groups = K / G, row_bytes = K * BITS / 8;
  const int64_t fit = DECODED_SCALE_BYTES / (sizeof(float) * groups * (mp != nullptr ? 2 : 1)) / 4 * 4;
  const int64_t piece = std::clamp<int64_t>(fit, 4, OUTPUT_CHUNK);
  std::vector<float> scales(piece * groups), mins(mp != nullptr ? piece * groups : 0);
  for (int64_t c = n0; c < n1; c += piece) {
    const int64_t c1 = std::min(c + piece, n1);
    expand_rows(sp, G, groups, c, c1, scales.data());
    if (mp != nullptr) expand_rows(mp, G, groups, c, c1, mins.data());
    // outputs [c, c1) as a weight of their own: y's columns from c (rows still N apart)
    outputs_range<BITS, G, float>(q, wide, offset, x, xsum, M, K, cp + c * row_bytes, scales.data(),
                                  mp != nullptr ? mins.data() : nullptr, yp + c, N, 0, c1 - c);
  }
}

template <int BITS, int G, typename S>
at::Tensor matmul_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& mins, int64_t threads, int64_t activation_bits) {
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const bool exact = activation_bits == 32;
  const bool has_min = mins.has_value() && mins->defined();
  QuantizedRows q = exact ? QuantizedRows{K, {}, {}, {}, {}} : quantize_rows<G>(x.data_ptr<float>(), M, K, has_min);
  if (BITS == 6 && !exact) six_corrections(q);
  const float* xp = exact ? x.data_ptr<float>() : nullptr;
  const std::vector<float> xsum = exact && has_min ? group_sums<G>(xp, M, K) : std::vector<float>();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const S* sp = scale_data<S>(scale);
  const S* mp = has_min ? scale_data<S>(*mins) : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t chunk = fastdecode::chunk_outputs(M * K, 32);
  const bool wide = fastdecode::use_avx512();  // read once: the whole product on one kernel
  // the AVX-512 int8 kernel's unsigned activations (rows_avx512.cpp: 8-bit codes in groups of 16, float scales, no mins;
  // 6-bit codes: the corrections q.six, which rows6_avx512.cpp reads)
  constexpr bool float_scales = std::is_same_v<S, float> || std::is_same_v<S, KScale>;  // (compact: decoded to float)
  const bool pairs_kernel = wide && !exact && (BITS == 8 || BITS == 6) && G == 16 && float_scales && !has_min;
  const std::vector<uint8_t> offset = pairs_kernel && BITS == 8 ? fastdecode::avx512::offset_rows(q) : std::vector<uint8_t>();
  const uint8_t* op = !pairs_kernel ? nullptr : BITS == 6 ? reinterpret_cast<const uint8_t*>(q.six.data()) : offset.data();
  fastdecode::parallel_chunks(N, chunk, threads, [&](int64_t n0, int64_t n1) {
    if constexpr (std::is_same_v<S, KScale>)
      compact_outputs_range<BITS, G>(q, wide, op, xp, xsum.data(), M, K, cp, sp,
                                     mp, yp, N, n0, n1);
    else
      outputs_range<BITS, G, S>(q, wide, op, xp, xsum.data(), M, K, cp, sp, mp,
                                yp, N, n0, n1);
  }, chunk * M * K);
  return y;
}

at::Tensor rows_qmatmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t threads,
                        int64_t activation_bits);

// x [M, K] float32 -> y [M, N] float32 (+ bias [N] float32, added to each output once it is summed: the
// same float addition as adding it after), activations quantized to int8 per 32 (see the top of the file).
at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t threads, int64_t activation_bits,
                   int64_t outputs, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(activation_bits == 8 || activation_bits == 32, "activation_bits is 8 or 32, not ", activation_bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->device().is_cpu(),
                "bias must be contiguous float32 [N] on the CPU");
  if (codes.dim() == 3) {  // the tiled layout (qtiles.cpp)
    TORCH_CHECK(group == 32, "tiled codes have groups of 32, not ", group);
    return fastdecode::tiled_qmatmul(x, codes, scale, mins, bits, outputs, threads, activation_bits,
                                     has_bias ? bias->data_ptr<float>() : nullptr, has_bias ? bias->numel() : 0);
  }
  // (the rows layout has one scale row per output; checked before the product)
  TORCH_CHECK(!has_bias || bias->numel() == scale.size(0), "bias has ", bias->numel(), " values for ", scale.size(0),
              " outputs");
  at::Tensor y = rows_qmatmul(x, codes, scale, mins, bits, group, threads, activation_bits);
  if (has_bias) y.add_(*bias);
  return y;
}

// The rows layout (every format, Q6_K's groups of 16 included).
at::Tensor rows_qmatmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t threads,
                        int64_t activation_bits) {
  TORCH_CHECK(codes.is_contiguous() && scale.is_contiguous(), "codes and scales must be contiguous");
  TORCH_CHECK(x.size(1) == scale_inputs(scale, group, false), "x has ", x.size(1), " inputs, the weight ",
              scale_inputs(scale, group, false));
  TORCH_CHECK(x.size(1) % 32 == 0, "activations are quantized in blocks of 32: ", x.size(1), " inputs");
  check_code_rows(codes, scale, x.size(1), bits);
  const bool half = scale.scalar_type() == at::kHalf, compact = is_compact(scale);
#define FD_CASE(B, GS)                                                                               \
  if (bits == B && group == GS)                                                                      \
    return compact ? matmul_impl<B, GS, KScale>(x, codes, scale, mins, threads, activation_bits)                \
           : half  ? matmul_impl<B, GS, at::Half>(x, codes, scale, mins, threads, activation_bits)              \
                   : matmul_impl<B, GS, float>(x, codes, scale, mins, threads, activation_bits);
  FD_FOR_EACH_ROWS_FORMAT(FD_CASE)
#undef FD_CASE
  TORCH_CHECK(false, "no kernel for bits=", bits, " group=", group);
}

}  // namespace

// A CPU kernel (not a composite one), so kernels.py can give the op a fake kernel for torch.compile.
TORCH_LIBRARY(fastdecode_kernels, m) {
  m.def("qmatmul(Tensor x, Tensor codes, Tensor scale, Tensor? mins, int bits, int group, int threads, int activation_bits=8, int outputs=-1, Tensor? bias=None) -> Tensor");
  m.def("dequantize(Tensor codes, Tensor scale, Tensor? mins, int bits, int group, int threads, int outputs=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) {
  m.impl("qmatmul", &qmatmul);
}
