// The rest of a layer after its cache write (block), and a whole layer with its cache write (layer).
#include "kvchat_ops.h"

namespace kvchat {

// The rest of a decoder layer after its new key and value are in the cache, in one call instead of the eight
// operator and kernel calls it takes as separate ones: attention of the scaled queries q [H, G, D] over each head's
// slots [0, lens[h]] of k and v [H, C, D] (later slots get probability 0), the output projection o_w [E, H * G * D]
// added to x [..., E], the RMS norm (weight n2, eps), gate and up (gu_w [2I, E]), SiLU(gate) * up, the down
// projection (down_w [E, I]) added. Returns the layer's output and the attention probabilities [H, G, C].
std::tuple<at::Tensor, at::Tensor> block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& lens_in, const at::Tensor& x_in, const at::Tensor& o_w,
                                         const at::Tensor& n2_in, double eps, const at::Tensor& gu_w,
                                         const at::Tensor& down_w) {
  check(q, k, "kvchat::block");
  const int64_t H = k.size(0), G = q.size(1), C = k.size(1), D = k.size(2), E = x_in.size(-1);
  TORCH_CHECK(q.size(2) == D && v.sizes() == k.sizes(), "kvchat::block: queries, keys and values of one size");
  TORCH_CHECK(lens_in.dim() == 1 && lens_in.size(0) == H && lens_in.scalar_type() == at::kLong,
              "kvchat::block: one int64 length per head");
  TORCH_CHECK(x_in.numel() == E && x_in.scalar_type() == at::kFloat && n2_in.numel() == E &&
              n2_in.scalar_type() == at::kFloat, "kvchat::block: one float32 token of E values and E norm weights");
  TORCH_CHECK(o_w.dim() == 2 && o_w.size(0) == E && o_w.size(1) == H * G * D && gu_w.dim() == 2 &&
              gu_w.size(1) == E && gu_w.size(0) % 2 == 0 && down_w.dim() == 2 && down_w.size(0) == E &&
              2 * down_w.size(1) == gu_w.size(0), "kvchat::block: o [E, H*G*D], gate/up [2I, E], down [E, I]");
  const at::Tensor lens = lens_in.contiguous(), n2 = n2_in.contiguous();
  at::Tensor probs = scores(q, k);
  masked_softmax(probs.data_ptr<float>(), lens.data_ptr<int64_t>(), H, G, C);
  const at::Tensor attn = values(probs, v).reshape({1, H * G * D});
  at::Tensor x = matvec(attn, o_w).view({E});
  float* xp = x.data_ptr<float>();
  const at::Tensor xin = x_in.contiguous();
  const float* xi = xin.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e) xp[e] += xi[e];
  at::Tensor h = at::empty({1, E}, x.options());
  rms_norm(xp, n2.data_ptr<float>(), eps, h.data_ptr<float>(), E);
  const at::Tensor gu = matvec(h, gu_w);
  const int64_t I = down_w.size(1);
  at::Tensor a = at::empty({1, I}, x.options());
  const float* g = gu.data_ptr<float>();
  float* ap = a.data_ptr<float>();
  int64_t i = 0;
#ifdef KVCHAT_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= I; i += 8) {
    const __m256 g8 = _mm256_loadu_ps(g + i);
    const __m256 silu = _mm256_div_ps(g8, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g8))));
    _mm256_storeu_ps(ap + i, _mm256_mul_ps(silu, _mm256_loadu_ps(g + I + i)));
  }
#endif
  for (; i < I; ++i) ap[i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
  const at::Tensor d = matvec(a, down_w);
  const float* dp = d.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e) xp[e] += dp[e];
  return {x.view(x_in.sizes()), probs};
}

// A whole decoder layer for one token whose cache heads all hold n slots of buffers with room for more, in one call
// where the eager step made ``project``, the cache write and ``block`` with a dozen small operations between them:
// ``project`` (the norm, q/k/v, the bias, the rotary embedding of the queries and keys), the new key and value
// written at slot n of each head of ``keys``/``values`` ([H * cap, D], head h's slots from row h * cap), then
// ``block`` over each head's slots [0, n] with the queries times ``scaling``. Returns the layer's output, the queries
// [1, H * G, 1, D] (rotated, unscaled), the new key and value [1, H, 1, D] (what the cache layer records besides) and
// the attention probabilities [H, G, n + 1]. With ``sums`` (a per-slot statistic [H * cap], H2O's), each slot's
// probability averaged over its head's G queries is added to it: ``sums.view(H, cap)[:, :n + 1] += probs.mean(1)``,
// the same sums in the same order.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer(
    const at::Tensor& x, const at::Tensor& n1, double eps1, const at::Tensor& qkv_w,
    const c10::optional<at::Tensor>& qkv_b, const at::Tensor& cos, const at::Tensor& sin, int64_t nq,
    const at::Tensor& keys, const at::Tensor& values, int64_t cap, int64_t n, double scaling, const at::Tensor& o_w,
    const at::Tensor& n2, double eps2, const at::Tensor& gu_w, const at::Tensor& down_w,
    const c10::optional<at::Tensor>& sums) {
  const int64_t N = qkv_w.dim() == 2 ? qkv_w.size(0) : 0, D = cos.numel();
  const int64_t nk = (N - nq) / 2, H = D > 0 ? nk / D : 0;
  TORCH_CHECK(keys.dim() == 2 && keys.sizes() == values.sizes() && keys.size(1) == D && keys.is_contiguous() &&
              values.is_contiguous() && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat &&
              keys.device().is_cpu() && values.device().is_cpu(),
              "kvchat::layer: contiguous float32 CPU key and value buffers [H * cap, D] of the rotary head size");
  TORCH_CHECK(nq > 0 && nk > 0 && N == nq + 2 * nk && nk % D == 0 && nq % nk == 0 && cap > 0 &&
              keys.size(0) == H * cap && n >= 0 && n < cap,
              "kvchat::layer: q/k/v outputs of whole heads, H * cap buffer rows and a free slot n < cap");
  TORCH_CHECK(!sums.has_value() || (sums->dim() == 1 && sums->size(0) == H * cap && sums->is_contiguous() &&
                                    sums->scalar_type() == at::kFloat && sums->device().is_cpu()),
              "kvchat::layer: sums as one contiguous float32 CPU value per buffer row");
  const at::Tensor qkv = project(x, n1, eps1, qkv_w, qkv_b, cos, sin, nq + nk).view({N});
  const float* src = qkv.data_ptr<float>();
  float *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    std::copy(src + nq + h * D, src + nq + (h + 1) * D, kp + (h * cap + n) * D);
    std::copy(src + nq + nk + h * D, src + nq + nk + (h + 1) * D, vp + (h * cap + n) * D);
  }
  const int64_t G = nq / nk;
  at::Tensor qh = at::empty({H, G, D}, qkv.options());
  float* qp = qh.data_ptr<float>();
  const float s = static_cast<float>(scaling);  // as ``q * scaling`` computes it for float32
  for (int64_t i = 0; i < nq; ++i) qp[i] = src[i] * s;
  const at::Tensor k = keys.as_strided({H, n + 1, D}, {cap * D, D, 1});
  const at::Tensor v = values.as_strided({H, n + 1, D}, {cap * D, D, 1});
  auto out = block(qh, k, v, at::full({H}, n, qkv.options().dtype(at::kLong)), x, o_w, n2, eps2, gu_w, down_w);
  if (sums.has_value()) {
    const float* pp = std::get<1>(out).data_ptr<float>();
    float* sp = sums->data_ptr<float>();
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c <= n; ++c) {
        float acc = pp[h * G * (n + 1) + c];
        for (int64_t g = 1; g < G; ++g) acc += pp[(h * G + g) * (n + 1) + c];
        sp[h * cap + c] += acc / static_cast<float>(G);
      }
  }
  return {std::get<0>(out), qkv.narrow(0, 0, nq).view({1, H * G, 1, D}), qkv.narrow(0, nq, nk).view({1, H, 1, D}),
          qkv.narrow(0, nq + nk, nk).view({1, H, 1, D}), std::get<1>(out)};
}

}  // namespace kvchat
