// Encoder-decoder cross-attention over each source's own keys (AVX2 + FMA + F16C; engine/cross.py
// holds the PyTorch path, SDPA with a padding mask).
//
// cross_attention(q [B, H, T, D], keys, values [B, H, S, D] contiguous, lengths [B], scale)
//   -> [B, H, T, D]: query t of row b, head h attends to keys 0 .. lengths[b] - 1 of (b, h) (the
//   sources are right-padded: padding is never read), softmax in float32, out = sum softmax * v.
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
  const E* k;  // [L, D] contiguous (the visible keys)
  const E* v;
  int64_t T, L, D;
  float scale;
  float* out;  // [T, D] contiguous
};

// scores [T, Lp] (Lp = L rounded up to 8; the padding stays -inf) of every query against every key.
template <typename E>
void head_scores(const Head<E>& h, int64_t Lp, float* scores) {
  const int64_t D = h.D;
  constexpr int64_t LINE = 64 / sizeof(E);  // elements per cache line
  int64_t j = 0;
  for (; j + 8 <= h.L; j += 8) {
    const E* k = h.k + j * D;
    // Memory, not arithmetic, bounds this op (each key and value is read once): ask for the keys two
    // blocks ahead and for these keys' values (the next phase's) while the products run.
    for (int64_t line = 0; line < 8 * D; line += LINE) {
      if (j + 24 <= h.L) _mm_prefetch(reinterpret_cast<const char*>(k + 16 * D + line), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(h.v + j * D + line), _MM_HINT_T1);
    }
    for (int64_t t = 0; t < h.T; ++t) {
      const float* q = h.q + t * h.q_t;
      __m256 acc[8];
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, load8(k + u * D + d), acc[u]);
      }
      _mm256_storeu_ps(scores + t * Lp + j, _mm256_mul_ps(eight_sums(acc), _mm256_set1_ps(h.scale)));
    }
  }
  for (; j < h.L; ++j) {  // the last keys, one at a time
    const E* k = h.k + j * D;
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
  for (int64_t j = 0; j < h.L; ++j) {
    const E* v = h.v + j * D + d;
    __m256 x[NV];
    for (int n = 0; n < NV; ++n) x[n] = load8(v + 8 * n);
    for (int t = 0; t < TILE; ++t) {
      const __m256 w = _mm256_broadcast_ss(p + (t0 + t) * Lp + j);
      for (int n = 0; n < NV; ++n) acc[t][n] = _mm256_fmadd_ps(w, x[n], acc[t][n]);
    }
  }
  for (int t = 0; t < TILE; ++t) {
    const __m256 inv = _mm256_set1_ps(inverse[t0 + t]);
    for (int n = 0; n < NV; ++n) _mm256_storeu_ps(h.out + (t0 + t) * D + d + 8 * n, _mm256_mul_ps(acc[t][n], inv));
  }
}

template <int NV, typename E>
void values_dims(const Head<E>& h, int64_t Lp, const float* p, const float* inverse, int64_t d) {
  int64_t t0 = 0;
  for (; t0 + 4 <= h.T; t0 += 4) values_tile<4, NV>(h, Lp, p, inverse, t0, d);
  switch (h.T - t0) {
    case 3: values_tile<3, NV>(h, Lp, p, inverse, t0, d); break;
    case 2: values_tile<2, NV>(h, Lp, p, inverse, t0, d); break;
    case 1: values_tile<1, NV>(h, Lp, p, inverse, t0, d); break;
    default: break;
  }
}

template <typename E>
void head_values(const Head<E>& h, int64_t Lp, const float* p, const float* inverse) {
  int64_t d = 0;
  for (; d + 16 <= h.D; d += 16) values_dims<2>(h, Lp, p, inverse, d);
  if (d < h.D) values_dims<1>(h, Lp, p, inverse, d);  // D = 16k + 8
}

template <typename E>
void attend_heads(const at::Tensor& q, const E* kd, const E* vd, const int64_t* len, int64_t S, double scale,
                  int64_t threads, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const float* qd = q.data_ptr<float>();
  float* od = out.data_ptr<float>();
  fastdecode::parallel_chunks(B * H, 1, threads, [&](int64_t first, int64_t last) {
    std::vector<float> scores, inverse(T);
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / H, h = item % H, L = len[b], Lp = (L + 7) / 8 * 8;
      const Head<E> head{qd + b * q.stride(0) + h * q.stride(1), q.stride(2), kd + item * S * D, vd + item * S * D,
                         T, L, D, static_cast<float>(scale), od + item * T * D};
      scores.assign(T * Lp, -INFINITY);
      head_scores(head, Lp, scores.data());
      for (int64_t t = 0; t < T; ++t) inverse[t] = softmax_numerators(scores.data() + t * Lp, L, Lp);
      head_values(head, Lp, scores.data(), inverse.data());
    }
  });
}

at::Tensor cross_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& lengths, double scale, int64_t threads) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.stride(3) == 1 && q.device().is_cpu(),
              "q must be float32 [B, H, T, D] on the CPU with D contiguous");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  TORCH_CHECK(D % 8 == 0, "head dim ", D, " is not a multiple of 8");
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == B && keys.size(1) == H && keys.size(3) == D &&
                  keys.sizes() == values.sizes() && keys.is_contiguous() && values.is_contiguous() &&
                  keys.scalar_type() == values.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kHalf),
              "keys and values must be contiguous [B, H, S, D] matching q, both float32 or both float16");
  const int64_t S = keys.size(2);
  TORCH_CHECK(lengths.numel() == B && lengths.scalar_type() == at::kLong && lengths.is_contiguous(),
              "lengths must be int64 [B]");
  const int64_t* len = lengths.data_ptr<int64_t>();
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= S, "row ", b, ": ", len[b], " keys of ", S);
    longest = std::max(longest, len[b]);
  }
  at::Tensor out = at::empty({B, H, T, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (keys.scalar_type() == at::kHalf) {
    attend_heads(q, keys.data_ptr<at::Half>(), values.data_ptr<at::Half>(), len, S, scale, threads, out);
  } else {
    attend_heads(q, keys.data_ptr<float>(), values.data_ptr<float>(), len, S, scale, threads, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("cross_attention(Tensor q, Tensor keys, Tensor values, Tensor lengths, float scale, int threads=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("cross_attention", &cross_attention); }
