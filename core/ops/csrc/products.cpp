// The products with the fp16 weight copies, the RMS norm, and a layer's part before its cache write.
#include "kvchat_ops.h"

namespace kvchat {

// One fp32 row times one fp16 row, the fp16 values widened in registers.
inline float dot(const float* x, const at::Half* w, int64_t K) {
  int64_t k = 0;
  float acc = 0.f;
#ifdef KVCHAT_F16C
  // Four sums of eight lanes in flight, one row read straight through (more rows at a time read slower here).
  const auto* wh = reinterpret_cast<const __m128i*>(w);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 32 <= K; k += 32, wh += 4) {
    a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(wh)), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(wh + 1)), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(wh + 2)), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(wh + 3)), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8, ++wh)
    a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(wh)), _mm256_loadu_ps(x + k), a0);
  acc = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
  for (; k < K; ++k) acc += x[k] * static_cast<float>(w[k]);
  return acc;
}

at::Tensor matvec(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && x_in.dim() >= 1 && x_in.size(-1) == w_in.size(1),
              "kvchat::matvec: x [..., K] and w [N, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kHalf,
              "kvchat::matvec: float32 x, float16 w");
  TORCH_CHECK(x_in.device().is_cpu() && w_in.device().is_cpu(), "kvchat::matvec: CPU tensors");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), M = K ? x.numel() / K : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  if (K == 0) return out.zero_();  // an empty sum
  const float* xp = x.data_ptr<float>();
  const at::Half* wp = w.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  // Rows of w shared out over ATen's threads; each row read once, for every row of x.
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = dot(xp + m * K, wp + n * K, K);
  });
  return out;
}


// out[e] = w[e] * (x[e] / sqrt(mean(x^2) + eps)) for E values: Llama's RMS norm, as the model writes it.
void rms_norm(const float* x, const float* w, double eps, float* out, int64_t E) {
  float ss = 0.f;
  for (int64_t e = 0; e < E; ++e) ss += x[e] * x[e];
  const float r = 1.f / std::sqrt(ss / E + static_cast<float>(eps));
  for (int64_t e = 0; e < E; ++e) out[e] = w[e] * (x[e] * r);
}


// A layer's first part in one call where the eager step made six: the RMS norm of one token's x [..., E] (weight n,
// eps), its product with w [N, E] (fp16, ``matvec``), the bias [N] if given, and the rotary embedding of the first
// ``rotated`` outputs, head after head of D = cos.numel() values: y * cos + roll(y, D / 2) * sin' with sin' =
// cat(-sin1, sin2), the eager step's form of the model's y * cos + rotate_half(y) * sin. With ``rotated`` 0, the
// output layer's norm and product. Returns [..., N] in fp32.
at::Tensor project(const at::Tensor& x_in, const at::Tensor& n_in, double eps, const at::Tensor& w,
                   const c10::optional<at::Tensor>& bias_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                   int64_t rotated) {
  const int64_t E = x_in.size(-1), N = w.size(0), D = cos_in.numel();
  TORCH_CHECK(x_in.numel() == E && x_in.scalar_type() == at::kFloat && n_in.numel() == E &&
              n_in.scalar_type() == at::kFloat, "kvchat::project: one float32 token of E values and E norm weights");
  TORCH_CHECK(cos_in.scalar_type() == at::kFloat && sin_in.scalar_type() == at::kFloat && sin_in.numel() == D &&
              D % 2 == 0 && rotated >= 0 && rotated <= N && (rotated == 0 || (D > 0 && rotated % D == 0)),
              "kvchat::project: float32 cos and sin of one even head size dividing the rotated outputs");
  const at::Tensor xin = x_in.contiguous(), n = n_in.contiguous();
  at::Tensor h = at::empty({1, E}, xin.options());
  rms_norm(xin.data_ptr<float>(), n.data_ptr<float>(), eps, h.data_ptr<float>(), E);
  at::Tensor out = matvec(h, w);  // checks w
  float* op = out.data_ptr<float>();
  if (bias_in.has_value()) {
    const at::Tensor b = bias_in->contiguous();
    TORCH_CHECK(b.numel() == N && b.scalar_type() == at::kFloat, "kvchat::project: a float32 bias of N values");
    const float* bp = b.data_ptr<float>();
    for (int64_t i = 0; i < N; ++i) op[i] += bp[i];
  }
  const at::Tensor c = cos_in.contiguous(), s = sin_in.contiguous();
  const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  const int64_t half = D / 2;
  std::vector<float> y(D);
  for (int64_t base = 0; base < rotated; base += D) {
    std::copy(op + base, op + base + D, y.begin());
    for (int64_t j = 0; j < D; ++j) op[base + j] = y[j] * cp[j] + y[(j + half) % D] * sp[j];
  }
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  return out.view(shape);
}

}  // namespace kvchat
