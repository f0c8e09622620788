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
the sampler returns; and the engine does not wait for it (``runs_ahead``, core/engine/generate.py): a token still on
the device is copied into the graph's input there, so the next replay is queued before the host has read it.

The graph is CUDA's (``torch.cuda.CUDAGraph``): each capture takes milliseconds. A layer is ``graph_layer.layer``,
a function of tensors and constants: as written it runs about 25 kernels (measured on an H200, the first version's
43 cost ~100 µs a layer beyond the bytes it reads: docs/gpu.md); with ``compiled`` (``--decode compiled`` on CUDA)
``torch.compile`` fuses them into about a dozen before the capture, compiling once per layer shape (all layers of a
model share one) and cache capacity; with ``triton`` (``--decode triton``) each layer runs in kvchat's own Triton
kernels instead (``graph_triton``: 10 a layer). On the CPU the same step runs without capture (``capture`` False):
the tests compare it with the eager step there, and tests marked ``cuda`` compare the captured step on a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import types
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.observe import counted
from . import graph_triton
from .eager import DecodeStep
from .graph_layer import layer as _layer, norm_of as _norm_of
from .parts import SILU, Projections, norm as _norm

log = logging.getLogger(__name__)
INPUTS = 5  # token, rotary position, absolute position, the window's row, steps since the lengths were uploaded
ROPE_TABLE = 4096  # positions in the first rotary table (``GraphStep._rope_table``)
SHORT_FEED = 8  # tokens in a row the captured step feeds a replay each (``DecodeStep.short_feed``; ``__init__``)


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
    lens: torch.Tensor  # [layers, heads] int64: each head's length at the last upload
    offs: torch.Tensor  # [layers, heads] int64: each head's first row in its layer's buffers
    slots: dict[int, torch.Tensor]  # capacity -> arange(capacity) on the device
    gather: dict[int, torch.Tensor]  # layer -> [heads, largest capacity] its rows, for heads of different capacities
    accumulate: bool
    ring: Ring | None
    expected: list[list[int]] = field(default_factory=list)  # the heads' lengths the device's inputs give
    steps: int = 0  # steps replayed since the lengths were uploaded
    room: int = 0  # free slots of the fullest head: steps the graph can take before a compression
    copied: object = None  # CUDA: the event after the last copy of the inputs out of the pinned buffer
    graph: object = None
    logits: torch.Tensor | None = None
    table: torch.Tensor | None = None  # the rotary table it reads (``GraphStep._rope_table``)


class GraphStep(DecodeStep):
    """The step of the module docstring. ``capture``: record and replay a CUDA graph (on a CUDA device), else run
    the same static-shape step as it is (the CPU: tests)."""

    def __init__(self, model: nn.Module, compiled: bool = False, triton: bool = False):
        super().__init__(model)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.capture = self.device.type == "cuda"
        # The engine may feed a token before the host has read it (core/engine/generate.py): the step takes it where
        # the sampler left it, on the device. Worth it where replays run asynchronously (CUDA; tests set it on CPU).
        self.runs_ahead = self.capture
        # On an H100 a replay took 1.1-1.3 ms (llama-1b) where the model's forward over a reply's 3-token header took
        # 23.0 (host-bound: ~1,800 operators dispatched over 16 layers). Uncaptured (the CPU), a step costs a forward.
        self.short_feed = SHORT_FEED if self.capture else 0
        self._fuse()
        self.compiled, self.compile_error = compiled, None
        self._layer = _layer
        self.triton = triton and not compiled
        self.asked = "compiled" if compiled else "triton" if self.triton else "graph"  # kept where it falls back
        why = graph_triton.unsupported(self.weights, self.final, self.head_dim, self.device) if self.triton else None
        if why is not None:
            log.warning("Triton's kernels (--decode triton; auto on CUDA): %s; the step in PyTorch's operators", why)
            self.triton, self.compile_error = False, why
        if compiled:  # a function of its own: dynamo keeps compiled graphs (and their limit) per code object
            own = types.FunctionType(_layer.__code__.replace(), _layer.__globals__, _layer.__name__)
            self._layer = torch.compile(own, fullgraph=True)
            # One graph per kind of layer call (a policy's statistics, the query ring, per-head capacities, a mask
            # made once or per layer) and capacity: more than dynamo's default of 8 in a chat that changes policies,
            # past which it would run the function uncompiled without a word.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> _Plan
        self._table: torch.Tensor | None = None  # rotary cos and sin' of the first positions (``_rope_table``)
        self._lock = threading.Lock()  # sessions sharing the model in several threads: one capture or replay at a time
        self.captures = self.replays = self.eager_calls = 0
        self.capture_ms: list[float] = []
        self._side = torch.cuda.Stream(device=self.device) if self.capture else None  # every capture's warm-up

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
        """What ``_layer`` reads of each layer (``weights``, ``shapes``): q/k/v and gate/up as one weight each (one
        product instead of three and two; the model's own linear layers keep views into the concatenation, so the
        weights are held once), the norms as (weight, eps) for ``rms_norm``, a SiLU as ``F.silu``; kvchat's fp16
        copies (``--weights half``, the CPU) as the layer's ``Projections``, multiplied as the eager step does."""
        self.weights, self.shapes = [], []
        for lay in self.layers:
            projs = []
            for proj in (lay.qkv, lay.o, lay.gate_up, lay.down):
                if proj.halves:
                    projs.append(proj)
                    continue
                linears = proj.linears
                weight = linears[0].weight.detach()
                if len(linears) > 1 and _adjacent([m.weight for m in linears]):  # an earlier GraphStep's concatenation
                    weight = weight.new_empty(0).set_(weight.untyped_storage(), weight.storage_offset(),
                                                      (sum(m.out_features for m in linears), weight.shape[1]))
                elif len(linears) > 1:
                    weight = torch.cat([m.weight.detach() for m in linears])
                    start = 0
                    for m in linears:
                        m.weight.data = weight[start: start + m.out_features]
                        start += m.out_features
                projs.append((weight, proj.bias))
            qkv, o, gate_up, down = projs
            act = F.silu if type(lay.act).__name__ in SILU else lay.act
            self.weights.append((_norm_of(lay.norm1), qkv, o, _norm_of(lay.norm2), gate_up, down, act))
            nq, nk, _ = lay.split
            self.shapes.append((nq, nk, self.head_dim, nk // self.head_dim, lay.inner, lay.attn.scaling))
        self.final = _norm_of(self.norm)
        # a read of several tokens (``DecodeStep.read``) takes these norms and products, but not fp16 copies
        self.read_weights = [tuple(r if isinstance(w, Projections) else w for w, r in zip(ws, rs))
                             for ws, rs in zip(self.weights, self.read_weights)]

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
        lens, key = [layer.lens for layer in cache.layers], self._key(cache, observer)
        plan = self._plans.get(cache)
        # Between compressions nothing but the graph moves the cache: the plan's count of free slots says whether
        # the graph takes the step, without a look at every head (tens of µs a token at 32 layers).
        steady = plan is not None and plan.room > 0 and plan.key == key and lens == plan.expected
        if not steady and not self.serves(cache):
            self.eager_calls += 1
            return super().decode(ids, pos, abs_pos, cache, observer)
        token = ids[:1] if ids.device.type != "cpu" else int(ids[0])  # on the device: read there, no wait for it
        # The model's GPU made current: a capture, its streams and events, and Triton's launches use the current one.
        with self._lock, torch.cuda.device(self.device) if self.capture else contextlib.nullcontext():
            return self._replay(token, int(pos[0]), int(abs_pos[0]), cache, observer, lens, key)

    def stepper(self, cache, captured: bool = True):
        """A function taking one step of ``cache``'s plan: its graph's replay (``captured``, where there is one),
        else the step as written, uncaptured; None without a plan. What benches time and profile: each step writes the
        last token's slot again, so for benches, after a reply."""
        plan = self._plans.get(cache)
        if plan is None:
            return None
        if captured and plan.graph is not None:
            return plan.graph.replay
        return lambda: self._body(plan, cache)

    def _key(self, cache, observer) -> tuple:
        """What a plan's graph was captured over: each layer's buffers (``KVLayer.version``) and what the observer
        reads."""
        layers = tuple(layer.version for layer in cache.layers)
        watch = (observer.accumulate, observer.window) if observer is not None else None
        return layers, watch

    def _replay(self, token: int | torch.Tensor, pos: int, abs_pos: int, cache, observer, lens, key) -> torch.Tensor:
        table = self._rope_table(pos)
        plan = self._plans.get(cache)
        if plan is None or plan.key != key or plan.table is not table:
            plan = self._plans[cache] = self._plan(cache, observer, key)
            plan.table, key = table, plan.key
        if lens != plan.expected:  # a compression, a recall or a reload moved the heads' lengths: upload them
            plan.lens.copy_(torch.tensor(lens))
            plan.steps = 0
            plan.room = min(c - n for layer in cache.layers for n, c in zip(layer.lens, layer.caps))
        ring = plan.ring
        if plan.copied is not None:
            plan.copied.synchronize()  # the last step's inputs have left the pinned buffer
        on_device = isinstance(token, torch.Tensor)
        plan.host.numpy()[:] = (0 if on_device else token, pos, abs_pos,
                                ring.total % ring.size if ring is not None else 0, plan.steps)
        plan.inputs.copy_(plan.host, non_blocking=True)
        if on_device:  # the token the sampler left on the device, copied there after the rest
            plan.inputs[0:1].copy_(token)
        if self.capture:
            plan.copied = torch.cuda.Event()
            plan.copied.record()
            if plan.graph is None:
                self._record(plan, cache)
            plan.graph.replay()
            logits = plan.logits.clone()  # the graph's output buffer is written again by the next replay
        else:
            logits = self._first(plan, cache)
        self.replays, plan.steps, plan.room = self.replays + 1, plan.steps + 1, plan.room - 1
        for layer in cache.layers:
            layer.advanced(1)
        plan.expected = [list(layer.lens) for layer in cache.layers]
        if ring is not None:
            ring.total += 1
            observer.ring_written(ring)
        return logits

    def _rope_table(self, pos: int) -> torch.Tensor:
        """Rotary cos and sin' of positions [0, L) as [2, L, head_dim], made once by the model's rotary module (which
        is element-wise in the position: the bits it gives one position at a time), read by the step at its token's
        position: one kernel where computing them ran about ten. L doubles from 4,096 when a position reaches it (in
        ``rerotate`` mode positions stay near the cache's capacity); plans over an older table capture again."""
        if self._table is None or pos >= self._table.shape[1]:
            size = max(ROPE_TABLE, 1 << pos.bit_length())
            x = torch.empty(1, 1, 1, dtype=self.dtype, device=self.device)  # the rotary module reads its dtype alone
            self._table = torch.cat(self._rope(x, torch.arange(size, device=self.device)[None]))
        return self._table

    def _plan(self, cache, observer, key) -> _Plan:
        dev = self.device
        host = torch.zeros(INPUTS, dtype=torch.int64)
        if self.capture:
            host = host.pin_memory()
        lens = torch.zeros(len(cache.layers), cache.layers[0].heads, dtype=torch.int64, device=dev)
        offs = torch.tensor([layer.offs for layer in cache.layers], dtype=torch.int64, device=dev)
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
                counted(layer)
            key = self._key(cache, observer)
        return _Plan(key, host, torch.zeros(INPUTS, dtype=torch.int64, device=dev), lens, offs, slots, gather,
                     accumulate, ring)

    def _first(self, plan: _Plan, cache) -> torch.Tensor:
        """``_body`` run where the step may compile (uncaptured): if ``torch.compile`` or Triton fails, the layer as
        written from then on (``compile_error`` says why), which computes the same."""
        try:
            return self._body(plan, cache)
        except Exception as exc:  # noqa: BLE001 — any compiler failure: the step runs as written
            if not (self.compiled or self.triton):
                raise
            self.compile_error = f"{type(exc).__name__}: {exc}"[:300]
            log.warning("--decode %s: compiling the step failed (%s); the graph step as written",
                        "compiled" if self.compiled else "triton", self.compile_error)
            self.compiled = self.triton = False
            self._layer = _layer
            return self._body(plan, cache)

    def _record(self, plan: _Plan, cache) -> None:
        """Capture the step over this cache's buffers: one run first on the step's own side stream (cuBLAS keeps a
        workspace per stream for good, 32 MiB on Hopper), the statistics it adds put back; then the capture."""
        t = time.perf_counter()
        saved = [(t_, t_.clone()) for layer in cache.layers for t_ in layer.stats.values()]
        stream = self._side
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._first(plan, cache)
            for t_, copy in saved:
                t_.copy_(copy)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # Each graph has its own pool, freed with it (a shared one outlived closed sessions' graphs and a capture into
        # it failed: an H200, torch 2.11); no garbage collection while capturing: a tensor freed then breaks it.
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
        """One token through every layer over the cache's buffers, all on the device: what the graph records. The
        layers run as written (``_as_written``) or in Triton's kernels (``_in_triton``): a step's kernels are its cost
        on a GPU (docs/gpu.md)."""
        x = self.embed(plan.inputs[0:1][None])
        cos, sin = plan.table.index_select(1, plan.inputs[1:2]).view(2, 1, 1, 1, -1)  # each [1, 1, 1, head_dim]
        return self.head((self._in_triton if self.triton else self._as_written)(plan, cache, x, cos, sin))[0]

    def _as_written(self, plan: _Plan, cache, x, cos, sin) -> torch.Tensor:
        """The layers and the final norm, each layer ``_layer`` over tensors and constants alone (``self._layer``:
        compiled by ``torch.compile`` with ``compiled``). What every layer needs alike is computed once: each head's
        slot and row for the token in every layer, and, where every layer has one capacity, the mask of the slots
        after it."""
        inputs = plan.inputs
        pos, steps = inputs[1:2], inputs[4]
        positions = (pos.to(torch.int32), inputs[2:3].to(torch.int32), pos.float(), inputs[3:4])
        n_all = plan.lens + steps  # [layers, heads]: the slots each head held before this token
        at_all = plan.offs + n_all  # [layers, heads]: the token's row in each layer's buffers
        caps = {layer.caps[0] if layer.uniform_caps else -1 for layer in cache.layers}
        later_all = None
        if len(caps) == 1 and -1 not in caps:  # [layers, heads, 1, capacity]: the slots after the token's
            later_all = plan.slots[caps.pop()][None, None, None, :] > n_all[:, :, None, None]
        for i, layer in enumerate(cache.layers):
            later = later_all[i] if later_all is not None else None
            x = self._layer(x, cos, sin, n_all[i], at_all[i], later, positions, self.weights[i],
                            self._buffers(plan, i, layer), self.shapes[i])
        return _norm(self.final, x)

    def _in_triton(self, plan: _Plan, cache, x, cos, sin) -> torch.Tensor:
        """The layers and the final norm in Triton's kernels (``graph_triton``: they read the step's inputs and the
        heads' lengths and first rows themselves; the next layer's first kernel adds a layer's output)."""
        y = None
        for i, layer in enumerate(cache.layers):
            x, y = graph_triton.layer(x, y, cos, sin, plan.lens[i], plan.offs[i], plan.inputs, self.weights[i],
                                      self._buffers(plan, i, layer), self.shapes[i])
        return graph_triton.add_norm(x, y, self.final)[1]

    @staticmethod
    def _buffers(plan: _Plan, i: int, layer) -> tuple:
        """What a layer's step reads and writes of cache layer ``layer`` (the ``i``-th) and the plan."""
        ring = plan.ring
        gather = None if layer.uniform_caps else plan.gather[layer.index]  # [heads, largest capacity] rows
        cap = layer.caps[0] if gather is None else gather.shape[1]
        return (layer.keys, layer.values, layer.k0, layer.abs_pos, layer.computed, layer.rows,
                tuple(layer.stats.values()), layer.stats.get("acc") if plan.accumulate else None,
                ring.queries[i] if ring is not None else None, ring.positions[i] if ring is not None else None,
                gather, plan.slots[cap])


def _adjacent(weights: list[torch.Tensor]) -> bool:
    """Whether contiguous ``weights`` lie one after the other in one storage: the rows of one concatenation."""
    at, ptr = weights[0].storage_offset(), weights[0].untyped_storage().data_ptr()
    for w in weights:
        if not w.is_contiguous() or w.untyped_storage().data_ptr() != ptr or w.storage_offset() != at:
            return False
        at += w.numel()
    return True
