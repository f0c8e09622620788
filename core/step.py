"""The one-token decode step of Llama-family models, run layer by layer without transformers' module dispatch.

A decode step on the CPU is many small pieces of work: per layer seven products with one token's vector, two norms,
the rotary embedding, the cache update and attention. Through the model's ``forward`` each of them also pays
transformers' module calls, keyword plumbing and per-projection casts: on this project's machine the small
operations of a step took longer than its products (README, Speed). ``DecodeStep`` runs the same computation for
one token:

* the model's own modules where they run once per step or carry the model's formula (embedding, rotary embedding,
  RMS norms, the MLP's activation, the output layer);
* q/k/v and gate/up as one product each: with ``--weights half`` their fp16 copies are concatenated once and the
  ``HalfLinear`` layers keep views into the concatenation (no extra memory); with the weights as loaded each
  projection is its own product, as in the model;
* the rotary embedding of queries and keys in one pass (the model's formula, ``x * cos + rotate_half(x) * sin``,
  in three kernels);
* kvchat's cache update and attention function, as the model's forward calls them (the cache layer's ``update``,
  ``kvchat_attention`` with the observer), so policies, statistics and the archive see what they always see.

It serves decoder layers whose forward is Llama's (``SUPPORTED``: Llama, Mistral, Qwen2 — Qwen2's q/k/v biases
included); other architectures, reads of several tokens, recall's query tap and models dispatched by accelerate
hooks run through the model's forward. ``--decode model`` turns it off. tests/test_step.py compares it with the
model's forward for each supported family: the same logits bit for bit with the weights as loaded (fp32 or bf16),
within 1e-5 with ``--weights half`` (one fp16 product for q/k/v instead of three may sum in another order), and the
same greedy replies. Alternating with the model's forward on this project's machine it saved 5-6 ms of a 30-32 ms step
(median of 96 steps each, ``streaming`` at budget 1024; README, Speed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import kvchat_attention
from .weights import HalfLinear

DECODE = ("auto", "model")
SUPPORTED = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})
NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})  # the same forward, line for line


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

    def __call__(self, x: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """``widen=False``: an fp16 product is returned as it is (without a bias), for a sum that widens it anyway
        (``x + out`` computes ``x + out.float()`` exactly, in one kernel)."""
        if self.halves and self.linears[0].use_step:  # as HalfLinear computes it, for all of them at once
            out = F.linear(x.to(self.weight.dtype), self.weight)
            if self.bias is not None:
                return out.to(x.dtype) + self.bias
            return out.to(x.dtype) if widen else out
        outs = [F.linear(x, m.weight, m.bias) for m in self.linears]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


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


class _Layer:
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


class DecodeStep:
    def __init__(self, model: nn.Module):
        base = model.model
        self.embed, self.rotary, self.head = base.embed_tokens, base.rotary_emb, model.lm_head
        self.norm = Norm(base.norm)
        self.layers = [_Layer(layer) for layer in base.layers[: model.config.num_hidden_layers]]
        self.head_dim = self.layers[0].attn.head_dim

    @staticmethod
    def unsupported(model: nn.Module) -> str | None:
        """Why the step cannot run ``model`` (None when it can)."""
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if layers is None or not all(hasattr(base, a) for a in ("embed_tokens", "rotary_emb", "norm")):
            return f"{type(model).__name__} has no Llama-style decoder"
        kinds = {type(layer).__name__ for layer in layers} - SUPPORTED
        if kinds:
            return f"decoder layers {', '.join(sorted(kinds))} are not Llama's"
        if any(hasattr(m, "_hf_hook") for m in model.modules()):
            return "the model is dispatched by accelerate hooks (--device-map)"
        if not isinstance(getattr(model, "lm_head", None), (nn.Linear, HalfLinear)):
            return "the output layer is not a linear layer"
        return None

    @classmethod
    def build(cls, model: nn.Module, decode: str = "auto") -> DecodeStep | None:
        if check(decode) == "model" or cls.unsupported(model) is not None:
            return None
        return cls(model)

    def __call__(self, token: torch.Tensor, position: torch.Tensor, cache, observer=None) -> torch.Tensor:
        """Logits [1, vocab] for one token id (``token``, shape [1]) at ``position`` ([1]) on top of ``cache``."""
        x = self.embed(token[None])  # [1, 1, hidden]
        cos, sin = self.rotary(x, position[None])  # [1, 1, head_dim]
        d, half = self.head_dim, self.head_dim // 2
        # The model's x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1), as x * cos + roll(x) * sin'
        # with sin' = cat(-sin1, sin2): the same products ((-a) * b is a * (-b) exactly) in three kernels, not six.
        cos, sin = cos[:, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]
        extra = {"kvchat_observer": observer} if observer is not None else {}
        for i, lay in enumerate(self.layers):
            nq, nk, _ = lay.split
            qkv = lay.qkv(lay.norm1(x))
            qk = qkv[..., : nq + nk].view(1, -1, 1, d)  # [1, query + key heads, 1, d]
            qk = qk * cos + qk.roll(half, -1) * sin
            q, k = qk[:, : nq // d], qk[:, nq // d:]
            v = qkv[..., nq + nk:].view(1, -1, 1, d)
            keys, values = cache.layers[i].update(k, v)
            out, _ = kvchat_attention(lay.attn, q, keys, values, None, scaling=lay.attn.scaling, **extra)
            x = x + lay.o(out.reshape(1, 1, -1), widen=False)
            gu = lay.gate_up(lay.norm2(x))
            x = x + lay.down(lay.act(gu[..., : lay.inner]) * gu[..., lay.inner:], widen=False)
        return self.head(self.norm(x))[0]
