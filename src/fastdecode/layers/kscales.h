// Compact K-quant scales: Q4_K, Q5_K and Q6_K's scales (and Q4_K/Q5_K's mins) as GGUF stores them, decoded
// in the kernels instead of being held as one float32 per group.
//
// Per 256 inputs (a super-block) of one output: 256 / G int8 sub-scale codes c (6-bit, 0..63 for Q4_K/Q5_K;
// signed 8-bit for Q6_K) and one float16 super-scale d; a group's scale is d * c, a float32 product of an
// 11-bit by at most 8-bit integer: exact, so the value equals the float32 one the repacker stored before
// (loading/gguf_blocks.py) and every kernel computes the same bits. Mins are the same with d = -dmin.
// The tensors are int8 (the dtype that marks them compact), in records:
//   rows layout  [N, K/256, S + 2]       S = 256/G codes, then the 2 bytes of d (little-endian float16);
//   tiled layout [tiles, K/256, 80]      bytes 8i + r: the code of block i of the super-block for the
//                                        tile's output r (i, r < 8); bytes 64 + 2r: output r's d.
// 2.25 bytes per 32 weights (Q4_K, scale and mins) or 1.125 per 16 (Q6_K) where float32 held 8 or 4.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "qrows.h"

namespace fastdecode {
namespace quant {

struct KScale {  // one byte of a compact scale record: the element type the kernels' templates take as S
  int8_t byte;
};

constexpr int64_t SUPER = 256;        // inputs per record
constexpr int64_t TILE_RECORD = 80;   // bytes per tiled record: 8 x 8 codes, 8 float16
constexpr int64_t TILE_OUTPUTS = 8;   // outputs per tile (qtiles.cpp's TILE)

inline bool is_compact(const at::Tensor& scale) { return scale.scalar_type() == at::kChar; }

inline float half_at(const int8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// The scales' data as the kernels' element type S (float, at::Half or KScale).
template <typename S>
inline const S* scale_data(const at::Tensor& t) {
  return reinterpret_cast<const S*>(t.data_ptr());
}

// ---- the tiled layout: tile t's scales, then the 8 outputs' scales of its block b ----------------------
template <typename S>
inline const S* tile_scales(const S* base, int64_t t, int64_t blocks) { return base + t * blocks * TILE_OUTPUTS; }
inline const KScale* tile_scales(const KScale* base, int64_t t, int64_t blocks) {
  return base + t * (blocks / 8) * TILE_RECORD;
}

inline __m256 block_scales(const float* tile, int64_t b) { return load8_scales(tile + b * TILE_OUTPUTS); }
inline __m256 block_scales(const at::Half* tile, int64_t b) { return load8_scales(tile + b * TILE_OUTPUTS); }
inline __m256 block_scales(const KScale* tile, int64_t b) {
  const int8_t* record = &tile[(b >> 3) * TILE_RECORD].byte;
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(record + 8 * (b & 7)));
  const __m256 super = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 64)));
  return _mm256_mul_ps(super, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)));
}

// ---- the rows layout: rows [n0, n1) decoded to float32 [n1 - n0, groups] (the float32 layout's values) ----
inline void expand_rows(const KScale* scale, int64_t G, int64_t groups, int64_t n0, int64_t n1, float* out) {
  const int64_t codes = SUPER / G, record = codes + 2, supers = groups / codes;
  const int8_t* p = &scale[n0 * supers * record].byte;
  for (int64_t i = 0; i < (n1 - n0) * supers; ++i, p += record, out += codes) {
    const __m256 super = _mm256_set1_ps(half_at(p + codes));
    for (int64_t c = 0; c < codes; c += 8) {
      const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c));
      _mm256_storeu_ps(out + c, _mm256_mul_ps(super, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight))));
    }
  }
}

// Tiles [t0, t1) of tiled compact scales (blocks of 32 inputs per tile) -> out [tiles, blocks, 8] float32 (rows t0..t1).
inline void expand_tiles(const KScale* scale, int64_t blocks, int64_t t0, int64_t t1, float* out) {
  for (int64_t t = t0; t < t1; ++t) {
    const KScale* tile = tile_scales(scale, t, blocks);
    for (int64_t b = 0; b < blocks; ++b) _mm256_storeu_ps(out + (t * blocks + b) * TILE_OUTPUTS, block_scales(tile, b));
  }
}

// A compact scale (or mins) tensor -> the float32 tensor of the float32 layout: rows [N, K/G], tiled
// [tiles, K/32, 8]; another dtype is returned as it is. For the ops that run on many rows (prompt GEMMs,
// dequantization), where decoding every scale once per call costs little beside the product.
inline at::Tensor expanded_scales(const at::Tensor& scale, int64_t G, bool tiled) {
  if (!is_compact(scale)) return scale;
  TORCH_CHECK(scale.dim() == 3 && scale.is_contiguous(), "compact scales are contiguous [outputs, K/256, record]");
  const int64_t supers = scale.size(1);
  const KScale* sp = scale_data<KScale>(scale);
  if (!tiled) {
    TORCH_CHECK(scale.size(2) == SUPER / G + 2, "compact scales of groups of ", G, " have records of ", SUPER / G + 2,
                " bytes, not ", scale.size(2));
    at::Tensor out = at::empty({scale.size(0), supers * SUPER / G}, scale.options().dtype(at::kFloat));
    expand_rows(sp, G, supers * SUPER / G, 0, scale.size(0), out.data_ptr<float>());
    return out;
  }
  TORCH_CHECK(G == 32 && scale.size(2) == TILE_RECORD, "tiled compact scales have records of ", TILE_RECORD, " bytes");
  const int64_t tiles = scale.size(0), blocks = supers * 8;
  at::Tensor out = at::empty({tiles, blocks, TILE_OUTPUTS}, scale.options().dtype(at::kFloat));
  expand_tiles(sp, blocks, 0, tiles, out.data_ptr<float>());
  return out;
}

// Inputs K of a weight whose scales are `scale` (compact: 256 per record; else G per scale, or 32 tiled).
inline int64_t scale_inputs(const at::Tensor& scale, int64_t G, bool tiled) {
  return scale.size(1) * (is_compact(scale) ? SUPER : tiled ? 32 : G);
}

}  // namespace quant
}  // namespace fastdecode
