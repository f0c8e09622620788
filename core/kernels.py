"""The decode step's products (core/step.py) as small C++ operators: attention's two, the products with the fp16
weights, the two parts of a layer around its cache write built from them (which the compiled step's graph calls
inside it, and the eager step where a cache layer must resize first), and a whole layer with its cache write, which
the eager step calls once per layer.

A decode step multiplies one token's vector with every weight matrix and a few queries per KV head (GQA's groups: 3
for the default model) with ~1,000 cached keys and values per head. Both are reads of memory with little arithmetic,
and the library kernels for these shapes read at well under this machine's memory bandwidth. Ad hoc, with buffers
cycled so that they come from memory as in a step (README, Speed): attention over 30 layers of 1,088 slots took 1.85
ms (scores) and 2.14 ms (values) as ``torch.bmm``; 1.19 and 1.21 with the last version's plain loops, 1.10 and 1.16
with the current ones (medians of 15 rounds in one run); the values 1.11 against 1.24 once the blocks' sums were
added inside the operator instead of by a ``sum`` call (another run). Weights shaped like the default model's (30
layers' seven projections and the output layer, 276 MB of fp16; q/k/v with 1,152 rows where the model's have 960),
medians of 12 rounds in one run: ``matvec`` 10.2 ms (27.1 GB/s), inductor's reduction kernel for ``(x *
w.float()).sum(-1)`` 13.6 (20.3), an fp16 ``F.linear`` 11.5 (23.9), a plain sum of the same bytes 9.5 (29.0). The
operators:

* ``kvchat::scores(q [H, G, D], k [H, C, D]) -> [H, G, C]``: ``q @ k.transpose(1, 2)``, one dot product per query
  and slot;
* ``kvchat::values(p [H, G, C], v [H, C, D]) -> [H, G, D]``: ``p @ v``, each block's weighted rows summed, then the
  blocks' sums;
* ``kvchat::matvec(x [..., K] fp32, w [N, K] fp16) -> [..., N] fp32``: ``x @ w.T`` with ``w`` widened to fp32 in
  registers, fp32 sums; the rows of ``w`` shared out over ATen's threads, each read once;
* ``kvchat::project(x, n, eps, w, bias, cos, sin, rotated) -> [..., N]``: a layer's part before its cache write —
  the RMS norm of one token's x, its product with w (q/k/v concatenated; ``matvec``), the bias if any, and the rotary
  embedding of the first ``rotated`` outputs (queries and keys) head by head — in one call where the eager step made
  six or more; with ``rotated`` 0, the output layer's norm and product;
* ``kvchat::block(q, k, v, lens, x, o_w, n2, eps, gu_w, down_w) -> (x', probs)``: the rest of a Llama-family layer
  once its new key and value are in the cache — the scores, the softmax over each head's slots up to ``lens[h]``
  (later ones 0), the weighted values, the output projection added to ``x``, the RMS norm, gate and up, SiLU(gate) *
  up, the down projection added — with the three above inside and the norm, the softmax's and SiLU's exponentials
  (eight lanes at a time with AVX2) and the adds in between, so that the graph makes one operator call per layer
  where it made eight operator and kernel calls. Alternating with those in blocks of 8 tokens (ad hoc,
  ``streaming``, budget 1024, six replies of 96 tokens): 9.68-10.17 ms per token against 9.99-10.29;
* ``kvchat::layer(x, n1, eps1, qkv_w, qkv_b, cos, sin, nq, keys, values, cap, n, scaling, o_w, n2, eps2, gu_w,
  down_w, sums=None) -> (x', q, k, v, probs)``: a whole layer of the eager step where every head of the cache layer
  has a free slot n: ``project``, the new key and value written at slot n of each head of the layer's buffers
  ([heads * cap, D], head after head), the queries times ``scaling`` and ``block`` over slots [0, n], and with
  ``sums`` (H2O's per-slot statistic) each slot's probability averaged over its head's queries added to it; the
  eager step's Python around its three parts (views, the cache write, the scaling, H2O's sums) in C++. The bits of
  the three parts (tests/test_step.py); not registered for ``torch.compile`` (the compiled step writes the cache
  inside its graph).

Attention reads each head's slots in place: a cache buffer's heads may lie any distance apart (the eager step hands
the first n slots of each, a view), its rows of one head one after the other. It streams them in blocks of ``BLOCK``
slots shared out over ATen's threads. With AVX, FMA and F16C (x86-64 since about 2013) the three products are
written with their intrinsics (for attention, head sizes that are multiples of 8; a key of up to 64 values stays in
registers while every query meets it); elsewhere as plain loops the compiler vectorizes. All are float32 arithmetic
in another summation order than the library's (tests/test_step.py compares them with ``torch.bmm``, a widened
product and the separate operations). They are built once per machine with ``torch.utils.cpp_extension`` (g++;
ninja, a kvchat dependency; ``-march=native``) into torch's extension cache, and registered as torch operators so
that ``torch.compile`` calls them inside its graph. ``load()`` says why they cannot be had; the eager step then runs
without them and the compiled step uses ``torch.bmm`` and inductor's own products.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading

import torch

log = logging.getLogger(__name__)

BLOCK = 128  # slots per block of work

SOURCE = r"""
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

namespace {

constexpr int64_t BLOCK = %(block)d;

void check(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0), what, ": 3-d tensors of the same heads");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat, what, ": float32 tensors");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), what, ": CPU tensors");
}

// A cache buffer [H, C, D] as it is when each head's rows are dense (head after head at any distance: the first
// slots of a larger buffer, as the eager step hands them), else a contiguous copy.
at::Tensor rows(const at::Tensor& t) {
  return t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == t.size(2)) ? t : t.contiguous();
}

#if defined(KVCHAT_F16C) && defined(__AVX2__)
#define KVCHAT_AVX2 1
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

// Slots [c0, c1) of one head's scores, D a multiple of 8: one slot at a time, its key read once from memory and
// from the L1 cache for each further query, two sums of eight lanes in flight.
inline void scores_avx(const float* q, const float* k, float* out, int64_t G, int64_t C, int64_t D, int64_t c0,
                       int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) {
    const float* kr = k + c * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qr = q + g * D;
      __m256 a = _mm256_setzero_ps(), b = a;
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(kr + d), a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d + 8), _mm256_loadu_ps(kr + d + 8), b);
      }
      if (d < D) a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(kr + d), a);
      out[g * C + c] = hsum(_mm256_add_ps(a, b));
    }
  }
}

// The same for D = 8 * NV <= 64: each key held in NV registers while every query meets it.
template <int NV>
inline void scores_reg(const float* q, const float* k, float* out, int64_t G, int64_t C, int64_t c0, int64_t c1) {
  constexpr int64_t D = 8 * NV;
  for (int64_t c = c0; c < c1; ++c) {
    __m256 kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = _mm256_loadu_ps(k + c * D + 8 * j);
    for (int64_t g = 0; g < G; ++g) {
      const float* qr = q + g * D;
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qr), kv[0]), b = _mm256_setzero_ps();
      for (int j = 1; j < NV; ++j) {
        if (j %% 2) b = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * j), kv[j], b);
        else a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * j), kv[j], a);
      }
      out[g * C + c] = hsum(_mm256_add_ps(a, b));
    }
  }
}

// Columns [d0, d0 + 8 * NV) of one query's weighted sum over slots [c0, c1), the sums held in NV registers.
template <int NV>
inline void values_avx(const float* w, const float* v, float* out, int64_t D, int64_t d0, int64_t c0, int64_t c1) {
  __m256 a[NV];
  for (int j = 0; j < NV; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t c = c0; c < c1; ++c) {
    const __m256 wc = _mm256_set1_ps(w[c]);
    const float* vr = v + c * D + d0;
    for (int j = 0; j < NV; ++j) a[j] = _mm256_fmadd_ps(wc, _mm256_loadu_ps(vr + 8 * j), a[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + d0 + 8 * j, a[j]);
}
#endif

at::Tensor scores(const at::Tensor& q_in, const at::Tensor& k_in) {
  check(q_in, k_in, "kvchat::scores");
  TORCH_CHECK(q_in.size(2) == k_in.size(2), "kvchat::scores: queries and keys of one size");
  const at::Tensor q = q_in.contiguous(), k = rows(k_in);
  const int64_t H = k.size(0), C = k.size(1), D = k.size(2), G = q.size(1), nb = (C + BLOCK - 1) / BLOCK;
  const int64_t hs = k.stride(0);  // from one head's slots to the next's
  at::Tensor out = at::empty({H, G, C}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, H * nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / nb, c0 = (i %% nb) * BLOCK, c1 = std::min(C, c0 + BLOCK);
#ifdef KVCHAT_F16C
      if (D %% 8 == 0) {
        const float *qh = qp + h * G * D, *kh = kp + h * hs;
        float* oh = op + h * G * C;
        switch (D / 8) {
          case 4: scores_reg<4>(qh, kh, oh, G, C, c0, c1); break;
          case 6: scores_reg<6>(qh, kh, oh, G, C, c0, c1); break;
          case 8: scores_reg<8>(qh, kh, oh, G, C, c0, c1); break;
          default: scores_avx(qh, kh, oh, G, C, D, c0, c1);
        }
        continue;
      }
#endif
      int64_t c = c0;
      // Four slots at a time: four independent sums in flight instead of one chain of adds per dot product.
      for (; c + 4 <= c1; c += 4) {
        const float* k0 = kp + h * hs + c * D;
        const float *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = qp + (h * G + g) * D;
          float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
          #pragma omp simd reduction(+:a0, a1, a2, a3)
          for (int64_t d = 0; d < D; ++d) {
            a0 += qr[d] * k0[d];
            a1 += qr[d] * k1[d];
            a2 += qr[d] * k2[d];
            a3 += qr[d] * k3[d];
          }
          float* o = op + (h * G + g) * C + c;
          o[0] = a0;
          o[1] = a1;
          o[2] = a2;
          o[3] = a3;
        }
      }
      for (; c < c1; ++c) {
        const float* kr = kp + h * hs + c * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = qp + (h * G + g) * D;
          float acc = 0.f;
          #pragma omp simd reduction(+:acc)
          for (int64_t d = 0; d < D; ++d) acc += qr[d] * kr[d];
          op[(h * G + g) * C + c] = acc;
        }
      }
    }
  });
  return out;
}

at::Tensor values(const at::Tensor& p_in, const at::Tensor& v_in) {
  check(p_in, v_in, "kvchat::values");
  TORCH_CHECK(p_in.size(2) == v_in.size(1), "kvchat::values: one weight per slot");
  const at::Tensor p = p_in.contiguous(), v = rows(v_in);
  const int64_t H = v.size(0), C = v.size(1), D = v.size(2), G = p.size(1), nb = (C + BLOCK - 1) / BLOCK;
  const int64_t hs = v.stride(0);
#ifdef KVCHAT_F16C
  const bool avx = D %% 8 == 0;
#else
  const bool avx = false;
#endif
  // The vector path writes every block's sums; the other adds into them.
  at::Tensor partial = avx ? at::empty({H, nb, G, D}, v.options()) : at::zeros({H, nb, G, D}, v.options());
  const float* pp = p.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = partial.data_ptr<float>();
  at::parallel_for(0, H * nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / nb, b = i %% nb, c0 = b * BLOCK, c1 = std::min(C, c0 + BLOCK);
      float* acc = op + (h * nb + b) * G * D;
#ifdef KVCHAT_F16C
      if (avx) {
        // Each query's sums in registers, 64 columns at a time; the block's values come from the L1/L2 cache
        // after the first query.
        for (int64_t g = 0; g < G; ++g) {
          const float* w = pp + (h * G + g) * C;
          const float* vh = vp + h * hs;
          float* o = acc + g * D;
          int64_t d0 = 0;
          for (; d0 + 64 <= D; d0 += 64) values_avx<8>(w, vh, o, D, d0, c0, c1);
          if (d0 + 32 <= D) { values_avx<4>(w, vh, o, D, d0, c0, c1); d0 += 32; }
          if (d0 + 16 <= D) { values_avx<2>(w, vh, o, D, d0, c0, c1); d0 += 16; }
          if (d0 + 8 <= D) values_avx<1>(w, vh, o, D, d0, c0, c1);
        }
        continue;
      }
#endif
      int64_t c = c0;
      // Four slots at a time: each query's sums loaded and stored once per four rows of values.
      for (; c + 4 <= c1; c += 4) {
        const float* v0 = vp + h * hs + c * D;
        const float *v1 = v0 + D, *v2 = v1 + D, *v3 = v2 + D;
        for (int64_t g = 0; g < G; ++g) {
          const float* w = pp + (h * G + g) * C + c;
          const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
          float* a = acc + g * D;
          #pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d];
        }
      }
      for (; c < c1; ++c) {
        const float* vr = vp + h * hs + c * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = pp[(h * G + g) * C + c];
          float* a = acc + g * D;
          #pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
        }
      }
    }
  });
  // The blocks' sums added in block order, here rather than by another operator call (a few thousand adds).
  at::Tensor out = at::empty({H, G, D}, v.options());
  if (nb == 0) return out.zero_();  // no slots: an empty sum
  float* res = out.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    float* o = res + h * G * D;
    const float* part = op + h * nb * G * D;
    std::copy(part, part + G * D, o);
    for (int64_t b = 1; b < nb; ++b)
      for (int64_t j = 0; j < G * D; ++j) o[j] += part[b * G * D + j];
  }
  return out;
}

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

// Each row of s [R, C] (R = H * G, heads' rows in order) as softmax over its slots [0, lens[h]], zero after them.
void masked_softmax(float* s, const int64_t* lens, int64_t H, int64_t G, int64_t C) {
  at::parallel_for(0, H * G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = s + r * C;
      const int64_t n = std::min(C, std::max<int64_t>(0, lens[r / G] + 1));
      float mx = -INFINITY, sum = 0.f;
      for (int64_t c = 0; c < n; ++c) mx = std::max(mx, row[c]);
      int64_t c = 0;
#ifdef KVCHAT_AVX2
      const __m256 m8 = _mm256_set1_ps(mx);
      __m256 s8 = _mm256_setzero_ps();
      for (; c + 8 <= n; c += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + c), m8));
        _mm256_storeu_ps(row + c, e);
        s8 = _mm256_add_ps(s8, e);
      }
      sum = hsum(s8);
#endif
      for (; c < n; ++c) sum += (row[c] = std::exp(row[c] - mx));
      const float inv = 1.f / sum;
      for (c = 0; c < n; ++c) row[c] *= inv;
      std::fill(row + n, row + C, 0.f);
    }
  });
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
              D %% 2 == 0 && rotated >= 0 && rotated <= N && (rotated == 0 || (D > 0 && rotated %% D == 0)),
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
    for (int64_t j = 0; j < D; ++j) op[base + j] = y[j] * cp[j] + y[(j + half) %% D] * sp[j];
  }
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  return out.view(shape);
}

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
              gu_w.size(1) == E && gu_w.size(0) %% 2 == 0 && down_w.dim() == 2 && down_w.size(0) == E &&
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
  TORCH_CHECK(nq > 0 && nk > 0 && N == nq + 2 * nk && nk %% D == 0 && nq %% nk == 0 && cap > 0 &&
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

}  // namespace

TORCH_LIBRARY(kvchat, m) {
  m.def("scores(Tensor q, Tensor k) -> Tensor");
  m.def("values(Tensor p, Tensor v) -> Tensor");
  m.def("matvec(Tensor x, Tensor w) -> Tensor");
  m.def("project(Tensor x, Tensor n, float eps, Tensor w, Tensor? bias, Tensor cos, Tensor sin, int rotated) -> "
        "Tensor");
  m.def("block(Tensor q, Tensor k, Tensor v, Tensor lens, Tensor x, Tensor o_w, Tensor n2, float eps, Tensor gu_w, "
        "Tensor down_w) -> (Tensor, Tensor)");
  m.def("layer(Tensor x, Tensor n1, float eps1, Tensor qkv_w, Tensor? qkv_b, Tensor cos, Tensor sin, int nq, "
        "Tensor(a!) keys, Tensor(b!) values, int cap, int n, float scaling, Tensor o_w, Tensor n2, float eps2, "
        "Tensor gu_w, Tensor down_w, Tensor(c!)? sums=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) {
  m.impl("scores", &scores);
  m.impl("values", &values);
  m.impl("matvec", &matvec);
  m.impl("project", &project);
  m.impl("block", &block);
  m.impl("layer", &layer);
}
""" % {"block": BLOCK}

_lock = threading.Lock()
_state: dict[str, object] = {}


def load() -> str | None:
    """Build (once per machine) and register the operators; None when ``torch.ops.kvchat`` has them, else why not
    (said once in the log)."""
    with _lock:
        if "why" in _state:
            return _state["why"]
        why = None
        try:
            from torch.utils.cpp_extension import load_inline

            _find_ninja()

            # -march=native: one build per CPU kind (torch's extension cache is keyed by the name, not the CPU)
            name = f"kvchat_decode_ops_{torch.backends.cpu.get_cpu_capability().lower()}"
            # Loading a build takes a fraction of a second; building takes ~30 s on a 2-core machine, once: said
            # when it is taking that long.
            notice = threading.Timer(3.0, log.warning, ("building kvchat's decode operators (core/kernels.py; once "
                                                        "per machine and version, about half a minute on 2 cores)",))
            notice.daemon = True
            notice.start()
            try:
                load_inline(name, cpp_sources=[SOURCE], is_python_module=False,
                            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
            finally:
                notice.cancel()
            _register_fakes()
        except Exception as exc:  # noqa: BLE001 — no compiler, no ninja, a build error: torch.bmm instead
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            why = f"{type(exc).__name__}: {first}"
            log.warning("kvchat's operators could not be built (%s); the compiled step uses torch.bmm and inductor's "
                        "products", why)
        _state["why"] = why
        return why


def _find_ninja() -> None:
    """torch runs ``ninja`` from PATH; the ``ninja`` package (a kvchat dependency) installs it beside the venv's
    Python, which is not on PATH when that Python is run by its path (``.venv/bin/python -m pytest``)."""
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing (fake tensors)."""

    @torch.library.register_fake("kvchat::scores")
    def _(q, k):
        return q.new_empty(q.shape[0], q.shape[1], k.shape[1])

    @torch.library.register_fake("kvchat::values")
    def _(p, v):
        return v.new_empty(v.shape[0], p.shape[1], v.shape[2])

    @torch.library.register_fake("kvchat::matvec")
    def _(x, w):
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @torch.library.register_fake("kvchat::project")
    def _(x, n, eps, w, bias, cos, sin, rotated):
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @torch.library.register_fake("kvchat::block")
    def _(q, k, v, lens, x, o_w, n2, eps, gu_w, down_w):
        return x.new_empty(x.shape), q.new_empty(q.shape[0], q.shape[1], k.shape[1])
