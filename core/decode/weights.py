"""How the linear layers' weights are held: as loaded, or with an fp16 copy for fast CPU decoding (``--weights``).

A decode step reads every weight of the model once, for one token: it is bound by memory, and on the CPU it runs on
PyTorch's matrix-vector kernels. Measured on this project's machine (docs/speed.md), an fp16 weight matrix times one
token's vector runs about 4x faster than fp32 (half the bytes and a better kernel); for a read of many tokens fp16 is
several times slower than fp32, and bf16 activations there turn near-ties of greedy answers (the default model
answered "What is the capital of France?" with French gibberish). ``half`` therefore keeps the loaded weight for
reads of several tokens (prefill is exactly what it was) and adds an fp16 copy that one-token steps use, casting
their input to fp16 and the output back: +50% weight memory for an fp32 model, a decode step that reads half the
bytes. Norms, attention and the KV cache stay in the model's dtype.

``model`` leaves the model as loaded. ``auto`` is ``half`` for an fp32 model on the CPU and ``model`` elsewhere
(GPUs pick their dtype with ``--dtype``).

The decode step (core/decode) moves the fp16 copies into one block of memory backed by 2 MiB pages where Linux
allows (``on_huge_pages``): a step reads all ~270 MB of them, and with 4 KiB pages that is ~66,000 pages' address
translations per token, far more than the TLB holds. On this project's machine (docs/speed.md) that made the
compiled step's replies 12.3 ms per token against 12.9.
"""

from __future__ import annotations

import contextlib
import mmap
import sys

import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS = ("auto", "model", "half")


class HalfLinear(nn.Module):
    """A ``nn.Linear`` (its weight and bias kept, tied weights stay tied) plus an fp16 copy for one-token steps."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("step", linear.weight.detach().to(torch.float16), persistent=False)
        self.use_step = True  # False: every read on the loaded weight (``as_loaded``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_step or x.numel() != x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        out = F.linear(x.to(self.step.dtype), self.step).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp16 copy for one-token steps"


def resolve(weights: str, device: torch.device, dtype: torch.dtype) -> str:
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r} ({', '.join(WEIGHTS)})")
    if weights == "auto":
        return "half" if device.type == "cpu" and dtype == torch.float32 else "model"
    return weights


def apply(model: nn.Module, weights: str) -> str:
    """Hold the model's linear layers as ``weights`` says (already resolved); returns what was applied."""
    if weights == "half":
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, name, HalfLinear(child))
    return weights


@contextlib.contextmanager
def as_loaded(model: nn.Module):
    """Within the block, every read runs on the loaded weights (what ``--weights model`` would do), without a
    second copy of the model."""
    halves = [m for m in model.modules() if isinstance(m, HalfLinear)]
    for m in halves:
        m.use_step = False
    try:
        yield
    finally:
        for m in halves:
            m.use_step = True


def step_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: the fp16 copies of ``HalfLinear`` layers (not their loaded weights),
    every other parameter, but not the input embedding (one row is read) unless a plain output layer shares it."""
    halves = [m for m in model.modules() if isinstance(m, HalfLinear)]
    skip = {id(m.weight) for m in halves} | {id(model.get_input_embeddings().weight)}
    output = model.get_output_embeddings()
    if output is not None and not isinstance(output, HalfLinear):
        skip.discard(id(output.weight))
    return (sum(m.step.numel() * m.step.element_size() for m in halves)
            + sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip))


HUGE_PAGE = 2 << 20
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_allowed() -> bool:
    """Whether anonymous memory can be asked for transparent huge pages here: Linux with THP in ``always`` or
    ``madvise`` mode (``never``: no)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(THP) as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Copies of the CPU ``tensors``, in order, in one private anonymous mapping advised to the kernel as huge-page
    memory (``madvise(MADV_HUGEPAGE)`` before its pages are first touched, so they are faulted in as 2 MiB pages
    where the kernel has them, else as ordinary pages: nothing to configure, nothing that fails); each copy starts
    on a 64-byte boundary. The mapping lives as long as any of the copies (``torch.frombuffer`` holds it). None
    where huge pages cannot be asked for (``huge_pages_allowed``) or a tensor is not on the CPU."""
    if not tensors or not huge_pages_allowed() or any(t.device.type != "cpu" for t in tensors):
        return None
    sizes = [(t.numel() * t.element_size() + 63) // 64 * 64 for t in tensors]
    total = sum(sizes)
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE  # the copies from a 2 MiB boundary on
    out = []
    for t, size in zip(tensors, sizes):
        n = t.numel() * t.element_size()
        copy = raw[start: start + n].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
        start += size
    return out
