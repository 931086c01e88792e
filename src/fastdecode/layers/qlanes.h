// Many int8 rows x a tiled weight of 4-bit codes with AVX-512 VNNI, rows in the register lanes
// (qlanes_avx512.cpp), called by qtiles.cpp from LANES_MIN_ROWS rows where isa.h's use_avx512() holds.
//
// qtiles_avx512.cpp's kernel puts 16 outputs in a register's lanes and broadcasts each row's 4 activation
// bytes: per row and block 8 broadcasts for 8 dot products beside the float steps per 16 lanes (the scale
// product, the accumulating FMA and the mins FMA run on Zen 5's two VNNI pipes too: ~384 G MAC/s a core at most
// for these bits, measured at 4.1 GHz). Here a
// register holds one output's dot products for 16 rows: activations transposed once per call (LaneRows: 16
// rows' 4 bytes per register), each tile's codes unpacked once per call to bytes, one code broadcast feeding 2
// row groups. The same float operations per (row, output) in the same order (float products commute
// exactly): bit for bit qtiles.cpp's int8_tiles. One Zen 5 core, SmolLM2-135M's 512-row Q4_1 products: gate and
// up (576 -> 3072) 3.5-3.9 -> 3.0-3.3 ms, down (1536 -> 576) 1.7 -> 1.6 ms (benchmarks/README.md, prompt_ab.py).
#pragma once

#include <ATen/ATen.h>
#include <cstdint>
#include <vector>

#include "kscales.h"
#include "qrows.h"

namespace fastdecode {
namespace lanes {

constexpr int64_t LANES_MIN_ROWS = 32;  // fewer rows: qtiles_avx512.cpp's kernel (a group of 16 rows half empty)
constexpr int64_t PASS_TILES = 4;       // tiles unpacked per pass over the rows (32 outputs: 18-48 KB of bytes)
constexpr int64_t PASS_OUTPUTS = 8 * PASS_TILES;

// Rows [m0, m1) of quantized activations, 16 rows (a group) per register: the last group padded with zero rows.
//   codes[g][b][c][r][i] = activation code of row m0 + 16 g + r at input 32 b + 4 c + i
//   scale[g][b][r], sums[g][b][r] = that row's block scale and d * code sum (sums: only for weights with mins)
struct LaneRows {
  int64_t m0 = 0, rows = 0, groups = 0, blocks = 0;
  std::vector<int8_t> storage;  // codes(): from its first 64-byte boundary (whole cache lines per register)
  std::vector<float> scale, sums;
  int8_t* codes() { return storage.data() + (-reinterpret_cast<uintptr_t>(storage.data()) & 63); }
  const int8_t* codes() const { return storage.data() + (-reinterpret_cast<uintptr_t>(storage.data()) & 63); }
};

// One pass's tiles [t0, t0 + PASS_TILES) unpacked, outputs o = 8 (t - t0) + j (rows past the weight: zero):
//   codes[b][o][c][i] = 4-bit code (0..15) of output o at input 32 b + 4 c + i
//   scale[b][o], mins[b][o] = its block scale and min as float32 (quant::block_scales' values)
struct LaneTiles {
  std::vector<uint8_t> codes;
  std::vector<float> scale, mins;
};

}  // namespace lanes

namespace avx512 {
// Rows [m0, m1) of q in the lanes layout (with_sums: the code sums too).
lanes::LaneRows lane_rows(const quant::QuantizedRows& q, int64_t m0, int64_t m1, bool with_sums);

// Tiles [t0, t1) (t1 - t0 <= PASS_TILES) of the tiled weight's 4-bit codes x every row of `rows` -> y [M, N] (the
// rows' outputs below N), `buffer` the thread's reusable unpacked tiles; mins nullptr for a weight without.
template <typename S>
void lanes_pass(const lanes::LaneRows& rows, const uint8_t* codes, const S* scale, const S* mins, int64_t t0,
                int64_t t1, float* y, int64_t N, lanes::LaneTiles& buffer);

// The gated MLP's rows: tiles t0, t0 + 1 (gate outputs 8 t0 .. 8 t0 + 15) and u0, u0 + 1 (their up outputs) ->
// act(gate) * up (kind 0: SiLU, 1: GELU tanh: gated_avx512.cpp's gated_row on the finished products) at outputs
// [8 t0, 8 t0 + 16) of y [M, I].
template <typename S>
void lanes_gated_pass(const lanes::LaneRows& rows, const uint8_t* codes, const S* scale, const S* mins, int64_t t0,
                      int64_t u0, int64_t kind, float* y, int64_t I, lanes::LaneTiles& buffer);
}  // namespace avx512

}  // namespace fastdecode
