// kvchat's decode operators (core/ops/kernels.py): what the .cpp files share. One translation unit each:
// attention.cpp (scores, values, the masked softmax), products.cpp (matvec, the RMS norm, project), layer.cpp
// (block, layer) and register.cpp (the torch operators).
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>
#if defined(__AVX__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define KVCHAT_F16C 1
#endif
#if defined(KVCHAT_F16C) && defined(__AVX2__)
#define KVCHAT_AVX2 1
#endif


namespace kvchat {

#ifndef KVCHAT_BLOCK
#define KVCHAT_BLOCK 128
#endif
constexpr int64_t BLOCK = KVCHAT_BLOCK;  // slots per block of work (kernels.BLOCK, passed at the build)

inline void check(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0), what, ": 3-d tensors of the same heads");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat, what, ": float32 tensors");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), what, ": CPU tensors");
}

// A cache buffer [H, C, D] as it is when each head's rows are dense (head after head at any distance: the first
// slots of a larger buffer, as the eager step hands them), else a contiguous copy.
inline at::Tensor rows(const at::Tensor& t) {
  return t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == t.size(2)) ? t : t.contiguous();
}

#ifdef KVCHAT_AVX2
// e^x for eight lanes (Cephes' polynomial; within 2 ulp), x clamped to [-87, 88] so that 2^n stays a normal float:
// the softmax's and SiLU's exponentials, which the library would otherwise compute one value at a time here.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif


#ifdef KVCHAT_F16C
inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_hadd_ps(h, h);
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(h);
}
#endif

at::Tensor scores(const at::Tensor& q, const at::Tensor& k);
at::Tensor values(const at::Tensor& p, const at::Tensor& v);
void masked_softmax(float* s, const int64_t* lens, int64_t H, int64_t G, int64_t C);
at::Tensor matvec(const at::Tensor& x, const at::Tensor& w);
void rms_norm(const float* x, const float* w, double eps, float* out, int64_t E);
at::Tensor project(const at::Tensor& x, const at::Tensor& n, double eps, const at::Tensor& w,
                   const c10::optional<at::Tensor>& bias, const at::Tensor& cos, const at::Tensor& sin,
                   int64_t rotated);
std::tuple<at::Tensor, at::Tensor> block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& lens, const at::Tensor& x, const at::Tensor& o_w,
                                         const at::Tensor& n2, double eps, const at::Tensor& gu_w,
                                         const at::Tensor& down_w);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer(
    const at::Tensor& x, const at::Tensor& n1, double eps1, const at::Tensor& qkv_w,
    const c10::optional<at::Tensor>& qkv_b, const at::Tensor& cos, const at::Tensor& sin, int64_t nq,
    const at::Tensor& keys, const at::Tensor& values, int64_t cap, int64_t n, double scaling, const at::Tensor& o_w,
    const at::Tensor& n2, double eps2, const at::Tensor& gu_w, const at::Tensor& down_w,
    const c10::optional<at::Tensor>& sums);

}  // namespace kvchat
