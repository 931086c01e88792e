// Beam search's step selection in one pass over the logits (AVX2; engine/beam_scores.py holds the
// PyTorch path, which this op replaces when nothing but token bans, suppression and no-repeat-n-gram
// blocking, processes the step: decoding/sampling.py's bans_only).
//
// beam_candidates(logits [B*K, V], running [B*K], banned [E], K, keep, threads, row_banned [B*K, W]?)
// -> (scores [B, keep], indices [B, keep]): for each sample b (rows b*K .. b*K+K-1, its beams) the `keep`
// best of
//     score[k, v] = ((x[k, v] - max_k) - log(sum_v exp(x[k, v] - max_k))) + running[b*K + k]
// (log_softmax in PyTorch's operation order, plus the beam's running score; a token id in `banned`, or in
// the beam's row of `row_banned` (no-repeat-n-gram blocking: a few ids per beam, V where none), scores
// -inf), best first, with index k * V + v: what torch.topk(total.view(B, K*V), keep) returns for
// total = log_softmax(logits) (banned ids -inf) + running. Equal scores keep the lower index first.
// The PyTorch chain writes five [B*K, V] tensors per step (log_softmax, the suppression's copy,
// the running sum, ...) and sorts 2 x 10^5 scores per sample; here each row is read three times
// (max, sum of exp, candidates) and nothing of its size is written; samples run on the kernel pool.
// The exponentials are exp8's (vec_math.h, relative error ~2e-7; PyTorch's are SLEEF's, twice the time
// here) and the sum runs in another order, so scores differ from PyTorch's by a few float32 roundings.
// A row's scores depend on that row only: batched == alone, bitwise.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "parallel.h"
#include "vec_math.h"

namespace {

float lane_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

float row_max(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  float best = lane_max(m);
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// sum_i exp(x[i] - m); the last partial vector is padded with -inf (exp = 0).
float row_sum_exp(const float* x, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
  if (i < n) {
    alignas(32) float tail[8];
    std::fill_n(tail, 8, -INFINITY);
    std::copy(x + i, x + n, tail);
    acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_load_ps(tail), mv)));
  }
  return hsum(acc);
}

// The best `keep` (score, index) offered so far, best first; an equal score never displaces an
// earlier one (offers come in increasing index order), so ties keep the lower index first.
struct Best {
  float* score;
  int64_t* index;
  int64_t keep, count = 0;

  float threshold() const { return count < keep ? -INFINITY : score[keep - 1]; }
  bool full() const { return count == keep; }

  void offer(float s, int64_t i) {  // the caller checked: not full, or s > threshold()
    int64_t at = full() ? keep - 1 : count++;
    for (; at > 0 && score[at - 1] < s; --at) {
      score[at] = score[at - 1];
      index[at] = index[at - 1];
    }
    score[at] = s;
    index[at] = i;
  }
};

// banned: the ids every row bans (1) or not (0); row_banned: each row's own W ids (V: none), or null. A row's
// own ids are marked in `banned` while its scores are taken, then unmarked.
void sample_candidates(const float* logits, const float* running, std::vector<char>& banned,
                       const int64_t* row_banned, int64_t W, int64_t K, int64_t V, Best& best) {
  std::vector<int64_t> marked;
  for (int64_t k = 0; k < K; ++k) {
    marked.clear();
    for (int64_t w = 0; row_banned != nullptr && w < W; ++w) {
      const int64_t id = row_banned[k * W + w];
      if (id < V && !banned[id]) {
        banned[id] = 1;
        marked.push_back(id);
      }
    }
    const float* x = logits + k * V;
    const float m = row_max(x, V);
    const float log_sum = std::log(row_sum_exp(x, V, m));
    const float shift = running[k];
    auto score = [&](int64_t v) { return banned[v] ? -INFINITY : ((x[v] - m) - log_sum) + shift; };
    int64_t v = 0;
    for (; v < V && !best.full(); ++v) best.offer(score(v), k * V + v);
    const __m256 mv = _mm256_set1_ps(m), lv = _mm256_set1_ps(log_sum), sv = _mm256_set1_ps(shift);
    for (; v + 8 <= V; v += 8) {
      const __m256 s = _mm256_add_ps(_mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(x + v), mv), lv), sv);
      int above = _mm256_movemask_ps(_mm256_cmp_ps(s, _mm256_set1_ps(best.threshold()), _CMP_GT_OQ));
      for (; above; above &= above - 1) {  // rare after the first few hundred tokens of a sample
        const int64_t token = v + __builtin_ctz(above);
        const float value = score(token);  // the same roundings as the vector lane, or -inf if banned
        if (value > best.threshold()) best.offer(value, k * V + token);
      }
    }
    for (; v < V; ++v) {
      const float value = score(v);
      if (value > best.threshold()) best.offer(value, k * V + v);
    }
    for (const int64_t id : marked) banned[id] = 0;
  }
}

std::tuple<at::Tensor, at::Tensor> beam_candidates(const at::Tensor& logits, const at::Tensor& running,
                                                   const at::Tensor& banned, int64_t K, int64_t keep, int64_t threads,
                                                   const c10::optional<at::Tensor>& row_banned) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.device().is_cpu(),
              "logits must be contiguous float32 [B*K, V] on the CPU");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(K > 0 && N % K == 0, "logits rows ", N, " are not a multiple of the beams ", K);
  TORCH_CHECK(keep > 0 && keep <= K * V, "cannot keep ", keep, " candidates of ", K * V);
  TORCH_CHECK(running.numel() == N && running.scalar_type() == at::kFloat && running.is_contiguous(),
              "running must be contiguous float32 [B*K]");
  TORCH_CHECK(banned.dim() == 1 && banned.scalar_type() == at::kLong && banned.is_contiguous(),
              "banned must be int64 [E]");
  std::vector<char> is_banned(V, 0);
  const int64_t* ids = banned.data_ptr<int64_t>();
  for (int64_t e = 0; e < banned.numel(); ++e) {
    TORCH_CHECK(ids[e] >= 0 && ids[e] < V, "banned token id ", ids[e], " outside the vocabulary of ", V);
    is_banned[ids[e]] = 1;
  }
  const bool per_row = row_banned.has_value() && row_banned->defined();
  if (per_row)
    TORCH_CHECK(row_banned->dim() == 2 && row_banned->size(0) == N && row_banned->scalar_type() == at::kLong &&
                    row_banned->is_contiguous() && row_banned->device().is_cpu(),
                "row_banned must be contiguous int64 [B*K, W] on the CPU");
  const int64_t W = per_row ? row_banned->size(1) : 0;
  const int64_t* rb = per_row ? row_banned->data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < N * W; ++i)
    TORCH_CHECK(rb[i] >= 0 && rb[i] <= V, "row_banned token id ", rb[i], " outside the vocabulary of ", V,
                " (V itself: none)");
  const int64_t B = N / K;
  at::Tensor scores = at::empty({B, keep}, logits.options());
  at::Tensor indices = at::empty({B, keep}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* r = running.data_ptr<float>();
  float* sp = scores.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  // Samples on the kernel pool; one takes about 0.4 ns per score on one core (810 us for 8 x 4 x 50265 in
  // all), the time of ~80 of the products' multiply-adds.
  fastdecode::parallel_chunks(B, 1, threads, [&](int64_t b0, int64_t b1) {
    std::vector<char> marks;  // a piece's own copy where beams mark their own bans in it
    if (per_row) marks = is_banned;
    for (int64_t b = b0; b < b1; ++b) {
      Best best{sp + b * keep, ip + b * keep, keep};
      sample_candidates(x + b * K * V, r + b * K, per_row ? marks : is_banned, per_row ? rb + b * K * W : nullptr, W,
                        K, V, best);
    }
  }, 80 * K * V);
  return {scores, indices};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("beam_candidates(Tensor logits, Tensor running, Tensor banned, int K, int keep, int threads=1, "
        "Tensor? row_banned=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("beam_candidates", &beam_candidates); }
