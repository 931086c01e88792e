// The tiled layout's int8-activation kernel for two tiles (16 outputs) per AVX-512 register
// (qtiles_avx512.cpp), called by qtiles.cpp when isa.h's use_avx512() holds.
#pragma once

#include <ATen/ATen.h>
#include <cstdint>
#include <vector>

#include "qrows.h"

namespace fastdecode {
namespace avx512 {

// Rows [m0, m0 + RB) x tiles t0, t0 + 1 of y [M, N]: qtiles.cpp's int8_tiles<BITS, S, RB, 2, PREFETCH>, bit for bit.
// offset_codes (8-bit codes only, else unused): q's activation codes + 128 as unsigned bytes [M, K] (offset_rows).
template <int BITS, typename S, int RB, bool PREFETCH>
void int8_tile_pair(const quant::QuantizedRows& q, const uint8_t* offset_codes, int64_t m0, const uint8_t* codes,
                    const S* scale, const S* mins, int64_t blocks, int64_t t0, float* y, int64_t N);

// q's activation codes + 128 as unsigned bytes (the flipped sign bit), for int8_tile_pair's 8-bit codes.
inline std::vector<uint8_t> offset_rows(const quant::QuantizedRows& q) {
  std::vector<uint8_t> out(q.codes.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(q.codes[i]) ^ 0x80u;
  return out;
}

}  // namespace avx512
}  // namespace fastdecode
