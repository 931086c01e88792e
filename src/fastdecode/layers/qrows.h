// Shared by the quantized kernels (qmatmul.cpp: rows layout; qtiles.cpp: tiled layout): scale loads,
// horizontal sums, and the activation rows quantized to int8 once per call; the rows layout's float32-
// activation kernel and group decoding (qmatmul.cpp).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "six_bit.h"

namespace fastdecode {
namespace quant {

inline float load_scale(const at::Half* p) { return _cvtsh_ss(reinterpret_cast<const uint16_t&>(*p)); }
inline float load_scale(const float* p) { return *p; }
inline __m256 load8_scales(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8_scales(const float* p) { return _mm256_loadu_ps(p); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// An 8 x 8 float block transposed in registers (v[i][j] -> v[j][i]).
inline void transpose8(__m256 v[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
    s[4 * h + 0] = _mm256_shuffle_ps(t[4 * h + 0], t[4 * h + 2], 0x44);
    s[4 * h + 1] = _mm256_shuffle_ps(t[4 * h + 0], t[4 * h + 2], 0xEE);
    s[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    s[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x20);
    v[4 + j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x31);
  }
}

// ---- activations: rows quantized once per call ------------------------------------------------------
struct QuantizedRows {
  int64_t K;
  std::vector<int8_t> codes;  // [M, K]
  std::vector<float> scale;   // [M, K/32]: d, x ~ d * code
  std::vector<float> sums;    // [M, K/G]: d * (sum of the codes) per weight group, for the mins term (or empty)
  // [M, K/4]: -32 x the sum of each 4 codes (six_corrections), for 6-bit weights (or empty): their kernels
  // multiply the codes before their -32 (c + 32, unsigned) and start from this, so each int32 lane is
  // sum (c + 32) a - 32 sum a = sum c a, the 8-bit codes' lane exactly
  std::vector<int32_t> six;
};

inline void six_corrections(QuantizedRows& q) {
  q.six.resize(q.codes.size() / 4);
  for (size_t i = 0; i < q.six.size(); ++i)
    q.six[i] = -32 * (q.codes[4 * i] + q.codes[4 * i + 1] + q.codes[4 * i + 2] + q.codes[4 * i + 3]);
}

// with_sums: the code sums too (read only by weights with mins: a third of the quantization's time).
// Blocks [i0, i1) of 32 inputs (row-major over [M, K / 32]) of x into q, whose vectors are sized for all rows (a
// caller may quantize row ranges on several threads: each block is computed alone).
template <int G>
void quantize_blocks(const float* x, int64_t i0, int64_t i1, bool with_sums, QuantizedRows& q) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t i = i0; i < i1; ++i) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + 32 * i + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
    }
    const float top = hmax(amax), d = top / 127.0f;
    const __m256 inverse = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i c[4];  // |x * 127 / max| <= 127 (+ one rounding): never -128
    for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));  // nearest even
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(packed, order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.codes.data() + 32 * i), ordered);
    q.scale[i] = d;
    if (!with_sums) continue;
    // code sums per group: lanes 0-3 of `fours` sum inputs 0..15, lanes 4-7 inputs 16..31 (exact in float)
    const __m256 fours = _mm256_cvtepi32_ps(
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), ordered), _mm256_set1_epi16(1)));
    const float low = hsum(_mm256_blend_ps(fours, _mm256_setzero_ps(), 0xF0)), high = hsum(fours) - low;
    if constexpr (G == 32) {
      q.sums[i] = d * (low + high);
    } else {  // G == 16
      q.sums[2 * i] = d * low;
      q.sums[2 * i + 1] = d * high;
    }
  }
}

// Rows [M, K] sized for quantize_blocks (codes, scales, and the sums where with_sums).
template <int G>
QuantizedRows sized_rows(int64_t M, int64_t K, bool with_sums) {
  return QuantizedRows{K, std::vector<int8_t>(M * K), std::vector<float>(M * (K / 32)),
                       std::vector<float>(with_sums ? M * K / G : 0)};
}

// Rows [M, K] quantized per block of 32 (quantize_blocks), the blocks split over up to `threads` threads of the
// kernel pool (parallel.h; each block computed alone: the same bits at any thread count): a prompt's
// activations (512 x 1536 per MLP down product) are otherwise quantized by the caller alone while the
// helpers wait for the product.
constexpr int64_t QUANTIZE_CHUNK_BLOCKS = 1024;  // 32K inputs: ~10 us
template <int G>
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, bool with_sums = true, int64_t threads = 1) {
  QuantizedRows q = sized_rows<G>(M, K, with_sums);
  parallel_chunks(M * (K / 32), QUANTIZE_CHUNK_BLOCKS, threads,
                  [&](int64_t i0, int64_t i1) { quantize_blocks<G>(x, i0, i1, with_sums, q); });
  return q;
}

// x summed per group of G inputs (float32 activations: the mins term of the exact products).
template <int G>
std::vector<float> group_sums(const float* x, int64_t M, int64_t K) {
  std::vector<float> sums(M * K / G);
  for (int64_t i = 0; i < M * K / G; ++i) {
    __m256 v = _mm256_loadu_ps(x + G * i);
    for (int j = 1; j < G / 8; ++j) v = _mm256_add_ps(v, _mm256_loadu_ps(x + G * i + 8 * j));
    sums[i] = hsum(v);
  }
  return sums;
}

// ---- the rows layout (qmatmul.cpp) ---------------------------------------------------------------------
// Rows-layout codes: one row of K * bits / 8 bytes per output (6 bits: whole super-blocks of 256 inputs).
inline void check_code_rows(const at::Tensor& codes, const at::Tensor& scale, int64_t K, int64_t bits) {
  TORCH_CHECK(codes.dim() == 2 && codes.element_size() == 1 && codes.size(0) == scale.size(0) &&
                  codes.size(1) * 8 == K * bits && (bits != 6 || K % 256 == 0),
              "rows-layout codes ", codes.sizes(), " do not hold ", scale.size(0), " outputs of ", K, " ", bits, "-bit codes");
}

// The rows layout's (code bits, scale group) pairs, one kernel instantiation each (qmatmul.cpp, dequantize.cpp;
// layers/quantized.py's DECODED_ROWS lists them for Python): CASE(bits, group) returns when the weight's pair
// matches; the caller fails after the list.
#define FD_FOR_EACH_ROWS_FORMAT(CASE) CASE(8, 32) CASE(8, 16) CASE(6, 16) CASE(4, 32)

// sum_g min[g] * xsum[g], 8 groups at a time then one by one (a fixed order for a given K).
template <typename S>
inline float mins_term(const S* mins_row, const float* sums, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(load8_scales(mins_row + g), _mm256_loadu_ps(sums + g), acc);
  float total = hsum(acc);
  for (; g < groups; ++g) total += load_scale(mins_row + g) * sums[g];
  return total;
}

// The G weights of group g of one output's codes `row` decoded to float codes (not yet scaled): G / 8 vectors.
template <int BITS, int G>
inline void decode_group(const uint8_t* row, int64_t g, __m256* w) {
  static_assert(BITS == 4 || BITS == 8, "6-bit codes are unpacked a super-block at a time first (six_or_decode_group)");
  const uint8_t* codes = row + g * (G * BITS / 8);
  if constexpr (BITS == 8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(codes);
    for (int i = 0; i < G / 8; ++i)
      w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * i))));
  } else {  // 16 bytes -> elements 0..15 (low nibbles), 16..31 (high nibbles)
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
}

// Group g of one output's codes `row` as decode_group; 6-bit codes (G = 16) through `unpacked`, the int8 codes
// of the group's super-block, unpacked when g enters it (groups taken in order).
template <int BITS, int G>
inline void six_or_decode_group(const uint8_t* row, int64_t g, int8_t* unpacked, __m256* w) {
  if constexpr (BITS == 6) {
    static_assert(G == 16, "6-bit codes come in groups of 16");
    if (g % 16 == 0) six_super(row + g / 16 * SIX_SUPER_BYTES, unpacked);
    decode_group<8, 16>(reinterpret_cast<const uint8_t*>(unpacked), g % 16, w);
  } else {
    decode_group<BITS, G>(row, g, w);
  }
}

// Where a kernel prefetches, `ahead` units on, along a stream it reads in passes of `period` units (a tile's
// code bytes, an output row's super-blocks), each pass's stream continued by the same stream of the next
// pass (the next tile pair's, the next block of rows'): `pass` passes on, `offset` units into it. A look-ahead
// that ran on into the neighbouring stream instead found it loaded already, and left each stream's start
// unprefetched (qtiles_avx512.cpp, rows6_avx512.cpp).
struct StreamAhead {
  int64_t pass, offset, period;
  StreamAhead(int64_t ahead, int64_t period) : pass(ahead / period), offset(ahead % period), period(period) {}
  void advance(int64_t units) {  // the stream read `units` (<= period) further
    offset += units;
    if (offset >= period) {
      offset -= period;
      ++pass;
    }
  }
};

// ---- float32 activations (activation_bits = 32): exact products, for the logits layer ----------------
// Per group, the float dot product of the codes (decoded once for RB rows) with x, times the scale; the
// mins term is sum_g min[n, g] * xsum[r, g] (x summed per group once per call). Exact up to summation
// order (codes and scales are exact floats), and the same per-row operations for every RB.

// The codes are read row after row: prefetched this far ahead (measured on the 262144x640 and 49152x576
// Q8_0 logits layers at M = 1, loaded machine: ~15-25% faster than the hardware prefetcher alone; 4-8 KB
// were alike, 1 KB less), non-temporal: the logits layer is read once per step, and its tens of MB
// fetched into the caches as usual pushed out what the next step reads again (the layers' K/V, the
// activations, the kernels' own buffers). SmolLM2-135M's 30 MB Q8_0 layer, batch 1, on a shared Zen 5
// (2 cores, 32 MB L3): the whole step 1.03-1.09x at 1 thread and 1.05-1.12x at 2 with the AVX-512
// kernel's (rows_avx512.cpp) prefetches non-temporal where the machine's load was 2-5, 0.99-1.01x
// at 5-7 (the other processes then push the cache out anyway); this kernel (AVX-512 off) 1.02x
// (quartiles 0.97-1.08). The layers' products' prefetches (qtiles_avx512.cpp) made non-temporal: no change.
constexpr int64_t FLOAT_PREFETCH_BYTES = 8192;
template <int BITS, int G, typename S, int RB>
void float_rows(const float* x, const float* xsum, int64_t K, const uint8_t* codes, const S* scale, const S* mins,
                float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t groups = K / G, row_bytes = K * BITS / 8, group_bytes = G * BITS / 8;
  alignas(32) int8_t unpacked[256];  // 6 bits: the current super-block's codes
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      if (g % (64 / group_bytes) == 0)  // about once per cache line (6 bits: 60 bytes); prefetches never fault
        _mm_prefetch(reinterpret_cast<const char*>(codes + n * row_bytes + g * group_bytes + FLOAT_PREFETCH_BYTES), _MM_HINT_NTA);
      __m256 w[G / 8];
      six_or_decode_group<BITS, G>(codes + n * row_bytes, g, unpacked, w);
      const __m256 s = _mm256_set1_ps(load_scale(scale + n * groups + g));
      for (int r = 0; r < RB; ++r) {
        const float* xr = x + r * K + g * G;
        __m256 dot = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
        for (int i = 1; i < G / 8; ++i) dot = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), dot);
        acc[r] = _mm256_fmadd_ps(dot, s, acc[r]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      float total = hsum(acc[r]);
      if (mins != nullptr) total += mins_term(mins + n * groups, xsum + r * groups, groups);
      y[r * N + n] = total;
    }
  }
}

}  // namespace quant
}  // namespace fastdecode
