// A prompt's attention (layers/attention.py), float32 on the CPU: our own kernel in place of PyTorch's SDPA, split
// over the kernel pool (parallel.h) in items of (batch row, KV head, tile of queries).
//
// Why: SDPA's CPU flash kernel (MKL's small GEMMs per block, packing included) ran a prompt's attention products at
// ~50 G multiply-adds/s on a Zen 5 core (a quarter of a 512-token SmolLM2 prompt's time), scored the masked keys of
// its key blocks, and gave bits that depended on the block widths (so the queries ran in fixed chunks).
//
// How: the query heads of a KV head's group are folded into the query axis (row r of a tile: query t0 + r / G,
// head kv * G + r % G), so each block of keys and values is read once per group. A tile's rows go in groups of
// ROW_GROUP, each over the keys its rows' masks show (from the first to the last visible key of any of them;
// blocks of keys outside are never scored). For each row: the scores q . k (FMAs in d order, prompt_attention.h),
// times the scale, plus the mask; their maximum; p = exp(score - max) (vec_math.h's exp8); their sum l, added in key
// order; out = (sum of p v, FMAs in key order) * (1 / l). A masked key's p is exactly 0 and adds exactly nothing,
// so each row's bits depend only on its query, the keys and values it sees (in order) and D: not on the other rows
// (the tile, padding of a batch, the query count), not on where its visible keys sit (left padding, a prompt whole
// or in chunks against the cache), not on the thread count, and AVX2 = AVX-512 (the products in
// prompt_attention_avx512.cpp, the rest shared). A row that sees no key gives zeros.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "isa.h"
#include "parallel.h"
#include "prompt_attention.h"
#include "vec_math.h"

namespace {

using fastdecode::KEY_BLOCK;
using fastdecode::ROW_GROUP;

constexpr int64_t TILE_ROWS = 48;  // query rows (queries x the group's heads) of an item, about

// R rows x 16 keys (AVX2: 2R accumulators of 8 keys).
template <int R>
inline void scores16(const float* const* q, const float* kt, int64_t D, float* p, int64_t W) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * KEY_BLOCK), k1 = _mm256_loadu_ps(kt + d * KEY_BLOCK + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(q[r] + d);
      a0[r] = _mm256_fmadd_ps(x, k0, a0[r]);
      a1[r] = _mm256_fmadd_ps(x, k1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(p + r * W, a0[r]);
    _mm256_storeu_ps(p + r * W + 8, a1[r]);
  }
}

template <int R>
inline void scores32(const float* const* q, const float* kt, int64_t D, float* p, int64_t W) {
  scores16<R>(q, kt, D, p, W);
  scores16<R>(q, kt + 16, D, p + 16, W);
}

// R rows x NV registers of 8 dims from d; SUM: the rows' sums of p too (every lane the same sum), into sums.
template <int R, int NV, bool SUM>
inline void values_rows(const float* p, int64_t W, int64_t n, const float* v, int64_t v_stride, float* const* out,
                        int64_t d, float* sums) {
  __m256 a[R][NV], l[R];
  for (int r = 0; r < R; ++r) {
    l[r] = _mm256_setzero_ps();
    for (int i = 0; i < NV; ++i) a[r][i] = _mm256_setzero_ps();
  }
  for (int64_t u = 0; u < n; ++u) {
    __m256 x[NV];
    for (int i = 0; i < NV; ++i) x[i] = _mm256_loadu_ps(v + u * v_stride + d + 8 * i);
    for (int r = 0; r < R; ++r) {
      const __m256 w = _mm256_broadcast_ss(p + r * W + u);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm256_fmadd_ps(w, x[i], a[r][i]);
      if (SUM) l[r] = _mm256_add_ps(l[r], w);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out[r] + d + 8 * i, a[r][i]);
    if (SUM) sums[r] = _mm256_cvtss_f32(l[r]);
  }
}

template <int R>
inline void values_all(const float* p, int64_t W, int64_t n, const float* v, int64_t v_stride, int64_t D,
                       float* const* out, float* sums) {
  int64_t d = 0;  // (the rows' sums ride with the first 8 dims alone: 16 registers)
  if (D >= 8) values_rows<R, 1, true>(p, W, n, v, v_stride, out, 0, sums), d = 8;
  for (; d + 16 <= D; d += 16) values_rows<R, 2, false>(p, W, n, v, v_stride, out, d, sums);
  for (; d + 8 <= D; d += 8) values_rows<R, 1, false>(p, W, n, v, v_stride, out, d, sums);
  for (int r = 0; r < R && D < 8; ++r) {  // (a head dim under 8: the sums in key order one at a time)
    sums[r] = 0.0f;
    for (int64_t u = 0; u < n; ++u) sums[r] += p[r * W + u];
  }
  for (; d < D; ++d)  // (head dims not a multiple of 8: the same FMAs one lane at a time)
    for (int r = 0; r < R; ++r) {
      float a = 0.0f;
      for (int64_t u = 0; u < n; ++u) a = std::fma(p[r * W + u], v[u * v_stride + d], a);
      out[r][d] = a;
    }
}

void scores(bool wide, const float* const* q, int64_t R, const float* kt, int64_t D, float* p, int64_t W) {
  if (wide) return fastdecode::avx512::attention_scores(q, R, kt, D, p, W);
  switch (R) {
    case 1: return scores32<1>(q, kt, D, p, W);
    case 2: return scores32<2>(q, kt, D, p, W);
    case 3: return scores32<3>(q, kt, D, p, W);
    case 4: return scores32<4>(q, kt, D, p, W);
    case 5: return scores32<5>(q, kt, D, p, W);
    default: return scores32<6>(q, kt, D, p, W);
  }
}

void values(bool wide, const float* p, int64_t W, int64_t R, int64_t n, const float* v, int64_t v_stride, int64_t D,
            float* const* out, float* sums) {
  if (wide) return fastdecode::avx512::attention_values(p, W, R, n, v, v_stride, D, out, sums);
  switch (R) {
    case 1: return values_all<1>(p, W, n, v, v_stride, D, out, sums);
    case 2: return values_all<2>(p, W, n, v, v_stride, D, out, sums);
    case 3: return values_all<3>(p, W, n, v, v_stride, D, out, sums);
    case 4: return values_all<4>(p, W, n, v, v_stride, D, out, sums);
    case 5: return values_all<5>(p, W, n, v, v_stride, D, out, sums);
    default: return values_all<6>(p, W, n, v, v_stride, D, out, sums);
  }
}

// The first and one past the last key a mask row m [S] does not hide (-inf); [0, 0) when it hides them all.
void visible_keys(const float* m, int64_t S, int64_t& lo, int64_t& hi) {
  const __m256 hidden = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= S; j += 8) {
    const int seen = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(m + j), hidden, _CMP_NEQ_UQ));
    if (seen) break;
  }
  while (j < S && m[j] == -INFINITY) ++j;
  if (j == S) {
    lo = hi = 0;
    return;
  }
  lo = j;
  int64_t e = S;
  for (; e - 8 >= lo; e -= 8) {
    const int seen = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(m + e - 8), hidden, _CMP_NEQ_UQ));
    if (seen) break;
  }
  while (m[e - 1] == -INFINITY) --e;  // (stops at lo at the latest)
  hi = e;
}

// A row's n scores s (dot products) -> softmax numerators p = exp(s * scale + m - max) in place (m: its mask over
// those keys, or null); returns the maximum (-inf: every key hidden, p all 0).
float numerators(float* s, const float* m, int64_t n, float scale) {
  const __m256 sv = _mm256_set1_ps(scale);
  __m256 top = _mm256_set1_ps(-INFINITY);
  int64_t u = 0;
  for (; u + 8 <= n; u += 8) {
    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + u), sv);
    if (m) x = _mm256_add_ps(x, _mm256_loadu_ps(m + u));
    _mm256_storeu_ps(s + u, x);
    top = _mm256_max_ps(x, top);
  }
  alignas(32) float lane[8];
  _mm256_store_ps(lane, top);
  float best = -INFINITY;
  for (int i = 0; i < 8; ++i) best = lane[i] > best ? lane[i] : best;
  for (int64_t t = u; t < n; ++t) {
    s[t] = m ? s[t] * scale + m[t] : s[t] * scale;
    best = s[t] > best ? s[t] : best;
  }
  if (best == -INFINITY) {
    std::fill(s, s + n, 0.0f);
    return best;
  }
  const __m256 bv = _mm256_set1_ps(best);
  for (u = 0; u + 8 <= n; u += 8) _mm256_storeu_ps(s + u, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + u), bv)));
  if (u < n) {  // the last few through the same exp8, the lanes past n fed -inf
    for (int i = 0; i < 8; ++i) lane[i] = u + i < n ? s[u + i] : -INFINITY;
    _mm256_store_ps(lane, exp8(_mm256_sub_ps(_mm256_load_ps(lane), bv)));
    for (int64_t t = u; t < n; ++t) s[t] = lane[t - u];
  }
  return best;
}

struct Operands {
  const float *q, *v, *mask;  // q [B, H, T, D], v [B, Hkv, S, D] (strides below; D contiguous), mask or null
  const float* kt;  // the keys in blocks of KEY_BLOCK, each transposed: [B * Hkv, SP / KEY_BLOCK, D, KEY_BLOCK]
  float* out;  // [B, T, H, D] contiguous
  int64_t q_b, q_h, q_t, v_b, v_h, v_t, m_b, m_h, m_t;  // m_h 0: one mask for every head
  const int64_t* keys_seen;  // [B, 1 or H, T, 2]: each mask row's visible keys (visible_keys), with a mask
  int64_t T, H, Hkv, S, SP, D, G, tile, Hm;  // tile: queries per item; Hm: the mask's heads (1 or H)
  float scale;
  bool wide;  // AVX-512
};

struct Scratch {
  std::vector<const float*> q, mask;
  std::vector<float*> out;
  std::vector<int64_t> lo, hi;
  std::vector<float> p;
};

// Rows of queries t0 .. t1 - 1 of batch row b, KV head kv (its G query heads each).
void attend_tile(const Operands& o, int64_t b, int64_t kv, int64_t t0, int64_t t1, Scratch& s) {
  const int64_t rows = (t1 - t0) * o.G, groups = (rows + ROW_GROUP - 1) / ROW_GROUP, D = o.D;
  s.q.resize(rows), s.mask.resize(rows), s.out.resize(rows), s.lo.resize(groups), s.hi.resize(groups);
  int64_t base = o.SP, top = 0;
  for (int64_t g = 0; g < groups; ++g) {
    int64_t glo = o.S, ghi = 0;
    for (int64_t r = g * ROW_GROUP; r < std::min(rows, (g + 1) * ROW_GROUP); ++r) {
      const int64_t t = t0 + r / o.G, h = kv * o.G + r % o.G;
      s.q[r] = o.q + b * o.q_b + h * o.q_h + t * o.q_t;
      s.out[r] = o.out + ((b * o.T + t) * o.H + h) * D;
      s.mask[r] = o.mask ? o.mask + b * o.m_b + h * o.m_h + t * o.m_t : nullptr;
      int64_t lo = 0, hi = o.S;
      if (o.mask) {
        const int64_t* seen = o.keys_seen + ((b * o.Hm + (o.Hm == 1 ? 0 : h)) * o.T + t) * 2;
        lo = seen[0], hi = seen[1];
      }
      if (lo < hi) glo = std::min(glo, lo), ghi = std::max(ghi, hi);
    }
    s.lo[g] = glo, s.hi[g] = std::max(glo, ghi);
    if (glo < ghi) base = std::min(base, glo / KEY_BLOCK * KEY_BLOCK), top = std::max(top, ghi);
  }
  top = (top + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;  // (<= SP)
  const int64_t W = std::max<int64_t>(top - base, 0) + 16;  // (+ 16: rows of scores not 2^k floats apart)
  s.p.resize(rows * W);
  float* p = s.p.data();
  const float* kt = o.kt + (b * o.Hkv + kv) * D * o.SP;  // [SP / KEY_BLOCK, D, KEY_BLOCK]
  // Scores: a block of keys (its transposed D x 32 in L1) for every row group that sees any of them.
  for (int64_t j = base; j < top; j += KEY_BLOCK)
    for (int64_t g = 0; g < groups; ++g)
      if (s.lo[g] < j + KEY_BLOCK && s.hi[g] > j)
        scores(o.wide, &s.q[g * ROW_GROUP], std::min(ROW_GROUP, rows - g * ROW_GROUP), kt + j * D, D,
               p + g * ROW_GROUP * W + (j - base), W);
  const float* v = o.v + b * o.v_b + kv * o.v_h;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = g * ROW_GROUP, R = std::min(ROW_GROUP, rows - r0), lo = s.lo[g], n = s.hi[g] - lo;
    float* pg = p + r0 * W + (lo - base);
    float sums[ROW_GROUP] = {};
    for (int64_t r = 0; r < R; ++r) {
      const float* m = s.mask[r0 + r] ? s.mask[r0 + r] + lo : nullptr;
      o.wide ? fastdecode::avx512::attention_numerators(pg + r * W, m, n, o.scale) : numerators(pg + r * W, m, n, o.scale);
    }
    values(o.wide, pg, W, R, n, v + lo * o.v_t, o.v_t, D, &s.out[r0], sums);
    for (int64_t r = 0; r < R; ++r) {
      const float inverse = sums[r] > 0.0f ? 1.0f / sums[r] : 0.0f;
      float* out = s.out[r0 + r];
      for (int64_t d = 0; d < D; ++d) out[d] *= inverse;
    }
  }
}

// q [B, H, T, D]; k, v [B, Hkv, S, D] (H a multiple of Hkv); mask additive [B, 1 or H, T, S] or none
// -> [B, H, T, D] (a view of a [B, T, H, D] buffer: merging the heads after is a view).
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale, int64_t threads) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kFloat && q.device().is_cpu() &&
                  k.device().is_cpu() && v.device().is_cpu(),
              "q, k, v must be float32 [B, H, T, D] / [B, Hkv, S, D] on the CPU");
  const bool masked = mask.has_value() && mask->defined();
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && (!masked || mask->stride(3) == 1),
              "q, k, v and the mask must be contiguous in their last dim");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.sizes() == v.sizes() &&
                  k.size(0) == B && k.size(3) == D && Hkv > 0 && H % Hkv == 0 && D > 0,
              "k, v must be [B, Hkv, S, D] with H a multiple of Hkv");
  if (masked)
    TORCH_CHECK(mask->scalar_type() == at::kFloat && mask->dim() == 4 && mask->size(0) == B &&
                    (mask->size(1) == 1 || mask->size(1) == H) && mask->size(2) == T && mask->size(3) == S,
                "mask must be float32 [B, 1 or H, T, S]");
  at::Tensor out = at::empty({B, T, H, D}, q.options());
  if (out.numel() == 0) return out.transpose(1, 2);
  const int64_t SP = (S + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK, G = H / Hkv;
  // The keys in blocks of KEY_BLOCK, each transposed (its D x KEY_BLOCK floats in a row; the padding keys 0):
  // [B * Hkv, SP / KEY_BLOCK, D, KEY_BLOCK].
  at::Tensor kt = at::empty({B * Hkv, SP / KEY_BLOCK, D, KEY_BLOCK}, q.options());
  float* ktp = kt.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  // With them, in the same job, each mask row's visible keys (the mask is read once per call, not per KV head).
  const int64_t Hm = masked ? mask->size(1) : 0;
  std::vector<int64_t> keys_seen(B * Hm * T * 2);
  fastdecode::parallel_chunks(B * Hkv + B * Hm, 1, threads, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (i >= B * Hkv) {  // the T rows of a (batch row, mask head)
        const int64_t bm = i - B * Hkv;
        const float* m = mask->data_ptr<float>() + bm / Hm * mask->stride(0) + bm % Hm * mask->stride(1);
        for (int64_t t = 0; t < T; ++t)
          visible_keys(m + t * mask->stride(2), S, keys_seen[(bm * T + t) * 2], keys_seen[(bm * T + t) * 2 + 1]);
        continue;
      }
      const float* ki = kp + i / Hkv * k.stride(0) + i % Hkv * k.stride(1);
      float* ti = ktp + i * D * SP;
      for (int64_t j0 = 0; j0 < SP; j0 += KEY_BLOCK)  // a block: D rows of 32 keys, written in order
        for (int64_t d = 0; d < D; ++d)
          for (int64_t j = j0; j < j0 + KEY_BLOCK; ++j) *ti++ = j < S ? ki[j * k.stride(2) + d] : 0.0f;
    }
  }, S * D);
  const int64_t tile = std::max<int64_t>(1, TILE_ROWS / G), tiles = (T + tile - 1) / tile;
  Operands o{q.data_ptr<float>(), v.data_ptr<float>(), masked ? mask->data_ptr<float>() : nullptr, ktp,
             out.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2),
             masked ? mask->stride(0) : 0, masked && mask->size(1) != 1 ? mask->stride(1) : 0,
             masked ? mask->stride(2) : 0, keys_seen.data(), T, H, Hkv, S, SP, D, G, tile, Hm,
             static_cast<float>(scale),
             fastdecode::use_avx512()};
  // Items (tile, batch row, KV head), the last tiles first: under a causal mask they see the most keys, so the
  // last pieces claimed are the short ones.
  const int64_t items = tiles * B * Hkv;
  fastdecode::parallel_chunks(items, 1, threads, [&](int64_t i0, int64_t i1) {
    Scratch scratch;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t0 = (tiles - 1 - i / (B * Hkv)) * tile, b = i / Hkv % B, kv = i % Hkv;
      attend_tile(o, b, kv, t0, std::min(T, t0 + tile), scratch);
    }
  }, std::min(T, tile) * G * S * D * 2);
  return out.transpose(1, 2);  // [B, T, H, D] -> [B, H, T, D]
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, int threads) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("prompt_attention", &prompt_attention); }
