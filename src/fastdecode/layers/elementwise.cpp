// Fused element-wise ops of a decoder block (AVX2; float32 only; layers/elementwise.py holds the
// PyTorch fallback and picks between them).
//
// At decode a block's element-wise work is a few thousand floats, so the time goes to dispatching
// PyTorch ops (F.rms_norm alone is seven on CPU), not to arithmetic. Each op here replaces a chain:
//   rms_norm      y = (x * r) * w,  r = 1 / sqrt(mean(x^2) + eps)      (F.rms_norm's op order)
//   add_rms_norm  s = x + delta (or + rms_norm(delta, delta_weight): Gemma's post-norms);
//                 returns (s, rms_norm(s, weight)): the residual add and the next block's norm
//   qkv_heads     a fused Q/K/V product's output split into q, k, v heads [B, heads, T, D]; the query
//                 and key heads optionally RMS-normed per head first (Gemma's q/k norms), then
//                 rotated in the half-split layout:
//                 y[i] = x[i] * cos[i] + x[i +- rot/2] * signed_sin[i] (rotate_heads' op order)
//   gated         act(gate) * up over [..., 2I] = [gate | up] (SiLU, or GELU with tanh); 16 lanes at a
//                 time where the CPU has AVX-512 (gated_avx512.cpp: the same bits)
// Every product and sum is rounded as the PyTorch ops round it (mul, then add; no FMA: kernels.py
// builds with -ffp-contract=off); only the sum of squares runs in another order. The activations
// use the SLEEF functions PyTorch's own vectorized kernels call.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sleef.h>
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "isa.h"
#include "parallel.h"

namespace fastdecode::avx512 {
int64_t gated_row(const float* g, const float* u, float* y, int64_t n, int64_t kind);  // gated_avx512.cpp
}

namespace {

float sum_of_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float total = _mm_cvtss_f32(s);
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

// y[i] = (x[i] * r) * w[i] (w null: x[i] * r), r = 1 / sqrt(mean(x^2) + eps). y may alias x.
void normalize(const float* x, const float* w, float eps, int64_t n, float* y) {
  const float r = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), rv);
    if (w) v = _mm256_mul_ps(v, _mm256_loadu_ps(w + i));
    _mm256_storeu_ps(y + i, v);
  }
  for (; i < n; ++i) y[i] = w ? (x[i] * r) * w[i] : x[i] * r;
}

void check_float_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), name, " must be float32 on the CPU");
}

const float* weight_data(const c10::optional<at::Tensor>& w, int64_t n, const char* name) {
  if (!w.has_value()) return nullptr;
  check_float_rows(*w, name);
  TORCH_CHECK(w->is_contiguous() && w->numel() == n, name, " must be contiguous with ", n, " elements");
  return w->data_ptr<float>();
}

// Rows per piece when an op's rows are split over threads (the `.split` overloads: a prompt's rows; every row is
// computed alone, so the split changes no bit): about ROW_PIECE_FLOATS floats of a row's width.
constexpr int64_t ROW_PIECE_FLOATS = 1 << 14;
inline int64_t row_chunk(int64_t width) { return std::max<int64_t>(1, ROW_PIECE_FLOATS / std::max<int64_t>(1, width)); }

// x [..., C] -> rms_norm(x) * weight [..., C]
at::Tensor rms_norm(const at::Tensor& x_in, const c10::optional<at::Tensor>& weight, double eps) {
  check_float_rows(x_in, "x");
  const at::Tensor x = x_in.contiguous();
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  const float* w = weight_data(weight, C, "weight");
  at::Tensor y = at::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) normalize(src + r * C, w, static_cast<float>(eps), C, dst + r * C);
  return y;
}

// x, delta [..., C] -> (s = x + delta', rms_norm(s) * weight); delta' = rms_norm(delta) * delta_weight
// where delta_weight is given, else delta.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_split(const at::Tensor& x_in, const at::Tensor& delta_in,
                                                      const c10::optional<at::Tensor>& delta_weight,
                                                      const at::Tensor& weight, double eps, int64_t threads) {
  check_float_rows(x_in, "x");
  check_float_rows(delta_in, "delta");
  TORCH_CHECK(x_in.sizes() == delta_in.sizes(), "x and delta differ in shape");
  const at::Tensor x = x_in.contiguous(), delta = delta_in.contiguous();
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  const float* dw = weight_data(delta_weight, C, "delta_weight");
  const float* w = weight_data(weight, C, "weight");
  at::Tensor s = at::empty_like(x), y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  fastdecode::parallel_chunks(rows, row_chunk(C), threads, [&](int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = xp + r * C;
    float* sr = sp + r * C;
    if (dw) normalize(dp + r * C, dw, e, C, sr);  // the normed delta, then the sum in place
    const float* d = dw ? sr : dp + r * C;
    int64_t i = 0;
    for (; i + 8 <= C; i += 8) _mm256_storeu_ps(sr + i, _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(d + i)));
    for (; i < C; ++i) sr[i] = xr[i] + d[i];
    normalize(sr, w, e, C, yp + r * C);
  }
  });
  return {s, y};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const c10::optional<at::Tensor>& delta_weight,
                                                const at::Tensor& weight, double eps) {
  return add_rms_norm_split(x, delta, delta_weight, weight, eps, 1);
}

// qkv [B, T, (H + 2 Hkv) D] (one product's output: query, key, value heads; last dim contiguous) ->
// q [B, H, T, D], k, v [B, Hkv, T, D]. Query and key heads are optionally RMS-normed over D with
// norm_weight [H + Hkv, D] first, then their first rot dims rotated by cos, signed_sin [B, T, 1, rot]
// (half-split pairs (i, i + rot/2)); dims past rot pass through. Value heads are copied.
std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_heads_split(const at::Tensor& qkv, int64_t H, int64_t Hkv,
                                                               const c10::optional<at::Tensor>& norm_weight, double eps,
                                                               const at::Tensor& cos_in, const at::Tensor& sin_in,
                                                               int64_t threads) {
  check_float_rows(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && H > 0 && Hkv > 0 && qkv.size(2) % (H + 2 * Hkv) == 0,
              "qkv must be [B, T, (H + 2 Hkv) * D] with a contiguous last dim");
  const int64_t B = qkv.size(0), T = qkv.size(1), D = qkv.size(2) / (H + 2 * Hkv);
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t rot = cos.size(-1), half = rot / 2;
  TORCH_CHECK(rot % 2 == 0 && rot <= D && cos.numel() == B * T * rot && sin.numel() == cos.numel(),
              "cos/sin must be [B, T, 1, rot] with an even rot <= D");
  const float* nw = weight_data(norm_weight, (H + Hkv) * D, "norm_weight");
  at::Tensor q = at::empty({B, H, T, D}, qkv.options()), k = at::empty({B, Hkv, T, D}, qkv.options());
  at::Tensor v = at::empty({B, Hkv, T, D}, qkv.options());
  const float e = static_cast<float>(eps);
  fastdecode::parallel_chunks(B * T, row_chunk(qkv.size(2)), threads, [&](int64_t bt0, int64_t bt1) {
  std::vector<float> normed(D);
  for (int64_t bt = bt0; bt < bt1; ++bt) {
      const int64_t b = bt / T, t = bt % T;
      const float* row = qkv.data_ptr<float>() + b * qkv.stride(0) + t * qkv.stride(1);
      const float* c = cos.data_ptr<float>() + (b * T + t) * rot;
      const float* s = sin.data_ptr<float>() + (b * T + t) * rot;
      for (int64_t h = 0; h < H + 2 * Hkv; ++h) {
        const float* x = row + h * D;
        const bool is_q = h < H, is_v = h >= H + Hkv;
        const int64_t head = is_q ? h : is_v ? h - H - Hkv : h - H;
        float* y = (is_q ? q : is_v ? v : k).data_ptr<float>() + ((b * (is_q ? H : Hkv) + head) * T + t) * D;
        if (is_v) {
          std::copy(x, x + D, y);
          continue;
        }
        if (nw) {
          normalize(x, nw + h * D, e, D, normed.data());
          x = normed.data();
        }
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
          const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + half + i);
          _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(c + i)),
                                                _mm256_mul_ps(hi, _mm256_loadu_ps(s + i))));
          _mm256_storeu_ps(y + half + i, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(c + half + i)),
                                                       _mm256_mul_ps(lo, _mm256_loadu_ps(s + half + i))));
        }
        for (; i < half; ++i) {
          y[i] = x[i] * c[i] + x[half + i] * s[i];
          y[half + i] = x[half + i] * c[half + i] + x[i] * s[half + i];
        }
        std::copy(x + rot, x + D, y + rot);
      }
    }
  });
  return {q, k, v};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_heads(const at::Tensor& qkv, int64_t H, int64_t Hkv,
                                                         const c10::optional<at::Tensor>& norm_weight, double eps,
                                                         const at::Tensor& cos, const at::Tensor& sin) {
  return qkv_heads_split(qkv, H, Hkv, norm_weight, eps, cos, sin, 1);
}

constexpr int64_t SILU = 0, GELU_TANH = 1;

// PyTorch's formulas: silu x / (1 + exp(-x)); gelu 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
inline __m256 activate(__m256 x, int64_t kind) {
  const __m256 one = _mm256_set1_ps(1.0f);
  if (kind == SILU) return _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), x))));
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5)),
                                     _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube)));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, Sleef_tanhf8_u10(inner)));
}

inline float activate(float x, int64_t kind) {
  if (kind == SILU) return x / (1.0f + std::exp(-x));
  const float inner = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5) * (x + 0.044715f * (x * x * x));
  return 0.5f * x * (1.0f + std::tanh(inner));
}

// gate_up [..., 2I] = [gate | up] (last dim contiguous) -> act(gate) * up [..., I]
at::Tensor gated_split(const at::Tensor& gate_up_in, int64_t kind, int64_t threads) {
  check_float_rows(gate_up_in, "gate_up");
  TORCH_CHECK(kind == SILU || kind == GELU_TANH, "activation is 0 (SiLU) or 1 (GELU tanh), not ", kind);
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t I = gate_up.size(-1) / 2, rows = I ? gate_up.numel() / (2 * I) : 0;
  TORCH_CHECK(gate_up.size(-1) == 2 * I, "gate_up's last dim must be even");
  std::vector<int64_t> sizes(gate_up.sizes().begin(), gate_up.sizes().end());
  sizes.back() = I;
  at::Tensor out = at::empty(sizes, gate_up.options());
  const bool avx512 = fastdecode::use_avx512();
  fastdecode::parallel_chunks(rows, row_chunk(2 * I), threads, [&](int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = gate_up.data_ptr<float>() + r * 2 * I;
    const float* u = g + I;
    float* y = out.data_ptr<float>() + r * I;
    int64_t i = avx512 ? fastdecode::avx512::gated_row(g, u, y, I, kind) : 0;  // 16 lanes, the same bits
    for (; i + 8 <= I; i += 8)
      _mm256_storeu_ps(y + i, _mm256_mul_ps(activate(_mm256_loadu_ps(g + i), kind), _mm256_loadu_ps(u + i)));
    for (; i < I; ++i) y[i] = activate(g[i], kind) * u[i];
  }
  });
  return out;
}

at::Tensor gated(const at::Tensor& gate_up, int64_t kind) { return gated_split(gate_up, kind, 1); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdecode_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor? delta_weight, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("qkv_heads(Tensor qkv, int num_heads, int num_kv_heads, Tensor? norm_weight, float eps, Tensor cos, Tensor sin) -> (Tensor, Tensor, Tensor)");
  m.def("gated(Tensor gate_up, int activation) -> Tensor");
  // the same ops with their rows split over `threads` (prompt rows: layers/elementwise.py)
  m.def("add_rms_norm.split(Tensor x, Tensor delta, Tensor? delta_weight, Tensor weight, float eps, int threads) -> (Tensor, Tensor)");
  m.def("qkv_heads.split(Tensor qkv, int num_heads, int num_kv_heads, Tensor? norm_weight, float eps, Tensor cos, Tensor sin, int threads) -> (Tensor, Tensor, Tensor)");
  m.def("gated.split(Tensor gate_up, int activation, int threads) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdecode_kernels, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("qkv_heads", &qkv_heads);
  m.impl("gated", &gated);
  m.impl("add_rms_norm.split", &add_rms_norm_split);
  m.impl("qkv_heads.split", &qkv_heads_split);
  m.impl("gated.split", &gated_split);
}
