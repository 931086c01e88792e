// The int8 prompt GEMM of qprompt.cpp (rows-layout 8-bit codes in groups of 16: Q6_K) on AMX's tile unit,
// used by prompt_qmatmul where amx.h's use_amx() holds and the rows are many. Bit for bit the AVX2 and VNNI
// kernels (qprompt.h): the tile unit's int32 dot products per 16 inputs are theirs (exact), and the float
// operations after them are theirs, lane for lane, in group order:
//   y = 0;  for b: y = fma(float(dot_0(b)), scale[n, 2b] * d[m, b], y);  y = fma(float(dot_1(b)), scale[n, 2b+1] * d[m, b], y)
//
// Per panel of 32 outputs (repacked once per row block into B tiles: per group of 16 inputs two 4 x 64-byte
// tiles, row c = inputs 4c..4c+3 of 16 outputs) and 16 rows (A tiles of 16 x 16 bytes, repacked once per
// call so that each is 256 contiguous bytes), per block of 32 inputs: 4 tile products (2 groups x 2 output
// halves), stored to L1 and folded into the float accumulators by AVX-512 one block later (the tile unit
// and the vector units overlap). Panels are split across the caller's threads.
#include <ATen/ATen.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "parallel.h"
#include "qprompt.h"
#include "qrows.h"
#include "six_bit.h"

namespace fastdecode {
namespace amx {
namespace {

constexpr int64_t PANEL = 32;                 // outputs per panel: two B tiles of 16
constexpr int64_t ROWS = 16;                  // rows per pass: one A tile per group
constexpr int64_t ROW_BLOCK_BYTES = 1 << 20;  // activation bytes of one row block (L2)

struct Rows16 {
  const quant::QuantizedRows* q;
  const int8_t* act;     // q's codes as A tiles: [row / 16][group][row % 16][16] (rows past M zero)
  const uint8_t* codes;  // int8 [N, K], or packed 6-bit [N, 3K/4] (six)
  bool six;
  const float* scale;    // [N, K / 16]
  const float* bias;     // [N] or nullptr
  int64_t M, K, N;
  float* y;
};

struct Panel16 {
  std::vector<int8_t> codes;  // [group][2][4][64]: B tiles
  std::vector<float> scale;   // [group][32]
};

void pack(const Rows16& o, int64_t n0, Panel16& p);
void panel_rows(const Rows16& o, int64_t n0, int64_t m0, int64_t m1, const Panel16& p);

}  // namespace

at::Tensor rows16_gemm(const at::Tensor& x, const at::Tensor& codes, bool six, const at::Tensor& scale, int64_t threads,
                       const float* bias) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), groups = K / 16;
  const at::Tensor s = scale.scalar_type() == at::kFloat ? scale.contiguous() : scale.to(at::kFloat).contiguous();
  const quant::QuantizedRows q = quant::quantize_rows<16>(x.data_ptr<float>(), M, K, false);
  const int64_t padded = (M + ROWS - 1) / ROWS * ROWS;
  std::vector<int8_t> act(padded * K, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g)
      std::memcpy(act.data() + ((m / 16) * groups + g) * 256 + (m % 16) * 16, q.codes.data() + m * K + 16 * g, 16);
  at::Tensor y = at::empty({M, N}, x.options());
  const Rows16 o{&q, act.data(), static_cast<const uint8_t*>(codes.data_ptr()), six, s.data_ptr<float>(), bias, M, K, N,
                 y.data_ptr<float>()};
  const int64_t panels = (N + PANEL - 1) / PANEL;
  const int64_t rows_per_block = std::max<int64_t>(ROWS, ROW_BLOCK_BYTES / K / ROWS * ROWS);
  for (int64_t m0 = 0; m0 < M; m0 += rows_per_block) {
    const int64_t m1 = std::min(M, m0 + rows_per_block);
    parallel_chunks(panels, 1, threads, [&](int64_t p0, int64_t p1) {
      // tmm0, tmm1: A (16 x 16 bytes: the block's two groups); tmm2, tmm3: B (4 x 64); tmm4-7: C (16 x 16 int32)
      configure({16, 16, 4, 4, 16, 16, 16, 16}, {16, 16, 64, 64, 64, 64, 64, 64});
      thread_local Panel16 panel;  // (reused: a panel of K = 8960 is 280 KB, which malloc would map and unmap)
      for (int64_t p = p0; p < p1; ++p) {
        pack(o, p * PANEL, panel);
        panel_rows(o, p * PANEL, m0, m1, panel);
      }
      release();
    }, PANEL * (m1 - m0) * K);
  }
  return y;
}

}  // namespace amx
}  // namespace fastdecode

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")

namespace fastdecode {
namespace amx {
namespace {

// Outputs [n0, n0 + 32) (zero past N) into the panel's B tiles and scales: per 8 outputs and block, their
// 8 x 32 code bytes transposed as 8 x 8 dwords in registers (v[c]: inputs 4c..4c+3 of the 8 outputs).
void pack(const Rows16& o, int64_t n0, Panel16& p) {
  const int64_t K = o.K, groups = K / 16, blocks = K / 32;
  p.codes.resize(groups * 2 * 4 * 64);
  p.scale.assign(groups * PANEL, 0.0f);
  for (int64_t e = 0; e < PANEL / 8; ++e) {
    const int64_t o0 = n0 + 8 * e;
    const int64_t row_bytes = o.six ? K * 6 / 8 : K;
    const uint8_t* rows[8];
    for (int i = 0; i < 8; ++i) rows[i] = o0 + i < o.N ? o.codes + (o0 + i) * row_bytes : nullptr;
    int8_t* dst = p.codes.data() + (e / 2) * 256 + (e % 2) * 32;  // B tile half e / 2, outputs 8 (e % 2) ..
    alignas(32) int8_t unpacked[8][256];  // six: the 8 outputs' codes of the current super-block (six_bit.h)
    for (int64_t b = 0; b < blocks; ++b) {
      if (o.six && b % 8 == 0)
        for (int i = 0; i < 8; ++i)
          if (rows[i] != nullptr) quant::six_super(rows[i] + b / 8 * quant::SIX_SUPER_BYTES, unpacked[i]);
      __m256 v[8];  // dwords as float lanes: moved, never computed on
      for (int i = 0; i < 8; ++i)
        v[i] = rows[i] == nullptr ? _mm256_setzero_ps()
               : _mm256_loadu_ps(reinterpret_cast<const float*>(o.six ? unpacked[i] + 32 * (b % 8) : reinterpret_cast<const int8_t*>(rows[i]) + 32 * b));
      quant::transpose8(v);
      for (int c = 0; c < 8; ++c)  // group 2b + c / 4, tile row c % 4
        _mm256_storeu_ps(reinterpret_cast<float*>(dst + (2 * b + c / 4) * 512 + (c % 4) * 64), v[c]);
    }
    for (int i = 0; i < 8 && o0 + i < o.N; ++i)
      for (int64_t g = 0; g < groups; ++g) p.scale[g * PANEL + 8 * e + i] = o.scale[(o0 + i) * groups + g];
  }
}

// Block b's 4 tile products (groups 2b, 2b + 1 x output halves) into dots[group % 2 * 2 + half].
inline void block_dots(const int8_t* a, const int8_t* b_tiles, int32_t (*dots)[16][16]) {
  _tile_loadd(0, a, 16);
  _tile_loadd(1, a + 256, 16);
  _tile_loadd(2, b_tiles, 64);
  _tile_loadd(3, b_tiles + 256, 64);
  amx::zero_accumulators();
  _tile_dpbssd(4, 0, 2);
  _tile_dpbssd(5, 0, 3);
  _tile_loadd(2, b_tiles + 512, 64);
  _tile_loadd(3, b_tiles + 768, 64);
  _tile_dpbssd(6, 1, 2);
  _tile_dpbssd(7, 1, 3);
  amx::store_accumulators(dots);
}

inline void fold(const int32_t (*dots)[16][16], const float* scale, const float* d, int64_t blocks, int64_t rows,
                 float (*acc)[PANEL]) {
  const __m512 s00 = _mm512_loadu_ps(scale), s01 = _mm512_loadu_ps(scale + 16);
  const __m512 s10 = _mm512_loadu_ps(scale + PANEL), s11 = _mm512_loadu_ps(scale + PANEL + 16);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 dr = _mm512_set1_ps(d[r * blocks]);
    __m512 a0 = _mm512_load_ps(acc[r]), a1 = _mm512_load_ps(acc[r] + 16);
    a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[0][r])), _mm512_mul_ps(s00, dr), a0);
    a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[1][r])), _mm512_mul_ps(s01, dr), a1);
    a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[2][r])), _mm512_mul_ps(s10, dr), a0);
    a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[3][r])), _mm512_mul_ps(s11, dr), a1);
    _mm512_store_ps(acc[r], a0);
    _mm512_store_ps(acc[r] + 16, a1);
  }
}

void panel_rows(const Rows16& o, int64_t n0, int64_t m0, int64_t m1, const Panel16& p) {
  const quant::QuantizedRows& q = *o.q;
  const int64_t K = o.K, blocks = K / 32, groups = K / 16;
  const int64_t valid = std::min<int64_t>(PANEL, o.N - n0);
  const __mmask16 mask0 = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  const __mmask16 mask1 = valid >= 32 ? __mmask16(0xFFFF) : valid <= 16 ? __mmask16(0) : __mmask16((1u << (valid - 16)) - 1);
  alignas(64) int32_t dots[2][4][16][16];
  alignas(64) float acc[ROWS][PANEL];
  for (int64_t g = m0; g < m1; g += ROWS) {  // (m0 is a multiple of 16: row blocks are)
    const int64_t rows = std::min<int64_t>(ROWS, m1 - g);
    std::memset(acc, 0, sizeof(acc));
    const int8_t* a = o.act + (g / 16) * groups * 256;
    const float* d = q.scale.data() + g * blocks;
    block_dots(a, p.codes.data(), dots[0]);
    for (int64_t b = 1; b < blocks; ++b) {
      block_dots(a + 512 * b, p.codes.data() + 1024 * b, dots[b % 2]);
      fold(dots[(b - 1) % 2], p.scale.data() + 2 * (b - 1) * PANEL, d + b - 1, blocks, rows, acc);
    }
    fold(dots[(blocks - 1) % 2], p.scale.data() + 2 * (blocks - 1) * PANEL, d + blocks - 1, blocks, rows, acc);
    // the bias (masked loads: the panel may pass the last output; zero where there is none)
    const __m512 bias0 = o.bias != nullptr ? _mm512_maskz_loadu_ps(mask0, o.bias + n0) : _mm512_setzero_ps();
    const __m512 bias1 = o.bias != nullptr && mask1 ? _mm512_maskz_loadu_ps(mask1, o.bias + n0 + 16) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      float* out = o.y + (g + r) * o.N + n0;
      __m512 total0 = _mm512_load_ps(acc[r]), total1 = _mm512_load_ps(acc[r] + 16);
      if (o.bias != nullptr) total0 = _mm512_add_ps(total0, bias0), total1 = _mm512_add_ps(total1, bias1);
      _mm512_mask_storeu_ps(out, mask0, total0);
      if (mask1) _mm512_mask_storeu_ps(out + 16, mask1, total1);
    }
  }
}

}  // namespace
}  // namespace amx
}  // namespace fastdecode

#pragma GCC pop_options
