"""The one-token decode step of Llama-family models, run layer by layer without transformers' module dispatch.

A decode step on the CPU is many small pieces of work: per layer seven products with one token's vector, two norms,
the rotary embedding, the cache update and attention. Through the model's ``forward`` each of them also pays
transformers' module calls, keyword plumbing and per-projection casts: on this project's machine the small
operations of a step took longer than its products (README, Speed). ``DecodeStep`` runs the same computation for
one token, in one of two ways:

* on kvchat's operators (core/kernels.py), where the fp16 copies of ``--weights half`` are in use, the model is fp32
  on the CPU with Llama's RMS norms and a SiLU MLP, and the operators build (a C++ compiler; once per machine): per
  layer one ``kvchat::layer`` call where every head of the cache layer has a free slot (``KVLayer.free_slot``: the
  norm, q/k/v as one product, their bias, the rotary embedding of q and k, the new key and value written into the
  layer's buffers, attention over them in place, the output projection, the norm, the MLP, and H2O's sums where the
  observer keeps them, ``Observer.step_sums``), the cache layer having claimed the slot before (its position, zeroed
  statistics: ``KVLayer.claim``) and staging the archive's copy after; where a head has no free slot (the cache
  resizes first) ``kvchat::project``, the cache layer's ``update`` and ``kvchat::block``, the same computation.
  ``kvchat::project`` then runs the output layer. Heads of different lengths (``headaware``) take the attention
  below and the operators for the products. The products widen the fp16 weights in registers and sum in fp32 with
  the input unrounded, where an fp16 GEMM rounds the input and the products to fp16: logits within that rounding of
  the model's forward with the same copies, and about as close to the fp32 model's (tests/test_step.py).
  ``without_ops`` says why a step runs without them;
* otherwise the model's own modules where they run once per step or carry the model's formula (embedding, RMS
  norms, the MLP's activation, the output layer); q/k/v and gate/up as one product each (with ``--weights half``
  their fp16 copies are concatenated once and the ``HalfLinear`` layers keep views into the concatenation; with the
  weights as loaded each projection is its own product, as in the model); the rotary embedding of queries and keys
  in one pass (the model's formula, ``x * cos + rotate_half(x) * sin``, in three kernels); kvchat's cache update
  and attention function, as the model's forward calls them.

Either way the cache layer records what ``update`` records and the policy's observer sees what it always sees, so
policies, statistics and the archive are the same. It serves decoder layers whose forward is Llama's (``SUPPORTED``:
Llama, Mistral, Qwen2 — Qwen2's q/k/v biases included); other architectures, reads of several tokens, recall's query
tap and models dispatched by accelerate hooks run through the model's forward. ``--decode model`` turns it off.
tests/test_step.py compares it with the model's forward for each supported family: without the operators the same
logits bit for bit with the weights as loaded (fp32 or bf16), within 1e-5 with ``--weights half`` (one fp16 product
for q/k/v instead of three may sum in another order); with them within the fp16 rounding above; the same greedy
replies either way; ``kvchat::layer`` gives the bits of its three parts and of the observer's H2O sums. On this
project's machine the step without the operators saved 5-6 ms of a 30-32 ms step against the model's forward, the
operators took the reply loop from about 22 to 12.4-14.1 ms per token (alternating with the step without them,
``streaming`` at budget 1024), and ``kvchat::layer`` saved another 0.9-1.4 ms a token against its three parts
(``streaming``; 1.6-2.5 ms for ``h2o``), and H2O's sums inside it 0.8-2.1 ms against the observer's (README, Speed).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import types

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .attention import kvchat_attention
from .layer import RaggedKV
from .weights import HalfLinear, on_huge_pages

log = logging.getLogger(__name__)

DECODE = ("auto", "model", "compiled")
SUPPORTED = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})
# Inductor's options for the graph: its wrapper in C++ rather than Python (hundreds of kernel and product calls per
# step), no size checks of the inputs on each call (dynamo's guards check the shapes already). About 1 ms of a 17-18
# ms step on this project's machine (README, Speed).
OPTIONS = {"cpp_wrapper": True, "size_asserts": False}
# The arguments whose guards the graph goes without (``_unguarded``): the weights.
WEIGHTS = ("params", "final")
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


def _fp32_llama(model: nn.Module) -> str | None:
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


def _blockable(lay: _Layer) -> bool:
    """Whether ``kvchat::block`` can run the layer after its cache write: the output projection and the MLP as fp16
    copies without biases, a SiLU MLP (Llama, Mistral, Qwen2 as released)."""
    parts = (lay.o, lay.gate_up, lay.down)
    return all(p.halves and p.bias is None for p in parts) and type(lay.act).__name__ in SILU


class DecodeStep:
    def __init__(self, model: nn.Module):
        base = model.model
        self.embed, self.rotary, self.head = base.embed_tokens, base.rotary_emb, model.lm_head
        self.norm = Norm(base.norm)
        self.layers = [_Layer(layer) for layer in base.layers[: model.config.num_hidden_layers]]
        self.head_dim = self.layers[0].attn.head_dim
        # Rotary cos/sin' are kept per block of positions below the model's maximum (``_rope_block``: ~4 MB for all
        # 8,192 of the default model, only the blocks in use are made) where they depend on the position alone;
        # rope types that rescale with the sequence's length (dynamic NTK, LongRoPE), and models off the CPU, compute
        # them at every step.
        rope = getattr(self.rotary, "rope_type", None)
        static = rope is not None and "dynamic" not in rope and rope != "longrope"
        static = static and next(model.parameters()).device.type == "cpu"  # elsewhere int(position) would sync
        self.rope_limit = getattr(model.config, "max_position_embeddings", 0) if static else 0
        self._rope_blocks: dict[int, torch.Tensor] = {}
        self._place_copies()
        # Why the step runs without kvchat's operators (None: it runs on them; ``_operators``).
        self.without_ops: str | None = self._operators(model)

    def _operators(self, model: nn.Module) -> str | None:
        """Whether every layer can run on kvchat's operators (core/kernels.py: ``layer`` for a whole layer, or
        ``project`` and ``block`` around the cache layer's ``update`` where it must resize first; ``project`` for the
        output layer), building them if need be (once per machine): None if so, else why not. They need the fp16
        copies of ``--weights half`` (with the layers' norms as Llama's, in fp32 on the CPU) and a C++ compiler."""
        why = _fp32_llama(model)
        if why is not None:
            return why
        if not all(n.fused for lay in self.layers for n in (lay.norm1, lay.norm2)) or not self.norm.fused:
            return "its norms' weights are not fp32"
        if not all(lay.qkv.halves and _blockable(lay) for lay in self.layers) or not isinstance(self.head, HalfLinear):
            return "the weights are not fp16 copies without biases after q/k/v, or the MLP is not SiLU"
        return kernels.load()

    def _place_copies(self) -> None:
        """The fp16 copies the step reads (``--weights half``) moved into one block of huge-page memory
        (``weights.on_huge_pages``), the ``HalfLinear`` layers' views with them; nothing changes where that cannot
        be had. Values and shapes stay; only where the bytes live changes."""
        projections = [p for lay in self.layers for p in (lay.qkv, lay.o, lay.gate_up, lay.down) if p.halves]
        head = self.head if isinstance(self.head, HalfLinear) else None
        copies = [p.weight for p in projections] + ([head.step] if head is not None else [])
        placed = on_huge_pages(copies)
        if placed is None:
            return
        for p, weight in zip(projections, placed):
            p.weight = weight
            start = 0
            for m in p.linears:
                m.step = weight[start: start + m.out_features]
                start += m.out_features
        if head is not None:
            head.step = placed[-1]

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
        if decode == "compiled":
            why = CompiledStep.unsupported(model)
            if why is None:
                return CompiledStep(model)
            log.warning("--decode compiled: %s; kvchat's eager step instead", why)
        return DecodeStep(model)

    def _embed(self, token: torch.Tensor, position: torch.Tensor):
        """The token's embedding [1, 1, hidden] and its rotary cos and sin', each [1, 1, 1, head_dim]."""
        x = self.embed(token[None])
        if self.rope_limit:
            p = int(position[0])
            if p < self.rope_limit:
                block = self._rope_block(p // ROPE_BLOCK, x)
                row = p % ROPE_BLOCK
                return x, block[0, row].view(1, 1, 1, -1), block[1, row].view(1, 1, 1, -1)
        cos, sin = self._rope(x, position[None])
        return x, cos[:, None], sin[:, None]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary cos and sin' for ``positions`` ([1, n]), each [1, n, head_dim]. The model computes x *
        cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1); the step computes it as x * cos + roll(x) * sin'
        with sin' = cat(-sin1, sin2): the same products ((-a) * b is a * (-b) exactly) in three kernels, not six."""
        cos, sin = self.rotary(x, positions)
        half = self.head_dim // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def _rope_block(self, b: int, x: torch.Tensor) -> torch.Tensor:
        """cos and sin' of positions [b * ROPE_BLOCK, (b + 1) * ROPE_BLOCK) as [2, ROPE_BLOCK, head_dim], computed
        once by the model's rotary module (element-wise in the position: the same bits as one at a time) and kept."""
        block = self._rope_blocks.get(b)
        if block is None:
            positions = torch.arange(b * ROPE_BLOCK, (b + 1) * ROPE_BLOCK, device=x.device)[None]
            block = self._rope_blocks[b] = torch.cat(self._rope(x, positions))
        return block

    def __call__(self, token: torch.Tensor, position: torch.Tensor, cache, observer=None) -> torch.Tensor:
        """Logits [1, vocab] for one token id (``token``, shape [1]) at ``position`` ([1]) on top of ``cache``."""
        x, cos, sin = self._embed(token, position)
        d, half = self.head_dim, self.head_dim // 2
        extra = {"kvchat_observer": observer} if observer is not None else {}
        ops = self.without_ops is None and self.layers[0].qkv.linears[0].use_step  # not ``weights.as_loaded``
        lens, held = None, None  # kvchat::block's lengths (each head's last slot) and (heads, slots) they are for
        for i, lay in enumerate(self.layers):
            nq, nk, _ = lay.split
            layer = cache.layers[i]
            n = layer.free_slot() if ops else None
            if n is not None:  # the whole layer, its cache write (and H2O's sums) included, in one operator call
                layer.claim(1)  # slot n: its position, zeroed statistics
                sums = observer.step_sums(layer) if observer is not None else None
                x, q, k, v, probs = torch.ops.kvchat.layer(x, lay.norm1.weight, lay.norm1.eps, lay.qkv.weight,
                                                           lay.qkv.bias, cos, sin, nq, layer.keys, layer.values,
                                                           layer.caps[0], n, lay.attn.scaling, lay.o.weight,
                                                           lay.norm2.weight, lay.norm2.eps, lay.gate_up.weight,
                                                           lay.down.weight, sums)
                layer.staged(k, v)
                if observer is not None:
                    observer(lay.attn, q, layer.held_keys(), lay.attn.scaling, probs=[probs], summed=sums is not None)
                continue
            if ops:  # the norm, q/k/v and the rotary embedding of q and k in one operator call
                qkv = torch.ops.kvchat.project(x, lay.norm1.weight, lay.norm1.eps, lay.qkv.weight, lay.qkv.bias, cos,
                                               sin, nq + nk)
                q, k = qkv[..., :nq].view(1, -1, 1, d), qkv[..., nq: nq + nk].view(1, -1, 1, d)
            else:
                qkv = lay.qkv(lay.norm1(x))
                qk = qkv[..., : nq + nk].view(1, -1, 1, d)  # [1, query + key heads, 1, d]
                qk = qk * cos + qk.roll(half, -1) * sin
                q, k = qk[:, : nq // d], qk[:, nq // d:]
            v = qkv[..., nq + nk:].view(1, -1, 1, d)
            keys, values = layer.update(k, v)
            if ops and not isinstance(keys, RaggedKV):  # the rest of the layer as one operator call
                heads, n = keys.shape[1], keys.shape[2]
                if held != (heads, n):  # layers of one length share them
                    lens, held = torch.full((heads,), n - 1, dtype=torch.long), (heads, n)
                qh = (q[0, :, 0] * lay.attn.scaling).view(heads, -1, d)
                x, probs = torch.ops.kvchat.block(qh, keys[0], values[0], lens, x, lay.o.weight, lay.norm2.weight,
                                                  lay.norm2.eps, lay.gate_up.weight, lay.down.weight)
                if observer is not None:
                    observer(lay.attn, q, keys, lay.attn.scaling, probs=[probs])
                continue
            out, _ = kvchat_attention(lay.attn, q, keys, values, None, scaling=lay.attn.scaling, **extra)
            if ops:  # heads of different lengths (RaggedKV): attention as without the operators, the rest on them
                x = x + torch.ops.kvchat.matvec(out.reshape(1, 1, -1), lay.o.weight)
                gu = torch.ops.kvchat.project(x, lay.norm2.weight, lay.norm2.eps, lay.gate_up.weight, None, cos, sin,
                                              0)
                x = x + torch.ops.kvchat.matvec(lay.act(gu[..., : lay.inner]) * gu[..., lay.inner:], lay.down.weight)
                continue
            x = x + lay.o(out.reshape(1, 1, -1), widen=False)
            gu = lay.gate_up(lay.norm2(x))
            x = x + lay.down(lay.act(gu[..., : lay.inner]) * gu[..., lay.inner:], widen=False)
        if ops:
            return torch.ops.kvchat.project(x, self.norm.weight, self.norm.eps, self.head.step, self.head.bias, cos,
                                            sin, 0)[0]
        return self.head(self.norm(x))[0]


def _graph_product(x: torch.Tensor, copies: bool, pieces: tuple, *, ops: bool) -> torch.Tensor:
    """``product`` inside the graph: x times the fp16 copies with the input and the sums in fp32 (``product``'s fp16
    GEMM rounds both to fp16): the eager step's numbers within that rounding (tests/test_step.py). With ``ops``
    kvchat's ``matvec`` operator (core/kernels.py: each weight row read once, widened in registers); else written
    as a multiply and a sum over the input, which inductor compiles into one reduction kernel of the same kind with the
    input's norm fused in (inductor drops an fp16 round trip within a kernel even when written out). On this
    project's machine the reduction kernels made the step 18.5, 19.1 and 15.8 ms against 20.4, 22.0 and 16.5 with the
    fp16 GEMM (three ad-hoc runs), and ``matvec`` 14.9 against 16.0 for the reduction kernels (ten replies, the two
    alternating token by token; README, Speed). The loaded layers (``copies`` False) multiply as ``product`` does."""
    if not copies:
        return product(x, copies, pieces)
    weight, bias = pieces[0]
    out = torch.ops.kvchat.matvec(x, weight) if ops else (x[..., None, :] * weight.to(x.dtype)).sum(-1)
    return out if bias is None else out + bias


def _graph(x, cos, sin, lens, keys, values, params, final, shape, ops):
    """Every layer of one token's step, the output layer included: the graph ``torch.compile`` compiles.

    ``keys``/``values``: each layer's buffer ([KV heads * capacity, dim], head after head); the new key and value
    are written at slot ``lens[layer, head]`` of each head and attention runs over the whole buffer with the slots
    past that one masked, so the shapes are the same at every step. Unused slots hold finite values (zeros when
    allocated, else what was evicted), so their zero probabilities keep them out of the output. Returns the logits,
    the queries ([layers, heads, dim]), keys and values ([layers, 1, KV heads, 1, dim]: one token's, as ``update``
    takes them) and each layer's attention probabilities ([KV heads, groups, capacity]) for the bookkeeping after
    the graph. ``ops``: attention's products and the products with the weights as kvchat's operators
    (core/kernels.py), else ``torch.bmm`` and inductor's own kernels; ``"block"``: besides, everything in a layer after
    its cache write — attention, the output projection, the norm, the MLP — as one ``kvchat::block`` call (a
    layer's fp16 copies without biases and a SiLU MLP: ``CompiledStep.mode``)."""
    nq, nk, d, inner, eps, scaling, act = shape
    heads, half = nk // d, d // 2
    hidx = torch.arange(heads)
    qs, ks, vs, ps = [], [], [], []
    for i, (n1, n2, qkv_w, o_w, gu_w, down_w) in enumerate(params):
        kbuf, vbuf = keys[i].view(heads, -1, d), values[i].view(heads, -1, d)
        cap = kbuf.shape[1]
        qkv = _graph_product(F.rms_norm(x, (x.shape[-1],), n1, eps), *qkv_w, ops=ops)
        qk = qkv[..., : nq + nk].view(1, -1, 1, d)
        qk = qk * cos + qk.roll(half, -1) * sin
        q, k = qk[0, : nq // d, 0], qk[0, nq // d:, 0]
        v = qkv[0, 0, nq + nk:].view(heads, d)
        kbuf.index_put_((hidx, lens[i]), k)
        vbuf.index_put_((hidx, lens[i]), v)
        qh = (q * scaling).view(heads, -1, d)
        if ops == "block":  # the rest of the layer as one operator call
            x, probs = torch.ops.kvchat.block(qh, kbuf, vbuf, lens[i], x, o_w[1][0][0], n2, eps, gu_w[1][0][0],
                                              down_w[1][0][0])
        else:
            scores = torch.ops.kvchat.scores(qh, kbuf) if ops else torch.bmm(qh, kbuf.transpose(1, 2))
            later = torch.arange(cap)[None, None, :] > lens[i][:, None, None]
            probs = scores.masked_fill(later, float("-inf")).softmax(-1)
            out = torch.ops.kvchat.values(probs, vbuf) if ops else torch.bmm(probs, vbuf)
            x = x + _graph_product(out.reshape(1, 1, -1), *o_w, ops=ops)
            gu = _graph_product(F.rms_norm(x, (x.shape[-1],), n2, eps), *gu_w, ops=ops)
            x = x + _graph_product(act(gu[..., :inner]) * gu[..., inner:], *down_w, ops=ops)
        qs.append(q)
        ks.append(k)
        vs.append(v)
        ps.append(probs)
    norm_w, head_w = final
    logits = _graph_product(F.rms_norm(x, (x.shape[-1],), norm_w, eps), *head_w, ops=ops)[0]
    return logits, torch.stack(qs), torch.stack(ks)[:, None, :, None], torch.stack(vs)[:, None, :, None], ps


def _unguarded(entries) -> list[bool]:
    """dynamo's guards a compiled step keeps: all but those on its weights (``WEIGHTS``: the nested tuples of ~190
    tensors, checked before every call for structure, shapes, strides and dtypes). Those never change for one
    ``CompiledStep``: it hands the graph the same tuples at every step and has a graph function of its own
    (``_own_graph``), so no other model's weights meet its compiled graphs. The guards on the cache's buffers (their
    capacity), the inputs and the globals stay. Dynamo's lookup before each call took 0.83 ms with them and 0.20
    without on this project's machine (torch.profiler, 50 calls each, the default model at budget 1024)."""
    return [not (e.name in WEIGHTS or e.name.startswith(tuple(w + "[" for w in WEIGHTS))) for e in entries]


def _own_graph():
    """``_graph`` with a code object of its own: dynamo keeps its compiled graphs and their guards per code object."""
    return types.FunctionType(_graph.__code__.replace(), _graph.__globals__, _graph.__name__)


class CompiledStep(DecodeStep):
    """``--decode compiled``: the whole step — every layer, the cache write and attention, the output layer — as
    one ``torch.compile`` graph (inductor, C++ on the CPU), which fuses the ~50 small operations per layer that
    dispatch one by one in the eager step. Attention runs over each layer's whole preallocated buffer with the slots
    past the new token masked, so the graph's shapes stay the same while the cache's capacity does (every bounded
    policy between compressions). After the graph, each cache layer records what ``update`` would have
    (``KVLayer.appended``: positions, statistics, the archive) and the observer gets the queries and probabilities,
    as in the eager step. Attention's two products and the products with the fp16 weights are kvchat's operators
    (core/kernels.py: each streams its buffer once, where ``torch.bmm`` reads the cache at half the rate for this
    shape), built at the first compile, and for Llama-family layers as released everything after a layer's cache
    write is one ``kvchat::block`` call (``mode``); without the operators (no ninja), ``torch.bmm`` and inductor's
    reduction kernels. dynamo's guards leave out the weights (``_unguarded``). The fp16 copies the graph reads sit in
    huge-page memory where Linux allows (``DecodeStep._place_copies``).

    The first step compiles (one to two minutes for the default model on this project's machine; inductor's cache makes
    a later process's compile a few seconds); a capacity the graph has not seen compiles once more (with dynamic
    shapes from the second). Steps the graph does not serve run the eager step: a layer whose heads have different
    capacities (``headaware``'s per-head budgets), a cache with no room for the token (it resizes or compresses
    first), the loaded weights in use (``weights.as_loaded``), a cache that grows (``full``: its buffer doubles,
    and attention over all of it would read up to twice what it holds). If compiling fails (no C++ compiler), the
    session keeps the eager step and says why once. Logits match the eager step's within fp16 rounding
    (``_graph_product``) and are about as close to the fp32 model's, tests/test_step.py. Sessions sharing the model
    in several threads take the graph one step at a time."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        first = self.layers[0]
        nq, nk, _ = first.split
        self.shape = (nq, nk, self.head_dim, first.inner, first.norm1.eps, first.attn.scaling, first.act)
        # Why kvchat's operators (core/kernels.py) are not in use; known from the first compile on.
        self.no_ops: str | None = None
        self.ops: bool | str = False  # ``mode()``, from the first compile on
        self.compiled = None
        self.compile_s: float | None = None  # seconds the first step took to compile
        self.failed: str | None = None
        self.calls = self.eager_calls = 0  # steps the graph took, steps it left to the eager step (not paused)
        self.paused = False  # ``eager_only``
        self._lock = threading.Lock()
        self.params = self._params()

    @staticmethod
    def unsupported(model: nn.Module) -> str | None:
        return DecodeStep.unsupported(model) or _fp32_llama(model)

    def _params(self):
        """The graph's weights (the steps it takes use the one-token copies: ``serves``)."""
        layers = tuple((lay.norm1.weight, lay.norm2.weight, lay.qkv.pieces(), lay.o.pieces(), lay.gate_up.pieces(),
                        lay.down.pieces()) for lay in self.layers)
        head = self.head
        head_w = (True, ((head.step, head.bias),)) if isinstance(head, HalfLinear) else \
            (False, ((head.weight, head.bias),))
        return layers, (self.norm.weight, head_w)

    @contextlib.contextmanager
    def eager_only(self):
        """Within the block every step runs the eager step (``kvchat bench speed`` times both)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def serves(self, cache) -> bool:
        """Whether the graph can take this step: a cache of fixed capacity (budget + slack: attention over the
        whole buffer reads at most the slack's slots more than it holds), every layer started, its heads of one
        capacity, room for one more token in each; the one-token weights in use."""
        qkv = self.layers[0].qkv
        if self.paused or self.failed is not None or (qkv.halves and not qkv.linears[0].use_step):
            return False
        if cache.capacity is None:  # a growing cache (``full``): its buffer can be twice what it holds
            return False
        for layer in cache.layers:
            if not layer.is_initialized or len(set(layer.caps)) != 1 or max(layer.lens) >= layer.caps[0]:
                return False
        return True

    def mode(self):
        """What the graph's layers run on (``_graph``'s ``ops``): ``"block"`` with kvchat's operators where every
        layer's output projection and MLP are fp16 copies without biases and the MLP's activation is SiLU (Llama,
        Mistral, Qwen2 as released), True with the operators otherwise, False without them (``no_ops`` says why)."""
        if self.no_ops is not None:
            return False
        return "block" if all(_blockable(lay) for lay in self.layers) else True

    def _run(self, x, cos, sin, lens, keys, values):
        params, final = self.params
        if self.compiled is None:
            self.no_ops = kernels.load()
            self.ops = self.mode()
            options = dict(OPTIONS)
            if hasattr(torch.compiler, "keep_tensor_guards_unsafe"):  # torch 2.8 on: guard filters
                options["guard_filter_fn"] = _unguarded
            self.compiled = torch.compile(_own_graph(), fullgraph=True, options=options)
            log.warning("compiling the decode step (once per model and cache shape; a minute or two the first time "
                        "on a small CPU, seconds once inductor's cache has it)")
            t = time.perf_counter()
            out = self.compiled(x, cos, sin, lens, keys, values, params, final, self.shape, self.ops)
            self.compile_s = time.perf_counter() - t
            return out
        return self.compiled(x, cos, sin, lens, keys, values, params, final, self.shape, self.ops)

    def __call__(self, token: torch.Tensor, position: torch.Tensor, cache, observer=None) -> torch.Tensor:
        if not self.serves(cache):
            self.eager_calls += not self.paused
            return super().__call__(token, position, cache, observer)
        x, cos, sin = self._embed(token, position)
        layers = cache.layers
        lens = torch.tensor([layer.lens for layer in layers])
        keys, values = [layer.keys for layer in layers], [layer.values for layer in layers]
        try:
            with self._lock:  # sessions of one model in several threads (the web UI): one compile, one step at a time
                out = self._run(x, cos, sin, lens, keys, values)
        except Exception as exc:  # noqa: BLE001 — any compiler failure: the eager step, said once
            # Nothing was recorded: at most the unused slot after each head was written, which stays unused.
            self.failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            log.warning("--decode compiled failed (%s); kvchat's eager step instead", self.failed)
            self.eager_calls += 1
            return super().__call__(token, position, cache, observer)
        self.calls += 1
        logits, qs, ks, vs, probs = out
        ks, vs = ks.unbind(0), vs.unbind(0)  # each layer's [1, KV heads, 1, dim]
        if observer is None:
            for layer, k, v in zip(layers, ks, vs):
                layer.appended(k, v)
            return logits
        for i, (lay, layer) in enumerate(zip(self.layers, layers)):
            lens_i = list(layer.lens)
            layer.appended(ks[i], vs[i])
            kbuf = layer.keys.view(layer.heads, layer.caps[0], -1)
            if layer.uniform:
                n = lens_i[0] + 1
                key, p = kbuf[None, :, :n], [probs[i][..., :n]]
            else:
                key = RaggedKV([kbuf[h, : n + 1][None, None] for h, n in enumerate(lens_i)])
                p = [probs[i][h: h + 1, :, : n + 1] for h, n in enumerate(lens_i)]
            observer(lay.attn, qs[i][None, :, None], key, lay.attn.scaling, probs=p)
        return logits
