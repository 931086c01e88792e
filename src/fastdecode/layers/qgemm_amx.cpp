// tiled_gemm: many int8 rows (a prompt, a batch, beams, a verify step) times the tiled layout (qtiles.cpp),
// on AMX's tile unit where amx.h's use_amx() holds and the rows are many (AMX_MIN_ROWS), else on the tiled
// kernels (tiled_qmatmul). The same bits either way: the AMX kernel's int32 dot products are the VNNI /
// AVX2 kernels' (exact), and every float operation after them is theirs, lane for lane, in block order:
//   acc = 0;  for b: acc = fma(float(dot_b), w_scale[n, b] * d[m, b], acc)
//   mins:     off = 0; for b: off = fma(w_min[n, b], sums[m, b], off);   y = acc + off
//   bias:     y = y + bias[n]  (optional: the same float addition as adding it after the product)
// So the choice changes only speed, never an answer (tests/unit/test_amx_gemm.py).
//
// The AMX kernel: per panel of 32 outputs (4 tiles of 8, repacked once per row block into the tile unit's
// B layout: per block of 32 inputs two 8 x 64-byte tiles, row c = inputs 4c..4c+3 of 16 outputs, 4-bit
// codes unpacked to bytes; scales and mins as float32), per 32 rows (two 16 x 32-byte A tiles read in place
// from the quantized rows, K bytes apart), per block: 4 tile products (int8 x int8 -> int32, K = 32: one
// block, so each block's dot products stay apart for their own scales), stored to L1 and folded into the
// float accumulators by AVX-512. Panels are split across the caller's threads (parallel.h); each thread
// loads the tile configuration for its pieces. Rows are processed in blocks whose activations stay in L2.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "kscales.h"
#include "parallel.h"
#include "qrows.h"
#include "qtiles.h"

namespace fastdecode {
namespace amx {

constexpr int64_t TILE = 8;         // outputs per tile of the tiled layout
constexpr int64_t PANEL = 32;       // outputs per panel: two B tiles of 16
constexpr int64_t ROW_GROUP = 32;   // rows per pass: two A tiles of 16
// Fewer rows: the tiled kernels (weights streamed once). Each call repacks the weight into B tiles, which
// fewer rows do not pay back: a bart-base decoder layer's six products (int8 and int4, 1 thread, loaded
// 2-core Xeon) ran 2.4-2.6x slower on AMX at 8 rows, 1.7x at 16, 1.4x at 24, alike at 32, 1.1-1.25x
// faster from 48 rows on.
constexpr int64_t AMX_MIN_ROWS = 32;
constexpr int64_t ROW_BLOCK_BYTES = 1 << 20;  // activation bytes of one row block (L2)
constexpr int MIN_ROWS = 8;         // rows whose mins terms are summed side by side
constexpr int64_t CHUNK = 4;        // blocks whose tile products are folded together (2 x 16 KB of int32 in L1)

// One panel repacked: codes [blocks][2][8][64] (B tiles), scale and mins [blocks][32] float32.
struct Panel {
  std::vector<int8_t> codes;
  std::vector<float> scale, mins;
};

// The tiles' float32 scales [tiles, blocks, 8] (compact and float16 ones decoded: the same values the
// kernels use) and everything the AMX kernel reads.
struct Operands {
  const quant::QuantizedRows* q;
  const int8_t* act;  // q's codes as A tiles: [row / 16][block][row % 16][32] (rows past M zero)
  const uint8_t* codes;
  const float* scale;
  const float* mins;  // or nullptr
  const float* bias;  // [N] or nullptr: added to each output as it is stored
  int64_t M, K, N, tiles, bits;
  float* y;
};

void panel_rows(const Operands& o, int64_t t0, int64_t m0, int64_t m1, Panel& p);
void pack_panel(const Operands& o, int64_t t0, Panel& p);
void configure();

}  // namespace amx

namespace {

// The tiled scales as float32 [tiles, blocks, 8]; compact ones decoded on up to `threads` threads (a prompt's
// gate/up scales of Qwen 1.5B: 860 K floats, which one thread decoded while the other waited).
at::Tensor float_scales(const at::Tensor& s, int64_t threads) {
  if (!quant::is_compact(s)) return s.scalar_type() == at::kFloat ? s.contiguous() : s.to(at::kFloat).contiguous();
  TORCH_CHECK(s.dim() == 3 && s.is_contiguous() && s.size(2) == quant::TILE_RECORD, "tiled compact scales have records of ",
              quant::TILE_RECORD, " bytes, not ", s.sizes());
  const int64_t tiles = s.size(0), blocks = s.size(1) * 8;
  at::Tensor out = at::empty({tiles, blocks, amx::TILE}, s.options().dtype(at::kFloat));
  const quant::KScale* sp = quant::scale_data<quant::KScale>(s);
  float* op = out.data_ptr<float>();
  parallel_chunks(tiles, 64, threads, [&](int64_t t0, int64_t t1) { quant::expand_tiles(sp, blocks, t0, t1, op); });
  return out;
}

at::Tensor amx_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                    const c10::optional<at::Tensor>& mins, int64_t bits, int64_t N, int64_t threads, const float* bias) {
  using namespace amx;
  const int64_t M = x.size(0), K = x.size(1), blocks = K / 32, tiles = codes.size(0);
  const bool has_min = mins.has_value() && mins->defined();
  const at::Tensor s = float_scales(scale, threads), mn = has_min ? float_scales(*mins, threads) : at::Tensor();
  const std::vector<int64_t> want{tiles, blocks, amx::TILE};
  TORCH_CHECK(s.sizes() == want, "tiled scales ", scale.sizes(), " do not match codes ", codes.sizes());
  quant::QuantizedRows q = quant::sized_rows<32>(M, K, has_min);
  const int64_t padded = (M + ROW_GROUP - 1) / ROW_GROUP * ROW_GROUP;  // A tiles read whole: zero rows past M
  q.scale.resize(padded * blocks, 0.0f);
  std::vector<int8_t> act(padded * K, 0);  // [row / 16][block][row % 16][32]: each A tile 512 contiguous bytes
  const float* xp = x.data_ptr<float>();
  parallel_chunks(M, 16, threads, [&](int64_t m0, int64_t m1) {  // each row quantized alone: the same bits
    quant::quantize_blocks<32>(xp, m0 * blocks, m1 * blocks, has_min, q);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < blocks; ++b)
        std::memcpy(act.data() + ((m / 16) * blocks + b) * 512 + (m % 16) * 32, q.codes.data() + m * K + 32 * b, 32);
  }, 16 * K);
  at::Tensor y = at::empty({M, N}, x.options());
  const Operands o{&q, act.data(), static_cast<const uint8_t*>(codes.data_ptr()), s.data_ptr<float>(),
                   has_min ? mn.data_ptr<float>() : nullptr, bias, M, K, N, tiles, bits, y.data_ptr<float>()};
  const int64_t panels = (tiles + PANEL / TILE - 1) / (PANEL / TILE);
  const int64_t rows_per_block = std::max<int64_t>(ROW_GROUP, ROW_BLOCK_BYTES / K / ROW_GROUP * ROW_GROUP);
  for (int64_t m0 = 0; m0 < M; m0 += rows_per_block) {
    const int64_t m1 = std::min(M, m0 + rows_per_block);
    parallel_chunks(panels, 1, threads, [&](int64_t p0, int64_t p1) {
      configure();
      thread_local Panel panel;  // (reused: a panel of K = 8960 is 280 KB, which malloc would map and unmap)
      for (int64_t p = p0; p < p1; ++p) {
        pack_panel(o, p * (PANEL / TILE), panel);
        panel_rows(o, p * (PANEL / TILE), m0, m1, panel);
      }
      release();
    }, PANEL * (m1 - m0) * K);
  }
  return y;
}

// x [M, K] float32 -> y [M, outputs] (+ bias [outputs] float32, added to each output as it is stored: the
// same float addition as adding it after): the tiled kernels' int8 product (qtiles.h's tiled_qmatmul with
// activation_bits 8), on AMX where it is on and the rows are many.
at::Tensor tiled_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& mins, int64_t bits, int64_t outputs, int64_t threads,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(codes.dim() == 3, "tiled_gemm takes the tiled layout's codes [tiles, K/32, bytes]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->device().is_cpu(),
                "bias must be contiguous float32 [N] on the CPU");
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  if (outputs < 0) outputs = codes.size(0) * amx::TILE;
  if (x.size(0) < amx::AMX_MIN_ROWS || !use_amx())  // (tiled_qmatmul checks the arguments, the bias's size too)
    return tiled_qmatmul(x, codes, scale, mins, bits, outputs, threads, 8, bp, has_bias ? bias->numel() : 0);
  TORCH_CHECK(bits == 4 || bits == 8, "tiled codes are 4 or 8 bits, not ", bits);
  TORCH_CHECK(codes.is_contiguous() && codes.element_size() == 1 && codes.size(2) == amx::TILE * 32 * bits / 8,
              "tiled codes ", codes.sizes(), " are not contiguous ", bits, "-bit tiles");
  TORCH_CHECK(x.size(1) == 32 * codes.size(1), "x has ", x.size(1), " inputs, the weight ", 32 * codes.size(1));
  TORCH_CHECK(outputs > (codes.size(0) - 1) * amx::TILE && outputs <= codes.size(0) * amx::TILE, outputs,
              " outputs do not fill ", codes.size(0), " tiles of ", amx::TILE);
  if (mins.has_value() && mins->defined())
    TORCH_CHECK(mins->sizes() == scale.sizes() && mins->scalar_type() == scale.scalar_type(), "mins must be like the scales");
  TORCH_CHECK(!has_bias || bias->numel() == outputs, "bias has ", bias->numel(), " values for ", outputs, " outputs");
  return amx_gemm(x, codes, scale, mins, bits, outputs, threads, bp);
}

bool set_amx(int64_t enabled) {
  if (enabled >= 0) amx_switch().store(enabled != 0 && cpu_has_amx(), std::memory_order_relaxed);
  return use_amx();
}

}  // namespace

// ---- the AMX kernel ---------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")

namespace amx {

// tmm0, tmm1: A (16 rows x 32 bytes); tmm2, tmm3: B (8 rows x 64 bytes); tmm4-7: C (16 rows x 16 int32)
void configure() { amx::configure({16, 16, 8, 8, 16, 16, 16, 16}, {32, 32, 64, 64, 64, 64, 64, 64}); }

// Tiles t0 .. t0 + 3 (zero past the last) into the panel's B tiles, scales and mins.
void pack_panel(const Operands& o, int64_t t0, Panel& p) {
  const int64_t blocks = o.K / 32, bb = TILE * 32 * o.bits / 8;  // bytes per tile-block
  p.codes.assign(blocks * 2 * 8 * 64, 0);
  p.scale.assign(blocks * PANEL, 0.0f);
  p.mins.assign(o.mins != nullptr ? blocks * PANEL : 0, 0.0f);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t i = 0; i < PANEL / TILE; ++i) {  // tile i of the panel: B tile i / 2, bytes 32 (i % 2) of each row
    const int64_t t = t0 + i;
    if (t >= o.tiles) break;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* src = o.codes + (t * blocks + b) * bb;
      int8_t* dst = p.codes.data() + (b * 2 + i / 2) * 8 * 64 + 32 * (i % 2);
      if (o.bits == 4) {  // chunk c: low nibbles inputs 4c..4c+3 (row c), high ones 16+4c.. (row 4 + c)
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * c));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 64 * c), _mm256_and_si256(v, nibble));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 64 * (4 + c)),
                              _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble));
        }
      } else {
        for (int c = 0; c < 8; ++c) std::memcpy(dst + 64 * c, src + 32 * c, 32);
      }
      std::memcpy(p.scale.data() + b * PANEL + TILE * i, o.scale + (t * blocks + b) * TILE, TILE * sizeof(float));
      if (o.mins != nullptr)
        std::memcpy(p.mins.data() + b * PANEL + TILE * i, o.mins + (t * blocks + b) * TILE, TILE * sizeof(float));
    }
  }
}

// Blocks [b0, b0 + count) folded into acc: dots [count][row tile * 2 + B tile][row][output], w_scale the
// panel's scales from block b0, d the rows' activation scales from block b0 (rows `blocks` apart). 8 rows at a
// time, their 16 accumulators in registers across the blocks (each output's operations in block order).
inline void fold(const int32_t (*dots)[4][16][16], int64_t count, const float* w_scale, const float* d, int64_t blocks,
                 int64_t rows, float (*acc)[PANEL]) {
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    __m512 a[8][2];
    for (int i = 0; i < 8; ++i) a[i][0] = _mm512_load_ps(acc[r0 + i]), a[i][1] = _mm512_load_ps(acc[r0 + i] + 16);
    for (int64_t b = 0; b < count; ++b) {
      const __m512 w0 = _mm512_loadu_ps(w_scale + b * PANEL), w1 = _mm512_loadu_ps(w_scale + b * PANEL + 16);
      for (int i = 0; i < 8; ++i) {  // (rows past `rows`: padding, computed and never stored)
        const int64_t r = r0 + i;
        const __m512 dr = _mm512_set1_ps(d[r * blocks + b]);
        const __m512i dot0 = _mm512_load_si512(dots[b][(r / 16) * 2][r % 16]);
        const __m512i dot1 = _mm512_load_si512(dots[b][(r / 16) * 2 + 1][r % 16]);
        a[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_mul_ps(w0, dr), a[i][0]);
        a[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(w1, dr), a[i][1]);
      }
    }
    for (int i = 0; i < 8; ++i) _mm512_store_ps(acc[r0 + i], a[i][0]), _mm512_store_ps(acc[r0 + i] + 16, a[i][1]);
  }
}

// Block b's 4 tile products into dots (A tiles at a and a + next, 512 bytes each; B tiles: the panel's block b).
template <int BITS>
inline void block_dots(const int8_t* a, int64_t next, const int8_t* b_tiles, int32_t (*dots)[16][16]) {
  _tile_loadd(0, a, 32);
  _tile_loadd(1, a + next, 32);
  _tile_loadd(2, b_tiles, 64);
  _tile_loadd(3, b_tiles + 512, 64);
  amx::zero_accumulators();
  if constexpr (BITS == 4) {  // activations signed, codes unsigned 0..15
    _tile_dpbsud(4, 0, 2);
    _tile_dpbsud(5, 0, 3);
    _tile_dpbsud(6, 1, 2);
    _tile_dpbsud(7, 1, 3);
  } else {
    _tile_dpbssd(4, 0, 2);
    _tile_dpbssd(5, 0, 3);
    _tile_dpbssd(6, 1, 2);
    _tile_dpbssd(7, 1, 3);
  }
  amx::store_accumulators(dots);
}

// Rows [m0, m1) x the panel's 32 outputs (tiles t0 ..) -> y.
template <int BITS>
void panel_rows_bits(const Operands& o, int64_t t0, int64_t m0, int64_t m1, Panel& p) {
  const quant::QuantizedRows& q = *o.q;
  const int64_t K = o.K, blocks = K / 32, n0 = t0 * TILE;
  const int64_t valid = std::min<int64_t>(PANEL, o.N - n0);
  const __mmask16 mask0 = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  const __mmask16 mask1 = valid >= 32 ? __mmask16(0xFFFF) : valid <= 16 ? __mmask16(0) : __mmask16((1u << (valid - 16)) - 1);
  alignas(64) int32_t dots[2][CHUNK][4][16][16];  // two chunks of blocks' C tiles: [chunk % 2][block][tile][row][output]
  alignas(64) float acc[ROW_GROUP][PANEL];
  const int64_t chunks = (blocks + CHUNK - 1) / CHUNK;
  for (int64_t g = m0; g < m1; g += ROW_GROUP) {
    const int64_t rows = std::min<int64_t>(ROW_GROUP, m1 - g);
    std::memset(acc, 0, sizeof(acc));

    const int8_t* a = o.act + (g / 16) * blocks * 512;
    const float* d = q.scale.data() + g * blocks;
    // chunk k's tile products are issued before chunk k - 1 is folded: the tile unit and the vector units overlap
    for (int64_t k = 0; k <= chunks; ++k) {
      if (k < chunks)
        for (int64_t b = k * CHUNK; b < std::min(blocks, (k + 1) * CHUNK); ++b)
          block_dots<BITS>(a + 512 * b, blocks * 512, p.codes.data() + b * 1024, dots[k % 2][b - k * CHUNK]);
      if (k > 0) {
        const int64_t b0 = (k - 1) * CHUNK;
        fold(dots[(k - 1) % 2], std::min(CHUNK, blocks - b0), p.scale.data() + b0 * PANEL, d + b0, blocks, rows, acc);
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += MIN_ROWS) {  // the mins terms of 8 rows side by side: 16 independent chains
      const int64_t n = std::min<int64_t>(MIN_ROWS, rows - r0);
      __m512 off[MIN_ROWS][2];
      for (int i = 0; i < MIN_ROWS; ++i) off[i][0] = off[i][1] = _mm512_setzero_ps();
      if (o.mins != nullptr) {
        const float* sums = q.sums.data() + (g + r0) * blocks;
        for (int64_t b = 0; b < blocks; ++b) {
          const __m512 m0 = _mm512_loadu_ps(p.mins.data() + b * PANEL), m1 = _mm512_loadu_ps(p.mins.data() + b * PANEL + 16);
          for (int i = 0; i < MIN_ROWS; ++i) {  // (rows past n: zero, never stored)
            const __m512 s = _mm512_set1_ps(i < n ? sums[i * blocks + b] : 0.0f);
            off[i][0] = _mm512_fmadd_ps(m0, s, off[i][0]);
            off[i][1] = _mm512_fmadd_ps(m1, s, off[i][1]);
          }
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        __m512 total0 = _mm512_load_ps(acc[r0 + i]), total1 = _mm512_load_ps(acc[r0 + i] + 16);
        if (o.mins != nullptr) {
          total0 = _mm512_add_ps(total0, off[i][0]);
          total1 = _mm512_add_ps(total1, off[i][1]);
        }
        if (o.bias != nullptr) {  // (masked loads: the panel may pass the last output)
          total0 = _mm512_add_ps(total0, _mm512_maskz_loadu_ps(mask0, o.bias + n0));
          if (mask1) total1 = _mm512_add_ps(total1, _mm512_maskz_loadu_ps(mask1, o.bias + n0 + 16));
        }
        float* out = o.y + (g + r0 + i) * o.N + n0;
        _mm512_mask_storeu_ps(out, mask0, total0);
        if (mask1) _mm512_mask_storeu_ps(out + 16, mask1, total1);
      }
    }
  }
}

void panel_rows(const Operands& o, int64_t t0, int64_t m0, int64_t m1, Panel& p) {
  if (o.bits == 4)
    panel_rows_bits<4>(o, t0, m0, m1, p);
  else
    panel_rows_bits<8>(o, t0, m0, m1, p);
}

}  // namespace amx

#pragma GCC pop_options

}  // namespace fastdecode

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("tiled_gemm(Tensor x, Tensor codes, Tensor scale, Tensor? mins, int bits, int outputs, int threads, "
        "Tensor? bias=None) -> Tensor");
  m.def("set_amx(int enabled) -> bool", &fastdecode::set_amx);
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) { m.impl("tiled_gemm", &fastdecode::tiled_gemm); }
