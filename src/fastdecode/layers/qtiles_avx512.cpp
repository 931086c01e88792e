// The tiled layout's int8-activation products with AVX-512 + VNNI: qtiles.cpp's int8_tiles for two tiles
// at once, tile t0 in the low 256 bits of each register and tile t0 + 1 in the high ones (16 outputs).
//
// Bit for bit the AVX2 kernel (isa.h): VNNI's dpbusd adds 4 products (unsigned byte x signed byte) to an
// int32 lane exactly, so a block's int32 dot products equal the AVX2 kernel's maddubs/madd sums (which
// never saturate: see qtiles.cpp), and every float operation after them (convert, scale product, FMA into
// the accumulator, the mins term, in block order) is the AVX2 kernel's, lane for lane.
//   4-bit codes: dpbusd(codes 0..15, activation) straight;
//   8-bit codes: the codes are the signed operand and the activations the unsigned one, offset by 128
//                (u = a + 128, made once per call: `offset_codes`); a second dpbusd of ones with the codes
//                gives each output's code sum per block, and sum u * code - 128 * sum code = sum a * code
//                exactly in int32 (|sum u * code| <= 32 * 255 * 128). Per row and 4 inputs one dpbusd,
//                where the sign trick needed a sign fix-up of the activation too.
#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "kscales.h"
#include "qrows.h"
#include "qtiles_avx512.h"

// Everything below (and only it: the headers above keep their AVX2 code) may use AVX-512; it runs only
// where isa.h's use_avx512() holds.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

namespace fastdecode {
namespace avx512 {
namespace {

using quant::QuantizedRows;

constexpr int TILE = 8;
// Codes this far ahead are prefetched, at every row count: the kernel runs fast enough that a matrix
// streamed from memory (an LM head) waits for it otherwise (50265 x 768 int8 at 8 rows: 98 -> 205 GMAC/s).
// At one or two rows it runs fastest per byte, so it looks further ahead (a batch-1 decode step streams a
// block's matrices from L3 or memory, each only once): 3 KB per stream. Qwen2.5-Coder-1.5B Q4_K_M's matrices,
// each layer's in turn, one Zen 5 core beside others' load (CPU time, alternating builds of the same tree):
// gate/up 1536 x 17920 5-6% and the Q4_K down matrices ~5% faster than 4 KB ahead (2 KB: gate/up alike, down
// 1.5%; 8 KB: 1-4% slower). benchmarks/read_ceiling.py's reader with a 4-bit product's work per byte tells why
// it matters: one core streams 24-28 GB/s without prefetches, 32-39 with them, 38-43 reading alone.
constexpr int64_t PREFETCH_BYTES = 1024;
constexpr int64_t FEW_ROWS_PREFETCH_BYTES = 3072;

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The 32 code bytes of tile t0 (low half) and t0 + 1 (high half) at the same block offset.
inline __m512i load_pair(const uint8_t* low, const uint8_t* high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)), 1);
}

// 8 scales of each tile as 16 float32 lanes (float16: the same exact conversion as F16C's).
inline __m512 load_scales(const at::Half* low, const at::Half* high) {
  const __m256i halves = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(high)), 1);
  return _mm512_cvtph_ps(halves);
}
inline __m512 load_scales(const float* low, const float* high) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(low)), _mm256_loadu_ps(high), 1);
}

// Block b's scales of two tiles (their first scales at low, high) as 16 float32 lanes.
template <typename S>
inline __m512 pair_scales(const S* low, const S* high, int64_t b) {
  return load_scales(low + b * TILE, high + b * TILE);
}

// The block scales (or mins) of a tile pair, block after block: pair_scales; compact records (kscales.h) decoded
// with their 16 float16 super-scales converted once per super-block (8 blocks), not once per block: per block
// one 16-byte gather of the two tiles' codes, a widening, a conversion and the multiply of quant::block_scales
// (d * code, the same lanes: the same bits).
template <typename S>
struct PairScales {
  const S *low, *high;
  PairScales(const S* low, const S* high) : low(low), high(high) {}
  __m512 at(int64_t b) { return pair_scales(low, high, b); }
};
template <>
struct PairScales<quant::KScale> {
  const int8_t *low, *high;
  int64_t super = -1;
  __m512 d = _mm512_setzero_ps();  // the super-block's scales: tile t0's 8 outputs, then t0 + 1's
  PairScales(const quant::KScale* low, const quant::KScale* high) : low(&low->byte), high(&high->byte) {}
  __m512 at(int64_t b) {
    const int64_t record = (b >> 3) * quant::TILE_RECORD;
    if ((b >> 3) != super) {
      super = b >> 3;
      d = _mm512_cvtph_ps(_mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + record + 64))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(high + record + 64)), 1));
    }
    const __m128i codes = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(low + record + 8 * (b & 7))),
                                             _mm_loadl_epi64(reinterpret_cast<const __m128i*>(high + record + 8 * (b & 7))));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)));
  }
};

}  // namespace

template <int BITS, typename S, int RB, bool PREFETCH>
void int8_tile_pair(const QuantizedRows& q, const uint8_t* offset_codes, int64_t m0, const uint8_t* codes,
                    const S* scale, const S* mins, int64_t blocks, int64_t t0, float* y, int64_t N) {
  constexpr int64_t BB = TILE * 32 * BITS / 8;  // bytes of one tile-block
  const int64_t K = q.K;
  const uint8_t* low_codes = codes + t0 * blocks * BB;
  const uint8_t* high_codes = low_codes + blocks * BB;
  const S* low_scale = quant::tile_scales(scale, t0, blocks);
  const S* high_scale = quant::tile_scales(scale, t0 + 1, blocks);
  // each row's activation codes: as they are (4-bit codes), or + 128 as unsigned bytes (8-bit codes)
  const int8_t* act[RB];
  const float* act_scale[RB];
  for (int r = 0; r < RB; ++r) {
    act[r] = (BITS == 8 ? reinterpret_cast<const int8_t*>(offset_codes) : q.codes.data()) + (m0 + r) * K;
    act_scale[r] = q.scale.data() + (m0 + r) * blocks;
  }
  constexpr int64_t ahead = RB <= 2 ? FEW_ROWS_PREFETCH_BYTES : PREFETCH_BYTES;
  // One or two rows stream a matrix read once per step: prefetched non-temporal, so it does not push the step's
  // other data (the caller's Python between steps, the next ops' operands) out of the caches. The embedded
  // SmolLM2-135M at batch 1, 2 threads, AMD EPYC Zen 5: 331 -> 356 and 339 -> 364 tok/s (benchmarks/batch1_ab.py
  // --paired 16, ratios 1.079 and 1.078); Qwen2.5-Coder-1.5B Q4_K_M 33.3 -> 33.4 (decode_ab.py).
  constexpr _mm_hint hint = RB <= 2 ? _MM_HINT_NTA : _MM_HINT_T0;
  if constexpr (PREFETCH) {  // the next pair's scales and mins (their own streams, read once per pair)
    const int64_t bytes = 2 * (reinterpret_cast<const char*>(quant::tile_scales(scale, 1, blocks)) -
                               reinterpret_cast<const char*>(scale));  // (compact: 80 bytes per 8 blocks)
    const char* next_scales = reinterpret_cast<const char*>(quant::tile_scales(scale, t0 + 2, blocks));
    const char* next_mins = mins != nullptr ? reinterpret_cast<const char*>(quant::tile_scales(mins, t0 + 2, blocks)) : nullptr;
    for (int64_t line = 0; line < bytes; line += 64) {  // (prefetches never fault, past the end included)
      _mm_prefetch(next_scales + line, hint);
      if (next_mins != nullptr) _mm_prefetch(next_mins + line, hint);
    }
  }
  // Each of the two code streams (tile t0's, tile t0 + 1's) is prefetched `ahead` bytes ahead along itself,
  // continued past its tile's end by the same stream of the following pairs (tiles t0 + 2 and t0 + 3, ...):
  // where the look-ahead crossed into the neighbouring tile instead (which the other stream has loaded
  // already), a stream ran without prefetches over its tile's start: Qwen2.5-Coder-1.5B's Q4_K matrices
  // (6 KB tiles) streamed at 20 -> 26 GB/s on one Zen 5 core, 33 -> 42 on two.
  const int64_t tile_bytes = blocks * BB;
  quant::StreamAhead prefetch(ahead, tile_bytes);  // passes: tile pairs
  // The mins term (K-quants and Q4_1: each block's mins times the row's activation sum) accumulates beside
  // acc, block by block in the same order as a separate pass over the blocks would: each block's mins are
  // decoded once for all RB rows, not once per row.
  PairScales<S> w_scales(low_scale, high_scale);
  PairScales<S> w_mins(mins != nullptr ? quant::tile_scales(mins, t0, blocks) : nullptr,
                       mins != nullptr ? quant::tile_scales(mins, t0 + 1, blocks) : nullptr);
  const float* sums[RB];
  for (int r = 0; r < RB; ++r) sums[r] = mins != nullptr ? q.sums.data() + (m0 + r) * blocks : nullptr;
  __m512 acc[RB], min_term[RB];
  for (int r = 0; r < RB; ++r) acc[r] = min_term[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w0 = low_codes + b * BB;
    const uint8_t* w1 = high_codes + b * BB;
    if constexpr (PREFETCH) {
      const int64_t at = prefetch.pass * 2 * tile_bytes + prefetch.offset;  // from low_codes (high_codes: the same)
      for (int64_t line = 0; line < BB; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(low_codes + at + line), hint);
        _mm_prefetch(reinterpret_cast<const char*>(high_codes + at + line), hint);
      }
      prefetch.advance(BB);
    }
    __m512i dot[RB];
    for (int r = 0; r < RB; ++r) dot[r] = _mm512_setzero_si512();
    if constexpr (BITS == 4) {
      const __m512i nibble = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i v = load_pair(w0 + 32 * c, w1 + 32 * c);
        const __m512i low = _mm512_and_si512(v, nibble), high = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int r = 0; r < RB; ++r) {
          const int8_t* a = act[r] + 32 * b + 4 * c;
          dot[r] = _mm512_dpbusd_epi32(dot[r], low, broadcast4(a));
          dot[r] = _mm512_dpbusd_epi32(dot[r], high, broadcast4(a + 16));
        }
      }
    } else {
      const __m512i ones = _mm512_set1_epi8(1);
      __m512i code_sum = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m512i v = load_pair(w0 + 32 * c, w1 + 32 * c);
        code_sum = _mm512_dpbusd_epi32(code_sum, ones, v);
        for (int r = 0; r < RB; ++r)
          dot[r] = _mm512_dpbusd_epi32(dot[r], broadcast4(act[r] + 32 * b + 4 * c), v);
      }
      const __m512i correction = _mm512_slli_epi32(code_sum, 7);  // 128 * sum of the codes
      for (int r = 0; r < RB; ++r) dot[r] = _mm512_sub_epi32(dot[r], correction);
    }
    const __m512 w_scale = w_scales.at(b);
    for (int r = 0; r < RB; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(w_scale, _mm512_set1_ps(act_scale[r][b])),
                               acc[r]);
    if (mins != nullptr) {
      const __m512 block_mins = w_mins.at(b);
      for (int r = 0; r < RB; ++r) min_term[r] = _mm512_fmadd_ps(block_mins, _mm512_set1_ps(sums[r][b]), min_term[r]);
    }
  }
  const int64_t n = t0 * TILE;
  const __mmask16 valid = N - n >= 2 * TILE ? __mmask16(0xFFFF) : __mmask16((1u << (N - n)) - 1);
  for (int r = 0; r < RB; ++r) {
    const __m512 total = mins != nullptr ? _mm512_add_ps(acc[r], min_term[r]) : acc[r];
    _mm512_mask_storeu_ps(y + (m0 + r) * N + n, valid, total);
  }
}

#define FD_INSTANCES(BITS, S)                                                                                    \
  template void int8_tile_pair<BITS, S, 8, true>(const QuantizedRows&, const uint8_t*, int64_t, const uint8_t*, const S*, const S*, \
                                                  int64_t, int64_t, float*, int64_t);                            \
  template void int8_tile_pair<BITS, S, 5, true>(const QuantizedRows&, const uint8_t*, int64_t, const uint8_t*, const S*, const S*, \
                                                  int64_t, int64_t, float*, int64_t);                            \
  template void int8_tile_pair<BITS, S, 4, true>(const QuantizedRows&, const uint8_t*, int64_t, const uint8_t*, const S*, const S*, \
                                                  int64_t, int64_t, float*, int64_t);                            \
  template void int8_tile_pair<BITS, S, 2, true>(const QuantizedRows&, const uint8_t*, int64_t, const uint8_t*, const S*, const S*, \
                                                  int64_t, int64_t, float*, int64_t);                            \
  template void int8_tile_pair<BITS, S, 1, true>(const QuantizedRows&, const uint8_t*, int64_t, const uint8_t*, const S*, const S*, \
                                                 int64_t, int64_t, float*, int64_t);
FD_INSTANCES(4, at::Half)
FD_INSTANCES(4, float)
FD_INSTANCES(8, at::Half)
FD_INSTANCES(8, float)
FD_INSTANCES(4, quant::KScale)
FD_INSTANCES(8, quant::KScale)
#undef FD_INSTANCES

}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
