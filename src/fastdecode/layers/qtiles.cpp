// Quantized products on the tiled layout: groups of 32 inputs, 4-bit or 8-bit codes, 8 outputs per
// 256-bit register, so the integer dot products need no horizontal sums (AVX2 + FMA + F16C).
//
// Layout (made once at load by quantized.tile_rows): tile t holds outputs 8t..8t+7 (the last tile padded
// with zero rows), block b inputs 32b..32b+31; the 8 rows' block bytes (16 for 4-bit codes, byte j holding
// element j in its low nibble and j + 16 in its high one: GGUF's order; 32 for 8-bit codes) interleave
// 4 bytes at a time:
//   codes[t, b, 32 c + 4 r + i] = byte 4 c + i of block b of output 8 t + r       (r < 8, i < 4)
//   scale[t, b, r], mins[t, b, r] = that output's block scale and min (float16 or float32)
// One 32-byte load is 8 outputs x 4 code bytes (4-bit: inputs 4c..4c+3 in the low nibbles and
// 16+4c..16+4c+3 in the high ones, 8-bit: inputs 4c..4c+3), a tile's codes are one sequential stream,
// and 8 outputs' scales convert in one instruction.
//
// int8 activations (quant::quantize_rows: x ~ d[row, b] * a, |a| <= 127, sums = d * sum a per block):
// 4 activation bytes are broadcast to the 8 lanes and maddubs (unsigned codes x signed activations)
// gives each output's pair sums in int16.
//   4-bit: a block's 8 vectors add in int16 (a lane sums 16 products: |sum| <= 16 * 15 * 127 = 30480, no
//          overflow), then one madd -> int32 per output;
//   8-bit: the sign trick (|code| <= 128 x sign-matched activation: |pair| <= 2 * 128 * 127 = 32512), one
//          madd per vector, int32 adds.
// Then y[8] += float(dot[8]) * (scale[8] * d[row, b]) per block, and the mins term
// sum_b mins[8] * sums[row, b] in its own accumulator, added at the end: the same operations in the same
// order for every (row, output) whatever the number of rows and however rows and outputs are tiled or
// split between threads, so a row's result never depends on the rest of the batch.
//
// float32 activations (the logits layer, exact up to summation order): see float_tile.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"
#include "parallel.h"
#include "kscales.h"
#include "qlanes.h"
#include "qrows.h"
#include "qtiles.h"
#include "qtiles_avx512.h"

namespace fastdecode {
namespace {

using namespace quant;

constexpr int TILE = 8;  // outputs per tile: one float32 lane each

template <int BITS>
constexpr int64_t tile_block_bytes() { return TILE * 32 * BITS / 8; }  // 128 (4-bit) or 256 (8-bit)

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The 8 outputs of one (row, tile) stored; the padded tail tile stores only its real outputs.
inline void store_outputs(float* y, __m256 v, int64_t valid) {
  if (valid >= TILE) {
    _mm256_storeu_ps(y, v);
    return;
  }
  alignas(32) float lanes[TILE];
  _mm256_store_ps(lanes, v);
  std::copy(lanes, lanes + valid, y);
}

// Codes this far ahead are prefetched at few rows (memory-bound; a tile is one stream, but the hardware
// prefetcher starts late on each new 4 KB page).
constexpr int64_t PREFETCH_BYTES = 1024;

// ---- int8 activations ---------------------------------------------------------------------------------
// total[r] += the mins term of rows [m0, m0 + RB) on one tile: sum over the blocks b, in order, of the tile's
// mins of block b times the row's activation sum, in its own accumulator from zero. The mins are decoded a
// chunk of blocks at a time, once for all RB rows (compact K-quant mins cost a few operations each).
template <typename S, int RB>
inline void add_mins_term(const QuantizedRows& q, int64_t m0, const S* tile_mins, int64_t blocks, __m256* total) {
  constexpr int64_t CHUNK = 32;  // blocks decoded at a time: 1 KB of float32 mins
  alignas(32) float decoded[CHUNK * TILE];
  __m256 offset[RB];
  for (int r = 0; r < RB; ++r) offset[r] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < blocks; b0 += CHUNK) {
    const int64_t count = std::min(CHUNK, blocks - b0);
    for (int64_t i = 0; i < count; ++i) _mm256_store_ps(decoded + i * TILE, block_scales(tile_mins, b0 + i));
    for (int r = 0; r < RB; ++r) {
      const float* sums = q.sums.data() + (m0 + r) * blocks + b0;
      for (int64_t i = 0; i < count; ++i)
        offset[r] = _mm256_fmadd_ps(_mm256_load_ps(decoded + i * TILE), _mm256_set1_ps(sums[i]), offset[r]);
    }
  }
  for (int r = 0; r < RB; ++r) total[r] = _mm256_add_ps(total[r], offset[r]);
}

// Rows [m0, m0 + RB) x tiles t0 .. t0 + NT: each weight vector is loaded once for the RB rows; NT tiles
// side by side give independent accumulators (instruction-level parallelism at one row).
template <int BITS, typename S, int RB, int NT, bool PREFETCH>
void int8_tiles(const QuantizedRows& q, int64_t m0, const uint8_t* codes, const S* scale, const S* mins,
                int64_t blocks, int64_t t0, float* y, int64_t N) {
  constexpr int64_t BB = tile_block_bytes<BITS>();
  const int64_t K = q.K;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* act[RB];
  const float* act_scale[RB];
  for (int r = 0; r < RB; ++r) {
    act[r] = q.codes.data() + (m0 + r) * K;
    act_scale[r] = q.scale.data() + (m0 + r) * blocks;
  }
  __m256 acc[NT][RB];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < RB; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int t = 0; t < NT; ++t) {
      const uint8_t* w = codes + ((t0 + t) * blocks + b) * BB;
      if constexpr (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_BYTES), _MM_HINT_T0);
      if constexpr (PREFETCH && BB > 64) _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_BYTES + 64), _MM_HINT_T0);
      __m256i dot[RB];
      if constexpr (BITS == 4) {
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        __m256i pairs[RB];  // int16 pair sums, 16 inputs per lane by the end
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
          const __m256i low = _mm256_and_si256(v, nibble), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          for (int r = 0; r < RB; ++r) {
            const int8_t* a = act[r] + 32 * b + 4 * c;
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(low, broadcast4(a)),
                                               _mm256_maddubs_epi16(high, broadcast4(a + 16)));
            pairs[r] = c == 0 ? p : _mm256_add_epi16(pairs[r], p);
          }
        }
        for (int r = 0; r < RB; ++r) dot[r] = _mm256_madd_epi16(pairs[r], ones);
      } else {
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
          const __m256i magnitude = _mm256_sign_epi8(v, v);  // |code|; -128 stays 0x80 = 128 unsigned
          for (int r = 0; r < RB; ++r) {
            const __m256i a = _mm256_sign_epi8(broadcast4(act[r] + 32 * b + 4 * c), v);  // a * sign(code)
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, a), ones);
            dot[r] = c == 0 ? p : _mm256_add_epi32(dot[r], p);
          }
        }
      }
      const __m256 w_scale = block_scales(tile_scales(scale, t0 + t, blocks), b);
      for (int r = 0; r < RB; ++r)
        acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(w_scale, _mm256_set1_ps(act_scale[r][b])),
                                    acc[t][r]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    if (mins != nullptr) add_mins_term<S, RB>(q, m0, tile_scales(mins, t0 + t, blocks), blocks, acc[t]);
    for (int r = 0; r < RB; ++r) {
      const int64_t n = (t0 + t) * TILE;
      store_outputs(y + (m0 + r) * N + n, acc[t][r], N - n);
    }
  }
}

// ---- float32 activations ------------------------------------------------------------------------------
// 8 code bytes (2 outputs x 4 inputs) -> float32 codes.
inline __m256 codes_to_float(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

// Rows [m0, m0 + RB) of x [M, K] x one tile, in the interleaved order itself: each tile-block is decoded
// once to float codes w[i][p] (inputs 4i..4i+3 of outputs 2p and 2p + 1: 8 code bytes), which meet x's
// 4 inputs broadcast to both halves; per row the block's sums (4 partials per output: inputs k mod 4)
// are scaled into acc[r][p], reduced once per tile at the end. The same operations per row for every RB.
template <int BITS, typename S, int RB>
void float_tile(const float* x, const float* xsum, int64_t m0, int64_t K, const uint8_t* codes, const S* scale,
                const S* mins, int64_t blocks, int64_t t, float* y, int64_t N) {
  constexpr int64_t BB = tile_block_bytes<BITS>();
  __m256 acc[RB][4];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < 4; ++p) acc[r][p] = _mm256_setzero_ps();
  const __m256i pair_index[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  __m256 w[8][4];
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = codes + (t * blocks + b) * BB;
    if (RB == 1) _mm_prefetch(reinterpret_cast<const char*>(block + 4 * PREFETCH_BYTES), _MM_HINT_T0);
    if constexpr (BITS == 4) {
      const __m256i nibble = _mm256_set1_epi8(0x0F);
      auto decode = [&](__m256i v, int i) __attribute__((always_inline)) {  // v: 8 outputs x inputs 4i..4i+3
        const __m128i first = _mm256_castsi256_si128(v), second = _mm256_extracti128_si256(v, 1);
        const __m128i parts[4] = {first, _mm_unpackhi_epi64(first, first), second, _mm_unpackhi_epi64(second, second)};
        for (int p = 0; p < 4; ++p) w[i][p] = codes_to_float(parts[p]);
      };
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * c));
        decode(_mm256_and_si256(v, nibble), c);
        decode(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), 4 + c);
      }
    } else {  // 8 bytes straight from memory per pair of outputs
      for (int i = 0; i < 8; ++i)
        for (int p = 0; p < 4; ++p)
          w[i][p] = codes_to_float(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 32 * i + 8 * p)));
    }
    const __m256 w_scale = block_scales(tile_scales(scale, t, blocks), b);
    __m256 pair_scale[4];
    for (int p = 0; p < 4; ++p) pair_scale[p] = _mm256_permutevar8x32_ps(w_scale, pair_index[p]);
    for (int r = 0; r < RB; ++r) {
      const float* xb = x + (m0 + r) * K + 32 * b;
      __m256 sums[4];
      for (int i = 0; i < 8; ++i) {
        const __m256 xs = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(xb + 4 * i));
        for (int p = 0; p < 4; ++p) sums[p] = i == 0 ? _mm256_mul_ps(w[i][p], xs) : _mm256_fmadd_ps(w[i][p], xs, sums[p]);
      }
      for (int p = 0; p < 4; ++p) acc[r][p] = _mm256_fmadd_ps(sums[p], pair_scale[p], acc[r][p]);
    }
  }
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int r = 0; r < RB; ++r) {
    // per 128-bit half: [o0 o2 o4 o6] | [o1 o3 o5 o7], each the sum of its 4 partials
    const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
    __m256 total = _mm256_permutevar8x32_ps(sums, order);
    if (mins != nullptr) {
      const S* m = tile_scales(mins, t, blocks);
      const float* group_sum = xsum + (m0 + r) * blocks;
      __m256 offset = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b)
        offset = _mm256_fmadd_ps(block_scales(m, b), _mm256_set1_ps(group_sum[b]), offset);
      total = _mm256_add_ps(total, offset);
    }
    store_outputs(y + (m0 + r) * N + t * TILE, total, N - t * TILE);
  }
}

// Tiles per pass over the rows: their codes (4 x 3 KB at K = 1536, 4-bit) stay in L1/L2 while every row
// block passes over them, so each weight byte comes from memory once per call.
constexpr int64_t TILES_PER_PASS = 4;

// y[m, n] += bias[n] for rows [m0, m1), outputs [n0, n1) of y [M, N].
inline void add_bias(const float* bias, int64_t m0, int64_t m1, int64_t n0, int64_t n1, float* y, int64_t N) {
  for (int64_t m = m0; m < m1; ++m) {
    float* row = y + m * N;
    for (int64_t n = n0; n < n1; ++n) row[n] += bias[n];
  }
}

// Activation bytes of the rows a pass over the tiles reads: within L2 (512 KB per core on Zen 2-4, 1 MB on
// Zen 5; blocks of 256 or 512 rows of K = 768 measured alike on Zen 5).
constexpr int64_t ROW_BLOCK_BYTES = 384 << 10;

// Rows per block: a multiple of 8 (the widest row group), at least 8.
inline int64_t row_block(int64_t row_bytes) {
  return std::max<int64_t>(8, ROW_BLOCK_BYTES / row_bytes / 8 * 8);
}

// Rows [m, m + RB) x tiles [p, p1) on the AVX-512 kernel, two tiles at a time; a last odd tile on the AVX2 one.
template <int BITS, typename S, int RB>
void wide_rows(const QuantizedRows& q, const uint8_t* offset, int64_t m, const uint8_t* cp, const S* sp, const S* mp,
               int64_t blocks, int64_t p, int64_t p1, float* yp, int64_t N) {
  int64_t t = p;
  for (; t + 2 <= p1; t += 2) avx512::int8_tile_pair<BITS, S, RB, true>(q, offset, m, cp, sp, mp, blocks, t, yp, N);
  constexpr int AVX2_ROWS = RB < 4 ? RB : 4;
  if (t < p1) {
    int r = 0;
    for (; r + AVX2_ROWS <= RB; r += AVX2_ROWS)
      int8_tiles<BITS, S, AVX2_ROWS, 1, RB == 1>(q, m + r, cp, sp, mp, blocks, t, yp, N);
    for (; r < RB; ++r) int8_tiles<BITS, S, 1, 1, false>(q, m + r, cp, sp, mp, blocks, t, yp, N);  // RB 5's last row
  }
}

// Rows [m0, M) x tiles [t0, t1); wide: the AVX-512 kernels (offset: their unsigned activations for 8-bit codes).
template <int BITS, typename S>
void tiles_range(const QuantizedRows& q, bool wide, const uint8_t* offset, const float* x, const float* xsum,
                 int64_t m0, int64_t M, int64_t K, const uint8_t* cp, const S* sp, const S* mp, float* yp, int64_t N,
                 int64_t t0, int64_t t1) {
  const int64_t blocks = K / 32;
  for (int64_t p = t0; p < t1; p += TILES_PER_PASS) {
    const int64_t p1 = std::min(p + TILES_PER_PASS, t1);
    int64_t m = m0;
    if (x != nullptr) {
      for (; m + 8 <= M; m += 8)
        for (int64_t t = p; t < p1; ++t) float_tile<BITS, S, 8>(x, xsum, m, K, cp, sp, mp, blocks, t, yp, N);
      for (; m + 2 <= M; m += 2)
        for (int64_t t = p; t < p1; ++t) float_tile<BITS, S, 2>(x, xsum, m, K, cp, sp, mp, blocks, t, yp, N);
      for (; m < M; ++m)
        for (int64_t t = p; t < p1; ++t) float_tile<BITS, S, 1>(x, xsum, m, K, cp, sp, mp, blocks, t, yp, N);
      continue;
    }
    if (wide) {  // AVX-512: the same results, two tiles per instruction (qtiles_avx512.cpp)
      for (; m + 8 <= M; m += 8) wide_rows<BITS, S, 8>(q, offset, m, cp, sp, mp, blocks, p, p1, yp, N);
      if (M - m == 5) {  // beam search's 5 rows (Whisper's default) in one pass, not 4 then 1: the codes'
        // sums and loads once for all 5 rows, ~15% fewer instructions (the same operations per row)
        wide_rows<BITS, S, 5>(q, offset, m, cp, sp, mp, blocks, p, p1, yp, N);
        m += 5;
      }
      for (; m + 4 <= M; m += 4) wide_rows<BITS, S, 4>(q, offset, m, cp, sp, mp, blocks, p, p1, yp, N);
      for (; m + 2 <= M; m += 2) wide_rows<BITS, S, 2>(q, offset, m, cp, sp, mp, blocks, p, p1, yp, N);
      for (; m < M; ++m) wide_rows<BITS, S, 1>(q, offset, m, cp, sp, mp, blocks, p, p1, yp, N);
      continue;
    }
    for (; m + 4 <= M; m += 4)
      for (int64_t t = p; t < p1; ++t) int8_tiles<BITS, S, 4, 1, false>(q, m, cp, sp, mp, blocks, t, yp, N);
    for (; m + 2 <= M; m += 2)
      for (int64_t t = p; t < p1; ++t) int8_tiles<BITS, S, 2, 1, false>(q, m, cp, sp, mp, blocks, t, yp, N);
    for (; m < M; ++m) {
      int64_t t = p;
      for (; t + 2 <= p1; t += 2) int8_tiles<BITS, S, 1, 2, true>(q, m, cp, sp, mp, blocks, t, yp, N);
      for (; t < p1; ++t) int8_tiles<BITS, S, 1, 1, true>(q, m, cp, sp, mp, blocks, t, yp, N);
    }
  }
}

template <int BITS, typename S>
at::Tensor tiled_matmul_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& mins, int64_t N, int64_t threads, int64_t activation_bits,
                             const float* bias) {
  const int64_t M = x.size(0), K = x.size(1), tiles = codes.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const bool exact = activation_bits == 32, has_min = mins.has_value() && mins->defined();
  const QuantizedRows q = exact ? QuantizedRows{K, {}, {}, {}} : quantize_rows<32>(x.data_ptr<float>(), M, K, has_min, threads);
  const float* xp = exact ? x.data_ptr<float>() : nullptr;
  const std::vector<float> xsum = exact && has_min ? group_sums<32>(xp, M, K) : std::vector<float>();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const S* sp = scale_data<S>(scale);
  const S* mp = has_min ? scale_data<S>(*mins) : nullptr;
  float* yp = y.data_ptr<float>();
  // the AVX-512 kernel's unsigned activations for 8-bit codes (qtiles_avx512.cpp)
  const bool wide = use_avx512();  // read once: the whole product on one kernel
  const std::vector<uint8_t> offset = !exact && BITS == 8 && wide ? avx512::offset_rows(q) : std::vector<uint8_t>();
  // Row blocks whose activations stay in L2 while every tile passes over them (streamed from L3 once per
  // pass otherwise: an encoder's 2048 x 768 product ran 1.5-1.8x slower); each block one parallel product.
  const int64_t row_bytes = exact ? 4 * K : (offset.empty() ? K : 2 * K), rows_per_block = row_block(row_bytes);
  for (int64_t m0 = 0; m0 < M; m0 += rows_per_block) {
    const int64_t m1 = std::min(M, m0 + rows_per_block);
    if (!exact && BITS == 4 && wide && m1 - m0 >= lanes::LANES_MIN_ROWS) {  // 16 rows a register: qlanes.h
      const lanes::LaneRows rows = avx512::lane_rows(q, m0, m1, has_min);
      parallel_chunks((tiles + lanes::PASS_TILES - 1) / lanes::PASS_TILES, 1, threads, [&](int64_t p0, int64_t p1) {
        thread_local lanes::LaneTiles buffer;  // (reused: a pass of K = 8960 is 287 KB)
        const int64_t t0 = p0 * lanes::PASS_TILES, t1 = std::min(tiles, p1 * lanes::PASS_TILES);
        for (int64_t t = t0; t < t1; t += lanes::PASS_TILES)
          avx512::lanes_pass<S>(rows, cp, sp, mp, t, std::min(t1, t + lanes::PASS_TILES), yp, N, buffer);
        if (bias != nullptr) add_bias(bias, m0, m1, t0 * TILE, std::min(N, t1 * TILE), yp, N);
      }, lanes::PASS_TILES * TILE * (m1 - m0) * K);
      continue;
    }
    // tiles per claimed chunk; even for the AVX-512 kernel, so that no piece ends on a lone (AVX2) tile
    const int64_t chunk = chunk_outputs((m1 - m0) * K, wide ? 2 * TILE : TILE) / TILE;
    parallel_chunks(tiles, chunk, threads, [&](int64_t t0, int64_t t1) {
      tiles_range<BITS, S>(q, wide, offset.data(), xp, xsum.data(), m0, m1, K, cp, sp, mp, yp, N, t0, t1);
      if (bias != nullptr) add_bias(bias, m0, m1, t0 * TILE, std::min(N, t1 * TILE), yp, N);  // (in cache still)
    }, chunk * TILE * (m1 - m0) * K);
  }
  return y;
}

}  // namespace

void check_tiled(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& mins, int64_t bits,
                 int64_t outputs) {
  TORCH_CHECK(bits == 4 || bits == 8, "tiled codes are 4 or 8 bits, not ", bits);
  TORCH_CHECK(codes.dim() == 3 && scale.dim() == 3 && codes.is_contiguous() && scale.is_contiguous(),
              "tiled codes and scales must be contiguous [tiles, blocks, ...]");
  // compact scales (kscales.h): one 80-byte record per tile and 8 blocks; else one scale per output and block
  const bool compact = is_compact(scale);
  TORCH_CHECK(codes.size(0) == scale.size(0) &&
                  (compact ? codes.size(1) == 8 * scale.size(1) && scale.size(2) == TILE_RECORD
                           : codes.size(1) == scale.size(1) && scale.size(2) == TILE) &&
                  codes.size(2) == TILE * 32 * bits / 8 && codes.element_size() == 1,
              "tiled codes ", codes.sizes(), " and scales ", scale.sizes(), " do not match ", bits, "-bit tiles");
  TORCH_CHECK(outputs > (codes.size(0) - 1) * TILE && outputs <= codes.size(0) * TILE, outputs,
              " outputs do not fill ", codes.size(0), " tiles of ", TILE);
  if (mins.has_value() && mins->defined())
    TORCH_CHECK(mins->sizes() == scale.sizes() && mins->scalar_type() == scale.scalar_type() && mins->is_contiguous(),
                "mins must be like the scales");
}

at::Tensor tiled_qmatmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& mins, int64_t bits, int64_t outputs, int64_t threads,
                         int64_t activation_bits, const float* bias, int64_t bias_size) {
  if (outputs < 0) outputs = codes.size(0) * TILE;
  check_tiled(codes, scale, mins, bits, outputs);
  TORCH_CHECK(x.size(1) == 32 * codes.size(1), "x has ", x.size(1), " inputs, the weight ", 32 * codes.size(1));
  TORCH_CHECK(bias == nullptr || bias_size == outputs, "bias has ", bias_size, " values for ", outputs, " outputs");
  const bool half = scale.scalar_type() == at::kHalf;
  if (is_compact(scale))
    return bits == 4 ? tiled_matmul_impl<4, KScale>(x, codes, scale, mins, outputs, threads, activation_bits, bias)
                     : tiled_matmul_impl<8, KScale>(x, codes, scale, mins, outputs, threads, activation_bits, bias);
  if (bits == 4)
    return half ? tiled_matmul_impl<4, at::Half>(x, codes, scale, mins, outputs, threads, activation_bits, bias)
                : tiled_matmul_impl<4, float>(x, codes, scale, mins, outputs, threads, activation_bits, bias);
  return half ? tiled_matmul_impl<8, at::Half>(x, codes, scale, mins, outputs, threads, activation_bits, bias)
              : tiled_matmul_impl<8, float>(x, codes, scale, mins, outputs, threads, activation_bits, bias);
}

// enabled < 0: asks; else switches the AVX-512 kernels on (where the CPU has them) or off. Returns whether they are used.
bool set_avx512(int64_t enabled) {
  if (enabled >= 0) avx512_switch().store(enabled > 0 && cpu_has_avx512(), std::memory_order_relaxed);
  return use_avx512();
}

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) { m.def("set_avx512(int enabled) -> bool", &set_avx512); }

}  // namespace fastdecode
