"""The pieces every decode step is built from: a Llama-family layer's projections (``Projections``: q/k/v or
gate/up as one product, over the fp16 copies of ``--weights half`` or the loaded weights), its norms (``Norm``), one
layer's modules gathered (``Layer``), and which models the steps serve."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .weights import HalfLinear

DECODE = ("auto", "model", "compiled", "graph", "triton")
SUPPORTED = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})
NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})  # the same forward, line for line
ROPE_BLOCK = 256  # positions per block of kept rotary cos/sin' (``DecodeStep._rope_block``)
SILU = frozenset({"SiLU", "SiLUActivation"})  # transformers' ACT2FN["silu"] and torch's: F.silu



def check(decode: str) -> str:
    """``decode`` if it names a way to decode (``DECODE``), else ValueError with the choices."""
    if decode not in DECODE:
        raise ValueError(f"unknown decode {decode!r} ({', '.join(DECODE)})")
    return decode


class Projections:
    """Linear layers that read the same input, as one product: [x @ w1.T + b1, x @ w2.T + b2, ...]."""

    def __init__(self, linears: list[nn.Module]):
        self.linears = linears
        self.halves = all(isinstance(m, HalfLinear) for m in linears)
        self.weight = None
        if self.halves:
            self.weight = linears[0].step if len(linears) == 1 else torch.cat([m.step for m in linears])
            start = 0
            for m in linears:  # each HalfLinear keeps a view into the concatenation: no second copy
                m.step = self.weight[start: start + m.out_features]
                start += m.out_features
        biases = [m.bias for m in linears]
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b.detach() if b is not None else torch.zeros(m.out_features, dtype=m.weight.dtype,
                                                                                 device=m.weight.device)
                                   for b, m in zip(biases, linears)])

    def pieces(self) -> tuple[bool, tuple]:
        """What ``product`` multiplies by now: the fp16 copies, concatenated, while the one-token path is in use
        (``weights.as_loaded`` turns it off), else the loaded layers."""
        if self.halves and self.linears[0].use_step:
            return True, ((self.weight, self.bias),)
        return False, tuple((m.weight, m.bias) for m in self.linears)

    def __call__(self, x: torch.Tensor, widen: bool = True) -> torch.Tensor:
        return product(x, *self.pieces(), widen=widen)


def product(x: torch.Tensor, copies: bool, pieces: tuple, widen: bool = True) -> torch.Tensor:
    """x times the weights of ``pieces`` ((weight, bias), ...). ``copies``: one concatenation of fp16 copies, as
    ``HalfLinear`` computes it — x cast to fp16, the output widened back and the bias added after; ``widen=False``
    returns an fp16 product as it is (without a bias) for a sum that widens it anyway (``x + out`` computes
    ``x + out.float()`` exactly, in one kernel). Else the loaded layers, one product each, concatenated."""
    if copies:
        weight, bias = pieces[0]
        out = F.linear(x.to(weight.dtype), weight)
        if bias is not None:
            return out.to(x.dtype) + bias
        return out.to(x.dtype) if widen else out
    outs = [F.linear(x, w, b) for w, b in pieces]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def project(weights, x: torch.Tensor) -> torch.Tensor:
    """x times a layer's weights: (weight, bias) concatenated for one product, or a function of x (the layer's
    ``Projections``: kvchat's fp16 copies, ``--weights half`` on the CPU, as the eager step multiplies; the model's
    own linear layers for ``DecodeStep.read``)."""
    if isinstance(weights, tuple):
        return F.linear(x, *weights)
    return weights(x)


def norm(norm, x: torch.Tensor) -> torch.Tensor:
    """An RMS norm: (weight, eps) as PyTorch's ``rms_norm`` in any dtype (Llama's norms, ``parts.NORMS``: one kernel
    on CUDA where the model's module runs eight; in bf16 it multiplies by the weight before rounding, where the module
    rounds first), else the norm as given (the model's module, or ``Norm`` of it)."""
    if isinstance(norm, tuple):
        return F.rms_norm(x, (norm[0].shape[0],), *norm)
    return norm(x)


class Norm:
    """The model's RMS norm module; for fp32 input PyTorch's ``rms_norm``, which computes Llama's
    ``weight * (x * rsqrt(mean(x^2) + eps))`` bit for bit (tests/test_step.py) in one call instead of six."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.fused = type(module).__name__ in NORMS and module.weight.dtype == torch.float32
        self.weight, self.eps = module.weight, getattr(module, "variance_epsilon", None)
        self.shape = tuple(module.weight.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused or x.dtype != torch.float32:
            return self.module(x)
        return F.rms_norm(x, self.shape, self.weight, self.eps)


class Layer:
    __slots__ = ("attn", "norm1", "norm2", "qkv", "o", "gate_up", "down", "act", "split", "inner")

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.norm1, self.norm2 = Norm(layer.input_layernorm), Norm(layer.post_attention_layernorm)
        self.qkv = Projections([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = Projections([attn.o_proj])
        self.gate_up = Projections([mlp.gate_proj, mlp.up_proj])
        self.down = Projections([mlp.down_proj])
        self.act = mlp.act_fn
        self.split = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
        self.inner = mlp.gate_proj.out_features


def fp32_llama(model: nn.Module) -> str | None:
    """Why kvchat's operators and the compiled step cannot serve ``model``'s arithmetic (None when they can): they
    compute in fp32 on the CPU, with Llama's RMS norm (``weight * (x * rsqrt(mean(x^2) + eps))``) for every norm."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return f"only fp32 models on the CPU (this one: {param.dtype} on {param.device.type})"
    norms = [layer.input_layernorm for layer in model.model.layers] + [model.model.norm]
    norms += [layer.post_attention_layernorm for layer in model.model.layers]
    if not all(type(m).__name__ in NORMS and getattr(m, "variance_epsilon", None) is not None for m in norms):
        return "its norms are not Llama's RMS norm"
    return None


def blockable(lay: Layer) -> bool:
    """Whether ``kvchat::block`` can run the layer after its cache write: the output projection and the MLP as fp16
    copies without biases, a SiLU MLP (Llama, Mistral, Qwen2 as released)."""
    parts = (lay.o, lay.gate_up, lay.down)
    return all(p.halves and p.bias is None for p in parts) and type(lay.act).__name__ in SILU
