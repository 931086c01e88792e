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
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kscales.h"
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

// Outputs n .. n + 2 * PAIRS - 1: their code rows and scale rows (float32 or float16: K / 16 scales per output;
// compact, kscales.h: K / 256 records of 18 bytes, 16 sub-scale codes and the float16 super-scale d).
template <typename S>
inline int64_t scale_row_stride(int64_t K) {
  return std::is_same_v<S, quant::KScale> ? K / quant::SUPER * (quant::SUPER / 16 + 2) : K / 16;
}
template <typename S>
inline void pair_rows(const uint8_t* codes, const S* scale, int64_t row_bytes, int64_t K, int64_t n,
                      const uint8_t** rows, const S** scales) {
  for (int j = 0; j < 2 * PAIRS; ++j) {
    rows[j] = codes + (n + j) * row_bytes;
    scales[j] = scale + (n + j) * scale_row_stride<S>(K);
  }
}

// A compact record's 16 group scales (super-block s of one output: its record at `record`) as float32 lanes:
// d * code, the float multiply of the same two values that kscales.h's expand_rows makes (the same bits).
inline __m512 super_scales(const quant::KScale* record) {
  const int8_t* p = &record->byte;
  uint16_t d_bits;  // d broadcast as float16, then converted: F16C's exact conversion, as half_at's
  std::memcpy(&d_bits, p + quant::SUPER / 16, 2);
  const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(d_bits)));
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
}
constexpr int64_t RECORD16 = quant::SUPER / 16 + 2;  // bytes of a compact record of groups of 16

// Compact scales: each output's record of the super-block `s`, decoded (super_scales) once for its 8 blocks.
template <typename S>
inline void decode_supers(const S* const* scales, int64_t s, __m512* supers) {
  if constexpr (std::is_same_v<S, quant::KScale>)
    for (int j = 0; j < 2 * PAIRS; ++j) supers[j] = super_scales(scales[j] + s * RECORD16);
}

// Scale elements per super-block of one output (a compact record, or 16 scales).
template <typename S>
constexpr int64_t SUPER_SCALES = std::is_same_v<S, quant::KScale> ? RECORD16 : 16;

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
// Scales float32, or compact records decoded per super-block in registers (no expanded copy: Qwen2.5-Coder-1.5B's
// down and V matrices at batch 1 spent ~30% of their time expanding records into an L1 buffer beside this kernel).
template <typename S, int RB>
inline void int8_block(const quant::QuantizedRows& q, int64_t m0, const uint8_t* codes, const S* scale, float* y,
                       int64_t N, int64_t n) {
  constexpr bool compact = std::is_same_v<S, quant::KScale>;
  const int64_t K = q.K, blocks = K / 32, row_bytes = K * 6 / 8;
  const uint8_t* rows[2 * PAIRS];
  const S* scales[2 * PAIRS];
  pair_rows(codes, scale, row_bytes, K, n, rows, scales);
  const __m512i lane_scale = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int64_t prefetch_offset = 2 * 2 * PAIRS * row_bytes;  // two passes ahead: these rows' successors
  const int64_t record_prefetch = 2 * 2 * PAIRS * scale_row_stride<S>(K);  // (compact records: the same)
  __m512 acc[RB][PAIRS];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < PAIRS; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t s = 0; s < blocks / 8; ++s) {
    for (int j = 0; j < 2 * PAIRS; ++j) {
      for (int64_t line = 0; line < SIX_SUPER_BYTES; line += 64)  // prefetches never fault
        _mm_prefetch(reinterpret_cast<const char*>(rows[j] + s * SIX_SUPER_BYTES + line + prefetch_offset), _MM_HINT_T0);
      if constexpr (compact)
        _mm_prefetch(reinterpret_cast<const char*>(scales[j] + s * RECORD16 + record_prefetch), _MM_HINT_T0);
    }
    __m512 supers[2 * PAIRS];  // compact: each output's 16 group scales of this super-block
    decode_supers(scales, s, supers);
    for_super_blocks([&](auto block) __attribute__((always_inline)) {
      constexpr int I = decltype(block)::value;
      const int64_t b = 8 * s + I;
      __m512i w[PAIRS];
      __m512 w_scale[PAIRS];  // lanes: groups 2b, 2b + 1 of output 2p (4 each), then of output 2p + 1
      for (int p = 0; p < PAIRS; ++p) {
        w[p] = unsigned_pair<I>(rows[2 * p] + s * SIX_SUPER_BYTES, rows[2 * p + 1] + s * SIX_SUPER_BYTES);
        if constexpr (compact) {
          const __m512i groups = _mm512_setr_epi32(2 * I, 2 * I, 2 * I, 2 * I, 2 * I + 1, 2 * I + 1, 2 * I + 1, 2 * I + 1,
                                                   16 + 2 * I, 16 + 2 * I, 16 + 2 * I, 16 + 2 * I, 17 + 2 * I,
                                                   17 + 2 * I, 17 + 2 * I, 17 + 2 * I);
          w_scale[p] = _mm512_permutex2var_ps(supers[2 * p], groups, supers[2 * p + 1]);
        } else {
          const __m128 pair = _mm_castpd_ps(_mm_unpacklo_pd(_mm_castsi128_pd(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales[2 * p] + 2 * b))),
                                                            _mm_castsi128_pd(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales[2 * p + 1] + 2 * b)))));
          w_scale[p] = _mm512_permutexvar_ps(lane_scale, _mm512_castps128_ps512(pair));
        }
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
  constexpr bool compact = std::is_same_v<S, quant::KScale>;
  const int64_t row_bytes = K * 6 / 8, supers = K / 256, scale_stride = scale_row_stride<S>(K);
  const uint8_t* rows[2 * PAIRS];
  const S* scales[2 * PAIRS];
  pair_rows(codes, scale, row_bytes, K, n, rows, scales);
  // a group's scale of each output of a pair, 8 lanes each: from the pair's eight (eight_scales: lanes 0-7, 8-15)
  // or, compact, from their super-blocks' 16 (super_scales: output 2p's register, then 2p + 1's)
  const __m512i spread = compact ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16)
                                 : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
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
      _mm_prefetch(reinterpret_cast<const char*>(scales[j] + prefetch.pass * 2 * PAIRS * scale_stride +
                                                 prefetch.offset * SUPER_SCALES<S>), _MM_HINT_T0);
    }
    prefetch.advance(1);
    __m512 super[2 * PAIRS];  // compact: each output's 16 group scales of this super-block
    decode_supers(scales, s, super);
    for_super_blocks([&](auto block) __attribute__((always_inline)) {
      constexpr int I = decltype(block)::value;
      __m512i c[PAIRS];
      for (int p = 0; p < PAIRS; ++p)
        c[p] = unsigned_pair<I, true>(rows[2 * p] + s * SIX_SUPER_BYTES, rows[2 * p + 1] + s * SIX_SUPER_BYTES);
      for (int h = 0; h < 2; ++h) {  // group g = 16 s + 2 I + h
        const int64_t g = 16 * s + 2 * I + h;
        if (compact ? g % 16 == 0 : g % 8 == 0) {
          if constexpr (!compact)
            for (int p = 0; p < PAIRS; ++p) eight[p] = eight_scales(scales[2 * p] + g, scales[2 * p + 1] + g);
          index = spread;
        }
        __m512 w[PAIRS][2], sc[PAIRS];
        for (int p = 0; p < PAIRS; ++p) {
          w[p][0] = shuffled_codes<32>(c[p], eighths[2 * h]);
          w[p][1] = shuffled_codes<32>(c[p], eighths[2 * h + 1]);
          if constexpr (compact) sc[p] = _mm512_permutex2var_ps(super[2 * p], index, super[2 * p + 1]);
          else sc[p] = _mm512_permutexvar_ps(index, eight[p]);
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

template <typename S, int RB>
int64_t six_int8_row_pairs(const quant::QuantizedRows& q, int64_t m0, const uint8_t* codes, const S* scale, float* y,
                           int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 * PAIRS <= n1; n += 2 * PAIRS) int8_block<S, RB>(q, m0, codes, scale, y, N, n);
  return n;  // (the AVX2 kernel takes the last outputs: fewer than 2 * PAIRS)
}

template <typename S, int RB>
int64_t six_float_row_pairs(const float* x, int64_t K, const uint8_t* codes, const S* scale, float* y, int64_t N,
                            int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 * PAIRS <= n1; n += 2 * PAIRS) float_block<S, RB>(x, K, codes, scale, y, N, n);
  return n;
}

// Outputs [n0, n1) of 6-bit codes with compact scales, every row (x: M rows of float32 activations [M, K]; null:
// q's int8 activations): qmatmul.cpp's outputs_range on the expanded scales, bit for bit, its chunks of
// COMPACT_CHUNK outputs and row blocks alike (8 and the rest at once for float32 rows; 4, 2, 1 for int8 ones).
// Returns where it stopped: the last (n1 - n0) % 4 outputs are left to the caller.
constexpr int64_t COMPACT_CHUNK = 32;  // qmatmul.cpp's OUTPUT_CHUNK
int64_t six_compact_outputs(const quant::QuantizedRows& q, const float* x, int64_t M, int64_t K, const uint8_t* codes,
                            const quant::KScale* scale, float* y, int64_t N, int64_t n0, int64_t n1) {
  using quant::KScale;
  const int64_t end = n0 + (n1 - n0) / (2 * PAIRS) * (2 * PAIRS);
  for (int64_t c = n0; c < end; c += COMPACT_CHUNK) {
    const int64_t c1 = std::min(c + COMPACT_CHUNK, end);
    int64_t m = 0;
    if (x == nullptr) {
      for (; m + 4 <= M; m += 4) six_int8_row_pairs<KScale, 4>(q, m, codes, scale, y, N, c, c1);
      for (; m + 2 <= M; m += 2) six_int8_row_pairs<KScale, 2>(q, m, codes, scale, y, N, c, c1);
      for (; m < M; ++m) six_int8_row_pairs<KScale, 1>(q, m, codes, scale, y, N, c, c1);
      continue;
    }
    for (; m + 8 <= M; m += 8) six_float_row_pairs<KScale, 8>(x + m * K, K, codes, scale, y + m * N, N, c, c1);
    const float* xm = x + m * K;
    float* ym = y + m * N;
    switch (M - m) {  // the last 1-7 rows in one block
      case 7: six_float_row_pairs<KScale, 7>(xm, K, codes, scale, ym, N, c, c1); break;
      case 6: six_float_row_pairs<KScale, 6>(xm, K, codes, scale, ym, N, c, c1); break;
      case 5: six_float_row_pairs<KScale, 5>(xm, K, codes, scale, ym, N, c, c1); break;
      case 4: six_float_row_pairs<KScale, 4>(xm, K, codes, scale, ym, N, c, c1); break;
      case 3: six_float_row_pairs<KScale, 3>(xm, K, codes, scale, ym, N, c, c1); break;
      case 2: six_float_row_pairs<KScale, 2>(xm, K, codes, scale, ym, N, c, c1); break;
      case 1: six_float_row_pairs<KScale, 1>(xm, K, codes, scale, ym, N, c, c1); break;
      default: break;
    }
  }
  return end;
}

#define FD_INT8_INSTANCES(S)                                                                                           \
  template int64_t six_int8_row_pairs<S, 1>(const quant::QuantizedRows&, int64_t, const uint8_t*, const S*, float*,    \
                                            int64_t, int64_t, int64_t);                                                \
  template int64_t six_int8_row_pairs<S, 2>(const quant::QuantizedRows&, int64_t, const uint8_t*, const S*, float*,    \
                                            int64_t, int64_t, int64_t);                                                \
  template int64_t six_int8_row_pairs<S, 4>(const quant::QuantizedRows&, int64_t, const uint8_t*, const S*, float*,    \
                                            int64_t, int64_t, int64_t);
FD_INT8_INSTANCES(float)
FD_INT8_INSTANCES(quant::KScale)
#undef FD_INT8_INSTANCES
#define FD_INSTANCE(S, RB) \
  template int64_t six_float_row_pairs<S, RB>(const float*, int64_t, const uint8_t*, const S*, float*, int64_t, int64_t, int64_t);
#define FD_INSTANCES(S) \
  FD_INSTANCE(S, 1) FD_INSTANCE(S, 2) FD_INSTANCE(S, 3) FD_INSTANCE(S, 4) FD_INSTANCE(S, 5) FD_INSTANCE(S, 6) \
  FD_INSTANCE(S, 7) FD_INSTANCE(S, 8)
FD_INSTANCES(float)
FD_INSTANCES(at::Half)
FD_INSTANCES(quant::KScale)
#undef FD_INSTANCES
#undef FD_INSTANCE

}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
