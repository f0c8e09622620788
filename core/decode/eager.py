"""The eager one-token decode step of Llama-family models, run layer by layer without transformers' module dispatch.

A decode step on the CPU is many small pieces of work: per layer seven products with one token's vector, two norms,
the rotary embedding, the cache update and attention. Through the model's ``forward`` each of them also pays
transformers' module calls, keyword plumbing and per-projection casts: on this project's machine the small
operations of a step took longer than its products (docs/speed.md). ``DecodeStep`` runs the same computation for
one token, in one of two ways:

* on kvchat's operators (core/ops/kernels.py), where the fp16 copies of ``--weights half`` are in use, the model is fp32
  on the CPU with Llama's RMS norms and a SiLU MLP, and the operators build (a C++ compiler; once per machine): per
  layer one ``kvchat::layer`` call where every head of the cache layer has a free slot (``KVLayer.free_slot``: the norm,
  q/k/v as one product, their bias, the rotary embedding of q and k, the new key and value written into the layer's
  buffers, attention over them in place, the output projection, the norm, the MLP, and H2O's sums where the observer
  keeps them, ``Observer.step_sums``), the cache layer having claimed the slot before (its position, zeroed statistics:
  ``KVLayer.claim``) and keeping the computed key after (``KVLayer.staged``); where a head has no free slot (the cache
  resizes first) ``kvchat::project``, the cache layer's ``update`` and ``kvchat::block``, the same computation.
  ``kvchat::project`` then runs the output layer. Heads of different lengths (``headaware``) take the attention below
  and the operators for the products. The products widen the fp16 weights in registers and sum in fp32 with the input
  unrounded, where an fp16 GEMM rounds the input and the products to fp16: logits within that rounding of the model's
  forward with the same copies, and about as close to the fp32 model's (tests/test_step.py). ``without_ops`` says why a
  step runs without them;
* otherwise the model's own modules where they run once per step or carry the model's formula (embedding, RMS
  norms, the MLP's activation, the output layer); q/k/v and gate/up as one product each (with ``--weights half``
  their fp16 copies are concatenated once and the ``HalfLinear`` layers keep views into the concatenation; with the
  weights as loaded each projection is its own product, as in the model); the rotary embedding of queries and keys
  in one pass (the model's formula, ``x * cos + rotate_half(x) * sin``, in three kernels); kvchat's cache update
  and attention function, as the model's forward calls them.

Either way the cache layer records what ``update`` records and the policy's observer sees what it always sees, so
policies and statistics are the same. It serves decoder layers whose forward is Llama's (``SUPPORTED``:
Llama, Mistral, Qwen2 — Qwen2's q/k/v biases included); other architectures and models dispatched by accelerate hooks
run through the model's forward. ``--decode model`` turns it off. Reads of several tokens (a message, a long paste's
chunks, recall's text read again) take ``read``: the model's forward layer by layer without the dispatch, bit for
bit its logits, cache and statistics (tests/test_read.py).
tests/test_step.py compares it with the model's forward for each supported family: without the operators the same
logits bit for bit with the weights as loaded (fp32 or bf16), within 1e-5 with ``--weights half`` (one fp16 product
for q/k/v instead of three may sum in another order); with them within the fp16 rounding above; the same greedy
replies either way; ``kvchat::layer`` gives the bits of its three parts and of the observer's H2O sums. On this
project's machine the step without the operators saved 5-6 ms of a 30-32 ms step against the model's forward, the
operators took the reply loop from about 22 to 12.4-14.1 ms per token (alternating with the step without them,
``streaming`` at budget 1024), and ``kvchat::layer`` saved another 0.9-1.4 ms a token against its three parts
(``streaming``; 1.6-2.5 ms for ``h2o``), and H2O's sums inside it 0.8-2.1 ms against the observer's (docs/speed.md).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn

from ..cache.attention import kvchat_attention
from ..cache.layer import RaggedKV
from ..ops import kernels
from .parts import (ROPE_BLOCK, SUPPORTED, Layer, Norm, blockable, fp32_llama, norm as _norm,
                    project as _project)
from .weights import HalfLinear, on_huge_pages

SHORT_FEED = 4  # tokens the eager step feeds one at a time on kvchat's operators (``DecodeStep.short_feed``)


class DecodeStep:
    runs_ahead = False  # whether the engine may feed it a token the host has not read yet (graph.GraphStep)
    reads = True  # whether several tokens are read through its layers (``read``), else the model's forward (benches)

    def __init__(self, model: nn.Module):
        base = model.model
        self.embed, self.rotary, self.head = base.embed_tokens, base.rotary_emb, model.lm_head
        self.norm = Norm(base.norm)
        self.layers = [Layer(layer) for layer in base.layers[: model.config.num_hidden_layers]]
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
        # Segments of up to this many tokens (a reply's header, the template's closing) are fed a step a token where
        # that costs less than the model's forward over them (core/engine/feeding.py): on this project's CPU (ad
        # hoc), the default model on kvchat's operators, 2 / 3 / 4 / 8 tokens: steps 42 / 66 / 86 / 172 ms, the forward
        # 134 / 146 / 160 / 171. Elsewhere none (unmeasured: without the operators, or on a GPU, where this step
        # launches about as many kernels for one token as the forward does for all of them).
        self.short_feed = SHORT_FEED if self.without_ops is None else 0
        # What ``read`` normalises and multiplies each layer by: the model's norms and its linear layers, each its own
        # product, as the model's forward computes them.
        self.read_weights = [(lay.norm1, _as_modules(lay.qkv), _as_modules(lay.o), lay.norm2, _as_modules(lay.gate_up),
                              _as_modules(lay.down)) for lay in self.layers]
        # What one token multiplies each layer by without kvchat's operators: q/k/v and gate/up as one product each
        # (the fp16 copies concatenated, with ``--weights half``); o and down leave an fp16 product as it is, for the
        # sum that widens it (``parts.product``'s ``widen``).
        self.step_weights = [(lay.norm1, lay.qkv, partial(lay.o, widen=False), lay.norm2, lay.gate_up,
                              partial(lay.down, widen=False)) for lay in self.layers]

    def _operators(self, model: nn.Module) -> str | None:
        """Whether every layer can run on kvchat's operators (core/ops/kernels.py: ``layer`` for a whole layer, or
        ``project`` and ``block`` around the cache layer's ``update`` where it must resize first; ``project`` for the
        output layer), building them if need be (once per machine): None if so, else why not. They need the fp16
        copies of ``--weights half`` (with the layers' norms as Llama's, in fp32 on the CPU) and a C++ compiler."""
        why = fp32_llama(model)
        if why is not None:
            return why
        if not all(n.fused for lay in self.layers for n in (lay.norm1, lay.norm2)) or not self.norm.fused:
            return "its norms' weights are not fp32"
        if not all(lay.qkv.halves and blockable(lay) for lay in self.layers) or not isinstance(self.head, HalfLinear):
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

    def decode(self, ids: torch.Tensor, pos: torch.Tensor, abs_pos: torch.Tensor, cache, observer=None):
        """The logits [1, vocab] of one token (``ids`` [1]) at rotary position ``pos`` ([1]; its absolute one
        ``abs_pos``), on top of ``cache``: what the engine calls (core/engine/feeding.py)."""
        device = self.embed.weight.device
        cache.incoming_abs = abs_pos.to(device=device, dtype=torch.int32)
        cache.incoming_pos = pos.to(device=device, dtype=torch.int32)
        if observer is not None:
            observer.positions = pos.to(device)
        return self(ids.to(device), pos.to(device), cache, observer)

    def read(self, ids: torch.Tensor, pos: torch.Tensor, cache, keep: int = 1, **extra) -> torch.Tensor:
        """The logits of the last ``keep`` (0: all) of several tokens (``ids`` [n]) at rotary positions ``pos``
        on top of ``cache``: the model's forward (``logits_to_keep=keep``) without transformers' module dispatch,
        for a message, recall's text read again, a long paste's chunks (core/engine/feeding.py, which sets the
        cache's incoming positions and passes the policy's observer and recall's query tap in ``extra``, as to the
        model's forward). Each layer as the model computes it — its norms, q/k/v, the rotary embedding, the cache's
        update, kvchat's attention function, the output projection, the MLP — with what ``read_weights`` holds:
        here the model's own norms and weights as loaded (the same logits bit for bit, tests/test_read.py); in the
        graph step one product for q/k/v and one for gate/up, and its one-kernel norms (core/decode/graph.py). On a
        GPU, where a read's cost is the operations it dispatches, that is 32-42% fewer than the model's forward
        (counted: docs/gpu.md)."""
        x = self.hidden(ids[None], pos[None], cache, **extra)
        return self.head(x[:, -keep:] if keep else x)[0]

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, cache=None, **extra) -> torch.Tensor:
        """``read``'s layers and final norm over rows of tokens (``ids`` [b, n], positions ``pos`` [1 or b, n]): the
        last hidden states [b, n, hidden]; without a cache each row attends causally to itself alone, as the model's
        forward with no cache (recall's re-ranking reads its candidates so: core/recall/rerank.py)."""
        x = self.embed(ids)
        cos, sin = self._rope(x, pos)
        cos, sin = cos[:, None], sin[:, None]  # [1 or b, 1, n, head_dim]
        for i, weights in enumerate(self.read_weights):
            x = self._forward_layer(i, weights, x, cos, sin, cache, extra)
        return self.norm(x)

    def _forward_layer(self, i: int, weights: tuple, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
                       extra: dict) -> torch.Tensor:
        """Layer ``i`` over ``x`` [b, n, hidden] as the model computes it, multiplying by ``weights`` (norm1, qkv, o,
        norm2, gate_up, down: ``read_weights``' or, for one token without kvchat's operators, ``step_weights``'),
        writing the cache layer's ``update`` (no cache: each row attends to itself alone) and attending with kvchat's
        attention function and ``extra`` (the policy's observer, recall's query tap)."""
        lay, (norm1, qkv, o, norm2, gate_up, down) = self.layers[i], weights
        (b, n), d, (nq, nk, _) = x.shape[:2], self.head_dim, lay.split
        qkv = _project(qkv, _norm(norm1, x))
        qk = qkv[..., : nq + nk].view(b, n, -1, d).transpose(1, 2)  # [b, query + key heads, n, d]
        qk = qk * cos + qk.roll(d // 2, -1) * sin  # the model's x * cos + rotate_half(x) * sin, bit for bit
        k, v = qk[:, nq // d:], qkv[..., nq + nk:].view(b, n, -1, d).transpose(1, 2)
        keys, values = cache.layers[i].update(k, v) if cache is not None else (k, v)
        out, _ = kvchat_attention(lay.attn, qk[:, : nq // d], keys, values, None, scaling=lay.attn.scaling, **extra)
        x = x + _project(o, out.reshape(b, n, -1))
        gu = _project(gate_up, _norm(norm2, x))
        return x + _project(down, lay.act(gu[..., : lay.inner]) * gu[..., lay.inner:])

    def __call__(self, token: torch.Tensor, position: torch.Tensor, cache, observer=None) -> torch.Tensor:
        """Logits [1, vocab] for one token id (``token``, shape [1]) at ``position`` ([1]) on top of ``cache``."""
        x, cos, sin = self._embed(token, position)
        d = self.head_dim
        extra = {"kvchat_observer": observer} if observer is not None else {}
        ops = self.without_ops is None and self.layers[0].qkv.linears[0].use_step  # not ``weights.as_loaded``
        if not ops:
            for i, weights in enumerate(self.step_weights):
                x = self._forward_layer(i, weights, x, cos, sin, cache, extra)
            return self.head(self.norm(x))[0]
        lens, held = None, None  # kvchat::block's lengths (each head's last slot) and (heads, slots) they are for
        for i, lay in enumerate(self.layers):
            nq, nk, _ = lay.split
            layer = cache.layers[i]
            n = layer.free_slot()
            if n is not None:  # the whole layer, its cache write (and H2O's sums) included, in one operator call
                layer.claim(1)  # slot n: its position, zeroed statistics
                sums = observer.step_sums(layer) if observer is not None else None
                x, q, k, v, probs = torch.ops.kvchat.layer(x, lay.norm1.weight, lay.norm1.eps, lay.qkv.weight,
                                                           lay.qkv.bias, cos, sin, nq, layer.keys, layer.values,
                                                           layer.caps[0], n, lay.attn.scaling, lay.o.weight,
                                                           lay.norm2.weight, lay.norm2.eps, lay.gate_up.weight,
                                                           lay.down.weight, sums)
                layer.staged(k)
                if observer is not None:
                    observer(lay.attn, q, layer.held_keys(), lay.attn.scaling, probs=[probs], summed=sums is not None)
                continue
            # the norm, q/k/v and the rotary embedding of q and k in one operator call
            qkv = torch.ops.kvchat.project(x, lay.norm1.weight, lay.norm1.eps, lay.qkv.weight, lay.qkv.bias, cos, sin,
                                           nq + nk)
            q, k = qkv[..., :nq].view(1, -1, 1, d), qkv[..., nq: nq + nk].view(1, -1, 1, d)
            v = qkv[..., nq + nk:].view(1, -1, 1, d)
            keys, values = layer.update(k, v)
            if not isinstance(keys, RaggedKV):  # the rest of the layer as one operator call
                heads, n = keys.shape[1], keys.shape[2]
                if held != (heads, n):  # layers of one length share them
                    lens, held = torch.full((heads,), n - 1, dtype=torch.long), (heads, n)
                qh = (q[0, :, 0] * lay.attn.scaling).view(heads, -1, d)
                x, probs = torch.ops.kvchat.block(qh, keys[0], values[0], lens, x, lay.o.weight, lay.norm2.weight,
                                                  lay.norm2.eps, lay.gate_up.weight, lay.down.weight)
                if observer is not None:
                    observer(lay.attn, q, keys, lay.attn.scaling, probs=[probs])
                continue
            # heads of different lengths (RaggedKV): attention as without the operators, the rest on them
            out, _ = kvchat_attention(lay.attn, q, keys, values, None, scaling=lay.attn.scaling, **extra)
            x = x + torch.ops.kvchat.matvec(out.reshape(1, 1, -1), lay.o.weight)
            gu = torch.ops.kvchat.project(x, lay.norm2.weight, lay.norm2.eps, lay.gate_up.weight, None, cos, sin, 0)
            x = x + torch.ops.kvchat.matvec(lay.act(gu[..., : lay.inner]) * gu[..., lay.inner:], lay.down.weight)
        return torch.ops.kvchat.project(x, self.norm.weight, self.norm.eps, self.head.step, self.head.bias, cos, sin,
                                        0)[0]


def _as_modules(proj) -> Callable[[torch.Tensor], torch.Tensor]:
    """A layer's ``Projections`` as the model's own linear layers compute them, one product each (a ``HalfLinear``
    multiplies one token's row by its fp16 copy and more rows by the loaded weight, as in the model's forward)."""
    linears = proj.linears
    if len(linears) == 1:
        return linears[0]
    return lambda x: torch.cat([m(x) for m in linears], dim=-1)
