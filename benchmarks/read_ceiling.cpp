// How fast this machine's memory can be read, by hand-written readers (for benchmarks/read_ceiling.py): a buffer
// (anonymous memory, or a file mapped read-only as the engine maps its weights) read whole by THREADS pinned
// threads, each variant's GB/s per trial. Nothing is computed but an XOR of every 64 bytes read (kept, so that the
// loads stay).
//
//     read_ceiling BUFFER THREADS ROUNDS VARIANT...  ->  per round and variant, a line "VARIANT GB_PER_S"
//
// BUFFER: a size in MiB of anonymous memory (written first; "1024h": in transparent huge pages where the kernel
// gives them, madvise MADV_HUGEPAGE) or a file's path (mapped, read once first).
// VARIANT: fields joined by ':', in any order:
//   s<N>      N streams per thread: a thread's part cut in N equal pieces, read side by side, 256 bytes of each in
//             turn (as a product reads N weight rows at once); default 1
//   t0<D> / nta<D>   prefetcht0 / prefetchnta D bytes ahead of every stream's 256 bytes; default none
//   c<B>      the threads take chunks of B KiB in turn (chunk i to thread i mod THREADS) instead of one contiguous
//             part each; the streams cut each chunk
//   nt        non-temporal loads (vmovntdqa) instead of plain ones
//   w<N>      N multiply-adds (madd + add) per 64 bytes loaded, as a kernel's work between its loads
//             (Zen 5: w6 ~ 70 GB/s of one core's work from cache, a 4-bit batch-1 product's)
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

#ifdef __AVX512F__
using Vec = __m512i;
inline Vec load(const uint8_t* p) { return _mm512_load_si512(p); }
inline Vec load_nt(const uint8_t* p) { return _mm512_stream_load_si512(const_cast<uint8_t*>(p)); }
inline Vec mix(Vec a, Vec b) { return _mm512_xor_si512(a, b); }
inline uint64_t fold(Vec v) { return _mm512_reduce_add_epi64(v); }
inline Vec zero() { return _mm512_setzero_si512(); }
inline Vec churn(Vec acc, Vec v) { return _mm512_add_epi32(acc, _mm512_madd_epi16(v, v)); }
constexpr int kVec = 64;
#else
using Vec = __m256i;
inline Vec load(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
inline Vec load_nt(const uint8_t* p) { return _mm256_stream_load_si256(reinterpret_cast<const __m256i*>(p)); }
inline Vec mix(Vec a, Vec b) { return _mm256_xor_si256(a, b); }
inline uint64_t fold(Vec v) {
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}
inline Vec zero() { return _mm256_setzero_si256(); }
inline Vec churn(Vec acc, Vec v) { return _mm256_add_epi32(acc, _mm256_madd_epi16(v, v)); }
constexpr int kVec = 32;
#endif
constexpr int64_t kStep = 256;  // bytes of one stream read per turn

struct Variant {
  std::string name;
  int streams = 1;
  int prefetch = 0;  // 0 none, 1 prefetcht0, 2 prefetchnta
  int64_t distance = 0;
  int64_t chunk = 0;  // bytes; 0: one contiguous part per thread
  bool nt = false;
  int work = 0;  // multiply-adds per 64 bytes
};

Variant parse(const std::string& name) {
  Variant v;
  v.name = name;
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find(':', start);
    if (end == std::string::npos) end = name.size();
    const std::string field = name.substr(start, end - start);
    if (field.rfind("nta", 0) == 0) {
      v.prefetch = 2, v.distance = std::atoll(field.c_str() + 3);
    } else if (field.rfind("t0", 0) == 0) {
      v.prefetch = 1, v.distance = std::atoll(field.c_str() + 2);
    } else if (field.rfind("w", 0) == 0) {
      v.work = std::atoi(field.c_str() + 1);
    } else if (field == "nt") {
      v.nt = true;
    } else if (field.rfind("s", 0) == 0) {
      v.streams = std::atoi(field.c_str() + 1);
    } else if (field.rfind("c", 0) == 0) {
      v.chunk = std::atoll(field.c_str() + 1) * 1024;
    } else if (field != "plain") {
      std::fprintf(stderr, "unknown variant field '%s'\n", field.c_str());
      std::exit(2);
    }
    start = end + 1;
  }
  if (v.streams < 1 || v.streams > 16) std::exit(2);
  return v;
}

// [begin, begin + bytes) read as v.streams side-by-side pieces; bytes a multiple of streams * kStep.
template <int PREFETCH, bool NT>
Vec read_range(const uint8_t* begin, int64_t bytes, int streams, int64_t distance, int work, Vec acc) {
  const int64_t piece = bytes / streams;
  Vec a0 = acc, a1 = zero(), a2 = a1, a3 = a1;
  for (int64_t i = 0; i < piece; i += kStep) {
    for (int s = 0; s < streams; ++s) {
      const uint8_t* p = begin + s * piece + i;
      if constexpr (PREFETCH == 1) _mm_prefetch(reinterpret_cast<const char*>(p + distance), _MM_HINT_T0);
      if constexpr (PREFETCH == 1) _mm_prefetch(reinterpret_cast<const char*>(p + distance + 128), _MM_HINT_T0);
      if constexpr (PREFETCH == 2) _mm_prefetch(reinterpret_cast<const char*>(p + distance), _MM_HINT_NTA);
      if constexpr (PREFETCH == 2) _mm_prefetch(reinterpret_cast<const char*>(p + distance + 128), _MM_HINT_NTA);
      for (int j = 0; j < kStep; j += 4 * kVec) {
        const Vec v0 = NT ? load_nt(p + j) : load(p + j), v1 = NT ? load_nt(p + j + kVec) : load(p + j + kVec);
        const Vec v2 = NT ? load_nt(p + j + 2 * kVec) : load(p + j + 2 * kVec);
        const Vec v3 = NT ? load_nt(p + j + 3 * kVec) : load(p + j + 3 * kVec);
        a0 = mix(a0, v0), a1 = mix(a1, v1), a2 = mix(a2, v2), a3 = mix(a3, v3);
        for (int w = 0; w < work * kVec / 64; ++w)
          a0 = churn(a0, v0), a1 = churn(a1, v1), a2 = churn(a2, v2), a3 = churn(a3, v3);
      }
    }
  }
  return mix(mix(a0, a1), mix(a2, a3));
}

template <int PREFETCH, bool NT>
uint64_t read_part(const uint8_t* data, int64_t bytes, const Variant& v, int thread, int threads) {
  Vec acc = zero();
  const int64_t unit = v.streams * kStep;
  if (v.chunk == 0) {
    const int64_t part = bytes / threads / unit * unit;
    acc = read_range<PREFETCH, NT>(data + thread * part, part, v.streams, v.distance, v.work, acc);
  } else {
    const int64_t chunk = v.chunk / unit * unit;
    for (int64_t at = thread * chunk; at + chunk <= bytes; at += threads * chunk)
      acc = read_range<PREFETCH, NT>(data + at, chunk, v.streams, v.distance, v.work, acc);
  }
  return fold(acc);
}

uint64_t read_with(const uint8_t* data, int64_t bytes, const Variant& v, int thread, int threads) {
  if (v.nt) return read_part<0, true>(data, bytes, v, thread, threads);
  if (v.prefetch == 1) return read_part<1, false>(data, bytes, v, thread, threads);
  if (v.prefetch == 2) return read_part<2, false>(data, bytes, v, thread, threads);
  return read_part<0, false>(data, bytes, v, thread, threads);
}

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

std::atomic<uint64_t> sink{0};

// One trial: all threads start together (the caller is thread 0); seconds from the start until the last is done.
double trial(const uint8_t* data, int64_t bytes, const Variant& v, const std::vector<int>& cpus) {
  const int threads = static_cast<int>(cpus.size());
  std::atomic<int> arrived{0}, finished{0};
  auto work = [&](int t) {
    pin(cpus[t]);
    arrived.fetch_add(1);
    while (arrived.load() < threads) _mm_pause();
    sink.fetch_add(read_with(data, bytes, v, t, threads));
    finished.fetch_add(1);
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads; ++t) helpers.emplace_back(work, t);
  pin(cpus[0]);
  arrived.fetch_add(1);
  while (arrived.load() < threads) _mm_pause();
  const auto start = std::chrono::steady_clock::now();
  sink.fetch_add(read_with(data, bytes, v, 0, threads));
  finished.fetch_add(1);
  while (finished.load() < threads) _mm_pause();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (auto& h : helpers) h.join();
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: read_ceiling BUFFER THREADS ROUNDS VARIANT...\n");
    return 2;
  }
  const std::string buffer = argv[1];
  const int threads = std::atoi(argv[2]), rounds = std::atoi(argv[3]);
  std::vector<Variant> variants;
  for (int i = 4; i < argc; ++i) variants.push_back(parse(argv[i]));

  cpu_set_t allowed;
  sched_getaffinity(0, sizeof(allowed), &allowed);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE && static_cast<int>(cpus.size()) < threads; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  if (static_cast<int>(cpus.size()) < threads) return 2;

  uint8_t* data = nullptr;
  int64_t bytes = 0;
  struct stat info;
  if (stat(buffer.c_str(), &info) == 0) {  // a file, mapped as loading/weight_cache.py maps the weights
    const int fd = open(buffer.c_str(), O_RDONLY);
    bytes = info.st_size / (1 << 20) * (1 << 20);
    void* mapped = mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (mapped == MAP_FAILED) return 3;
    data = static_cast<uint8_t*>(mapped);
  } else {
    bytes = std::atoll(buffer.c_str()) << 20;
    data = static_cast<uint8_t*>(std::aligned_alloc(2 << 20, bytes));
    if (buffer.back() == 'h') madvise(data, bytes, MADV_HUGEPAGE);
    std::memset(data, 1, bytes);
  }
  sink.fetch_add(read_with(data, bytes, parse("plain"), 0, 1));  // every page mapped before the first trial
  for (int r = 0; r < rounds; ++r)
    for (const Variant& v : variants) std::printf("%s %.3f\n", v.name.c_str(), bytes / trial(data, bytes, v, cpus) / 1e9);
  return sink.load() == 42 ? 1 : 0;
}
