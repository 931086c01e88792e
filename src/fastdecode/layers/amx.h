// AMX (Intel's tile matrix unit: AMX-TILE + AMX-INT8, Sapphire Rapids and later Xeons): whether the kernels
// may use it. Used by the int8 GEMM of many rows (qgemm_amx.cpp) where the CPU has it, the OS grants the
// process its tile state (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, asked once here) and isa.h's AVX-512
// kernels are on (the AMX kernel's float epilogue is AVX-512; switching AVX-512 off for a test switches
// AMX off too). Its results are the VNNI and AVX2 kernels' bit for bit, so the choice changes only speed;
// `fastdecode_kernels::set_amx` (ops.set_amx: tests and benchmarks) switches it off and on.
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <immintrin.h>

#include <atomic>
#include <cstdint>

#include "isa.h"

namespace fastdecode {

inline bool cpu_has_amx() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!cpu_has_avx512() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1u) || !((d >> 25) & 1u)) return false;  // CPUID.7.0:EDX AMX-TILE, AMX-INT8
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return has;
}

inline std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{cpu_has_amx()};
  return on;
}

inline bool use_amx() { return amx_switch().load(std::memory_order_relaxed) && use_avx512(); }

namespace amx {

// The tile unit's configuration (palette 1): tiles 0..7 with these rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the configuration on this thread (each thread that runs tile instructions, before them).
__attribute__((target("amx-tile"))) inline void configure(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = rows[t], c.colsb[t] = colsb[t];
  asm volatile("" : : "r"(&c) : "memory");  // GCC 12's ldtilecfg builtin does not say it reads c: keep the stores
  _tile_loadconfig(&c);
}

// The four accumulator tiles of a block's 2 x 2 tile products (4: A tile 0 x B tile 0, 5: 0 x 1, 6: 1 x 0,
// 7: 1 x 1), zeroed before the products, and stored after them into dots[0..3] (16 x 16 int32 each).
__attribute__((target("amx-tile"))) inline void zero_accumulators() {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
}

__attribute__((target("amx-tile"))) inline void store_accumulators(int32_t (*dots)[16][16]) {
  _tile_stored(4, dots[0], 64);
  _tile_stored(5, dots[1], 64);
  _tile_stored(6, dots[2], 64);
  _tile_stored(7, dots[3], 64);
}

// Gives the tile state back (after a thread's last tile instruction of a call).
__attribute__((target("amx-tile"))) inline void release() { _tile_release(); }

}  // namespace amx

}  // namespace fastdecode
