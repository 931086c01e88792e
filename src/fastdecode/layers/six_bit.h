// 6-bit codes (Q6_K) held packed as GGUF stores them, unpacked in registers by the kernels into the int8
// codes they multiply (qmatmul.cpp, rows6_avx512.cpp, dequantize.cpp, qprompt.cpp, qprompt_amx.cpp): the same int8 values
// as the 8-bit layout held before, so every product gives the same bits, from 6 bits per weight read
// instead of 8 (Qwen2.5-Coder-1.5B Q4_K_M: ~100 MB less read per token and held).
//
// Layout (bits = 6, rows layout, groups of 16): codes uint8 [N, K * 3 / 4], per 256 inputs of an output
// (a super-block) GGUF's ql[128] then qh[64] bytes, copied from the file's blocks as they are:
//   code[32 i + l] = (ql[64 n + 32 (j & 1) + l] >> 4 (j >> 1)) & 15  |  ((qh[32 n + l] >> 2 j) & 3) << 4,  minus 32
// for block i < 8 of 32 inputs (n = i / 4, j = i % 4), l < 32: each block is two 32-byte loads (one of
// the nibbles, one of the high bits), a few shifts, ands and an or, and the -32 of Q6_K's signed codes.
#pragma once

#include <immintrin.h>
#include <cstdint>

namespace fastdecode {
namespace quant {

constexpr int64_t SIX_SUPER_BYTES = 192;  // bytes per 256 inputs: ql (128), qh (64)

// The 32 codes of block I of a super-block's bytes before their -32 (0..63, unsigned).
template <int I>
inline __m256i six_unsigned_of(const uint8_t* super) {
  constexpr int n = I / 4, j = I % 4;
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 64 * n + 32 * (j & 1)));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 128 + 32 * n));
  const __m256i low = _mm256_and_si256(j >> 1 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0F));
  // bits 2j, 2j + 1 of qh to bits 4, 5 (the 16-bit shifts move no kept bit across a byte)
  const __m256i moved = j == 0 ? _mm256_slli_epi16(qh, 4) : j == 1 ? _mm256_slli_epi16(qh, 2)
                        : j == 2 ? qh : _mm256_srli_epi16(qh, 2);
  const __m256i high = _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
  return _mm256_or_si256(low, high);
}

// The same codes after their -32: the int8 codes.
template <int I>
inline __m256i six_block_of(const uint8_t* super) {
  return _mm256_sub_epi8(six_unsigned_of<I>(super), _mm256_set1_epi8(32));
}

// Block b (inputs 32b .. 32b + 31) of one output's packed row -> its 32 codes before their -32 in input order.
// Where b % 8 is known at compile time (an unrolled loop over a super-block) the switch folds away.
inline __m256i six_unsigned(const uint8_t* row, int64_t b) {
  const uint8_t* super = row + (b >> 3) * SIX_SUPER_BYTES;
  switch (b & 7) {
    case 0: return six_unsigned_of<0>(super);
    case 1: return six_unsigned_of<1>(super);
    case 2: return six_unsigned_of<2>(super);
    case 3: return six_unsigned_of<3>(super);
    case 4: return six_unsigned_of<4>(super);
    case 5: return six_unsigned_of<5>(super);
    case 6: return six_unsigned_of<6>(super);
    default: return six_unsigned_of<7>(super);
  }
}

// The 256 int8 codes of one super-block (its 192 bytes at `super`) into out[256], in input order: for the
// kernels that read a row's codes group by group or transpose them (float32 activations without AVX-512,
// dequantization, the prompt GEMMs' repacking), which then read the 8-bit layout's bytes.
inline void six_super(const uint8_t* super, int8_t* out) {
  __m256i* blocks = reinterpret_cast<__m256i*>(out);
  _mm256_storeu_si256(blocks + 0, six_block_of<0>(super));
  _mm256_storeu_si256(blocks + 1, six_block_of<1>(super));
  _mm256_storeu_si256(blocks + 2, six_block_of<2>(super));
  _mm256_storeu_si256(blocks + 3, six_block_of<3>(super));
  _mm256_storeu_si256(blocks + 4, six_block_of<4>(super));
  _mm256_storeu_si256(blocks + 5, six_block_of<5>(super));
  _mm256_storeu_si256(blocks + 6, six_block_of<6>(super));
  _mm256_storeu_si256(blocks + 7, six_block_of<7>(super));
}

}  // namespace quant
}  // namespace fastdecode
