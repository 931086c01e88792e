// The two products of the prompt attention kernel (prompt_attention.cpp), in AVX2 there and AVX-512 in
// prompt_attention_avx512.cpp: the same bits (isa.h). Every result is one chain of FMAs in a fixed order, lane by
// lane, so the vector width and the tiling never change it:
//   scores: p[r * W + u] = sum over d = 0 .. D-1 of q_r[d] * kt[d * KEY_BLOCK + u] (FMAs in d order from 0), for
//           the KEY_BLOCK keys u of a block (kt: the block transposed, [D, KEY_BLOCK]) and R <= ROW_GROUP rows q_r
//           (D floats each);
//   values: out_r[d] = sum over u = 0 .. n-1 of p[r * W + u] * v[u * v_stride + d] (FMAs in u order from 0), for
//           R <= ROW_GROUP rows over n keys (v: the first key's D values), and sums[r] = the p[r * W + u] added
//           in u order from 0.
#pragma once

#include <cstdint>

namespace fastdecode {

constexpr int64_t ROW_GROUP = 6;  // query rows per micro-kernel call (a group shares its key range)
constexpr int64_t KEY_BLOCK = 32;  // keys per scores call, from key 0 (the transposed keys' row length is a multiple)

namespace avx512 {
void attention_scores(const float* const* q, int64_t R, const float* kt, int64_t D, float* p, int64_t W);
void attention_values(const float* p, int64_t W, int64_t R, int64_t n, const float* v, int64_t v_stride, int64_t D,
                      float* const* out, float* sums);
// prompt_attention.cpp's numerators (vec_math.h's exp on 16 lanes).
float attention_numerators(float* s, const float* m, int64_t n, float scale);
}  // namespace avx512

}  // namespace fastdecode
