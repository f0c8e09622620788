"""``--decode graph`` (the default on CUDA): one token's whole step captured once as a CUDA graph and replayed.

The step — the embedding, every layer (norm, q/k/v as one product, the rotary embedding, the new key and value
written into the cache layer's buffers, attention over each head's slots, the output projection, the MLP), the
statistics the running policy reads (H2O's accumulated attention added per slot, the query window's newest row),
the output layer — is recorded once per cache layout and replayed for every token: one launch instead of a few
hundred, no Python between the kernels. What makes that possible is the cache's fixed capacity between compressions
(budget + slack per head): every buffer the step reads and writes stays where it is, and attention runs over each
head's whole region with the slots past its length masked, so the shapes never change. What changes per token —
the token id, its rotary and absolute positions, the window's row, how many steps were taken since the heads'
lengths were last uploaded — is five integers, copied into the graph's input buffer from pinned memory in one copy.

Compression runs between replays (``core/cache/compress.py``): for a uniform budget it writes the kept slots back
into the same buffers (``KVLayer.keep``), so the graph stays valid and only the heads' lengths are uploaded again;
a new capacity (a budget change, a per-layer or per-head allocation that changed, a growing ``full`` cache
doubling, an undo) allocates new buffers, and the next step captures again (``captures`` counts them). After a
replay the cache layers only count the token (``KVLayer.advanced``): its position, computed key, zeroed
statistics and storage row were written by the graph. Nothing is copied off the device per token but the token id
the sampler returns.

The graph is CUDA's (``torch.cuda.CUDAGraph``): each capture takes milliseconds. ``torch.compile`` with CUDA graphs
would fuse the small operations further but compiles for minutes per model and again per capacity; docs/gpu.md
has what was measured. On the CPU the same step runs without capture (``capture`` False): the tests compare it with
the eager step there, and tests marked ``cuda`` compare the captured step on a GPU.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .eager import DecodeStep

INPUTS = 5  # token, rotary position, absolute position, the window's row, steps since the lengths were uploaded


@dataclass(eq=False)
class Ring:
    """The query window's newest rows as the graph writes them: per layer the last ``size`` decode steps' queries
    ([size, query heads, dim], fp32) and positions ([size]); step t goes to row t % size. ``total`` counts the
    steps written since the ring was made (core/cache/observe.py reads the rows it has not taken yet)."""

    size: int
    queries: dict[int, torch.Tensor]
    positions: dict[int, torch.Tensor]
    scaling: dict[int, float]
    total: int = 0

    def newest(self, li: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The newest ``count`` (<= size) rows of layer ``li``, oldest first."""
        rows = [(self.total - count + j) % self.size for j in range(count)]
        index = torch.tensor(rows, device=self.queries[li].device)
        return self.queries[li].index_select(0, index), self.positions[li].index_select(0, index)


@dataclass(eq=False)
class _Plan:
    """One cache layout's graph: the buffers it was captured over (``key``), its inputs and outputs."""

    key: tuple
    host: torch.Tensor  # pinned int64 [INPUTS] (plain memory off CUDA)
    inputs: torch.Tensor  # the same on the device
    lens: list[torch.Tensor]  # per layer [heads] int64: each head's length at the last upload
    offs: list[torch.Tensor]  # per layer [heads] int64: each head's first row in the layer's buffers
    slots: dict[int, torch.Tensor]  # capacity -> arange(capacity) on the device
    gather: dict[int, torch.Tensor]  # layer -> [heads, largest capacity] its rows, for heads of different capacities
    accumulate: bool
    ring: Ring | None
    expected: list[list[int]] = field(default_factory=list)  # the heads' lengths the device's inputs give
    steps: int = 0  # steps replayed since the lengths were uploaded
    copied: object = None  # CUDA: the event after the last copy of the inputs out of the pinned buffer
    graph: object = None
    logits: torch.Tensor | None = None


class GraphStep(DecodeStep):
    """The step of the module docstring. ``capture``: record and replay a CUDA graph (on a CUDA device), else run
    the same static-shape step as it is (the CPU: tests)."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.capture = self.device.type == "cuda"
        self._fuse()
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> _Plan
        self._lock = threading.Lock()  # sessions sharing the model in several threads: one capture or replay at a time
        self.captures = self.replays = self.eager_calls = 0
        self.capture_ms: list[float] = []

    @staticmethod
    def unsupported(model: nn.Module) -> str | None:
        why = DecodeStep.unsupported(model)
        if why is not None:
            return why
        rope = getattr(model.model.rotary_emb, "rope_type", "default")
        if "dynamic" in rope or rope == "longrope":
            return f"{rope} RoPE changes with the sequence's length"
        return None

    # -- weights ----------------------------------------------------------------------------------------------
    def _fuse(self) -> None:
        """q/k/v and gate/up of each layer as one weight each (one product instead of three and two): the model's
        own linear layers keep views into the concatenation, so the weights are held once."""
        self.fused = []
        for lay in self.layers:
            entry = []
            for proj in (lay.qkv, lay.gate_up):
                linears = proj.linears
                if len(linears) > 1 and not proj.halves:
                    weight = torch.cat([m.weight.detach() for m in linears])
                    start = 0
                    for m in linears:
                        m.weight.data = weight[start: start + m.out_features]
                        start += m.out_features
                else:
                    weight = linears[0].weight.detach()
                entry.append((weight, proj.bias))
            self.fused.append(tuple(entry))

    # -- serving ----------------------------------------------------------------------------------------------
    def serves(self, cache) -> bool:
        """Whether the graph takes this step: every layer started in the model's dtype with room for one more token
        in each head (else the cache grows or compresses first, through the eager step)."""
        for layer in cache.layers:
            if not layer.is_initialized or layer.keys.dtype != self.dtype or layer.keys.device != self.device:
                return False
            if any(n >= c for n, c in zip(layer.lens, layer.caps)):
                return False
        return True

    def decode(self, ids: torch.Tensor, pos: torch.Tensor, abs_pos: torch.Tensor, cache, observer=None):
        if not self.serves(cache):
            self.eager_calls += 1
            return super().decode(ids, pos, abs_pos, cache, observer)
        with self._lock:
            return self._replay(int(ids[0]), int(pos[0]), int(abs_pos[0]), cache, observer)

    def _key(self, cache, observer) -> tuple:
        """What a plan's graph was captured over: each layer's buffers (``KVLayer.version``) and what the observer
        reads."""
        layers = tuple(layer.version for layer in cache.layers)
        watch = (observer.accumulate, observer.window) if observer is not None else None
        return layers, watch

    def _replay(self, token: int, pos: int, abs_pos: int, cache, observer) -> torch.Tensor:
        plan = self._plans.get(cache)
        key = self._key(cache, observer)
        if plan is None or plan.key != key:
            plan = self._plans[cache] = self._plan(cache, observer, key)
        lens = [layer.lens for layer in cache.layers]
        if lens != plan.expected:  # a compression, a recall or a reload moved the heads' lengths: upload them
            for t, n in zip(plan.lens, lens):
                t.copy_(torch.tensor(n))
            plan.steps = 0
        ring = plan.ring
        if plan.copied is not None:
            plan.copied.synchronize()  # the last step's inputs have left the pinned buffer
        plan.host.numpy()[:] = (token, pos, abs_pos, ring.total % ring.size if ring is not None else 0, plan.steps)
        plan.inputs.copy_(plan.host, non_blocking=True)
        if self.capture:
            plan.copied = torch.cuda.Event()
            plan.copied.record()
            if plan.graph is None:
                self._record(plan, cache)
            plan.graph.replay()
            logits = plan.logits.clone()  # the graph's output buffer is written again by the next replay
        else:
            logits = self._body(plan, cache)
        self.replays += 1
        plan.steps += 1
        for layer in cache.layers:
            layer.advanced(1)
        plan.expected = [list(layer.lens) for layer in cache.layers]
        if ring is not None:
            ring.total += 1
            observer.ring_written(ring)
        return logits

    def _plan(self, cache, observer, key) -> _Plan:
        dev = self.device
        host = torch.zeros(INPUTS, dtype=torch.int64)
        if self.capture:
            host = host.pin_memory()
        lens = [torch.zeros(layer.heads, dtype=torch.int64, device=dev) for layer in cache.layers]
        offs = [torch.tensor(layer.offs, dtype=torch.int64, device=dev) for layer in cache.layers]
        slots = {c: torch.arange(c, device=dev) for layer in cache.layers for c in set(layer.caps)}
        gather = {}
        for layer in cache.layers:
            if not layer.uniform_caps:
                width = max(layer.caps)
                rows = torch.tensor(layer.offs)[:, None] + torch.arange(width)[None, :]
                gather[layer.index] = rows.clamp(max=layer.keys.shape[0] - 1).to(dev)
                slots.setdefault(width, torch.arange(width, device=dev))
        ring = None
        if observer is not None and observer.window:
            ring = Ring(observer.window,
                        {li: torch.zeros(observer.window, lay.split[0] // self.head_dim, self.head_dim,
                                         device=dev) for li, lay in enumerate(self.layers)},
                        {li: torch.zeros(observer.window, device=dev) for li in range(len(self.layers))},
                        {li: lay.attn.scaling for li, lay in enumerate(self.layers)})
        accumulate = observer is not None and observer.accumulate
        if accumulate:
            for layer in cache.layers:
                layer.ensure_stat("acc")
            key = self._key(cache, observer)
        return _Plan(key, host, torch.zeros(INPUTS, dtype=torch.int64, device=dev), lens, offs, slots, gather,
                     accumulate, ring)

    def _record(self, plan: _Plan, cache) -> None:
        """Capture the step over this cache's buffers: one run on a side stream first (cuBLAS's workspaces and
        the allocator warm up there), with the statistics it adds to put back, then the capture."""
        t = time.perf_counter()
        saved = [(t_, t_.clone()) for layer in cache.layers for t_ in layer.stats.values()]
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._body(plan, cache)
            for t_, copy in saved:
                t_.copy_(copy)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # Each graph has its own memory pool, freed with it: one pool shared by every plan outlived the graphs of
        # closed sessions, and capturing into it again failed inside the allocator (an H200, torch 2.11). No
        # garbage collection while capturing (torch.cuda.graph collects just before): a tensor freed by the collector
        # then would invalidate the capture.
        gc.disable()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                plan.logits = self._body(plan, cache)
        finally:
            gc.enable()
        plan.graph = graph
        self.captures += 1
        self.capture_ms.append(1000 * (time.perf_counter() - t))

    # -- the step ---------------------------------------------------------------------------------------------
    def _body(self, plan: _Plan, cache) -> torch.Tensor:
        """One token through every layer over the cache's buffers, all on the device: what the graph records."""
        inputs = plan.inputs
        token, pos, absolute, row, steps = inputs[0:1], inputs[1:2], inputs[2:3], inputs[3:4], inputs[4]
        x = self.embed(token[None])
        cos, sin = self._rope(x, pos[None])
        cos, sin = cos[:, None], sin[:, None]
        d, half = self.head_dim, self.head_dim // 2
        pos32, abs32 = pos.to(torch.int32), absolute.to(torch.int32)
        for i, (lay, layer) in enumerate(zip(self.layers, cache.layers)):
            nq, nk, _ = lay.split
            heads = layer.heads
            (qkv_w, qkv_b), (gu_w, _) = self.fused[i]
            qkv = torch.nn.functional.linear(lay.norm1(x), qkv_w, qkv_b)
            qk = qkv[..., : nq + nk].view(1, -1, 1, d)
            qk = qk * cos + qk.roll(half, -1) * sin
            q, k = qk[0, : nq // d, 0], qk[0, nq // d:, 0]  # [query heads, d], [heads, d]
            v = qkv[0, 0, nq + nk:].view(heads, d)
            n = plan.lens[i] + steps  # [heads] slots each head held before this token
            at = plan.offs[i] + n  # the token's row in the layer's buffers, per head
            layer.keys.index_copy_(0, at, k)
            layer.values.index_copy_(0, at, v)
            if layer.k0 is not None:
                layer.k0.index_copy_(0, at, k)
            layer.abs_pos.index_copy_(0, at, abs32.expand(heads))
            layer.computed.index_copy_(0, at, pos32.expand(heads))
            layer.rows.index_fill_(0, at, -1)
            for stat in layer.stats.values():
                stat.index_fill_(0, at, 0.0)
            out = self._attend(plan, layer, (q * lay.attn.scaling).view(heads, -1, d), n)
            if plan.ring is not None:
                plan.ring.queries[i].index_copy_(0, row, q.float()[None])
                plan.ring.positions[i].index_copy_(0, row, pos.float())
            x = x + lay.o(out.reshape(1, 1, -1))
            gu = torch.nn.functional.linear(lay.norm2(x), gu_w)
            x = x + lay.down(lay.act(gu[..., : lay.inner]) * gu[..., lay.inner:])
        return self.head(self.norm(x))[0]

    def _attend(self, plan: _Plan, layer, q: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """Attention of the scaled queries ``q`` ([heads, groups, d]) over each head's region of slots, the slots
        after the new token's (``n``: its slot per head) masked; H2O's sums added to ``acc`` (each slot's
        probability averaged over its head's queries, as the observer adds them). [heads, groups, d]. Heads of
        different capacities (``headaware``) read their regions through one gather each for keys and values, padded
        to the largest (``_Plan.gather``: the padding is masked, as the slots past a head's length are)."""
        heads, d = layer.heads, q.shape[-1]
        acc = layer.stats.get("acc") if plan.accumulate else None
        if layer.uniform_caps:
            cap = layer.caps[0]
            keys, values = layer.keys.view(heads, cap, d), layer.values.view(heads, cap, d)
            index = None
        else:
            index = plan.gather[layer.index]  # [heads, largest capacity] rows of the layer's buffers
            cap = index.shape[1]
            keys, values = layer.keys[index], layer.values[index]
        later = plan.slots[cap][None, None, :] > n[:, None, None]
        probs = _scores(q, keys.transpose(1, 2)).masked_fill(later, float("-inf")).softmax(-1)
        if acc is not None:
            if index is None:
                acc.view(heads, cap).add_(probs.mean(1))
            else:  # the padding's probabilities are 0: adding them anywhere changes nothing
                acc.index_put_((index.flatten(),), probs.mean(1).flatten(), accumulate=True)
        return torch.bmm(probs.to(values.dtype), values)

_OUT_DTYPE = True  # cuBLAS multiplies bf16/fp16 into fp32 sums (``out_dtype``); False once a build refuses it


def _scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q @ keys ([b, m, d] @ [b, d, n]) in fp32: bf16/fp16 inputs multiplied by cuBLAS with the fp32 sums kept
    (``out_dtype``, CUDA), where a bf16 output would round every logit to three digits before the softmax. A torch
    without that operator on the device multiplies fp32 copies instead (found on the first, uncaptured run)."""
    global _OUT_DTYPE
    if q.dtype == torch.float32:
        return torch.bmm(q, keys)
    if q.device.type == "cuda" and _OUT_DTYPE:
        try:
            return torch.bmm(q, keys, out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError, TypeError):
            _OUT_DTYPE = False
    return torch.bmm(q.float(), keys.float())
