// Whisper's logits rules (speech/rules.py's LogitsRules) on a step's rows as ONE op.
//
// The Python rules run a dozen small torch ops a step (the copy, the suppressed tokens, slices set to -inf, two
// row maxima, a logsumexp within reach): some 150 us of a tiny.en greedy step and 600 us of a beam-5 one on one
// core, mostly dispatch and passes over the rows. This op does the same in one call, in the same order:
//   masked = logits; masked[:, always] = -inf; rows with no generated token: masked[row, at_begin] = -inf;
//   with timestamps, per row (its generated count n, whether its last and second-to-last tokens are timestamps,
//   its last timestamp or -1):
//     a closed pair: masked[row, begin:] = -inf; an open timestamp: masked[row, :eot] = -inf;
//     after a timestamp: masked[row, begin:last] = -inf (last: that timestamp, or the next one);
//     no token yet: masked[row, :begin] = -inf and masked[row, begin + max_initial + 1:] = -inf;
//   then, on the masked rows, the rows whose timestamps' total beats the best text token take
//   masked[row, :begin] = -inf, decided as rules.py's _stamps_win: by the bound where it decides, else by
//   at::logsumexp over every row's timestamps (the op torch.logsumexp runs on the same [R, V - begin] view).
// Every value written is a copy or -inf, and each decision is _stamps_win's: the Python rules' bits
// (tests/speech/test_logits_rules.py compares both).
// Arguments: logits, masked [R, V] float32 (masked contiguous, written); always, at_begin [n] int64 token ids;
//   rows: 4 ints per row (n, last is a timestamp, second-to-last is one or n < 2, last timestamp or -1);
//   ints: timestamps (0 / 1), begin, eot, max_initial (the index of the latest first timestamp).
#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void fill(float* row, int64_t from, int64_t to, int64_t V) {  // row[from:to] = -inf, Python's slice clamping
  from = std::clamp<int64_t>(from, 0, V);
  to = std::clamp<int64_t>(to, 0, V);
  if (from < to) std::fill(row + from, row + to, kNegInf);
}

// torch.amax of one row as the rule reads it: its largest value, NaN if the row holds one (8 lanes at a time:
// a max is exact in any order; a zero's sign, which the order may pick, compares equal either way).
float row_max(const float* row, int64_t count) {
  __m256 best8 = _mm256_set1_ps(kNegInf), nan8 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 v = _mm256_loadu_ps(row + i);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best8 = _mm256_max_ps(best8, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best8);
  bool nan = _mm256_movemask_ps(nan8) != 0;
  float best = kNegInf;
  for (int u = 0; u < 8; ++u) best = lanes[u] > best ? lanes[u] : best;
  for (; i < count; ++i) {
    nan = nan || std::isnan(row[i]);
    best = row[i] > best ? row[i] : best;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : best;
}

void whisper_logits_rules(const at::Tensor& logits, const at::Tensor& masked, const at::Tensor& always,
                          const at::Tensor& at_begin, at::IntArrayRef rows, at::IntArrayRef ints) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "whisper_logits_rules: logits must be float32 [R, V] on the CPU");
  TORCH_CHECK(masked.sizes() == logits.sizes() && masked.scalar_type() == at::kFloat && masked.is_contiguous(),
              "whisper_logits_rules: masked must be a contiguous float32 tensor of the logits' shape");
  TORCH_CHECK(always.scalar_type() == at::kLong && always.is_contiguous() && at_begin.scalar_type() == at::kLong &&
                  at_begin.is_contiguous(),
              "whisper_logits_rules: the token lists must be contiguous int64");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == 4 * R, "whisper_logits_rules: 4 ints per row, got ", rows.size(),
              " for ", R, " rows");
  TORCH_CHECK(ints.size() == 4, "whisper_logits_rules: 4 ints (timestamps, begin, eot, max_initial)");
  const bool timestamps = ints[0] != 0;
  const int64_t begin = ints[1], eot = ints[2], max_initial = ints[3];
  TORCH_CHECK(!timestamps || (begin >= 0 && begin < V), "whisper_logits_rules: timestamp_begin ", begin,
              " outside the ", V, " logits");
  const int64_t* suppressed = always.data_ptr<int64_t>();
  const int64_t* first_suppressed = at_begin.data_ptr<int64_t>();
  for (int64_t i = 0; i < always.numel(); ++i)
    TORCH_CHECK(suppressed[i] >= 0 && suppressed[i] < V, "whisper_logits_rules: token ", suppressed[i], " outside V");
  for (int64_t i = 0; i < at_begin.numel(); ++i)
    TORCH_CHECK(first_suppressed[i] >= -V && first_suppressed[i] < V, "whisper_logits_rules: token ",
                first_suppressed[i], " outside V");
  masked.copy_(logits);
  float* data = masked.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    float* row = data + r * V;
    for (int64_t i = 0; i < always.numel(); ++i) row[suppressed[i]] = kNegInf;
    const int64_t n = rows[4 * r], last_was = rows[4 * r + 1], penultimate_was = rows[4 * r + 2];
    const int64_t latest = rows[4 * r + 3];
    if (n == 0)
      for (int64_t i = 0; i < at_begin.numel(); ++i)
        row[first_suppressed[i] < 0 ? first_suppressed[i] + V : first_suppressed[i]] = kNegInf;
    if (!timestamps) continue;
    if (last_was) {
      if (penultimate_was) fill(row, begin, V, V);  // a pair closed: text (or end) comes next
      else fill(row, 0, eot, V);                    // an opening timestamp: another timestamp or the end
    }
    if (latest >= 0) fill(row, begin, last_was && !penultimate_was ? latest : latest + 1, V);
    if (n == 0) {
      fill(row, 0, begin, V);
      fill(row, begin + max_initial + 1, V, V);
    }
  }
  if (!timestamps) return;
  const int64_t T = V - begin;
  const double reach = std::log(static_cast<double>(T)) + 1e-3;
  at::Tensor mass;  // every row's logsumexp of its timestamps, made once a row is within reach
  for (int64_t r = 0; r < R; ++r) {
    float* row = data + r * V;
    const double stamp = row_max(row + begin, T), text = row_max(row, begin);
    bool wins = false;
    if (stamp == -std::numeric_limits<double>::infinity()) {
      wins = false;  // no timestamp allowed
    } else if (stamp > text) {
      wins = true;  // the total is at least its largest term
    } else if (stamp + reach + 1e-4 * std::abs(stamp) >= text) {
      if (!mass.defined()) mass = at::logsumexp(masked.narrow(1, begin, T), {-1}).contiguous();  // [R]
      wins = static_cast<double>(mass.data_ptr<float>()[r]) > text;
    }
    if (wins) fill(row, 0, begin, V);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("whisper_logits_rules(Tensor logits, Tensor(a!) masked, Tensor always, Tensor at_begin, int[] rows, "
        "int[] ints) -> ()");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("whisper_logits_rules", &whisper_logits_rules); }
