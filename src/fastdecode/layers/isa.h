// Which instruction sets the kernels use beyond their AVX2 + FMA + F16C baseline.
//
// AVX-512 (F, BW, VL, DQ and VNNI together, as on AMD Zen 4/5 and Intel server cores): the int8 products
// of the tiled layout run 16 outputs per instruction with VNNI's dot products (qtiles_avx512.cpp), the
// exact prompt-row products two outputs per register (exact_matmul_avx512.cpp). They
// compute every result bit for bit like the AVX2 kernels (the same exact integer dot products, the same
// float operations per output), so the choice changes only speed, never an answer. Used where the CPU has
// them; `fastdecode_kernels::set_avx512` (kernels.set_avx512: tests and benchmarks) switches them off and on.
#pragma once

#include <atomic>

namespace fastdecode {

inline bool cpu_has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return has;
}

inline std::atomic<bool>& avx512_switch() {
  static std::atomic<bool> on{cpu_has_avx512()};
  return on;
}

inline bool use_avx512() { return avx512_switch().load(std::memory_order_relaxed); }

}  // namespace fastdecode
