// float_matmul for several rows with AVX-512 (fmatmul.h): the same operations per output as fmatmul.cpp's
// AVX2 kernel, in another order across outputs.
//
// The AVX2 kernel keeps its sums in L1 and loads and stores them at every 4 inputs (a decode step of 8 to
// 32 rows is compute-bound there: ~20 memory operations per 32 multiply-adds). Here a pass holds 8 rows x
// 48 columns of one segment's sums in 24 registers while the segment's 64 rows of w stream by (3 loads and
// 8 broadcasts per 24 multiply-adds), then adds them to the running totals (in y, once per segment). The
// passes go along a thread's whole column range segment by segment, so each row of w is read in one run
// of the range (a beam step's logits layer: 5 rows x 51865 columns), not 48 columns at a time. Each
// output's arithmetic is the contract's: one FMA chain per segment from 0 in k order, the segment sums
// added in order, then the bias, so a row's bits depend neither on the other rows nor on the ISA.
// 9 rows up to the caller's limits (InPlaceRows, fmatmul.h: at most 64; a serving step, a beam step: 8 sources x 4
// beams) run as such groups of 8 (and one of the rest) taking turns over runs of w's rows read in place
// (grouped_segment: a whole segment, or 8 rows where w's rows share L1 sets); more rows (a prompt) copy each block of
// w once for all K rows, which every 8-row group then runs through whole, its running totals kept beside it.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "fmatmul.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

namespace fastdecode {
namespace avx512 {
namespace {

constexpr int NV = 3;  // vectors of 16 columns per pass
constexpr int64_t WIDTH = 16 * NV;
// Read in place (one row group), each pass prefetches the columns of the pass this many later, wrapping into the
// next segment's rows at the end of the range (a range of 2 passes, a 768-column matrix's, used to prefetch only
// in its first, and none for the next segment's first). One pass ahead left a decode step's products memory-latency
// bound on a loaded 2-core Xeon (8 rows, one thread, medians: bart-base's 768 x 50265 logits layer 56 -> 36 ms,
// 768 x 3072 5.5 -> 1.6 ms, 768 x 2304 1.9 -> 1.2 ms, 3072 x 768 6.0 -> 2.3 ms with 2 passes ahead; 3 or 4 ahead
// no better): a distance in passes, each some hundreds of cycles of FMAs whatever the CPU.
constexpr int64_t PASSES_AHEAD = 2;
// 9 to in_place_rows rows where every row of w falls in the same L2 sets (N * sizeof(W) a multiple of L2_PERIOD: a
// 49152-word logits layer's, 192 KiB apart): lines prefetched into L1 or L2 two passes ahead are evicted by the
// other rows' before they are read, so the passes prefetch into L3 (T2), FAR_PASSES_AHEAD passes ahead (SmolLM2-135M's
// 576 x 49152 logits layer, 16 rows, one thread, streamed from memory, AMD Zen 5: 55-59 -> 65-66 GMAC/s; the
// same prefetch on the other products' shapes slowed them down).
constexpr int64_t FAR_PASSES_AHEAD = 4;
constexpr int64_t L2_PERIOD = 64 * 1024;  // bytes: a 1 MiB 16-way L2's set period (2 MiB 16-way: 128 KiB)

// 16 weights as float32 (the lanes of `mask` only, 0 elsewhere, when not `full`): float32 as they are, float16
// (IEEE half bits) widened, exactly.
inline __m512 load16(const float* p, bool full, __mmask16 mask) {
  return full ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask, p);
}
inline __m512 load16(const uint16_t* p, bool full, __mmask16 mask) {
  return _mm512_cvtph_ps(full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(mask, p));
}

// One segment [s0, s1) of rows [m0, m0 + RB) x columns [n, n + width) (width <= WIDTH; lanes past it masked
// off), w0 pointing at the segment's first weight of column n (rows N apart; prefetches the WIDTH columns `ahead`
// elements past each row k it reads while k < `ahead_until`: a later pass's, PASSES_AHEAD): the segment's sums
// (one FMA chain per output from 0, in k order) stored into y as the running total (the first segment) or added
// to it.
// Inlined into row_groups: out of line (as GCC left it once the packed variant was gone), 8 rows of a product
// streamed from memory ran 1.25-1.6x slower (2 threads, Zen 5: 512 x 1536 float32 0.070 -> 0.099-0.111 ms).
// Its loops over rows and vectors unrolled whole by pragma, before GCC's scalar replacement of acc: left to GCC's own
// estimate (GCC 12), 3, 5, 6 and 7 rows kept acc an array in memory, every sum stored to the stack at every k (15
// stores per 15 multiply-adds at 5 rows; 8, 4, 2 and 1 rows were spared), and Whisper base's 5-row products held in
// float16, streamed, ran 0.7-0.8x as fast as before the packed variant went.
template <int RB, typename W>
__attribute__((always_inline)) inline void tile_segment(const float* x, int64_t K, const W* w0, int64_t N, float* y, int64_t m0, int64_t n, int64_t width,
                  int64_t s0, int64_t s1, int64_t ahead_until, int64_t ahead) {
  __mmask16 mask[NV];
#pragma GCC unroll 3
  for (int v = 0; v < NV; ++v) {
    const int64_t valid = std::clamp<int64_t>(width - 16 * v, 0, 16);
    mask[v] = static_cast<__mmask16>(valid == 16 ? 0xFFFF : (1u << valid) - 1);
  }
  const bool full = width == WIDTH;
  __m512 acc[RB][NV];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = s0; k < s1; ++k) {
    const W* wk = w0 + (k - s0) * N;
    if (k < ahead_until)  // a later pass's WIDTH columns: the rows of w stream in runs along the chunk
      for (int64_t byte = 0; byte < WIDTH * static_cast<int64_t>(sizeof(W)); byte += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wk + ahead) + byte, _MM_HINT_T0);
    __m512 wv[NV];
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) wv[v] = load16(wk + 16 * v, full, mask[v]);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512 xb = _mm512_set1_ps(x[(m0 + r) * K + k]);
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) {
      float* t = y + (m0 + r) * N + n + 16 * v;
      const __m512 sum = s0 == 0 ? acc[r][v] : _mm512_add_ps(_mm512_maskz_loadu_ps(mask[v], t), acc[r][v]);
      _mm512_mask_storeu_ps(t, mask[v], sum);
    }
}

// 9 to 64 rows (a serving step's decode rows, a beam step's) run as row groups of 8 rows and one of the rest, each
// holding its rows' sums of the pass's 48 columns in registers (3 loads and up to 8 broadcasts per 24
// multiply-adds). The groups take turns over runs of w's rows, parking their sums in a buffer between turns, so the
// later groups read each run's weights from L1 right after the first. A run's lines must stay in L1: where w's rows lie a
// multiple of 4 KiB apart (a 3072-wide FFN, a 49152-word logits layer) all their lines fall in the same L1 sets,
// and a run is CHUNK rows, within a set's ways; where the rows spread over the sets (SmolLM2-135M's 576-, 960- and
// 1536-wide rows) a run is up to the whole segment, fewer sums parked (turn_rows). One group of 16 rows x 1
// vector instead (one load and 16 broadcasts per 16 multiply-adds) is bound by the loads: SmolLM2-135M's 30
// layers' products, 16 rows, one thread, weights streamed from memory, Intel Xeon: 76.5-115.8 ms as one group,
// 64.4-93.1 ms as two (the same run, alternating). Each output's arithmetic is tile_segment's: one FMA chain from 0
// in k order per segment, however the turns cut it.
constexpr int64_t CHUNK = 8;
// Rows up to which the groups read w in place (more: from a packed copy, below): the caller's InPlaceRows (fmatmul.h),
// `aliased` where the turns are CHUNK rows (every group parks and reloads its sums every 8 rows of w), at most
// IN_PLACE_ROWS (the buffers below). Against the packed copy, one thread, bart-base's decoder products streamed from
// memory, AMD Zen 5, G multiply-adds/s: 32 rows, the logits layer (768 x 50265) 58.5 -> 87.3, 768 x 2304 59 -> 86,
// 3072 x 768 53 -> 73, 768 x 3072 (rows 12 KiB apart) 60 -> 68; 64 rows 74 -> 92, 92, 83, but 768 x 3072 74 -> 64
// (48 rows: 68 -> 63): ZEN5_IN_PLACE_ROWS, which another CPU's caches and prefetchers may move.
constexpr int64_t IN_PLACE_ROWS = MAX_IN_PLACE_ROWS;

// Rows of w per turn of the two groups: CHUNK times the rows before w's rows repeat modulo 4 KiB (the period of
// their L1 sets: 1 where N * sizeof(W) is a multiple of 4 KiB, 16 for 576 floats), at most a segment.
template <typename W>
int64_t turn_rows(int64_t N) {
  const int64_t stride = N * static_cast<int64_t>(sizeof(W)) % 4096;
  const int64_t period = stride == 0 ? 1 : 4096 / std::gcd<int64_t>(stride, 4096);
  return std::min(FLOAT_SEGMENT, CHUNK * period);
}

template <typename W>
int64_t in_place_rows(int64_t N, InPlaceRows limits) {
  return std::min(IN_PLACE_ROWS, turn_rows<W>(N) == CHUNK ? limits.aliased : limits.spread);
}

// Rows [0, RB) of x (rows K apart) over rows [k0, k1) of one pass of w (w0: the segment's row s0; lanes past the
// width masked off), the sums from 0 when `first`, else from `park` ([RB][NV][16]), left in `park`; prefetching
// the later pass's columns of its rows while k < ahead_until (every row, or where SHARED the rows *next, *next +
// every, ...: *next left at the first past k1), into L3 when FAR (FAR_PASSES_AHEAD), else into L1. Inlined: with a
// run's length known only at run time, GCC kept it a call and its 24 sums in memory, stored at every multiply-add
// (half the speed). SHARED at compile time: a row count in the loop of a group that prefetches every row slowed 13
// rows' 3072 x 768 product by 10%.
template <int RB, bool FAR, bool SHARED = false, typename W>
__attribute__((always_inline)) inline void group_chunk(const float* x, int64_t K, const W* w0, int64_t N, int64_t s0,
                                                       int64_t k0, int64_t k1, bool first, const __mmask16* mask,
                                                       bool full, float* park, int64_t ahead_until, int64_t ahead,
                                                       int64_t every = 1, int64_t* shared_next = nullptr) {
  __m512 acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_load_ps(park + (r * NV + v) * 16);
  int64_t next = SHARED ? *shared_next : k0;
  for (int64_t k = k0; k < k1; ++k) {
    const W* wk = w0 + (k - s0) * N;
    if (!SHARED || k == next) {
      next += every;
      if (k < ahead_until)
        for (int64_t byte = 0; byte < WIDTH * static_cast<int64_t>(sizeof(W)); byte += 64)
          if constexpr (FAR) _mm_prefetch(reinterpret_cast<const char*>(wk + ahead) + byte, _MM_HINT_T2);
          else _mm_prefetch(reinterpret_cast<const char*>(wk + ahead) + byte, _MM_HINT_T0);
    }
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load16(wk + 16 * v, full, mask[v]);
    for (int r = 0; r < RB; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) _mm512_store_ps(park + (r * NV + v) * 16, acc[r][v]);
  if constexpr (SHARED) *shared_next = next;
}

// One segment [s0, s1) of 8 * groups + REST rows (groups >= 1, REST < 8) x columns [n, n + width) read in place
// (w0, ahead_until, ahead: as tile_segment's), the groups taking turns over runs of `turn` rows (turn_rows), the rest
// last; the segment's sums stored into y as the running total (the first segment) or added to it. Where the turns
// are longer than CHUNK rows, the 8-row groups share the prefetches, group g the rows k = g (mod groups) of the
// segment, where the first alone asked for a whole pass's lines in one burst (one thread, streamed, Zen 5, G
// multiply-adds/s, medians of two runs: 32 rows, the logits layer 84.5 -> 95.6 and 86.1 -> 95.4, 3072 x 768 73.3 ->
// 82.0 and 71.3 -> 80.5, 768 x 2304 alike; 16 rows, the logits layer 72.5 -> 87.0 and 71.9 -> 87.2, 768 x 2304
// 79.2 -> 86.5 and 81.2 -> 90.6; turns of CHUNK rows (768 x 3072) shared: 0.75-0.9x; the rest group taking a share
// too: 9 rows no better); the first group alone prefetches into L3 where `far`.
template <int REST, typename W>
void grouped_segment(const float* x, int64_t K, int64_t groups, const W* w0, int64_t N, float* y, int64_t n,
                     int64_t width, int64_t s0, int64_t s1, int64_t turn, bool far, int64_t ahead_until, int64_t ahead) {
  __mmask16 mask[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t valid = std::clamp<int64_t>(width - 16 * v, 0, 16);
    mask[v] = static_cast<__mmask16>(valid == 16 ? 0xFFFF : (1u << valid) - 1);
  }
  const bool full = width == WIDTH;
  alignas(64) float park[IN_PLACE_ROWS * NV * 16];  // [row][vector][16]: the sums between turns
  int64_t next[IN_PLACE_ROWS / 8];  // shared prefetches: group g's next row, g (mod groups) from s0
  for (int64_t g = 0; g < groups; ++g) next[g] = s0 + g;
  for (int64_t k0 = s0; k0 < s1; k0 += turn) {
    const int64_t k1 = std::min(s1, k0 + turn);
    const bool shared = !far && groups > 1 && turn > CHUNK;  // the 8-row groups share the prefetches
    if (far) group_chunk<8, true>(x, K, w0, N, s0, k0, k1, k0 == s0, mask, full, park, ahead_until, ahead);
    else if (!shared) group_chunk<8, false>(x, K, w0, N, s0, k0, k1, k0 == s0, mask, full, park, ahead_until, ahead);
    for (int64_t g = shared ? 0 : 1; g < groups; ++g)
      group_chunk<8, false, true>(x + 8 * g * K, K, w0, N, s0, k0, k1, k0 == s0, mask, full, park + 8 * g * NV * 16,
                                  shared ? ahead_until : 0, ahead, groups, next + g);
    if constexpr (REST > 0)
      group_chunk<REST, false>(x + 8 * groups * K, K, w0, N, s0, k0, k1, k0 == s0, mask, full,
                               park + 8 * groups * NV * 16, 0, 0);
  }
  for (int64_t r = 0; r < 8 * groups + REST; ++r)
    for (int v = 0; v < NV; ++v) {
      float* t = y + r * N + n + 16 * v;
      const __m512 acc = _mm512_load_ps(park + (r * NV + v) * 16);
      _mm512_mask_storeu_ps(t, mask[v], s0 == 0 ? acc : _mm512_add_ps(_mm512_maskz_loadu_ps(mask[v], t), acc));
    }
}

// The in-place passes over columns [n0, n1) of K rows of w: segment after segment, passes of WIDTH columns along
// the range in each; pass(s0, s1, n, width, ahead_until, ahead) runs one, `ahead` pointing at the pass PASSES_AHEAD
// later in this order (in a later segment's rows past the range's last pass: its columns are in flight by the
// time it runs), prefetched while k < ahead_until.
template <typename Pass>
void in_place_passes(int64_t K, int64_t N, int64_t n0, int64_t n1, Pass pass, int64_t passes_ahead = PASSES_AHEAD) {
  const int64_t passes = (n1 - n0 + WIDTH - 1) / WIDTH;  // per segment
  for (int64_t s0 = 0; s0 < K; s0 += FLOAT_SEGMENT) {
    const int64_t s1 = std::min(K, s0 + FLOAT_SEGMENT);
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t later = p + passes_ahead, rows_down = later / passes * FLOAT_SEGMENT;
      const int64_t n = n0 + p * WIDTH;
      pass(s0, s1, n, std::min(WIDTH, n1 - n), K - rows_down, rows_down * N + (later % passes - p) * WIDTH);
    }
  }
}

// Columns [n0, n1) of 9 to in_place_rows rows by grouped_segment, in place.
template <int REST, typename W>
void grouped_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t n0, int64_t n1) {
  const int64_t turn = turn_rows<W>(N), groups = M / 8;
  const bool far = N * static_cast<int64_t>(sizeof(W)) % L2_PERIOD == 0;
  in_place_passes(K, N, n0, n1, [&](int64_t s0, int64_t s1, int64_t n, int64_t width, int64_t until, int64_t ahead) {
    grouped_segment<REST>(x, K, groups, w + s0 * N + n, N, y, n, width, s0, s1, turn, far, until, ahead);
  }, far ? FAR_PASSES_AHEAD : PASSES_AHEAD);
}

template <typename W>
void in_place_groups(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t n0, int64_t n1) {
  switch (M % 8) {
    case 1: return grouped_rows<1>(x, M, K, w, N, y, n0, n1);
    case 2: return grouped_rows<2>(x, M, K, w, N, y, n0, n1);
    case 3: return grouped_rows<3>(x, M, K, w, N, y, n0, n1);
    case 4: return grouped_rows<4>(x, M, K, w, N, y, n0, n1);
    case 5: return grouped_rows<5>(x, M, K, w, N, y, n0, n1);
    case 6: return grouped_rows<6>(x, M, K, w, N, y, n0, n1);
    case 7: return grouped_rows<7>(x, M, K, w, N, y, n0, n1);
    default: return grouped_rows<0>(x, M, K, w, N, y, n0, n1);
  }
}

// Several row groups past in_place_rows (a prompt's rows) read the same weights. A block of the
// range's columns is first copied for all K rows of w (a float16 weight widened) into a buffer laid out pass by pass
// ([pass][k][WIDTH], aligned, zero past the block's end; at most PACK_FLOATS, in L2), each row of w read in one run
// of the block's width, PACK_AHEAD rows prefetched ahead. Then each group of 8 rows (the last 1-7 rows one group)
// runs the block's passes in turn: its rows of x stay in L1, a pass's packed weights stream from L2, its 8 x 48
// sums stay in registers through a segment and the running totals in a small buffer of its own between segments,
// and each output is stored once, with the bias. (Segment by segment with the running totals in y, the earlier
// order, read and wrote y at every segment of every group, and where y's rows lie a multiple of 4 KiB apart, a
// 3072-wide FFN's, all of a pass's rows of y fell in the same L1 sets: 256 prompt rows of SmolLM2-135M's 576 x 3072
// gate/up ran at 86 G multiply-adds/s on one Zen 5 core, oneDNN's GEMM at 107.) Read in place instead, a pass's rows
// of w lie N apart, and where N * 4 bytes is a multiple of 4 KiB they all fall in one L1 set: every group after the
// first found them evicted. One row group reads each weight once: it keeps reading w in place (copying cost more
// than it saved at 2-8 rows).
constexpr int64_t PACK_FLOATS = 96 * 1024;  // a block's buffer: 384 KiB (at least one pass of K rows)
constexpr int64_t PACK_AHEAD = 8;  // rows of w prefetched (into L2) ahead of the one being copied

template <typename W>
void pack_block(const W* w, int64_t K, int64_t N, int64_t nb, int64_t width, float* packed) {
  const int64_t passes = (width + WIDTH - 1) / WIDTH;
  for (int64_t k = 0; k < K; ++k) {
    const W* row = w + k * N + nb;
    if (k + PACK_AHEAD < K)
      for (int64_t byte = 0; byte < width * static_cast<int64_t>(sizeof(W)); byte += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + PACK_AHEAD * N) + byte, _MM_HINT_T1);
    for (int64_t p = 0; p < passes; ++p)
      for (int v = 0; v < NV; ++v) {
        const int64_t c = p * WIDTH + 16 * v, valid = std::clamp<int64_t>(width - c, 0, 16);
        const __mmask16 mask = static_cast<__mmask16>(valid == 16 ? 0xFFFF : (1u << valid) - 1);
        _mm512_store_ps(packed + (p * K + k) * WIDTH + 16 * v,
                        valid == 0 ? _mm512_setzero_ps() : load16(row + c, valid == 16, mask));
      }
  }
}

// The next block's rows of w, prefetched into L2 a line at a time while the row groups run through this block, so
// that streaming w from memory overlaps the multiply-adds instead of stalling the next pack_block (16 decode rows
// and 2 prompt rows of SmolLM2's float32 products, weights streamed, one Zen 5 core: 44 ms in one call without it,
// 33 ms as 16 + 2 in two). `total` lines spread evenly over `slots` steps (one per k of each pass of each group).
struct NextBlock {
  const char* row = nullptr;  // the next line's row of w (null: no next block)
  int64_t row_bytes = 0, row_lines = 0, line = 0, total = 0, slots = 1, credit = 0, issued = 0;

  inline void step() {
    if (row == nullptr) return;
    for (credit += total; credit >= slots && issued < total; credit -= slots, ++issued) {
      _mm_prefetch(row + line * 64, _MM_HINT_T1);
      if (++line == row_lines) line = 0, row += row_bytes;
    }
  }
};

// Rows [m0, m0 + RB) x one packed pass (wp: its [K][WIDTH] weights) -> y's columns [n, n + width) (+ bias when
// given): per output, each segment one FMA chain from 0 in k order, the segment sums added in order, then the bias
// (the contract's operations, as tile_segment's and the bias pass of `rows`); a step of `next` per k.
template <int RB>
void packed_pass(const float* x, int64_t K, const float* wp, int64_t N, const float* bias, float* y, int64_t m0,
                 int64_t n, int64_t width, NextBlock& next) {
  __mmask16 mask[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t valid = std::clamp<int64_t>(width - 16 * v, 0, 16);
    mask[v] = static_cast<__mmask16>(valid == 16 ? 0xFFFF : (1u << valid) - 1);
  }
  alignas(64) float total[RB * NV * 16];  // [row][vector][16]: the running totals between segments
  for (int64_t s0 = 0; s0 < K; s0 += FLOAT_SEGMENT) {
    const int64_t s1 = std::min(K, s0 + FLOAT_SEGMENT);
    __m512 acc[RB][NV];
    for (int r = 0; r < RB; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k = s0; k < s1; ++k) {
      next.step();
      __m512 wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = _mm512_load_ps(wp + k * WIDTH + 16 * v);
      for (int r = 0; r < RB; ++r) {
        const __m512 xb = _mm512_set1_ps(x[(m0 + r) * K + k]);
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int v = 0; v < NV; ++v) {
        float* t = total + (r * NV + v) * 16;
        _mm512_store_ps(t, s0 == 0 ? acc[r][v] : _mm512_add_ps(_mm512_load_ps(t), acc[r][v]));
      }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) {
      __m512 sum = _mm512_load_ps(total + (r * NV + v) * 16);
      if (bias != nullptr) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask[v], bias + n + 16 * v));
      _mm512_mask_storeu_ps(y + (m0 + r) * N + n + 16 * v, mask[v], sum);
    }
}

// Rows [m0, m0 + RB) over every pass of a packed block of `width` columns from column nb.
template <int RB>
void packed_group(const float* x, int64_t K, const float* packed, int64_t N, const float* bias, float* y, int64_t m0,
                  int64_t nb, int64_t width, NextBlock& next) {
  for (int64_t c = 0; c < width; c += WIDTH)
    packed_pass<RB>(x, K, packed + (c / WIDTH) * K * WIDTH, N, bias, y, m0, nb + c, std::min(WIDTH, width - c), next);
}

// Columns [n0, n1) of M > 16 rows (+ bias when given): block by block, row group by row group (see above).
template <typename W>
void many_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* bias, float* y, int64_t n0,
               int64_t n1) {
  const int64_t block_columns = std::max<int64_t>(1, PACK_FLOATS / (K * WIDTH)) * WIDTH;
  thread_local std::vector<float> buffer;  // a thread's block buffer, kept between calls
  const int64_t floats = std::min(block_columns, (n1 - n0 + WIDTH - 1) / WIDTH * WIDTH) * K;
  if (static_cast<int64_t>(buffer.size()) < floats + 15) buffer.resize(floats + 15);
  float* packed = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
  for (int64_t nb = n0; nb < n1; nb += block_columns) {
    const int64_t width = std::min(block_columns, n1 - nb);
    pack_block(w, K, N, nb, width, packed);
    NextBlock next;
    if (nb + width < n1) {
      const int64_t next_width = std::min(block_columns, n1 - nb - width);
      next.row = reinterpret_cast<const char*>(w + nb + width);
      next.row_bytes = N * static_cast<int64_t>(sizeof(W));
      next.row_lines = (next_width * static_cast<int64_t>(sizeof(W)) + 63) / 64;
      next.total = K * next.row_lines;
      next.slots = (M + 7) / 8 * ((width + WIDTH - 1) / WIDTH) * K;
    }
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) packed_group<8>(x, K, packed, N, bias, y, m, nb, width, next);
    switch (M - m) {
      case 1: packed_group<1>(x, K, packed, N, bias, y, m, nb, width, next); break;
      case 2: packed_group<2>(x, K, packed, N, bias, y, m, nb, width, next); break;
      case 3: packed_group<3>(x, K, packed, N, bias, y, m, nb, width, next); break;
      case 4: packed_group<4>(x, K, packed, N, bias, y, m, nb, width, next); break;
      case 5: packed_group<5>(x, K, packed, N, bias, y, m, nb, width, next); break;
      case 6: packed_group<6>(x, K, packed, N, bias, y, m, nb, width, next); break;
      case 7: packed_group<7>(x, K, packed, N, bias, y, m, nb, width, next); break;
      default: break;
    }
  }
}

// Rows [0, M <= 8) of one segment over the pass at column n, read in place (w0, ahead_until, ahead: as
// tile_segment's; the first group prefetches). 3, 5, 6 or 7 rows are one group: each weight loaded (and widened)
// once, not once per group, the second group's re-read missing L1 where w's rows lie 4 KiB apart (a beam-5 step of
// Whisper base, float16-held, one thread: its 512 x 2048 products 425 us as 4 + 1 rows).
template <typename W>
void row_groups(const float* x, int64_t M, int64_t K, const W* w0, int64_t N, float* y, int64_t n, int64_t width,
                int64_t s0, int64_t s1, int64_t ahead_until, int64_t ahead) {
  switch (M) {
    case 3: return tile_segment<3>(x, K, w0, N, y, 0, n, width, s0, s1, ahead_until, ahead);
    case 5: return tile_segment<5>(x, K, w0, N, y, 0, n, width, s0, s1, ahead_until, ahead);
    case 6: return tile_segment<6>(x, K, w0, N, y, 0, n, width, s0, s1, ahead_until, ahead);
    case 7: return tile_segment<7>(x, K, w0, N, y, 0, n, width, s0, s1, ahead_until, ahead);
    default: break;
  }
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) tile_segment<8>(x, K, w0, N, y, m, n, width, s0, s1, m == 0 ? ahead_until : 0, ahead);
  for (; m + 4 <= M; m += 4) tile_segment<4>(x, K, w0, N, y, m, n, width, s0, s1, m == 0 ? ahead_until : 0, ahead);
  for (; m + 2 <= M; m += 2) tile_segment<2>(x, K, w0, N, y, m, n, width, s0, s1, m == 0 ? ahead_until : 0, ahead);
  for (; m < M; ++m) tile_segment<1>(x, K, w0, N, y, m, n, width, s0, s1, m == 0 ? ahead_until : 0, ahead);
}

// Columns [n0, n1), every row. Up to 8 rows: segment after segment, each over the whole range 48 columns at a
// time (so each row of w is read in one run of the range per segment, not 48 columns at a time down all K rows: a
// wide matrix, a logits layer of 51865 columns, streams at memory speed), row groups of 8, 4, 2, 1 per pass or
// groups taking turns (9 to in_place_rows rows); the running totals in y, then the bias. More rows: many_rows
// (packed blocks).
template <typename W>
void rows(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* bias, float* y, int64_t n0,
          int64_t n1, InPlaceRows limits) {
  if (M > 8 && M <= in_place_rows<W>(N, limits)) {
    in_place_groups(x, M, K, w, N, y, n0, n1);
  } else if (M > 8) {
    return many_rows(x, M, K, w, N, bias, y, n0, n1);  // the bias with the outputs
  } else {
    in_place_passes(K, N, n0, n1, [&](int64_t s0, int64_t s1, int64_t n, int64_t width, int64_t until, int64_t ahead) {
      row_groups(x, M, K, w + s0 * N + n, N, y, n, width, s0, s1, until, ahead);
    });
  }
  if (bias == nullptr) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; n += 16) {
      const int64_t valid = std::min<int64_t>(16, n1 - n);
      const __mmask16 mask = static_cast<__mmask16>(valid == 16 ? 0xFFFF : (1u << valid) - 1);
      float* t = y + m * N + n;
      _mm512_mask_storeu_ps(t, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, t), _mm512_maskz_loadu_ps(mask, bias + n)));
    }
}

}  // namespace

void float_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1, InPlaceRows limits) {
  rows(x, M, K, w, N, bias, y, n0, n1, limits);
}

void float_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1, InPlaceRows limits) {
  rows(x, M, K, w, N, bias, y, n0, n1, limits);
}

void float_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t n1) {
  rows(x, M, K, w, N, bias, y, n0, n1, ZEN5_IN_PLACE_ROWS);
}

}  // namespace avx512
}  // namespace fastdecode

#pragma GCC pop_options
