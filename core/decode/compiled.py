"""``--decode compiled``: the eager step's computation for every layer and the output layer as one ``torch.compile``
graph over the cache's fixed-capacity buffers (fp32 models on the CPU)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.layer import RaggedKV
from ..ops import kernels
from .eager import DecodeStep
from .parts import blockable, fp32_llama, product
from .weights import HalfLinear

log = logging.getLogger(__name__)

# Inductor's options for the graph: its wrapper in C++ rather than Python (hundreds of kernel and product calls per
# step), no size checks of the inputs on each call (dynamo's guards check the shapes already). About 1 ms of a 17-18
# ms step on this project's machine (docs/speed.md).
OPTIONS = {"cpp_wrapper": True, "size_asserts": False}
# The arguments whose guards the graph goes without (``_unguarded``): the weights.
WEIGHTS = ("params", "final")


def _graph_product(x: torch.Tensor, copies: bool, pieces: tuple, *, ops: bool) -> torch.Tensor:
    """``product`` inside the graph: x times the fp16 copies with the input and the sums in fp32 (``product``'s fp16
    GEMM rounds both to fp16): the eager step's numbers within that rounding (tests/test_step.py). With ``ops``
    kvchat's ``matvec`` operator (core/ops/kernels.py: each weight row read once, widened in registers); else written
    as a multiply and a sum over the input, which inductor compiles into one reduction kernel of the same kind with the
    input's norm fused in (inductor drops an fp16 round trip within a kernel even when written out). On this
    project's machine the reduction kernels made the step 18.5, 19.1 and 15.8 ms against 20.4, 22.0 and 16.5 with the
    fp16 GEMM (three ad-hoc runs), and ``matvec`` 14.9 against 16.0 for the reduction kernels (ten replies, the two
    alternating token by token; docs/speed.md). The loaded layers (``copies`` False) multiply as ``product`` does."""
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
    (core/ops/kernels.py), else ``torch.bmm`` and inductor's own kernels; ``"block"``: besides, everything in a layer
    after its cache write — attention, the output projection, the norm, the MLP — as one ``kvchat::block`` call (a
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
    """``--decode compiled``: the whole step — every layer, the cache write and attention, the output layer — as one
    ``torch.compile`` graph (inductor, C++ on the CPU), which fuses the ~50 small operations per layer that dispatch one
    by one in the eager step. Attention runs over each layer's whole preallocated buffer with the slots past the new
    token masked, so the graph's shapes stay the same while the cache's capacity does (every bounded policy between
    compressions). After the graph, each cache layer records what ``update`` would have (``KVLayer.appended``:
    positions, statistics, the computed keys) and the observer gets the queries and probabilities, as in the eager step.
    Attention's two products and the products with the fp16 weights are kvchat's operators (core/ops/kernels.py: each
    streams its buffer once, where ``torch.bmm`` reads the cache at half the rate for this shape), built at the first
    compile, and for Llama-family layers as released everything after a layer's cache write is one ``kvchat::block``
    call (``mode``); without the operators (no ninja), ``torch.bmm`` and inductor's reduction kernels. dynamo's guards
    leave out the weights (``_unguarded``). The fp16 copies the graph reads sit in huge-page memory where Linux allows
    (``DecodeStep._place_copies``).

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
        # Why kvchat's operators (core/ops/kernels.py) are not in use; known from the first compile on.
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
        return DecodeStep.unsupported(model) or fp32_llama(model)

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
        return "block" if all(blockable(lay) for lay in self.layers) else True

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
