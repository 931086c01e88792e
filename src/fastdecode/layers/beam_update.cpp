// One beam search's bookkeeping after its step's candidates, in one op (engine/beam_scores.py's
// ``_update_torch`` is the PyTorch path it replaces, ~35 small tensor ops per sample and step, each a
// dispatch of a few microseconds on [1, 2K] tensors: ~0.3 ms per sample and step, 8 samples x 48 steps of a
// bart-base beam call).
//
// beam_update(top_scores [keep] f32, top_index [keep] i64, eos [E] i64, V, step, max_new, offer_divisor,
//   best_divisor, stop_when_done, running [K] f32 (a!), running_tokens [K, L] i64 (a!), fin_tokens [K, L] i64
//   (a!), fin_length [K] i64 (a!), fin_scores [K] f32 (a!), fin_done [K] bool (a!), improvable [1] bool (a!))
//   -> [2K + 1] int64: the beam each new beam continues [K], the new beams' last tokens [K], whether the
//   search goes on (1 / 0).
// The candidates (best first, index = beam * V + token) and the state are one sample's; the state is
// updated in place. The arithmetic is the PyTorch path's, operation for operation in float32: a candidate
// that ends (an EOS token, or the last step) has NEG added to its running score; the K best that did not
// end continue; the K best that ended (among the first K candidates) are offered to the finished set with
// scores top / offer_divisor (+ NEG where the finished set is full and stop_when_done, + NEG where nothing
// can improve it, + NEG where the candidate did not end: each an add of NEG or -0, in that order); the
// K best of the finished set and the offers stay; the search can still improve while the best running
// score / best_divisor beats the worst finished score. "The K best" is an order by score, higher first,
// NaN first, equal scores in their order of position: what a stable descending torch.sort gives (the
// PyTorch path sorts so, so both pick the same among equal scores).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

constexpr float NEG = -1.0e9f;  // engine/beam_scores.py's NEG

// Positions 0 .. n-1 of score, the `count` best first (higher first, NaN first, ties by position).
std::vector<int64_t> best_positions(const std::vector<float>& score, int64_t count) {
  std::vector<int64_t> order(score.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const float x = score[a], y = score[b];
    if (std::isnan(x) || std::isnan(y)) return std::isnan(x) && !std::isnan(y);
    return x > y;
  });
  order.resize(count);
  return order;
}

void check_state(const at::Tensor& t, int64_t numel, at::ScalarType type, const char* name) {
  TORCH_CHECK(t.numel() == numel && t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu(), name,
              " must be contiguous on the CPU with ", numel, " elements of ", type);
}

at::Tensor beam_update(const at::Tensor& top_scores, const at::Tensor& top_index, const at::Tensor& eos, int64_t V,
                       int64_t step, int64_t max_new, double offer_divisor, double best_divisor, bool stop_when_done,
                       at::Tensor& running, at::Tensor& running_tokens, at::Tensor& fin_tokens, at::Tensor& fin_length,
                       at::Tensor& fin_scores, at::Tensor& fin_done, at::Tensor& improvable) {
  const int64_t K = running.numel(), keep = top_scores.numel();
  TORCH_CHECK(K > 0 && keep >= 2 * K, "keep ", keep, " candidates for ", K, " beams: at least 2K");
  TORCH_CHECK(running_tokens.dim() >= 2 && running_tokens.size(-2) == K, "running_tokens must be [.., K, L]");
  const int64_t L = running_tokens.size(-1);
  TORCH_CHECK(step >= 0 && step < L && V > 0, "step ", step, " outside the ", L, " token columns");
  check_state(top_scores, keep, at::kFloat, "top_scores");
  check_state(top_index, keep, at::kLong, "top_index");
  TORCH_CHECK(eos.dim() == 1 && eos.scalar_type() == at::kLong && eos.is_contiguous(), "eos must be int64 [E]");
  check_state(running, K, at::kFloat, "running");
  check_state(running_tokens, K * L, at::kLong, "running_tokens");
  check_state(fin_tokens, K * L, at::kLong, "fin_tokens");
  check_state(fin_length, K, at::kLong, "fin_length");
  check_state(fin_scores, K, at::kFloat, "fin_scores");
  check_state(fin_done, K, at::kBool, "fin_done");
  check_state(improvable, 1, at::kBool, "improvable");
  const float* top = top_scores.data_ptr<float>();
  const int64_t* index = top_index.data_ptr<int64_t>();
  const int64_t* eos_ids = eos.data_ptr<int64_t>();
  float* run = running.data_ptr<float>();
  int64_t* run_tokens = running_tokens.data_ptr<int64_t>();
  int64_t* done_tokens = fin_tokens.data_ptr<int64_t>();
  int64_t* done_length = fin_length.data_ptr<int64_t>();
  float* done_scores = fin_scores.data_ptr<float>();
  bool* done = fin_done.data_ptr<bool>();
  bool* can_improve = improvable.data_ptr<bool>();

  // The candidates: their beam and token, their tokens so far, whether they end.
  std::vector<int64_t> beam(keep), token(keep), cand_tokens(keep * L);
  std::vector<char> hits(keep);
  bool all_hit = true;
  for (int64_t i = 0; i < keep; ++i) {
    TORCH_CHECK(index[i] >= 0 && index[i] < K * V, "candidate index ", index[i], " outside ", K, " x ", V);
    beam[i] = index[i] / V;
    token[i] = index[i] % V;
    std::copy_n(run_tokens + beam[i] * L, L, cand_tokens.data() + i * L);
    cand_tokens[i * L + step] = token[i];
    hits[i] = step + 1 >= max_new || std::find(eos_ids, eos_ids + eos.numel(), token[i]) != eos_ids + eos.numel();
    all_hit = all_hit && hits[i];
  }

  // The best K candidates that did not end continue.
  std::vector<float> run_lp(keep);
  for (int64_t i = 0; i < keep; ++i) run_lp[i] = top[i] + (hits[i] ? NEG : -0.0f);
  const std::vector<int64_t> kept = best_positions(run_lp, K);
  at::Tensor out = at::empty({2 * K + 1}, top_index.options());
  int64_t* answer = out.data_ptr<int64_t>();
  for (int64_t k = 0; k < K; ++k) {
    const int64_t i = kept[k];
    run[k] = run_lp[i];
    std::copy_n(cand_tokens.data() + i * L, L, run_tokens + k * L);
    answer[k] = beam[i];
    answer[K + k] = token[i];
  }

  // The best K candidates that ended are offered to the finished set.
  const bool was_all_done = std::all_of(done, done + K, [](bool d) { return d; });
  const float full = was_all_done && stop_when_done ? NEG : -0.0f, settled = *can_improve ? -0.0f : NEG;
  const float divisor = static_cast<float>(offer_divisor);
  std::vector<float> merged(done_scores, done_scores + K);
  std::vector<char> just(keep);
  for (int64_t i = 0; i < keep; ++i) {
    just[i] = hits[i] && i < K;
    float offered = top[i] / divisor;
    offered = offered + full;
    offered = offered + settled;
    offered = offered + (just[i] ? -0.0f : NEG);
    merged.push_back(offered);
  }
  const std::vector<int64_t> best = best_positions(merged, K);
  std::vector<int64_t> old_tokens(done_tokens, done_tokens + K * L), old_length(done_length, done_length + K);
  std::vector<char> old_done(done, done + K);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t j = best[k];  // < K: a slot of the finished set, else candidate j - K
    done_scores[k] = merged[j];
    std::copy_n(j < K ? old_tokens.data() + j * L : cand_tokens.data() + (j - K) * L, L, done_tokens + k * L);
    done_length[k] = j < K ? old_length[j] : step + 1;
    done[k] = j < K ? old_done[j] : just[j - K];
  }

  // Whether a running beam can still beat the worst finished one; whether the search goes on.
  const float best_running = run[0] / static_cast<float>(best_divisor);
  float lowest = done_scores[0];  // torch.min: NaN wins
  for (int64_t k = 1; k < K && !std::isnan(lowest); ++k)
    lowest = std::isnan(done_scores[k]) ? done_scores[k] : std::min(lowest, done_scores[k]);
  bool beats = false;
  for (int64_t k = 0; k < K; ++k) beats = beats || best_running > (done[k] ? lowest : NEG);
  *can_improve = *can_improve && beats;
  const bool all_done = std::all_of(done, done + K, [](bool d) { return d; });
  answer[2 * K] = *can_improve && !(all_done && stop_when_done) && !all_hit;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("beam_update(Tensor top_scores, Tensor top_index, Tensor eos, int V, int step, int max_new, "
        "float offer_divisor, float best_divisor, bool stop_when_done, Tensor(a!) running, Tensor(b!) running_tokens, "
        "Tensor(c!) fin_tokens, Tensor(d!) fin_length, Tensor(e!) fin_scores, Tensor(f!) fin_done, "
        "Tensor(g!) improvable) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("beam_update", &beam_update); }
