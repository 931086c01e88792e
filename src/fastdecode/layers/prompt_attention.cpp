// A prompt's attention (layers/attention.py) split over the kernel pool (parallel.h): PyTorch's CPU flash
// kernel once per (query chunk, batch row, query head), each call on one thread.
//
// Why: SDPA splits its work over OpenMP's threads, whose workers spin after each call. In a prompt's
// forward the pool's helpers run the products between those calls, so a 2-thread prompt had three busy
// threads on two cores: the OpenMP worker took the core of the pool's helper (which then slept, leaving
// the next products to the caller alone) and the helper's spin slowed SDPA's barrier. Measured on a shared
// 2-core Zen 5: a 512-token SmolLM2 prompt took 1.6x the wall time and 1.8x the CPU time on 2 threads as on 1.
// Here the same flash kernel runs per item on the pool's threads, with OpenMP and MKL held to one thread
// inside each call, so a prompt's forward has one set of threads.
//
// Bits: the flash kernel computes each (batch row, head, block of queries) on its own, by operations that
// depend on the query count (its block sizes) and the keys, not on the other rows and heads; the calls here
// keep the caller's chunks (the same query and key counts), so the output is SDPA's over those chunks bit for
// bit (tests/unit/test_prompt_attention.py), whatever the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>

#include "parallel.h"

// OpenMP's and MKL's per-thread thread counts (libgomp and torch's MKL export them; weak: absent, left as is).
// MKL's is its Fortran entry (the count by address): torch exports that one under both names.
extern "C" {
void omp_set_num_threads(int) __attribute__((weak));
int omp_get_max_threads(void) __attribute__((weak));
int mkl_set_num_threads_local_(const int*) __attribute__((weak));
}

namespace {

// ATen's ops on this thread run on it alone while this lives (then the thread's counts as they were): a call on a
// pool helper would otherwise start an OpenMP team of its own.
class OneAtenThread {
 public:
  OneAtenThread() {
    at::get_num_threads();  // (ATen sets a thread's OpenMP count on its first use: done before ours, not after)
    if (omp_get_max_threads != nullptr && omp_set_num_threads != nullptr) {
      omp_ = omp_get_max_threads();
      if (omp_ != 1) omp_set_num_threads(1);
    }
    const int one = 1;
    if (mkl_set_num_threads_local_ != nullptr) mkl_ = mkl_set_num_threads_local_(&one);
  }
  ~OneAtenThread() {
    if (omp_ > 1) omp_set_num_threads(omp_);
    if (mkl_set_num_threads_local_ != nullptr) mkl_set_num_threads_local_(&mkl_);
  }
  OneAtenThread(const OneAtenThread&) = delete;
  OneAtenThread& operator=(const OneAtenThread&) = delete;

 private:
  int omp_ = 1, mkl_ = 0;  // mkl 0: the process's setting
};

// q [B, H, T, D]; k, v [B, Hkv, S, D] (H a multiple of Hkv); mask additive [B, 1 or H, T, S] or none; key_counts:
// the keys of each chunk of `query_chunk` queries (<= S; empty: one chunk of every query over every key).
// -> [B, H, T, D] (a view of a [B, T, H, D] buffer: merging the heads after is a view).
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, at::IntArrayRef key_counts, int64_t query_chunk,
                            double scale, int64_t threads) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kFloat && q.device().is_cpu() &&
                  k.device().is_cpu() && v.device().is_cpu(),
              "q, k, v must be float32 [B, H, T, D] / [B, Hkv, S, D] on the CPU");
  // (SDPA runs its flash kernel only on rows whose last dim is contiguous: it reads them so)
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && (!mask.has_value() || !mask->defined() ||
                                                                           mask->stride(3) == 1),
              "q, k, v and the mask must be contiguous in their last dim");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && Hkv > 0 && H % Hkv == 0,
              "k, v must be [B, Hkv, S, D] with H a multiple of Hkv");
  const bool masked = mask.has_value() && mask->defined();
  if (masked)
    TORCH_CHECK(mask->scalar_type() == at::kFloat && mask->dim() == 4 && mask->size(0) == B && (mask->size(1) == 1 || mask->size(1) == H) &&
                    mask->size(2) == T && mask->size(3) == S,
                "mask must be float32 [B, 1 or H, T, S]");
  const int64_t chunk = key_counts.empty() ? std::max<int64_t>(T, 1) : query_chunk;
  const int64_t chunks = key_counts.empty() ? 1 : static_cast<int64_t>(key_counts.size());
  TORCH_CHECK(chunk > 0 && (chunks - 1) * chunk < std::max<int64_t>(T, 1) && chunks * chunk >= T,
              key_counts.size(), " key counts for ", T, " queries in chunks of ", query_chunk);
  for (int64_t c = 0; c < chunks; ++c)
    TORCH_CHECK(key_counts.empty() || (key_counts[c] > 0 && key_counts[c] <= S), "a chunk's key count ", key_counts[c],
                " is not in 1..", S);
  at::Tensor out = at::empty({B, T, H, D}, q.options());
  const int64_t items = chunks * B * H, G = H / Hkv;
  // The chunks with the most keys first, so that the last pieces claimed are the short ones.
  auto item = [&](int64_t i) {
    const int64_t c = chunks - 1 - i / (B * H), b = i / H % B, h = i % H;
    const int64_t t0 = c * chunk, t1 = std::min(T, t0 + chunk), keys = key_counts.empty() ? S : key_counts[c];
    const at::Tensor qi = q.slice(0, b, b + 1).slice(1, h, h + 1).slice(2, t0, t1);   // [1, 1, t, D]
    const at::Tensor ki = k.slice(0, b, b + 1).slice(1, h / G, h / G + 1).slice(2, 0, keys);  // [1, 1, keys, D]
    const at::Tensor vi = v.slice(0, b, b + 1).slice(1, h / G, h / G + 1).slice(2, 0, keys);
    c10::optional<at::Tensor> mi;
    if (masked) {
      const int64_t mh = mask->size(1) == 1 ? 0 : h;
      mi = mask->slice(0, b, b + 1).slice(1, mh, mh + 1).slice(2, t0, t1).slice(3, 0, keys);  // [1, 1, t, keys]
    }
    const at::Tensor result = std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(qi, ki, vi, 0.0, false, mi, scale));
    out.select(0, b).slice(0, t0, t1).select(1, h).copy_(result.select(0, 0).select(0, 0));  // [t, D]
  };
  const int64_t item_work = std::min(T, chunk) * S * D * 2;  // multiply-adds, about (the longest chunk)
  std::mutex failure_mutex;
  std::exception_ptr failure;  // the first error of any thread's calls, raised on the caller after the job
  fastdecode::parallel_chunks(items, 1, threads, [&](int64_t i0, int64_t i1) {
    try {
      c10::InferenceMode inference;  // (no autograd bookkeeping, on the helpers as on the caller)
      OneAtenThread one;
      for (int64_t i = i0; i < i1; ++i) item(i);
    } catch (...) {  // (an exception must not leave a helper thread: it would end the process)
      std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  }, item_work);
  if (failure) std::rethrow_exception(failure);
  return out.transpose(1, 2);  // [B, T, H, D] -> [B, H, T, D]
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, int[] key_counts, int query_chunk, float scale, "
        "int threads) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("prompt_attention", &prompt_attention); }
