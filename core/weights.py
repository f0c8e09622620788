"""How the linear layers' weights are held: as loaded, or with an fp16 copy for fast CPU decoding (``--weights``).

A decode step reads every weight of the model once, for one token: it is bound by memory, and on the CPU it runs on
PyTorch's matrix-vector kernels. Measured on this project's machine (README, Speed), an fp16 weight matrix times one
token's vector runs about 4x faster than fp32 (half the bytes and a better kernel); for a read of many tokens fp16 is
several times slower than fp32, and bf16 activations there turn near-ties of greedy answers (the default model
answered "What is the capital of France?" with French gibberish). ``half`` therefore keeps the loaded weight for
reads of several tokens (prefill is exactly what it was) and adds an fp16 copy that one-token steps use, casting
their input to fp16 and the output back: +50% weight memory for an fp32 model, a decode step that reads half the
bytes. Norms, attention and the KV cache stay in the model's dtype.

``model`` leaves the model as loaded. ``auto`` is ``half`` for an fp32 model on the CPU and ``model`` elsewhere
(GPUs pick their dtype with ``--dtype``).
"""

from __future__ import annotations

import contextlib

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
