// parallel_chunks: split a loop over [0, n) between the calling thread and helper threads that never
// make the caller wait for a thread that has not started.
//
// Why not at::parallel_for (OpenMP): it hands each thread a fixed share and ends on a barrier, so
// on a shared 2-core machine, where the second core is often running something else, the caller
// finishes its half and then waits a scheduler time slice (milliseconds) for the other half: a 40 us
// matvec took milliseconds. Here the range is cut into pieces that the threads claim from one atomic
// counter: the caller starts at once and claims until nothing is left, helpers join whenever they get
// a core, and at the end the caller waits only for pieces a helper has already claimed. A helper that
// never woke up costs nothing.
//
// Pieces shrink as the range runs out (guided scheduling: each claim takes 1/(2 x threads) of what is
// left, from one `chunk` to MAX_PIECE_CHUNKS): a claim moves a cache line between cores (~0.5 us
// measured here, as much as a small chunk's work), so big first pieces keep claims few, small last
// ones keep the caller's final wait short, and the cap bounds what a helper preempted mid-piece by
// another process holds up. A short job (a batch-1 decode step's product: under LONG_JOB_WORK multiply-adds,
// some 20-40 chunks, tens of microseconds) claims 1/threads of what is left instead: half the claims, and
// the embedded model's batch-1 decoding ran 1.06x faster on 2 threads (2-core AMD Zen 5; a prompt's long jobs
// kept 1/(2 x threads): 1/threads made them 3-7% slower there). Piece boundaries are multiples of `chunk`
// (or n) and depend on timing, so `body` must compute every output the same whatever range it is part of
// (the kernels do: each output is its own dot product); results then do not depend on the thread count.
//
// Helpers are persistent threads (made on first use, never joined). A helper spins between jobs (a
// decode step calls the kernels every ~20-100 us, and step to step within SPIN_MICROSECONDS) and is
// then counted in `spinning_` and writes a heartbeat every few microseconds; callers hand out work only
// while one spins and its heartbeat is fresh (a helper that lost its core to the caller or another
// process would take pieces only when it gets a core back, maybe in the middle of a job). It sleeps
// when no job came for SPIN_MICROSECONDS, or as soon as it finds it was kept off its core for
// PREEMPTED_MICROSECONDS:
// another process wants that core, and a spinning helper would only take turns with it (or with the
// caller, when both share one core). A caller that finds no helper spinning wakes the helpers, at most
// once per WAKE_INTERVAL_MICROSECONDS, and runs a short job (< LONG_JOB_CHUNKS) alone: they join later
// jobs once they have a core. A long job is published all the same, so helpers woken now (or by an
// earlier call) join it midway: a job longer than SPIN_MICROSECONDS (a prompt's products) would
// otherwise always run alone, its helpers woken by each call and asleep again before the next.
// One caller at a time owns the helpers: a second caller thread (another engine) runs its loop alone
// rather than wait. A forked child starts without helpers and makes its own.
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

// The whole range on this thread, as one piece.
template <typename F>
inline void run_alone(int64_t n, const F& body) {
  body(int64_t{0}, n);
}

class ChunkPool {
 public:
  static constexpr int MAX_HELPERS = 63;
  static constexpr int64_t SPIN_MICROSECONDS = 5000;        // helpers, after their last job
  static constexpr int64_t PREEMPTED_MICROSECONDS = 200;     // a helper off its core this long sleeps
  static constexpr int64_t HEARTBEAT_MICROSECONDS = 50;      // a spinning helper not seen this long is off its core
  static constexpr int64_t WAKE_INTERVAL_MICROSECONDS = 2000;  // callers wake sleeping helpers at most this often
  static constexpr int64_t FINAL_SPIN_MICROSECONDS = 20;     // the caller, for pieces helpers hold
  static constexpr int64_t MAX_PIECE_CHUNKS = 16;  // what a helper preempted mid-piece can make the caller wait for
  // Jobs of at least this many chunks (of >= CHUNK_WORK multiply-adds: tens of microseconds and more), or
  // of LONG_JOB_WORK multiply-adds when the caller says how much a chunk is (a product of thousands of rows:
  // few chunks, each long), are handed out even when no helper spins: a helper's wake-up is short beside them.
  static constexpr int64_t LONG_JOB_CHUNKS = 64;
  static constexpr int64_t LONG_JOB_WORK = int64_t{1} << 24;  // ~50-100 us on one core

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

  // Runs body(begin, end) over [0, n) in pieces of whole `chunk`s (the last may be shorter) on this
  // thread and up to threads - 1 helpers (one thread per core at most); chunk_work: multiply-adds per
  // chunk, 0 where unknown.
  template <typename F>
  void run(int64_t n, int64_t chunk, int threads, const F& body, int64_t chunk_work = 0) {
    const int64_t chunks = (n + chunk - 1) / chunk;
    static const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
    const int helpers = static_cast<int>(std::min<int64_t>({threads - 1, chunks - 1, cores - 1, MAX_HELPERS}));
    if (helpers <= 0 || chunks >= (int64_t{1} << 31) || owner_.test_and_set(std::memory_order_acquire)) {  // alone, or the pool is busy
      run_alone(n, body);
      return;
    }
    try {
      ensure_helpers(helpers);
    } catch (const std::system_error&) {  // no more threads to be had: this call and later ones run alone
      run_alone(n, body);
      return;  // (the pool stays owned: nobody waits on it)
    }
    if (spinning_.load(std::memory_order_seq_cst) == 0 ||
        now_microseconds() - heartbeat_.load(std::memory_order_relaxed) > HEARTBEAT_MICROSECONDS) {  // no helper has a core now
      wake_helpers();
      if (chunks < LONG_JOB_CHUNKS && chunks * chunk_work < LONG_JOB_WORK) {
        run_alone(n, body);
        owner_.clear(std::memory_order_release);
        return;
      }
    }
    // Publish the job: fields first, then the ticket (generation, chunk 0) that makes them visible.
    // (release/acquire on the fields too: a helper that reads a later job's field also sees this
    // job's close below, so its claim fails; free on x86.)
    body_.store(&trampoline<F>, std::memory_order_release);
    context_.store(&body, std::memory_order_release);
    n_.store(n, std::memory_order_release);
    chunk_.store(chunk, std::memory_order_release);
    chunks_.store(chunks, std::memory_order_release);
    const bool short_job = chunk_work > 0 && chunks * chunk_work < LONG_JOB_WORK;
    const int64_t divisor = short_job ? helpers + 1 : 2 * (helpers + 1);  // see piece()
    divisor_.store(divisor, std::memory_order_release);
    done_.store(0, std::memory_order_relaxed);
    active_.store(helpers, std::memory_order_relaxed);
    const uint64_t generation = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    ticket_.store(generation << 32, std::memory_order_seq_cst);
    int64_t mine = 0;  // chunks this thread ran
    for (uint64_t ticket = generation << 32;;) {  // the caller claims like any helper (its generation cannot change under it)
      const int64_t first = static_cast<int64_t>(ticket & 0xffffffffu);
      if (first >= chunks) break;
      const int64_t count = piece(chunks - first, divisor);
      if (!ticket_.compare_exchange_weak(ticket, ticket + count, std::memory_order_acq_rel, std::memory_order_relaxed)) continue;
      body(first * chunk, std::min(n, (first + count) * chunk));
      mine += count;
      ticket += count;  // (a guess: a failed exchange above reloads it)
    }
    // Every chunk is claimed; wait for the pieces helpers are still computing (one each at most).
    // Spin a little, then sleep: a helper preempted mid-piece by another process then migrates to
    // this core, instead of waiting out that process's time slice while this thread spins.
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

  static int64_t now_microseconds() {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  // Chunks in the next claim when `left` are unclaimed: guided, 1/divisor of them, 1 to MAX_PIECE_CHUNKS.
  static int64_t piece(int64_t left, int64_t divisor) {
    return std::clamp<int64_t>(left / divisor, 1, MAX_PIECE_CHUNKS);
  }

  void ensure_helpers(int helpers) {  // called by the owner only
    while (static_cast<int>(threads_.size()) < helpers) {
      threads_.emplace_back([this, id = static_cast<int>(threads_.size())] { helper_loop(id); });
      threads_.back().detach();
    }
  }

  // Called by the owner when no helper spins: wakes the sleeping ones, at most once per
  // WAKE_INTERVAL_MICROSECONDS (a helper that slept because its core was taken is not woken for
  // every product: a wake-up costs the caller a system call, and the woken helper may take its core).
  void wake_helpers() {
    const int64_t now = now_microseconds();
    if (now - last_wake_ < WAKE_INTERVAL_MICROSECONDS) return;
    last_wake_ = now;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_requests_.fetch_add(1, std::memory_order_seq_cst);
    }
    wake_.notify_all();
  }

  // Runs pieces of the ticket's generation until none are left or the job is closed; returns the
  // chunks it ran.
  int64_t claim_and_run(uint64_t generation) {
    int64_t ran = 0;
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if ((ticket >> 32) != generation) return ran;
      // Read the job before claiming: if the claim succeeds, the job was still open when read.
      const Body body = body_.load(std::memory_order_acquire);
      const void* context = context_.load(std::memory_order_acquire);
      const int64_t n = n_.load(std::memory_order_acquire), chunk = chunk_.load(std::memory_order_acquire);
      const int64_t chunks = chunks_.load(std::memory_order_acquire), divisor = divisor_.load(std::memory_order_acquire);
      const int64_t first = static_cast<int64_t>(ticket & 0xffffffffu);
      if (first >= chunks) return ran;
      const int64_t count = piece(chunks - first, divisor);
      if (ticket_.compare_exchange_weak(ticket, ticket + count, std::memory_order_acq_rel, std::memory_order_acquire)) {
        body(context, first * chunk, std::min(n, (first + count) * chunk));
        ran += count;
        ticket += count;  // (a guess: a failed exchange reloads it)
      }
    }
  }

  // Spins for jobs while they keep coming and this core is its own, else sleeps (see the top).
  void helper_loop(int id) {
    uint64_t seen = ticket_.load(std::memory_order_acquire) >> 32;
    spinning_.fetch_add(1, std::memory_order_seq_cst);
    for (;;) {
      uint64_t generation = ticket_.load(std::memory_order_acquire) >> 32;
      int64_t idle_since = now_microseconds(), checked = idle_since;
      heartbeat_.store(idle_since, std::memory_order_relaxed);
      for (int spins = 0; generation == seen; ++spins) {
        _mm_pause();
        if ((spins & 63) == 63) {
          sched_yield();  // never keep the caller (or anyone) off this core
          const int64_t now = now_microseconds();
          if (now - checked > PREEMPTED_MICROSECONDS || now - idle_since > SPIN_MICROSECONDS) {
            std::unique_lock<std::mutex> lock(mutex_);
            spinning_.fetch_sub(1, std::memory_order_seq_cst);
            const uint64_t requests = wake_requests_.load(std::memory_order_seq_cst);
            wake_.wait(lock, [&] { return wake_requests_.load(std::memory_order_seq_cst) != requests; });
            spinning_.fetch_add(1, std::memory_order_seq_cst);
            idle_since = now_microseconds();
          }
          checked = now_microseconds();
          heartbeat_.store(checked, std::memory_order_relaxed);
        }
        generation = ticket_.load(std::memory_order_acquire) >> 32;
      }
      seen = generation;
      if (id >= active_.load(std::memory_order_relaxed)) continue;  // a job wanting fewer helpers leaves the rest idle
      const int64_t ran = claim_and_run(generation);
      if (ran == 0) continue;
      done_.fetch_add(ran, std::memory_order_seq_cst);  // once per job: the caller waits for this
      if (caller_waiting_.load(std::memory_order_seq_cst)) {
        { std::lock_guard<std::mutex> lock(mutex_); }
        finished_.notify_one();
      }
    }
  }

  std::atomic_flag owner_ = ATOMIC_FLAG_INIT;
  // The claim counter, the finished counter and the job fields on separate cache lines: a claim does
  // not take the line helpers read the job from, nor a finished piece the one claims come from.
  alignas(64) std::atomic<uint64_t> ticket_{0xffffffffu};  // generation << 32 | next chunk index
  alignas(64) std::atomic<int64_t> done_{0};
  std::atomic<bool> caller_waiting_{false};
  alignas(64) std::atomic<Body> body_{nullptr};
  std::atomic<const void*> context_{nullptr};
  std::atomic<int64_t> n_{0}, chunk_{1}, chunks_{0}, divisor_{2};
  std::atomic<int> active_{0};
  alignas(64) std::atomic<int> spinning_{0};
  std::atomic<int64_t> heartbeat_{0};  // when a spinning helper last showed it had a core (microseconds)
  std::atomic<uint64_t> wake_requests_{0};
  int64_t last_wake_ = 0;  // the owner's
  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  std::vector<std::thread> threads_;
};

// body(begin, end) over [0, n) in pieces of whole `chunk`s, on up to `threads` threads (at most one
// per core; see above). body must compute each output the same whatever range it is given.
// threads <= 0: torch's thread count (at::get_num_threads()) when the call runs. chunk_work: the
// multiply-adds of one chunk where they are many (a long job is handed out even when no helper spins).
template <typename F>
inline void parallel_chunks(int64_t n, int64_t chunk, int64_t threads, const F& body, int64_t chunk_work = 0) {
  if (n <= 0) return;
  if (threads <= 0) threads = at::get_num_threads();
  chunk = std::max<int64_t>(1, chunk);
  if (threads <= 1 || n <= chunk) {
    run_alone(n, body);
    return;
  }
  ChunkPool::instance().run(n, chunk, static_cast<int>(threads), body, chunk_work);
}

// Outputs per chunk (the smallest piece): about CHUNK_WORK multiply-adds (a few microseconds: the
// caller's final wait is at most one piece), a multiple of `multiple` outputs.
constexpr int64_t CHUNK_WORK = 1 << 15;
inline int64_t chunk_outputs(int64_t work_per_output, int64_t multiple) {
  const int64_t outputs = (CHUNK_WORK + work_per_output - 1) / std::max<int64_t>(1, work_per_output);
  return std::max<int64_t>(1, (outputs + multiple - 1) / multiple) * multiple;
}

}  // namespace fastdecode
