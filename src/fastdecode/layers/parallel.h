// parallel_chunks: split a loop over [0, n) between the calling thread and helper threads that never
// make the caller wait for a thread that has not started.
//
// Why not at::parallel_for (OpenMP): it hands each thread a fixed share and ends on a barrier, so
// on a shared 2-core machine, where the second core is often running something else, the caller
// finishes its half and then waits a scheduler time slice (milliseconds) for the other half: a 40 us
// matvec took milliseconds. Here the range is cut into fixed chunks that the threads claim one at a
// time from one atomic counter: the caller starts at once and claims chunks until none are left,
// helpers join whenever they get a core, and at the end the caller waits only for chunks a helper
// has already claimed (one chunk's work at most each). A helper that never woke up costs nothing.
//
// Results do not depend on the thread count: chunk boundaries depend only on (n, chunk), and every
// chunk runs the same function whichever thread claims it.
//
// Helpers are persistent threads (made on first use, never joined: they sleep when idle). After a
// job a helper spins for SPIN_MICROSECONDS waiting for the next one (a decode step calls the
// kernels every ~50-150 us), then sleeps on a condition variable; a caller that finds helpers asleep
// wakes them and goes on without waiting. One caller at a time owns the helpers: a second caller
// thread (another engine) runs its loop alone rather than wait. A forked child starts without
// helpers and makes its own.
#pragma once

#include <ATen/Parallel.h>
#include <pthread.h>
#include <sched.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace fastdecode {

// The same chunks on this thread, in order.
template <typename F>
inline void run_alone(int64_t n, int64_t chunk, const F& body) {
  for (int64_t begin = 0; begin < n; begin += chunk) body(begin, std::min(n, begin + chunk));
}

class ChunkPool {
 public:
  static constexpr int MAX_HELPERS = 63;
  static constexpr int64_t SPIN_MICROSECONDS = 300;  // helpers, between jobs
  static constexpr int64_t FINAL_SPIN_MICROSECONDS = 20;  // the caller, for chunks helpers hold

  // The process's pool (a new one after fork: the parent's threads do not exist in the child).
  static ChunkPool& instance() {
    static std::once_flag once;
    std::call_once(once, [] { pthread_atfork(nullptr, nullptr, [] { current() = nullptr; }); });
    ChunkPool* pool = current().load(std::memory_order_acquire);
    if (pool == nullptr) {
      ChunkPool* fresh = new ChunkPool();  // never deleted: its threads live until the process ends
      if (current().compare_exchange_strong(pool, fresh)) pool = fresh;
      else delete fresh;  // another thread made one first (no threads started yet: safe to delete)
    }
    return *pool;
  }

  // Runs body(begin, end) over [0, n) in chunks of `chunk` (the last may be shorter) on this thread
  // and up to threads - 1 helpers (one thread per core at most).
  template <typename F>
  void run(int64_t n, int64_t chunk, int threads, const F& body) {
    const int64_t chunks = (n + chunk - 1) / chunk;
    static const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
    const int helpers = static_cast<int>(std::min<int64_t>({threads - 1, chunks - 1, cores - 1, MAX_HELPERS}));
    if (helpers <= 0 || chunks >= (int64_t{1} << 31) || owner_.test_and_set(std::memory_order_acquire)) {  // alone, or the pool is busy
      run_alone(n, chunk, body);
      return;
    }
    try {
      ensure_helpers(helpers);
    } catch (const std::system_error&) {  // no more threads to be had: this call and later ones run alone
      run_alone(n, chunk, body);
      return;  // (the pool stays owned: nobody waits on it)
    }
    // Publish the job: fields first, then the ticket (generation, chunk 0) that makes them visible.
    // (release/acquire on the fields too: a helper that reads a later job's field also sees this
    // job's close below, so its claim fails; free on x86.)
    body_.store(&trampoline<F>, std::memory_order_release);
    context_.store(&body, std::memory_order_release);
    n_.store(n, std::memory_order_release);
    chunk_.store(chunk, std::memory_order_release);
    chunks_.store(chunks, std::memory_order_release);
    done_.store(0, std::memory_order_relaxed);
    active_.store(helpers, std::memory_order_relaxed);
    const uint64_t generation = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    ticket_.store(generation << 32, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {  // wake them; do not wait for them
      { std::lock_guard<std::mutex> lock(mutex_); }
      wake_.notify_all();
    }
    int64_t mine = 0;
    for (;;) {  // the caller claims like any helper (its generation cannot change under it)
      const int64_t index = static_cast<int64_t>(ticket_.fetch_add(1, std::memory_order_acq_rel) & 0xffffffffu);
      if (index >= chunks) break;
      const int64_t begin = index * chunk;
      body(begin, std::min(n, begin + chunk));
      ++mine;
    }
    // Every chunk is claimed; wait for the ones helpers are still computing (at most one each).
    // Spin a little (a chunk is a few microseconds), then sleep: a helper preempted mid-chunk by
    // another process then migrates to this core, instead of waiting out that process's time slice
    // while this thread spins.
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(FINAL_SPIN_MICROSECONDS);
    for (int spins = 0; done_.load(std::memory_order_acquire) + mine < chunks; ++spins) {
      _mm_pause();
      if ((spins & 63) == 63) sched_yield();
      if ((spins & 63) == 63 && std::chrono::steady_clock::now() > until) {
        std::unique_lock<std::mutex> lock(mutex_);
        caller_waiting_.store(true, std::memory_order_seq_cst);
        finished_.wait_for(lock, std::chrono::milliseconds(1),  // (re-checked at least every ms)
                           [&] { return done_.load(std::memory_order_seq_cst) + mine >= chunks; });
        caller_waiting_.store(false, std::memory_order_relaxed);
      }
    }
    // Close the job: a helper that read this generation's ticket but has not claimed yet fails its
    // compare-exchange from now on, so the fields can be reused by the next job.
    ticket_.store(((generation + 1) << 32) | 0xffffffffu, std::memory_order_seq_cst);
    owner_.clear(std::memory_order_release);
  }

 private:
  using Body = void (*)(const void*, int64_t, int64_t);

  template <typename F>
  static void trampoline(const void* context, int64_t begin, int64_t end) {
    (*static_cast<const F*>(context))(begin, end);
  }

  static std::atomic<ChunkPool*>& current() {
    static std::atomic<ChunkPool*> pool{nullptr};
    return pool;
  }

  void ensure_helpers(int helpers) {  // called by the owner only
    while (static_cast<int>(threads_.size()) < helpers) {
      threads_.emplace_back([this, id = static_cast<int>(threads_.size())] { helper_loop(id); });
      threads_.back().detach();
    }
  }

  // Claims one chunk of the ticket's generation, or returns false (job closed, or no chunks left).
  bool claim_and_run(uint64_t generation) {
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if ((ticket >> 32) != generation) return false;
      // Read the job before claiming: if the claim succeeds, the job was still open when read.
      const Body body = body_.load(std::memory_order_acquire);
      const void* context = context_.load(std::memory_order_acquire);
      const int64_t n = n_.load(std::memory_order_acquire), chunk = chunk_.load(std::memory_order_acquire);
      const int64_t chunks = chunks_.load(std::memory_order_acquire);
      const int64_t index = static_cast<int64_t>(ticket & 0xffffffffu);
      if (index >= chunks) return false;
      if (ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        const int64_t begin = index * chunk;
        body(context, begin, std::min(n, begin + chunk));
        done_.fetch_add(1, std::memory_order_seq_cst);
        if (caller_waiting_.load(std::memory_order_seq_cst)) {
          { std::lock_guard<std::mutex> lock(mutex_); }
          finished_.notify_one();
        }
        return true;
      }
    }
  }

  void helper_loop(int id) {
    uint64_t seen = ticket_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      // Wait for a new generation: spin a while, then sleep.
      uint64_t generation = ticket_.load(std::memory_order_acquire) >> 32;
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_MICROSECONDS);
      for (int spins = 0; generation == seen; ++spins) {
        _mm_pause();
        if ((spins & 63) == 63) sched_yield();  // never keep the caller (or anyone) off this core
        if ((spins & 255) == 255 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return (ticket_.load(std::memory_order_seq_cst) >> 32) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_relaxed);
        }
        generation = ticket_.load(std::memory_order_acquire) >> 32;
      }
      seen = generation;
      if (id < active_.load(std::memory_order_relaxed)) {  // a job wanting fewer helpers leaves the rest idle
        while (claim_and_run(generation)) {
        }
      }
    }
  }

  std::atomic_flag owner_ = ATOMIC_FLAG_INIT;
  std::atomic<uint64_t> ticket_{0xffffffffu};  // generation << 32 | next chunk index
  std::atomic<Body> body_{nullptr};
  std::atomic<const void*> context_{nullptr};
  std::atomic<int64_t> n_{0}, chunk_{1}, chunks_{0}, done_{0};
  std::atomic<int> active_{0}, sleepers_{0};
  std::atomic<bool> caller_waiting_{false};
  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  std::vector<std::thread> threads_;
};

// body(begin, end) over [0, n) in chunks of `chunk` outputs, on up to `threads` threads (at most one
// per core; see above).
// threads <= 0: torch's thread count (at::get_num_threads()) when the call runs.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t chunk, int64_t threads, const F& body) {
  if (n <= 0) return;
  if (threads <= 0) threads = at::get_num_threads();
  chunk = std::max<int64_t>(1, chunk);
  if (threads <= 1 || n <= chunk) {
    run_alone(n, chunk, body);
    return;
  }
  ChunkPool::instance().run(n, chunk, static_cast<int>(threads), body);
}

// Outputs per claimed chunk: about CHUNK_WORK multiply-adds (a few microseconds: claiming costs
// ~0.1 us, and the caller's final wait is at most one chunk), a multiple of `multiple` outputs.
constexpr int64_t CHUNK_WORK = 1 << 15;
inline int64_t chunk_outputs(int64_t work_per_output, int64_t multiple) {
  const int64_t outputs = (CHUNK_WORK + work_per_output - 1) / std::max<int64_t>(1, work_per_output);
  return std::max<int64_t>(1, (outputs + multiple - 1) / multiple) * multiple;
}

}  // namespace fastdecode
