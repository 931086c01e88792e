// Encoder-decoder cross-attention over each source's own keys (AVX2 + FMA + F16C; engine/cross.py
// holds the PyTorch path, SDPA with a padding mask).
//
// cross_attention(q [B, H, T, D], keys, values [B, H, S, D] contiguous, lengths [B], scale)
//   -> [B, H, T, D]: query t of row b, head h attends to keys 0 .. lengths[b] - 1 of (b, h) (the
//   sources are right-padded: padding is never read), softmax in float32, out = sum softmax * v.
// paged_cross_attention(q [B, H, T, D], keys, values [blocks, H, block, D], table [B, n], lengths [B],
//   scale) -> [B, H, T, D]: the same over sources held in blocks (the engine's cross store,
//   engine/cross.py): key j of row b, head h is row j % block of head h in block table[b, j / block],
//   so each head's keys stay contiguous a block at a time. The contiguous op is the case of one
//   block per row (block = S, table[b] = [b]): both run the same code, bitwise.
// Keys and values are float32, or both float16 (half the bytes a step streams: a Whisper window's
// K/V are 4.6 MB per decoder layer in float32), widened to float32 as they are loaded: the same
// operations in the same order as on their float32 values.
// In a beam search the T queries of a row are the K beams of a source folded into its query axis
// (FastSeq: a Whisper window's beams, engine/speech_source.py): each (b, h) reads its keys and values once for all T,
// 8 keys at a time from L1, where SDPA's CPU kernel, built for long query blocks, runs ~3x slower
// on T = 4. Every (b, h) runs the same operations in the same order whatever B is: batched ==
// alone, bitwise. The (b, h) items are split between threads by parallel.h's chunk claiming (a thread
// that is late or busy elsewhere never makes the step wait): a decode step's cross-attention reads every
// source's keys and values (6 MB per layer at 8 x 256 tokens, beam 4), too little per item for OpenMP's
// barrier to pay, enough for a second core to halve.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "vec_math.h"

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <typename E>  // the keys' and values' element: float or at::Half
struct Head {
  const float* q;  // [T, D], rows q_t apart
  int64_t q_t;
  const E* k;  // this head's rows of block 0: key j at k + table[j / block] * block_step + (j % block) * D
  const E* v;
  const int64_t* table;  // the row's block ids
  int64_t block, block_step;
  int64_t T, L, D;
  float scale;
  float* out;  // [T, D] contiguous
  int64_t at(int64_t j) const { return table[j / block] * block_step + (j % block) * D; }
  // keys j .. j + count - 1 lie in one block from j (count <= the rest of j's block)
  int64_t run(int64_t j) const { return std::min(block - j % block, L - j); }
};

// One query's scores against 8 keys (each a sum over d in order, reduced by eight_sums), times the scale.
template <typename P>
inline void eight_scores(const float* q, const P* const* keys, int64_t D, float scale, float* out) {
  __m256 acc[8];
  for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, load8(keys[u] + d), acc[u]);
  }
  _mm256_storeu_ps(out, _mm256_mul_ps(eight_sums(acc), _mm256_set1_ps(scale)));
}

// scores [T, Lp] (Lp = L rounded up to 8; the padding stays -inf) of every query against every key.
// float16 keys read by several queries (a prompt's rows, a window's beams) are widened once per eight
// into a float32 buffer, not once per query (a 168-row prompt's scores were bound by the conversions):
// the same float32 values in the same operations, so the same bits.
template <typename E>
void head_scores(const Head<E>& h, int64_t Lp, float* scores) {
  const int64_t D = h.D;
  constexpr int64_t LINE = 64 / sizeof(E);  // elements per cache line
  const bool widen = !std::is_same<E, float>::value && h.T > 1;
  std::vector<float> wide(widen ? 8 * D : 0);  // the eight keys widened, key u at u * D
  const float* wide_keys[8];
  for (int u = 0; u < 8 && widen; ++u) wide_keys[u] = wide.data() + u * D;
  int64_t j = 0;
  for (; j + 8 <= h.L; j += 8) {
    // The 8 keys j .. j + 7: consecutive where they lie in one block, else each found in its block
    // (a block size that is not a multiple of 8); the same products either way.
    const E* keys[8];
    const bool one_block = h.run(j) >= 8;
    for (int u = 0; u < 8; ++u) keys[u] = one_block ? h.k + h.at(j) + u * D : h.k + h.at(j + u);
    // Memory, not arithmetic, bounds this op (each key and value is read once): ask for the keys two
    // eights ahead and for these keys' values (the next phase's) while the products run.
    if (one_block) {
      const E* ahead = j + 24 <= h.L ? h.k + h.at(j + 16) : nullptr;
      const E* v = h.v + h.at(j);
      for (int64_t line = 0; line < 8 * D; line += LINE) {
        if (ahead) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v + line), _MM_HINT_T1);
      }
    }
    if (widen) {
      for (int u = 0; u < 8; ++u)
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(wide.data() + u * D + d, load8(keys[u] + d));
      for (int64_t t = 0; t < h.T; ++t) eight_scores(h.q + t * h.q_t, wide_keys, D, h.scale, scores + t * Lp + j);
    } else {
      for (int64_t t = 0; t < h.T; ++t) eight_scores(h.q + t * h.q_t, keys, D, h.scale, scores + t * Lp + j);
    }
  }
  for (; j < h.L; ++j) {  // the last keys, one at a time
    const E* k = h.k + h.at(j);
    for (int64_t t = 0; t < h.T; ++t) {
      const float* q = h.q + t * h.q_t;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
      scores[t * Lp + j] = hsum(acc) * h.scale;
    }
  }
}

// out[t] = inverse[t] * sum_j p[t, j] v_j for TILE queries from t0 and 8 * NV dims from d: their
// sums stay in registers (compile-time sizes: a runtime-sized accumulator array would live on the
// stack) while the keys stream by; each sum adds its keys in order j = 0 .. L-1.
template <int TILE, int NV, typename E>
void values_tile(const Head<E>& h, int64_t Lp, const float* p, const float* inverse, int64_t t0, int64_t d) {
  const int64_t D = h.D;
  __m256 acc[TILE][NV];
  for (int t = 0; t < TILE; ++t)
    for (int n = 0; n < NV; ++n) acc[t][n] = _mm256_setzero_ps();
  for (int64_t j0 = 0, count = 0; j0 < h.L; j0 += count) {  // a block's keys at a time
    count = h.run(j0);
    const E* v0 = h.v + h.at(j0) + d;
    for (int64_t j = j0; j < j0 + count; ++j) {
      const E* v = v0 + (j - j0) * D;
      __m256 x[NV];
      for (int n = 0; n < NV; ++n) x[n] = load8(v + 8 * n);
      for (int t = 0; t < TILE; ++t) {
        const __m256 w = _mm256_broadcast_ss(p + (t0 + t) * Lp + j);
        for (int n = 0; n < NV; ++n) acc[t][n] = _mm256_fmadd_ps(w, x[n], acc[t][n]);
      }
    }
  }
  for (int t = 0; t < TILE; ++t) {
    const __m256 inv = _mm256_set1_ps(inverse[t0 + t]);
    for (int n = 0; n < NV; ++n) _mm256_storeu_ps(h.out + (t0 + t) * D + d + 8 * n, _mm256_mul_ps(acc[t][n], inv));
  }
}

// All D dims of TILE queries from t0: NV registers of 8 dims per query while the keys stream by (at most 8
// sums in registers, so one query keeps 8 independent sums instead of a chain of 2, and reads each value
// row once instead of D / 16 times), the rest in passes of 8 dims. Every output is its own sum in key
// order whatever the grouping: the same bits at any TILE and NV.
template <int TILE, typename E>
void values_rows(const Head<E>& h, int64_t Lp, const float* p, const float* inverse, int64_t t0) {
  constexpr int NV = TILE == 1 ? 8 : TILE == 2 ? 4 : 2;
  int64_t d = 0;
  for (; d + 8 * NV <= h.D; d += 8 * NV) values_tile<TILE, NV>(h, Lp, p, inverse, t0, d);
  for (; d < h.D; d += 8) values_tile<TILE, 1>(h, Lp, p, inverse, t0, d);
}

template <typename E>
void head_values(const Head<E>& h, int64_t Lp, const float* p, const float* inverse) {
  int64_t t0 = 0;
  for (; t0 + 4 <= h.T; t0 += 4) values_rows<4>(h, Lp, p, inverse, t0);
  switch (h.T - t0) {
    case 3: values_rows<3>(h, Lp, p, inverse, t0); break;
    case 2: values_rows<2>(h, Lp, p, inverse, t0); break;
    case 1: values_rows<1>(h, Lp, p, inverse, t0); break;
    default: break;
  }
}

// Row b's head h: keys in blocks table[b * n ..] of block_step elements each, this head's rows
// head_step elements into a block.
template <typename E>
void attend_heads(const at::Tensor& q, const E* kd, const E* vd, const int64_t* table, int64_t n, int64_t block,
                  int64_t block_step, int64_t head_step, const int64_t* len, double scale, int64_t threads,
                  at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const float* qd = q.data_ptr<float>();
  float* od = out.data_ptr<float>();
  fastdecode::parallel_chunks(B * H, 1, threads, [&](int64_t first, int64_t last) {
    std::vector<float> scores, inverse(T);
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / H, h = item % H, L = len[b], Lp = (L + 7) / 8 * 8;
      const Head<E> head{qd + b * q.stride(0) + h * q.stride(1), q.stride(2), kd + h * head_step, vd + h * head_step,
                         table + b * n, block, block_step, T, L, D, static_cast<float>(scale), od + item * T * D};
      scores.assign(T * Lp, -INFINITY);
      head_scores(head, Lp, scores.data());
      for (int64_t t = 0; t < T; ++t) inverse[t] = softmax_numerators(scores.data() + t * Lp, L, Lp);
      head_values(head, Lp, scores.data(), inverse.data());
    }
  });
}

void check_queries(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.stride(3) == 1 && q.device().is_cpu(),
              "q must be float32 [B, H, T, D] on the CPU with D contiguous");
  TORCH_CHECK(q.size(3) % 8 == 0, "head dim ", q.size(3), " is not a multiple of 8");
}

void check_lengths(const at::Tensor& lengths, int64_t B, int64_t S) {
  TORCH_CHECK(lengths.numel() == B && lengths.scalar_type() == at::kLong && lengths.is_contiguous(),
              "lengths must be int64 [B]");
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(len[b] >= 1 && len[b] <= S, "row ", b, ": ", len[b], " keys of ", S);
}

template <typename... Args>
void attend_either(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& q, Args... args) {
  if (keys.scalar_type() == at::kHalf) {
    attend_heads(q, keys.data_ptr<at::Half>(), values.data_ptr<at::Half>(), args...);
  } else {
    attend_heads(q, keys.data_ptr<float>(), values.data_ptr<float>(), args...);
  }
}

at::Tensor cross_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& lengths, double scale, int64_t threads) {
  check_queries(q);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == B && keys.size(1) == H && keys.size(3) == D &&
                  keys.sizes() == values.sizes() && keys.is_contiguous() && values.is_contiguous() &&
                  keys.scalar_type() == values.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kHalf),
              "keys and values must be contiguous [B, H, S, D] matching q, both float32 or both float16");
  const int64_t S = keys.size(2);
  check_lengths(lengths, B, S);
  std::vector<int64_t> rows(B);  // row b is block b of S keys
  for (int64_t b = 0; b < B; ++b) rows[b] = b;
  at::Tensor out = at::empty({B, H, T, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  attend_either(keys, values, q, rows.data(), int64_t{1}, S, H * S * D, S * D, lengths.data_ptr<int64_t>(), scale,
                threads, out);
  return out;
}

at::Tensor paged_cross_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                 const at::Tensor& table, const at::Tensor& lengths, double scale, int64_t threads) {
  check_queries(q);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  TORCH_CHECK(keys.dim() == 4 && keys.size(1) == H && keys.size(3) == D && keys.sizes() == values.sizes() &&
                  keys.is_contiguous() && values.is_contiguous() && keys.scalar_type() == values.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kHalf),
              "keys and values must be contiguous [blocks, H, block, D] matching q, both float32 or both float16");
  const int64_t blocks = keys.size(0), block = keys.size(2);
  TORCH_CHECK(table.dim() == 2 && table.size(0) == B && table.scalar_type() == at::kLong && table.is_contiguous(),
              "table must be contiguous int64 [B, n]");
  const int64_t n = table.size(1);
  check_lengths(lengths, B, n * block);
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)  // every block a row reads exists: checked once, so the kernel indexes freely
    for (int64_t i = 0; i < (len[b] + block - 1) / block; ++i)
      TORCH_CHECK(tab[b * n + i] >= 0 && tab[b * n + i] < blocks, "row ", b, ": block id ", tab[b * n + i],
                  " outside the ", blocks, " blocks");
  at::Tensor out = at::empty({B, H, T, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  attend_either(keys, values, q, tab, n, block, H * block * D, block * D, len, scale, threads, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("cross_attention(Tensor q, Tensor keys, Tensor values, Tensor lengths, float scale, int threads=1) -> Tensor");
  m.def("paged_cross_attention(Tensor q, Tensor keys, Tensor values, Tensor table, Tensor lengths, float scale, "
        "int threads=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) {
  m.impl("cross_attention", &cross_attention);
  m.impl("paged_cross_attention", &paged_cross_attention);
}
