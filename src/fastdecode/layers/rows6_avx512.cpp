// rows_avx512.cpp's two kernels on packed 6-bit codes (Q6_K as GGUF stores them: six_bit.h), bit for bit
// those kernels on the unpacked int8 codes: two outputs per register, output n in the low 256 bits, n + 1 in
// the high ones, and per super-block of 256 inputs its 8 blocks unrolled, each block's unpacking (which
// nibble, which 2 high bits) fixed at compile time. Per block and pair of outputs one 64-byte register of
// codes from two 32-byte loads of each output's nibbles and high bits: two inserts (or two-source permutes), a
// shift or two, an and and one ternary-logic op.
//
// int8 activations (down and V matrices at decode): VNNI's dpbusd takes the codes before their -32 (c + 32,
// 0..63) as its unsigned operand and the activation codes a as the signed one, starting from
// -32 x the sum of each 4 activations (qrows.h's six_corrections): every int32 lane is sum c a exactly, the lane
// rows_avx512.cpp's int8_pairs_block makes; the float operations after it are that kernel's.
// float32 activations (the logits layer): the codes' 4-byte words spread over the 128-bit lanes as they are
// loaded, then each half of a group shuffled byte by byte into 32-bit lanes as floats (shuffled_codes):
// pairs_block's operations on the same values.
#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>
#include <utility>

#include "pairs_avx512.h"
#include "qrows.h"
#include "rows_avx512.h"
#include "six_bit.h"

// Everything below may use AVX-512; it runs only where isa.h's use_avx512() holds.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

namespace fastdecode {
namespace avx512 {
namespace {

using quant::SIX_SUPER_BYTES;

using pairs::eight_scales;
using pairs::eighth_index;
using pairs::PAIRS;
using pairs::shuffled_codes;
using pairs::spread_words;

// f(std::integral_constant<int, I>{}) for the blocks I = 0 .. 7 of a super-block in order (defined here, under
// this file's target, so that the AVX-512 lambdas inline into it).
template <typename F, int... I>
inline __attribute__((always_inline)) void each_block(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <typename F>
inline __attribute__((always_inline)) void for_super_blocks(F&& f) {
  each_block(f, std::make_integer_sequence<int, 8>{});
}
constexpr int64_t PREFETCH_SUPERS = 16;  // float_block: super-blocks ahead in each output's row (~3 KB)

// Outputs n .. n + 2 * PAIRS - 1: their code rows and scale rows.
template <typename S>
inline void pair_rows(const uint8_t* codes, const S* scale, int64_t row_bytes, int64_t groups, int64_t n,
                      const uint8_t** rows, const S** scales) {
  for (int j = 0; j < 2 * PAIRS; ++j) {
    rows[j] = codes + (n + j) * row_bytes;
    scales[j] = scale + (n + j) * groups;
  }
}

// 32 bytes at x in the low half, 32 at y in the high one.
inline __m512i both(const uint8_t* x, const uint8_t* y) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y)), 1);
}

// Block I of the super-blocks at a and b (two outputs' rows): the 64 codes before their -32 (0..63), a's 32
// in the low half (SPREAD: their 4-byte words as spread_words places them; the unpacking below is per byte
// and per 16-bit word, so it gives each code the same value wherever its word sits).
template <int I, bool SPREAD = false>
inline __m512i unsigned_pair(const uint8_t* a, const uint8_t* b) {
  constexpr int n = I / 4, j = I % 4;
  constexpr int64_t low_at = 64 * n + 32 * (j & 1), high_at = 128 + 32 * n;
  const __m512i ql = SPREAD ? spread_words(a + low_at, b + low_at) : both(a + low_at, b + low_at);
  const __m512i qh = SPREAD ? spread_words(a + high_at, b + high_at) : both(a + high_at, b + high_at);
  const __m512i low = j >> 1 ? _mm512_srli_epi16(ql, 4) : ql;  // the nibble in bits 0-3 (the rest masked below)
  // bits 2j, 2j + 1 of qh to bits 4, 5 (the 16-bit shifts move no kept bit across a byte)
  const __m512i moved = j == 0 ? _mm512_slli_epi16(qh, 4) : j == 1 ? _mm512_slli_epi16(qh, 2)
                        : j == 2 ? qh : _mm512_srli_epi16(qh, 2);
  const __m512i high = _mm512_and_si512(moved, _mm512_set1_epi8(0x30));
  return _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi8(0x0F), 0xEC);  // (low & 0x0F) | high
}

// Rows [m0, m0 + RB) x outputs n .. n + 2 * PAIRS - 1, int8 activations: rows_avx512.cpp's int8_pairs_block.
template <int RB>
inline void int8_block(const quant::QuantizedRows& q, int64_t m0, const uint8_t* codes, const float* scale, float* y,
                       int64_t N, int64_t n) {
  const int64_t K = q.K, blocks = K / 32, groups = K / 16, row_bytes = K * 6 / 8;
  const uint8_t* rows[2 * PAIRS];
  const float* scales[2 * PAIRS];
  pair_rows(codes, scale, row_bytes, groups, n, rows, scales);
  const __m512i lane_scale = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int64_t prefetch_offset = 2 * 2 * PAIRS * row_bytes;  // two passes ahead: these rows' successors
  __m512 acc[RB][PAIRS];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < PAIRS; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t s = 0; s < blocks / 8; ++s) {
    for (int j = 0; j < 2 * PAIRS; ++j)
      for (int64_t line = 0; line < SIX_SUPER_BYTES; line += 64)  // prefetches never fault
        _mm_prefetch(reinterpret_cast<const char*>(rows[j] + s * SIX_SUPER_BYTES + line + prefetch_offset), _MM_HINT_T0);
    for_super_blocks([&](auto block) __attribute__((always_inline)) {
      constexpr int I = decltype(block)::value;
      const int64_t b = 8 * s + I;
      __m512i w[PAIRS];
      __m512 w_scale[PAIRS];
      for (int p = 0; p < PAIRS; ++p) {
        w[p] = unsigned_pair<I>(rows[2 * p] + s * SIX_SUPER_BYTES, rows[2 * p + 1] + s * SIX_SUPER_BYTES);
        const __m128 pair = _mm_castpd_ps(_mm_unpacklo_pd(_mm_castsi128_pd(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales[2 * p] + 2 * b))),
                                                          _mm_castsi128_pd(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales[2 * p + 1] + 2 * b)))));
        w_scale[p] = _mm512_permutexvar_ps(lane_scale, _mm512_castps128_ps512(pair));
      }
      for (int r = 0; r < RB; ++r) {
        const int64_t at = (m0 + r) * K + 32 * b;
        const __m512i a = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.codes.data() + at)));
        const __m512i start = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.six.data() + at / 4)));
        const __m512 d = _mm512_set1_ps(q.scale[(m0 + r) * blocks + b]);
        for (int p = 0; p < PAIRS; ++p) {
          const __m512i dot = _mm512_dpbusd_epi32(start, w[p], a);  // sum c a per 4 inputs
          acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w_scale[p], d), acc[r][p]);
        }
      }
    });
  }
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < PAIRS; ++p) pairs::store_pair(acc[r][p], y + (m0 + r) * N + n + 2 * p);
}

// Rows [0, RB) x outputs n .. n + 2 * PAIRS - 1, float32 activations: rows_avx512.cpp's pairs_block<16, S, RB>
// (K a multiple of 256, so every group's scale comes from eight converted at once, as there). Per block and
// pair the codes spread (unsigned_pair<I, true>), so that each half of each group is one byte shuffle away
// from its 32-bit lanes (pairs_avx512.h's shuffled_codes). Qwen2.5-Coder-1.5B's 151936 x 1536 head (233 MB)
// on one Zen 5 core: 15-18 GB/s before the scales were prefetched (their loads missed and stalled the
// accumulator chains) and the conversion was this one (a qword permute, a store and 4 vpmovsxbd +
// vcvtdq2ps per block and pair), ~31 GB/s after, as fast as on codes already in L2 (compute-bound).
template <typename S, int RB>
inline void float_block(const float* x, int64_t K, const uint8_t* codes, const S* scale, float* y, int64_t N,
                        int64_t n) {
  const int64_t groups = K / 16, row_bytes = K * 6 / 8, supers = K / 256;
  const uint8_t* rows[2 * PAIRS];
  const S* scales[2 * PAIRS];
  pair_rows(codes, scale, row_bytes, groups, n, rows, scales);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
  const __m512i eighths[4] = {eighth_index(0), eighth_index(1), eighth_index(2), eighth_index(3)};  // of a block
  // Each output's codes and scales are prefetched PREFETCH_SUPERS super-blocks ahead along its own row,
  // continued past the row's end by the same output of the following blocks (n + 2 * PAIRS, ...).
  quant::StreamAhead prefetch(PREFETCH_SUPERS, supers);  // passes: blocks of 2 * PAIRS rows
  __m512 acc[RB][PAIRS];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < PAIRS; ++p) acc[r][p] = _mm512_setzero_ps();
  __m512 eight[PAIRS];
  __m512i index = spread;
  for (int64_t s = 0; s < supers; ++s) {
    for (int j = 0; j < 2 * PAIRS; ++j) {  // prefetches never fault
      const uint8_t* ahead = rows[j] + prefetch.pass * 2 * PAIRS * row_bytes + prefetch.offset * SIX_SUPER_BYTES;
      for (int64_t line = 0; line < SIX_SUPER_BYTES; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(scales[j] + prefetch.pass * 2 * PAIRS * groups + prefetch.offset * 16), _MM_HINT_T0);
    }
    prefetch.advance(1);
    for_super_blocks([&](auto block) __attribute__((always_inline)) {
      constexpr int I = decltype(block)::value;
      __m512i c[PAIRS];
      for (int p = 0; p < PAIRS; ++p)
        c[p] = unsigned_pair<I, true>(rows[2 * p] + s * SIX_SUPER_BYTES, rows[2 * p + 1] + s * SIX_SUPER_BYTES);
      for (int h = 0; h < 2; ++h) {  // group g = 16 s + 2 I + h
        const int64_t g = 16 * s + 2 * I + h;
        if (g % 8 == 0) {
          for (int p = 0; p < PAIRS; ++p) eight[p] = eight_scales(scales[2 * p] + g, scales[2 * p + 1] + g);
          index = spread;
        }
        __m512 w[PAIRS][2], sc[PAIRS];
        for (int p = 0; p < PAIRS; ++p) {
          w[p][0] = shuffled_codes<32>(c[p], eighths[2 * h]);
          w[p][1] = shuffled_codes<32>(c[p], eighths[2 * h + 1]);
          sc[p] = _mm512_permutexvar_ps(index, eight[p]);
        }
        index = _mm512_add_epi32(index, _mm512_set1_epi32(1));
        for (int r = 0; r < RB; ++r) {
          const float* xr = x + r * K + 16 * g;
          __m512 dot[PAIRS];
          const __m512 x0 = _mm512_broadcast_f32x8(_mm256_loadu_ps(xr));
          for (int p = 0; p < PAIRS; ++p) dot[p] = _mm512_mul_ps(w[p][0], x0);
          const __m512 x1 = _mm512_broadcast_f32x8(_mm256_loadu_ps(xr + 8));
          for (int p = 0; p < PAIRS; ++p) dot[p] = _mm512_fmadd_ps(w[p][1], x1, dot[p]);
          for (int p = 0; p < PAIRS; ++p) acc[r][p] = _mm512_fmadd_ps(dot[p], sc[p], acc[r][p]);
        }
      }
    });
  }
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < PAIRS; ++p) pairs::store_pair(acc[r][p], y + r * N + n + 2 * p);
}

}  // namespace

template <int RB>
int64_t six_int8_row_pairs(const quant::QuantizedRows& q, int64_t m0, const uint8_t* codes, const float* scale, float* y,
                           int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 * PAIRS <= n1; n += 2 * PAIRS) int8_block<RB>(q, m0, codes, scale, y, N, n);
  return n;  // (the AVX2 kernel takes the last outputs: fewer than 2 * PAIRS)
}

template <typename S, int RB>
int64_t six_float_row_pairs(const float* x, int64_t K, const uint8_t* codes, const S* scale, float* y, int64_t N,
                            int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 * PAIRS <= n1; n += 2 * PAIRS) float_block<S, RB>(x, K, codes, scale, y, N, n);
  return n;
}

template int64_t six_int8_row_pairs<1>(const quant::QuantizedRows&, int64_t, const uint8_t*, const float*, float*,
                                       int64_t, int64_t, int64_t);
template int64_t six_int8_row_pairs<2>(const quant::QuantizedRows&, int64_t, const uint8_t*, const float*, float*,
                                       int64_t, int64_t, int64_t);
template int64_t six_int8_row_pairs<4>(const quant::QuantizedRows&, int64_t, const uint8_t*, const float*, float*,
                                       int64_t, int64_t, int64_t);
#define FD_INSTANCE(S, RB) \
  template int64_t six_float_row_pairs<S, RB>(const float*, int64_t, const uint8_t*, const S*, float*, int64_t, int64_t, int64_t);
#define FD_INSTANCES(S) \
  FD_INSTANCE(S, 1) FD_INSTANCE(S, 2) FD_INSTANCE(S, 3) FD_INSTANCE(S, 4) FD_INSTANCE(S, 5) FD_INSTANCE(S, 6) \
  FD_INSTANCE(S, 7) FD_INSTANCE(S, 8)
FD_INSTANCES(float)
FD_INSTANCES(at::Half)
#undef FD_INSTANCES
#undef FD_INSTANCE

}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
