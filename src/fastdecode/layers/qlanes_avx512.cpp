// The tiled layout's int8-activation product for many rows with AVX-512 VNNI, 16 rows per register (see
// qlanes.h for the layouts and why).
//
// Bit for bit qtiles.cpp's int8_tiles (and qtiles_avx512.cpp's pair kernel): per (row, output) and block b, in
// block order,
//   dot = sum_k code[k] * a[k]                                 exact int32 (VNNI: unsigned codes 0..15 x signed a)
//   acc = fma(float(dot), scale[o, b] * d[row, b], acc)       (w * d: the same product as d * w)
//   mins: min_term = fma(min[o, b], sums[row, b], min_term), and acc + min_term at the end
// the same float operations on the same values, only in other lanes.
#include <ATen/ATen.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kscales.h"
#include "qlanes.h"
#include "qrows.h"

// Everything below (and only it: the headers above keep their AVX2 code) may use AVX-512; it runs only
// where isa.h's use_avx512() holds.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

namespace fastdecode {
namespace avx512 {

int64_t gated_row(const float* g, const float* u, float* y, int64_t n, int64_t kind);  // gated_avx512.cpp

namespace {

using lanes::LaneRows;
using lanes::LaneTiles;
using lanes::PASS_TILES;

constexpr int LANES = 16;  // rows per group: float32 lanes of a register
constexpr int OUTPUTS = 4;  // outputs per kernel call (x 2 row groups: 8 dot products and 8 accumulators)
using lanes::PASS_OUTPUTS;

// One tile-block's 128 code bytes (tiled layout, qtiles.cpp: byte 4c + i of output j at 32 c + 4 j + i, inputs
// 4c + i in the low nibbles and 16 + 4c + i in the high ones) -> 8 outputs x 32 bytes, output j's code of input
// 4c + i at 32 j + 4c + i.
inline void unpack_tile_block(const uint8_t* src, uint8_t* out) {
  const __m512i first = _mm512_loadu_si512(src), second = _mm512_loadu_si512(src + 64);  // dwords 8 c + j
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // each output's 4 dwords (c = 0..3): outputs 0-3, then 4-7
  const __m512i by_output[2] = {
      _mm512_permutex2var_epi32(first, _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27),
                                second),
      _mm512_permutex2var_epi32(first, _mm512_setr_epi32(4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31),
                                second)};
  const __m512i pick[2] = {_mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15)};
  for (int h = 0; h < 2; ++h) {
    const __m512i low = _mm512_and_si512(by_output[h], nibble);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(by_output[h], 4), nibble);
    for (int q = 0; q < 2; ++q)  // outputs 4h + 2q, 4h + 2q + 1: [low 16 bytes, high 16 bytes] each
      _mm512_storeu_si512(out + 64 * (2 * h + q), _mm512_permutex2var_epi64(low, pick[q], high));
  }
}

// Tiles [t0, t1) into w's outputs first .. first + 8 (t1 - t0) of nout (w sized for them: size_tiles).
template <typename S>
void unpack_tiles(const uint8_t* codes, const S* scale, const S* mins, int64_t blocks, int64_t t0, int64_t t1,
                  int64_t nout, int64_t first, LaneTiles& w) {
  for (int64_t t = t0; t < t1; ++t) {
    const S* tile_scale = quant::tile_scales(scale, t, blocks);
    const S* tile_mins = mins != nullptr ? quant::tile_scales(mins, t, blocks) : nullptr;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = b * nout + first + 8 * (t - t0);
      unpack_tile_block(codes + (t * blocks + b) * 128, w.codes.data() + at * 32);
      _mm256_storeu_ps(w.scale.data() + at, quant::block_scales(tile_scale, b));
      if (tile_mins != nullptr) _mm256_storeu_ps(w.mins.data() + at, quant::block_scales(tile_mins, b));
    }
  }
}

void size_tiles(int64_t blocks, int64_t nout, bool with_mins, LaneTiles& w) {
  w.codes.resize(blocks * nout * 32);
  w.scale.resize(blocks * nout);
  w.mins.resize(with_mins ? blocks * nout : 0);
}

// The next pass's codes, scales and mins (tiles [next, next + count)) on their way to L2 while this one computes
// (a model's weights come from memory: the unpacking would wait for each line).
template <typename S>
void prefetch_tiles(const uint8_t* codes, const S* scale, const S* mins, int64_t blocks, int64_t next, int64_t count) {
  const auto ahead = [&](const void* first, const void* after) {
    const char* start = static_cast<const char*>(first);
    const int64_t bytes = static_cast<const char*>(after) - start;
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(start + line, _MM_HINT_T1);
  };
  ahead(codes + next * blocks * 128, codes + (next + count) * blocks * 128);
  ahead(quant::tile_scales(scale, next, blocks), quant::tile_scales(scale, next + count, blocks));
  if (mins != nullptr) ahead(quant::tile_scales(mins, next, blocks), quant::tile_scales(mins, next + count, blocks));
}

// Row groups [g0, g0 + G) x the pass's outputs [o0, o0 + OUTPUTS) -> out [G * 16 rows][PASS_OUTPUTS], columns o0...
template <int G, bool MINS>
void group_outputs(const LaneRows& a, const LaneTiles& w, int64_t g0, int64_t o0, int64_t nout, float* out) {
  const int64_t blocks = a.blocks, group_bytes = blocks * 8 * 64;
  const int8_t* act = a.codes() + g0 * group_bytes;
  __m512 acc[G][OUTPUTS];
  for (int g = 0; g < G; ++g)
    for (int o = 0; o < OUTPUTS; ++o) acc[g][o] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w.codes.data() + (b * nout + o0) * 32;
    __m512i dot[G][OUTPUTS];
    for (int g = 0; g < G; ++g)
      for (int o = 0; o < OUTPUTS; ++o) dot[g][o] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m512i rows[G];  // 16 rows' 4 activation bytes
      for (int g = 0; g < G; ++g) rows[g] = _mm512_loadu_si512(act + g * group_bytes + (b * 8 + c) * 64);
      for (int o = 0; o < OUTPUTS; ++o) {
        int32_t four;
        std::memcpy(&four, wb + 32 * o + 4 * c, 4);
        const __m512i code = _mm512_set1_epi32(four);
        for (int g = 0; g < G; ++g) dot[g][o] = _mm512_dpbusd_epi32(dot[g][o], code, rows[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 d = _mm512_loadu_ps(a.scale.data() + ((g0 + g) * blocks + b) * LANES);
      for (int o = 0; o < OUTPUTS; ++o)
        acc[g][o] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[g][o]),
                                    _mm512_mul_ps(_mm512_set1_ps(w.scale[b * nout + o0 + o]), d), acc[g][o]);
    }
  }
  if constexpr (MINS) {  // the mins term in its own accumulator, block after block, then added
    __m512 term[G][OUTPUTS];
    for (int g = 0; g < G; ++g)
      for (int o = 0; o < OUTPUTS; ++o) term[g][o] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b)
      for (int g = 0; g < G; ++g) {
        const __m512 sums = _mm512_loadu_ps(a.sums.data() + ((g0 + g) * blocks + b) * LANES);
        for (int o = 0; o < OUTPUTS; ++o)
          term[g][o] = _mm512_fmadd_ps(_mm512_set1_ps(w.mins[b * nout + o0 + o]), sums, term[g][o]);
      }
    for (int g = 0; g < G; ++g)
      for (int o = 0; o < OUTPUTS; ++o) acc[g][o] = _mm512_add_ps(acc[g][o], term[g][o]);
  }
  for (int g = 0; g < G; ++g) {
    // 4 outputs x 16 rows -> per 128-bit lane l, rows 4l + k: u[k] = that row's 4 outputs
    const __m512 low01 = _mm512_unpacklo_ps(acc[g][0], acc[g][1]), high01 = _mm512_unpackhi_ps(acc[g][0], acc[g][1]);
    const __m512 low23 = _mm512_unpacklo_ps(acc[g][2], acc[g][3]), high23 = _mm512_unpackhi_ps(acc[g][2], acc[g][3]);
    const __m512 u[4] = {_mm512_shuffle_ps(low01, low23, 0x44), _mm512_shuffle_ps(low01, low23, 0xEE),
                         _mm512_shuffle_ps(high01, high23, 0x44), _mm512_shuffle_ps(high01, high23, 0xEE)};
    float* rows = out + g * LANES * PASS_OUTPUTS + o0;
    for (int k = 0; k < 4; ++k) {
      _mm_storeu_ps(rows + k * PASS_OUTPUTS, _mm512_castps512_ps128(u[k]));
      _mm_storeu_ps(rows + (4 + k) * PASS_OUTPUTS, _mm512_extractf32x4_ps(u[k], 1));
      _mm_storeu_ps(rows + (8 + k) * PASS_OUTPUTS, _mm512_extractf32x4_ps(u[k], 2));
      _mm_storeu_ps(rows + (12 + k) * PASS_OUTPUTS, _mm512_extractf32x4_ps(u[k], 3));
    }
  }
}

// The pass's outputs of rows [g0 * 16, g1 * 16) of `a`, G groups at a time, through `out` (L1): finish(row of y,
// its PASS_OUTPUTS outputs) for each real row. Returns the first group not done.
template <int G, bool MINS, typename Finish>
int64_t rows_through(const LaneRows& a, const LaneTiles& w, int64_t g0, int64_t g1, int64_t nout,
                     const Finish& finish) {
  alignas(64) float out[G * LANES * PASS_OUTPUTS];
  for (int64_t g = g0; g + G <= g1; g += G) {
    for (int64_t o = 0; o < nout; o += OUTPUTS) group_outputs<G, MINS>(a, w, g, o, nout, out);
    const int64_t rows = std::min<int64_t>(G * LANES, a.rows - g * LANES);
    for (int64_t r = 0; r < rows; ++r) finish(a.m0 + g * LANES + r, out + r * PASS_OUTPUTS);
    g0 = g + G;
  }
  return g0;
}

template <bool MINS, typename Finish>
void pass_rows(const LaneRows& a, const LaneTiles& w, int64_t nout, const Finish& finish) {
  const int64_t g = rows_through<2, MINS>(a, w, 0, a.groups, nout, finish);
  rows_through<1, MINS>(a, w, g, a.groups, nout, finish);
}

}  // namespace

lanes::LaneRows lane_rows(const quant::QuantizedRows& q, int64_t m0, int64_t m1, bool with_sums) {
  const int64_t K = q.K, blocks = K / 32;
  LaneRows a;
  a.m0 = m0;
  a.rows = m1 - m0;
  a.groups = (a.rows + LANES - 1) / LANES;
  a.blocks = blocks;
  a.storage.resize(a.groups * blocks * 8 * 64 + 63);
  a.scale.assign(a.groups * blocks * LANES, 0.0f);
  a.sums.assign(with_sums ? a.groups * blocks * LANES : 0, 0.0f);
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t valid = std::min<int64_t>(LANES, a.rows - g * LANES);
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 v[2][8];  // rows 0-7, 8-15: their 8 dwords of block b (padded rows zero)
      for (int r = 0; r < LANES; ++r)
        v[r / 8][r % 8] = r < valid ? _mm256_loadu_ps(reinterpret_cast<const float*>(
                                          q.codes.data() + (m0 + g * LANES + r) * K + 32 * b))
                                    : _mm256_setzero_ps();
      quant::transpose8(v[0]);  // v[h][c]: dword c of rows 8h .. 8h + 7
      quant::transpose8(v[1]);
      for (int c = 0; c < 8; ++c)
        _mm512_storeu_ps(reinterpret_cast<float*>(a.codes() + ((g * blocks + b) * 8 + c) * 64),
                         _mm512_insertf32x8(_mm512_castps256_ps512(v[0][c]), v[1][c], 1));
      for (int64_t r = 0; r < valid; ++r) {
        a.scale[(g * blocks + b) * LANES + r] = q.scale[(m0 + g * LANES + r) * blocks + b];
        if (with_sums) a.sums[(g * blocks + b) * LANES + r] = q.sums[(m0 + g * LANES + r) * blocks + b];
      }
    }
  }
  return a;
}

template <typename S>
void lanes_pass(const LaneRows& rows, const uint8_t* codes, const S* scale, const S* mins, int64_t t0, int64_t t1,
                float* y, int64_t N, LaneTiles& buffer) {
  TORCH_CHECK(t1 - t0 <= PASS_TILES && t1 > t0, "lanes_pass: 1 to ", PASS_TILES, " tiles per pass");
  const int64_t blocks = rows.blocks, nout = 8 * (t1 - t0), n0 = 8 * t0;
  prefetch_tiles(codes, scale, mins, blocks, t1, PASS_TILES);
  size_tiles(blocks, nout, mins != nullptr, buffer);
  unpack_tiles(codes, scale, mins, blocks, t0, t1, nout, 0, buffer);
  // whole cache lines into y: the pass's outputs below N
  const __mmask16 first = __mmask16((1u << std::min<int64_t>(16, N - n0)) - 1);
  const __mmask16 second = N - n0 > 16 && nout > 16 ? __mmask16((1u << std::min<int64_t>(16, N - n0 - 16)) - 1) : 0;
  const auto store = [&](int64_t m, const float* out) {
    _mm512_mask_storeu_ps(y + m * N + n0, first, _mm512_load_ps(out));
    if (second) _mm512_mask_storeu_ps(y + m * N + n0 + 16, second, _mm512_load_ps(out + 16));
  };
  if (mins != nullptr) pass_rows<true>(rows, buffer, nout, store);
  else pass_rows<false>(rows, buffer, nout, store);
}

template <typename S>
void lanes_gated_pass(const LaneRows& rows, const uint8_t* codes, const S* scale, const S* mins, int64_t t0,
                      int64_t u0, int64_t kind, float* y, int64_t I, LaneTiles& buffer) {
  const int64_t blocks = rows.blocks;
  prefetch_tiles(codes, scale, mins, blocks, t0 + 2, 2);
  prefetch_tiles(codes, scale, mins, blocks, u0 + 2, 2);
  size_tiles(blocks, PASS_OUTPUTS, mins != nullptr, buffer);
  unpack_tiles(codes, scale, mins, blocks, t0, t0 + 2, PASS_OUTPUTS, 0, buffer);
  unpack_tiles(codes, scale, mins, blocks, u0, u0 + 2, PASS_OUTPUTS, 16, buffer);
  const auto store = [&](int64_t m, const float* out) { gated_row(out, out + 16, y + m * I + 8 * t0, 16, kind); };
  if (mins != nullptr) pass_rows<true>(rows, buffer, PASS_OUTPUTS, store);
  else pass_rows<false>(rows, buffer, PASS_OUTPUTS, store);
}

template void lanes_pass<float>(const LaneRows&, const uint8_t*, const float*, const float*, int64_t, int64_t, float*,
                                int64_t, LaneTiles&);
template void lanes_pass<at::Half>(const LaneRows&, const uint8_t*, const at::Half*, const at::Half*, int64_t, int64_t,
                                   float*, int64_t, LaneTiles&);
template void lanes_pass<quant::KScale>(const LaneRows&, const uint8_t*, const quant::KScale*, const quant::KScale*,
                                        int64_t, int64_t, float*, int64_t, LaneTiles&);
template void lanes_gated_pass<float>(const LaneRows&, const uint8_t*, const float*, const float*, int64_t, int64_t,
                                      int64_t, float*, int64_t, LaneTiles&);
template void lanes_gated_pass<at::Half>(const LaneRows&, const uint8_t*, const at::Half*, const at::Half*, int64_t,
                                         int64_t, int64_t, float*, int64_t, LaneTiles&);
template void lanes_gated_pass<quant::KScale>(const LaneRows&, const uint8_t*, const quant::KScale*,
                                              const quant::KScale*, int64_t, int64_t, int64_t, float*, int64_t,
                                              LaneTiles&);

}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
