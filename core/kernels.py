"""Attention products of one decode token as two small C++ operators, for the compiled decode step (core/step.py).

A decode step's attention multiplies a few queries per KV head (GQA's groups: 3 for the default model) with a
buffer of ~1,000 keys and values per head. As a batched GEMM (``torch.bmm``) that shape reads the cache at half this
machine's memory bandwidth or less. For 30 layers of 1,088 slots (buffers of 90 layers cycled, so that they come
from memory as in a step, not from the L3 cache), ad hoc, medians of five rounds: the scores took 1.85 ms with
``torch.bmm`` and 1.31 with these loops, the weighted values 2.14 and 1.08, a plain sum over the same keys 1.08
(README, Speed). Each operator streams its buffer once, in blocks of ``BLOCK`` slots shared out over ATen's threads,
four slots at a time:

* ``kvchat::scores(q [H, G, D], k [H, C, D]) -> [H, G, C]``: ``q @ k.transpose(1, 2)``, one dot product per query
  and slot;
* ``kvchat::values(p [H, G, C], v [H, C, D]) -> [H, G, D]``: ``p @ v``, each block's weighted rows summed, then the
  blocks' sums.

Both are plain float32 arithmetic in another summation order than the GEMM's (tests/test_step.py compares them with
``torch.bmm``). They are built once per machine with ``torch.utils.cpp_extension`` (the C++ compiler the compiled
step needs anyway, and ninja, a kvchat dependency; ``-march=native``) into torch's extension cache, and registered as
torch operators so that ``torch.compile`` calls them inside its graph. ``load()`` says why they cannot be had; the
compiled step then uses ``torch.bmm``.
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

namespace {

constexpr int64_t BLOCK = %(block)d;

void check(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0), what, ": 3-d tensors of the same heads");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat, what, ": float32 tensors");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), what, ": CPU tensors");
}

at::Tensor scores(const at::Tensor& q_in, const at::Tensor& k_in) {
  check(q_in, k_in, "kvchat::scores");
  TORCH_CHECK(q_in.size(2) == k_in.size(2), "kvchat::scores: queries and keys of one size");
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous();
  const int64_t H = k.size(0), C = k.size(1), D = k.size(2), G = q.size(1), nb = (C + BLOCK - 1) / BLOCK;
  at::Tensor out = at::empty({H, G, C}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, H * nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / nb, c0 = (i %% nb) * BLOCK, c1 = std::min(C, c0 + BLOCK);
      int64_t c = c0;
      // Four slots at a time: four independent sums in flight instead of one chain of adds per dot product.
      for (; c + 4 <= c1; c += 4) {
        const float* k0 = kp + (h * C + c) * D;
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
        const float* kr = kp + (h * C + c) * D;
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
  const at::Tensor p = p_in.contiguous(), v = v_in.contiguous();
  const int64_t H = v.size(0), C = v.size(1), D = v.size(2), G = p.size(1), nb = (C + BLOCK - 1) / BLOCK;
  at::Tensor partial = at::zeros({H, nb, G, D}, v.options());
  const float* pp = p.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = partial.data_ptr<float>();
  at::parallel_for(0, H * nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / nb, b = i %% nb, c0 = b * BLOCK, c1 = std::min(C, c0 + BLOCK);
      float* acc = op + (h * nb + b) * G * D;
      int64_t c = c0;
      // Four slots at a time: each query's sums loaded and stored once per four rows of values.
      for (; c + 4 <= c1; c += 4) {
        const float* v0 = vp + (h * C + c) * D;
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
        const float* vr = vp + (h * C + c) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = pp[(h * G + g) * C + c];
          float* a = acc + g * D;
          #pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
        }
      }
    }
  });
  return partial.sum(1);
}

}  // namespace

TORCH_LIBRARY(kvchat, m) {
  m.def("scores(Tensor q, Tensor k) -> Tensor");
  m.def("values(Tensor p, Tensor v) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) {
  m.impl("scores", &scores);
  m.impl("values", &values);
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
            name = f"kvchat_decode_attention_{torch.backends.cpu.get_cpu_capability().lower()}"
            load_inline(name, cpp_sources=[SOURCE], is_python_module=False,
                        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
            _register_fakes()
        except Exception as exc:  # noqa: BLE001 — no compiler, no ninja, a build error: torch.bmm instead
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            why = f"{type(exc).__name__}: {first}"
            log.warning("kvchat's attention operators could not be built (%s); the compiled step uses torch.bmm", why)
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
