// Attention's two products over each head's cached slots, and the masked softmax between them.
#include "kvchat_ops.h"

namespace kvchat {

#ifdef KVCHAT_F16C
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
        if (j % 2) b = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * j), kv[j], b);
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
      const int64_t h = i / nb, c0 = (i % nb) * BLOCK, c1 = std::min(C, c0 + BLOCK);
#ifdef KVCHAT_F16C
      if (D % 8 == 0) {
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
  const bool avx = D % 8 == 0;
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
      const int64_t h = i / nb, b = i % nb, c0 = b * BLOCK, c1 = std::min(C, c0 + BLOCK);
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

}  // namespace kvchat
