// Decode attention over the slot cache's block pool (AVX2 + FMA; elsewhere the PyTorch path).
//
// One op per layer for rows with one query each (engine/plan.py, engine/decode_step.py):
//   1. write this step's k, v [B, Hkv, D] into their slots of the layer's buffers [slots, Hkv, D]
//      (optional: a caller that wrote them already passes no slots);
//   2. for each row b and query head h (KV head h / (H / Hkv): GQA / MQA share a KV head), attend
//      over the keys at positions lo .. p of the row (p its query position, lo = key_start[b], or
//      p - window + 1 on a sliding layer when that is later): key at position t is slot
//      table[b, i / block] * block + i % block with i = t - key_start[b], read in place (no gather).
//      score = (q . k) * scale (+ bias[b, h or 0, i]: ALiBi, T5's relative buckets), softmax in
//      float32 over the visible keys (two passes over the scores: max, then exp and sum), then
//      out = sum softmax * v.
// Keys outside lo .. p are never read, so a table covering more blocks than a row has written (the
// compiled step's fixed-width tables) costs nothing. Each (row, KV head) is computed by the same
// operations in the same order whatever the number of rows: batched == alone, bitwise.

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

// out[g] = q[g] . k for g < G (G <= 4), q[g] at q + g * q_stride, D floats each.
inline void dots(const float* q, int64_t q_stride, int64_t G, const float* k, int64_t D, float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 kv = _mm256_loadu_ps(k + d);
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * q_stride + d), kv, acc[g]);
  }
  for (int64_t g = 0; g < G; ++g) {
    float s = hsum(acc[g]);
    for (int64_t e = d; e < D; ++e) s += q[g * q_stride + e] * k[e];
    out[g] = s;
  }
}

struct Rows {
  const float* q;  // [B, H, D] with strides q_b, q_h (D contiguous)
  int64_t q_b, q_h;
  const float* keys;  // [slots, Hkv, D] contiguous
  const float* values;
  const int64_t* table;  // [B, n]
  int64_t n;
  const int64_t* key_start;  // [B]
  const int64_t* positions;  // [B]
  const float* bias;  // [B, Hb, S] with strides bias_b, bias_h (S contiguous), or null
  int64_t bias_b, bias_h;
  int64_t H, Hkv, D, block, window;
  float scale;
  float* out;  // [B, H, D] contiguous
};

// Calls run(j, slot, count) for the visible keys lo .. lo + L - 1 of a row in runs of consecutive
// slots (a run never crosses a block): key j of the run is slot + (j - its first j).
template <typename Run>
inline void for_each_run(const int64_t* table, int64_t block, int64_t start, int64_t lo, int64_t L, Run run) {
  for (int64_t j = 0; j < L;) {
    const int64_t i = lo + j - start, offset = i % block;
    const int64_t count = std::min(block - offset, L - j);
    run(j, table[i / block] * block + offset, count);
    j += count;
  }
}

// Keys ahead of the ones being scored that are fetched into cache meanwhile (and the values of the keys being
// scored, summed after the softmax): a row's keys lie in its blocks, a KV head's 256 B of each 768 B slot row
// (SmolLM2's), and at batch 1 they are cold (a step streams ~100 MB of weights between two reads of a layer's
// cache). Measured on Zen 5, 1 thread, 200 keys of 3 KV heads after 3.5 MB of other reads: ~5% off the op
// (64 and 128 keys ahead: the same); the bytes themselves, at the core's read bandwidth, are most of the rest.
constexpr int64_t PREFETCH_KEYS = 32;

// Fetches the D floats of key j of the row (each cache line of them) into cache.
inline void prefetch_key(const float* cache, const int64_t* table, int64_t block, int64_t first, int64_t j,
                         int64_t row_stride, int64_t D) {
  const int64_t i = first + j;
  const char* row = reinterpret_cast<const char*>(cache + (table[i / block] * block + i % block) * row_stride);
  for (int64_t byte = 0; byte < D * 4; byte += 64) _mm_prefetch(row + byte, _MM_HINT_T0);
  _mm_prefetch(row + D * 4 - 1, _MM_HINT_T0);  // (a row not starting on a line ends on one more)
}

// acc[g] += p[g * Lp + t] v_t for the `count` values of a run (v_t at v0 + t * row_stride) and a tile of TILE
// heads (compile time, so that the 2 x TILE partial sums of 16 dims stay in registers): each sum adds the
// run's values in order t = 0 .. count - 1.
template <int TILE>
inline void add_values(const float* v0, int64_t row_stride, int64_t count, const float* p, int64_t Lp, float* acc,
                       int64_t D) {
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    __m256 a0[TILE], a1[TILE];
    for (int g = 0; g < TILE; ++g) {
      a0[g] = _mm256_loadu_ps(acc + g * D + d);
      a1[g] = _mm256_loadu_ps(acc + g * D + d + 8);
    }
    for (int64_t t = 0; t < count; ++t) {
      const float* v = v0 + t * row_stride + d;
      const __m256 x0 = _mm256_loadu_ps(v), x1 = _mm256_loadu_ps(v + 8);
      for (int g = 0; g < TILE; ++g) {
        const __m256 w = _mm256_broadcast_ss(p + g * Lp + t);
        a0[g] = _mm256_fmadd_ps(w, x0, a0[g]);
        a1[g] = _mm256_fmadd_ps(w, x1, a1[g]);
      }
    }
    for (int g = 0; g < TILE; ++g) {
      _mm256_storeu_ps(acc + g * D + d, a0[g]);
      _mm256_storeu_ps(acc + g * D + d + 8, a1[g]);
    }
  }
  for (; d < D; ++d)  // head dims not a multiple of 16 (tiny test models)
    for (int g = 0; g < TILE; ++g)
      for (int64_t t = 0; t < count; ++t) acc[g * D + d] += p[g * Lp + t] * v0[t * row_stride + d];
}

// One row's query heads of one KV head: G = H / Hkv heads, scores in `scores` [G, Lp], value
// sums in `sums` [G, D], 1 / softmax sums in `inverse` [G].
void attend_one(const Rows& r, int64_t b, int64_t kv, std::vector<float>& scores, std::vector<float>& sums,
                std::vector<float>& inverse) {
  const int64_t G = r.H / r.Hkv, D = r.D, pos = r.positions[b], start = r.key_start[b];
  const int64_t lo = r.window > 0 ? std::max(start, pos - r.window + 1) : start;
  const int64_t L = pos - lo + 1, Lp = (L + 7) / 8 * 8;
  scores.assign(G * Lp, -INFINITY);
  sums.assign(G * D, 0.0f);
  inverse.resize(G);
  const int64_t* table = r.table + b * r.n;
  const int64_t row_stride = r.Hkv * D;  // floats from one slot to the next
  const float* q = r.q + b * r.q_b + kv * G * r.q_h;
  const float *keys = r.keys + kv * D, *values = r.values + kv * D;
  // Key j's slot row is table[(first + j) / block] (its block) * block + (first + j) % block.
  const int64_t first = lo - start;
  for (int64_t j = 0; j < std::min(L, PREFETCH_KEYS); ++j) prefetch_key(keys, table, r.block, first, j, row_stride, D);
  // Keys j .. j + count - 1 being scored: fetch the keys PREFETCH_KEYS ahead and these keys' values (summed
  // after the softmax, from cache).
  const auto fetch_ahead = [&](int64_t j, int64_t count) {
    for (int64_t u = j + PREFETCH_KEYS; u < std::min(L, j + PREFETCH_KEYS + count); ++u)
      prefetch_key(keys, table, r.block, first, u, row_stride, D);
    for (int64_t u = j; u < j + count; ++u) prefetch_key(values, table, r.block, first, u, row_stride, D);
  };
  // Scores, 8 consecutive keys of a run at a time (head dims a multiple of 8) for one head: 8 sums
  // in registers, added across lanes together (eight_sums); other keys one at a time for the G heads.
  for_each_run(table, r.block, start, lo, L, [&](int64_t j0, int64_t slot, int64_t count) {
    const float* k0 = keys + slot * row_stride;
    const int64_t eights = D % 8 == 0 ? count / 8 * 8 : 0;
    for (int64_t t = 0; t < eights; t += 8) {
      fetch_ahead(j0 + t, 8);
      const float* k = k0 + t * row_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * r.q_h;
        __m256 acc[8];
        for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qg + d);
          for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + u * row_stride + d), acc[u]);
        }
        __m256 x = _mm256_mul_ps(eight_sums(acc), _mm256_set1_ps(r.scale));
        if (r.bias)
          x = _mm256_add_ps(x, _mm256_loadu_ps(r.bias + b * r.bias_b + (r.bias_h ? kv * G + g : 0) * r.bias_h +
                                                 (lo + j0 + t - start)));
        _mm256_storeu_ps(scores.data() + g * Lp + j0 + t, x);
      }
    }
    float dot[4];
    for (int64_t t = eights; t < count; ++t) {
      const int64_t j = j0 + t;
      fetch_ahead(j, 1);
      const float* k = k0 + t * row_stride;
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t tile = std::min<int64_t>(4, G - g0);
        dots(q + g0 * r.q_h, r.q_h, tile, k, D, dot);
        for (int64_t g = 0; g < tile; ++g) {
          float s = dot[g] * r.scale;
          if (r.bias) s += r.bias[b * r.bias_b + (r.bias_h ? kv * G + g0 + g : 0) * r.bias_h + (lo + j - start)];
          scores[(g0 + g) * Lp + j] = s;
        }
      }
    }
  });
  // Softmax numerators in place (padding past L: exp(-inf) = 0) and each head's 1 / sum.
  for (int64_t g = 0; g < G; ++g) inverse[g] = softmax_numerators(scores.data() + g * Lp, L, Lp);
  // Values: sums[h] += p[h, j] v_j, run by run (a run's values stay in cache while its 16-dim
  // slices are summed in registers, 4 heads at a time); each sum adds its keys in order j = 0..L-1.
  for_each_run(table, r.block, start, lo, L, [&](int64_t j0, int64_t slot, int64_t count) {
    const float* v0 = values + slot * row_stride;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const float* p = scores.data() + g0 * Lp + j0;
      float* acc = sums.data() + g0 * D;
      switch (std::min<int64_t>(4, G - g0)) {
        case 1: add_values<1>(v0, row_stride, count, p, Lp, acc, D); break;
        case 2: add_values<2>(v0, row_stride, count, p, Lp, acc, D); break;
        case 3: add_values<3>(v0, row_stride, count, p, Lp, acc, D); break;
        default: add_values<4>(v0, row_stride, count, p, Lp, acc, D); break;
      }
    }
  });
  float* out = r.out + (b * r.H + kv * G) * D;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = sums[g * D + d] * inverse[g];
}

// q [B, H, D]; keys, values [slots, Hkv, D] (written at write_slots [B] with k_new, v_new [B, Hkv, D]
// when given); table [B, n] block ids; key_start, positions [B]; bias [B, 1 or H, S] or None
// -> out [B, H, D] float32.
at::Tensor paged_attention(const at::Tensor& q, at::Tensor keys, at::Tensor values,
                           const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new,
                           const c10::optional<at::Tensor>& write_slots, const at::Tensor& table,
                           const at::Tensor& key_start, const at::Tensor& positions, int64_t block, int64_t window,
                           double scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1, "q must be float32 [B, H, D]");
  TORCH_CHECK(keys.dim() == 3 && keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes() &&
                  keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "keys and values must be contiguous float32 [slots, Hkv, D]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), slots = keys.size(0), Hkv = keys.size(1);
  TORCH_CHECK(keys.size(2) == D && H % Hkv == 0, "q heads/dims do not fit the cache's [", Hkv, ", ", keys.size(2), "]");
  TORCH_CHECK(block > 0 && slots % block == 0, "bad block size ", block);
  TORCH_CHECK(table.dim() == 2 && table.size(0) == B && table.scalar_type() == at::kLong && table.is_contiguous(),
              "table must be contiguous int64 [B, n]");
  TORCH_CHECK(key_start.numel() == B && positions.numel() == B && key_start.scalar_type() == at::kLong &&
                  positions.scalar_type() == at::kLong && key_start.is_contiguous() && positions.is_contiguous(),
              "key_start and positions must be contiguous int64 [B]");
  const int64_t n = table.size(1), num_blocks = slots / block;
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t* starts = key_start.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  // Every block a row will read must exist: checked here, once, so the kernel indexes freely.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t lo = window > 0 ? std::max(starts[b], pos[b] - window + 1) : starts[b];
    TORCH_CHECK(starts[b] >= 0 && lo <= pos[b] && pos[b] - starts[b] < n * block,
                "row ", b, ": position ", pos[b], " outside its table (first key ", starts[b], ", ", n, " blocks)");
    for (int64_t i = (lo - starts[b]) / block; i <= (pos[b] - starts[b]) / block; ++i)
      TORCH_CHECK(tab[b * n + i] >= 0 && tab[b * n + i] < num_blocks, "row ", b, ": block id ", tab[b * n + i],
                  " outside the pool of ", num_blocks);
  }
  if (write_slots.has_value()) {
    TORCH_CHECK(k_new.has_value() && v_new.has_value(), "writing needs k_new and v_new");
    const at::Tensor& ks = *k_new;
    const at::Tensor& vs = *v_new;
    const at::Tensor& ws = *write_slots;
    TORCH_CHECK(ks.dim() == 3 && ks.size(0) == B && ks.size(1) == Hkv && ks.size(2) == D && vs.sizes() == ks.sizes() &&
                    ks.scalar_type() == at::kFloat && vs.scalar_type() == at::kFloat && ks.stride(2) == 1 && vs.stride(2) == 1,
                "k_new, v_new must be float32 [B, Hkv, D]");
    TORCH_CHECK(ws.numel() == B && ws.scalar_type() == at::kLong && ws.is_contiguous(), "write_slots must be int64 [B]");
    const int64_t* w = ws.data_ptr<int64_t>();
    float* kd = keys.data_ptr<float>();
    float* vd = values.data_ptr<float>();
    const float* kn = ks.data_ptr<float>();
    const float* vn = vs.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(w[b] >= 0 && w[b] < slots, "write slot ", w[b], " outside the pool of ", slots);
      for (int64_t h = 0; h < Hkv; ++h) {
        std::copy_n(kn + b * ks.stride(0) + h * ks.stride(1), D, kd + (w[b] * Hkv + h) * D);
        std::copy_n(vn + b * vs.stride(0) + h * vs.stride(1), D, vd + (w[b] * Hkv + h) * D);
      }
    }
  }
  Rows r{q.data_ptr<float>(), q.stride(0), q.stride(1), keys.data_ptr<float>(), values.data_ptr<float>(), tab, n,
         starts, pos, nullptr, 0, 0, H, Hkv, D, block, window, static_cast<float>(scale), nullptr};
  if (bias.has_value()) {
    const at::Tensor& bt = *bias;
    TORCH_CHECK(bt.dim() == 3 && bt.size(0) == B && (bt.size(1) == 1 || bt.size(1) == H) && bt.size(2) >= n * block &&
                    bt.scalar_type() == at::kFloat && bt.stride(2) == 1,
                "bias must be float32 [B, 1 or H, S >= n * block]");
    r.bias = bt.data_ptr<float>();
    r.bias_b = bt.stride(0);
    r.bias_h = bt.size(1) == 1 ? 0 : bt.stride(1);
  }
  at::Tensor out = at::empty({B, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  r.out = out.data_ptr<float>();
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, pos[b] - starts[b] + 1);
  // (KV head, row) items over the kernel thread pool (parallel.h: no barrier waiting for a busy core),
  // on torch's thread count (attention.py's threads_for: one thread for small steps). KV head major:
  // a thread takes one head's rows in a row, so the rows of a sequence verifying a draft (consecutive
  // rows over the same blocks, engine/layout.py) read that head's keys and values from its cache
  // instead of memory again (a verify row then costs its arithmetic, not another pass over the context).
  fastdecode::parallel_chunks(B * Hkv, fastdecode::chunk_outputs(2 * (H / Hkv) * longest * D, 1), 0,
                              [&](int64_t first, int64_t last) {
    std::vector<float> scores, sums, inverse;
    for (int64_t item = first; item < last; ++item) attend_one(r, item % B, item / B, scores, sums, inverse);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("paged_attention(Tensor q, Tensor(a!) keys, Tensor(b!) values, Tensor? k_new, Tensor? v_new, "
        "Tensor? write_slots, Tensor table, Tensor key_start, Tensor positions, int block, int window, float scale, "
        "Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("paged_attention", &paged_attention); }
