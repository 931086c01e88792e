// The tiled layout's weights back to float32 (qtiles.cpp describes the layout): the whole matrix
// (tiled_dequantize) or a range of tiles into a caller's buffer (tiled_dequantize_range, the exact prompt
// products' pieces), each value the same two roundings as quantized.dequantize().
#include <ATen/ATen.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

#include "kscales.h"
#include "parallel.h"
#include "qrows.h"
#include "qtiles.h"

namespace fastdecode {
namespace {

using namespace quant;

constexpr int TILE = 8;  // outputs per tile (qtiles.cpp)

template <int BITS>
constexpr int64_t tile_block_bytes() { return TILE * 32 * BITS / 8; }  // 128 (4-bit) or 256 (8-bit)

// Tiles [t0, t1) of a tiled weight of N outputs and `blocks` 32-input blocks -> their float32 rows (the
// valid ones of the last tile only), row t0 * TILE at `out`, K = 32 * blocks floats apart.
template <int BITS, typename S>
void dequantize_tiles(const uint8_t* cp, const S* sp, const S* mp, int64_t blocks, int64_t N, int64_t t0, int64_t t1,
                      float* out) {
  constexpr int64_t BB = tile_block_bytes<BITS>();
  const int64_t K = 32 * blocks;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t valid = std::min<int64_t>(TILE, N - t * TILE);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t tile_block = t * blocks + b;
      // the tile-block's dwords [chunk c][output r] transposed: v[r] = output r's code bytes in order
      __m256 v[8];
      for (int c = 0; c < 8; ++c)
        v[c] = c < BB / 32 ? _mm256_loadu_ps(reinterpret_cast<const float*>(cp + tile_block * BB + 32 * c)) : _mm256_setzero_ps();
      transpose8(v);
      for (int64_t r = 0; r < valid; ++r) {
        __m256 w[4];
        const __m256i bytes = _mm256_castps_si256(v[r]);
        if constexpr (BITS == 8) {
          const __m128i first = _mm256_castsi256_si128(bytes), second = _mm256_extracti128_si256(bytes, 1);
          const __m128i parts[4] = {first, _mm_unpackhi_epi64(first, first), second, _mm_unpackhi_epi64(second, second)};
          for (int i = 0; i < 4; ++i) w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i]));
        } else {  // 16 bytes: elements 0..15 in the low nibbles, 16..31 in the high ones
          const __m128i packed = _mm256_castsi256_si128(bytes), nibble = _mm_set1_epi8(0x0F);
          const __m128i low = _mm_and_si128(packed, nibble), high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
          const __m128i parts[4] = {low, _mm_unpackhi_epi64(low, low), high, _mm_unpackhi_epi64(high, high)};
          for (int i = 0; i < 4; ++i) w[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        }
        const __m256 s = _mm256_set1_ps(load_scale(sp + tile_block * TILE + r));
        float* row = out + ((t - t0) * TILE + r) * K + 32 * b;
        if (mp != nullptr) {  // scale * code + min: the same two roundings as quantized.dequantize()
          const __m256 m = _mm256_set1_ps(load_scale(mp + tile_block * TILE + r));
          for (int i = 0; i < 4; ++i) _mm256_storeu_ps(row + 8 * i, _mm256_add_ps(_mm256_mul_ps(w[i], s), m));
        } else {
          for (int i = 0; i < 4; ++i) _mm256_storeu_ps(row + 8 * i, _mm256_mul_ps(w[i], s));
        }
      }
    }
  }
}

template <int BITS, typename S>
at::Tensor tiled_dequantize_impl(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                                 int64_t N, int64_t threads) {
  const int64_t tiles = codes.size(0), blocks = codes.size(1), K = 32 * blocks;
  at::Tensor out = at::empty({N, K}, scale.options().dtype(at::kFloat));
  const bool has_min = mins.has_value() && mins->defined();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const S* sp = scale.data_ptr<S>();
  const S* mp = has_min ? mins->data_ptr<S>() : nullptr;
  float* op = out.data_ptr<float>();
  parallel_chunks(tiles, chunk_outputs(K * TILE, 1), threads, [&](int64_t t0, int64_t t1) {
    dequantize_tiles<BITS, S>(cp, sp, mp, blocks, N, t0, t1, op + t0 * TILE * K);
  });
  return out;
}

}  // namespace

at::Tensor tiled_dequantize(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                            int64_t bits, int64_t outputs, int64_t threads) {
  if (outputs < 0) outputs = codes.size(0) * TILE;
  check_tiled(codes, scale, mins, bits, outputs);
  if (is_compact(scale)) {  // decoded once to the float32 layout's values (kscales.h): the same bits
    const c10::optional<at::Tensor> expanded_mins =
        mins.has_value() && mins->defined() ? c10::optional<at::Tensor>(expanded_scales(*mins, 32, true)) : c10::nullopt;
    return tiled_dequantize(codes, expanded_scales(scale, 32, true), expanded_mins, bits, outputs, threads);
  }
  const bool half = scale.scalar_type() == at::kHalf;
  if (bits == 4)
    return half ? tiled_dequantize_impl<4, at::Half>(codes, scale, mins, outputs, threads)
                : tiled_dequantize_impl<4, float>(codes, scale, mins, outputs, threads);
  return half ? tiled_dequantize_impl<8, at::Half>(codes, scale, mins, outputs, threads)
              : tiled_dequantize_impl<8, float>(codes, scale, mins, outputs, threads);
}

bool tiled_dequantize_range(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                            int64_t bits, int64_t outputs, int64_t t0, int64_t t1, float* out) {
  if (outputs < 0) outputs = codes.size(0) * TILE;
  check_tiled(codes, scale, mins, bits, outputs);
  TORCH_CHECK(0 <= t0 && t0 <= t1 && t1 <= codes.size(0), "tiles ", t0, "..", t1, " of ", codes.size(0));
  if (is_compact(scale)) return false;
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const int64_t blocks = codes.size(1);
  const bool has_min = mins.has_value() && mins->defined();
  if (scale.scalar_type() == at::kHalf) {
    const at::Half* mp = has_min ? mins->data_ptr<at::Half>() : nullptr;
    if (bits == 4) dequantize_tiles<4, at::Half>(cp, scale.data_ptr<at::Half>(), mp, blocks, outputs, t0, t1, out);
    else dequantize_tiles<8, at::Half>(cp, scale.data_ptr<at::Half>(), mp, blocks, outputs, t0, t1, out);
  } else {
    const float* mp = has_min ? mins->data_ptr<float>() : nullptr;
    if (bits == 4) dequantize_tiles<4, float>(cp, scale.data_ptr<float>(), mp, blocks, outputs, t0, t1, out);
    else dequantize_tiles<8, float>(cp, scale.data_ptr<float>(), mp, blocks, outputs, t0, t1, out);
  }
  return true;
}

}  // namespace fastdecode
