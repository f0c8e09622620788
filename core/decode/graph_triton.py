"""One layer of the graph step (core/decode/graph.py) in kvchat's own Triton kernels (``--decode triton`` on CUDA):
10 kernels a layer where ``graph_layer.layer`` runs about 25, each of them small enough that a replay's time
is mostly the gaps between them (docs/gpu.md). A layer is

    add + norm     the residual sum of the last layer's output and its RMS norm, one kernel (``add_norm``)
    q/k/v          one product (cuBLAS)
    rotate + write the rotary embedding of q and k; k, v, the positions, the storage row and the statistics'
                   reset written at each head's new slot; the query window's row (SnapKV): one kernel
    attend         each head's slots 0..n read once in splits of its region, an online softmax per split, then one
                   kernel that combines the splits and adds H2O's probabilities to its accumulator: two kernels
    o, add + norm, gate/up, SiLU x up, down

and the residual sum of a layer's output is the next layer's first kernel. The sums and the softmax run in fp32,
rounded to the model's dtype where the layer as written rounds a tensor it keeps (the residual, the norms' outputs, q,
the new key); the rotary embedding, the SiLU product and the probabilities each round once where the layer as written
rounds two or three times. On a CPU the same kernels run in Triton's interpreter (``TRITON_INTERPRET=1``: the tests),
where Triton is installed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BLOCK = 64  # slots a kernel reads at a time
SPLIT = 128  # about this many slots a split of a head's region: two tiles


def unsupported(weights: list, final, head_dim: int, device: torch.device) -> str | None:
    """Why these layers (``GraphStep.weights``, the final norm) cannot run in the kernels on ``device``, None if they
    can."""
    try:
        import triton
    except ImportError:
        return "Triton is not installed"
    knobs = getattr(triton, "knobs", None)  # Triton 3.4 on
    if device.type != "cuda" and not (knobs is not None and knobs.runtime.interpret):
        return "Triton's kernels run on a CUDA GPU (on a CPU only in its interpreter: TRITON_INTERPRET=1, the tests)"
    if head_dim < 16:
        return f"head_dim {head_dim} < 16 (Triton's products take 16 at least)"
    for norm1, qkv, o, norm2, gate_up, down, act in weights:
        if not all(isinstance(nm, tuple) for nm in (norm1, norm2, final)):
            return "a norm other than Llama's RMS norm"
        if not all(isinstance(p, tuple) for p in (qkv, o, gate_up, down)):
            return "kvchat's fp16 weight copies (--weights half)"
        if act is not F.silu:
            return "an activation other than SiLU"
    return None


def layer(x, y, cos, sin, lens, offs, inputs, weights, buffers, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of one token's step: what ``graph_layer.layer`` computes, from the residual ``x`` and the last
    layer's output ``y`` not yet added to it (None before the first layer); returns them for the next layer
    (``add_norm`` adds the last before the final norm). ``lens``, ``offs``: each head's length at the last upload
    and first row in the layer's buffers; ``inputs``: the step's (``graph.INPUTS``: the positions, the window's row,
    the steps since the upload), which the kernels read; the rest as ``graph_layer.layer`` takes them."""
    nq, nk, d, heads, inner, scaling = shape
    norm1, qkv, o, norm2, gate_up, down, _ = weights
    keys, values, k0, abs_pos, computed, rows, stats, acc, ring_q, ring_pos, _, slots = buffers
    x, h = add_norm(x, y, norm1)
    q = _rotate_write(F.linear(h, *qkv).view(-1), cos.reshape(-1), sin.reshape(-1), lens, offs, inputs,
                      (keys, values, k0, abs_pos, computed, rows, stats[0] if stats else None, ring_q, ring_pos),
                      nq, nk, d, heads)
    for stat in stats[1:]:  # the kernel resets one statistic (kvchat's policies keep one at most)
        stat.index_fill_(0, offs + lens + inputs[4], 0.0)
    out = attend(q, keys, values, offs, lens, inputs, acc, slots.shape[0], scaling, heads)
    x, h = add_norm(x, F.linear(out.view(1, 1, -1), *o), norm2)
    return x, F.linear(silu_mul(F.linear(h, *gate_up), inner), *down)


# -- the kernels' launches ----------------------------------------------------------------------------------------
def add_norm(x: torch.Tensor, y: torch.Tensor | None, norm: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, rms_norm(x + y) * weight) for one token ([1, 1, hidden]); x itself where ``y`` is None."""
    weight, eps = norm
    width = x.shape[-1]
    total = torch.empty_like(x) if y is not None else x
    normed = torch.empty_like(x)
    _kernel("add_norm")[(1,)](x, y if y is not None else x, weight, total, normed, eps, N=width, NP=_pow2(width),
                              ADD=y is not None)
    return total, normed


def silu_mul(gate_up: torch.Tensor, inner: int) -> torch.Tensor:
    """SiLU(gate) * up of one token's [.., 2 * inner] product, [1, 1, inner]."""
    out = torch.empty(1, 1, inner, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(inner))
    _kernel("silu_mul")[(-(-inner // block),)](gate_up, out, inner, B=block)
    return out


def attend(q, keys, values, offs, lens, inputs, acc, cap: int, scaling: float, heads: int) -> torch.Tensor:
    """Attention of the token's queries ``q`` ([query heads, d], rotated, unscaled) over each head's slots 0..n,
    n = ``lens[h]`` + ``inputs[4]`` (the steps since the lengths' upload): rows ``offs[h] + slot`` of the layer's
    ``keys``/``values`` ([rows, d]); ``acc``: H2O's accumulator, each slot's probability averaged over its head's
    queries added, or None. [query heads, d] in the values' dtype."""
    queries, d = q.shape
    groups = queries // heads
    gp, dp = max(16, _pow2(groups)), _pow2(d)
    splits = min(64, _pow2(-(-cap // SPLIT)))
    chunk = -(-cap // splits)
    chunk = -(-chunk // BLOCK) * BLOCK
    part_m = torch.empty(heads, splits, gp, dtype=torch.float32, device=q.device)
    part_l, part_o = torch.empty_like(part_m), torch.empty(heads, splits, gp, dp, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # 8 warps for heads wider than 64: 128-wide ones' fp32 tiles then fit in registers (4 warps spilled: ptxas -v,
    # sm_90)
    consts = dict(G=groups, GP=gp, D=d, DP=dp, B=BLOCK, SPLITS=splits, PREC=precision, num_warps=8 if d > 64 else 4)
    _kernel("attend_part")[(heads, splits)](q, keys, values, offs, lens, inputs, part_m, part_l, part_o, chunk,
                                            scaling, **consts)
    _kernel("attend_done")[(heads, splits if acc is not None else 1)](  # split 0 writes the output
        q, keys, offs, lens, inputs, part_m, part_l, part_o, acc if acc is not None else part_m, out, chunk, scaling,
        ACC=acc is not None, **consts)
    return out


def _rotate_write(qkv, cos, sin, lens, offs, inputs, buffers, nq, nk, d, heads) -> torch.Tensor:
    """The rotated queries [query heads, d] (the model's dtype); the rotated key, the value, the positions, the row
    (-1: none yet) and the statistic's reset written at each head's new row (``offs + lens + inputs[4]``); the query
    window's row."""
    keys, values, k0, abs_pos, computed, rows, stat, ring_q, ring_pos = buffers
    q = torch.empty(nq // d, d, dtype=keys.dtype, device=keys.device)
    groups = nq // nk
    _kernel("rotate_write")[(heads,)](
        qkv, cos, sin, lens, offs, inputs, keys, values, k0 if k0 is not None else keys, abs_pos, computed,
        rows, stat if stat is not None else cos, ring_q if ring_q is not None else q,
        ring_pos if ring_pos is not None else cos, q, NQ=nq, NK=nk, G=groups, GP=_pow2(groups), D=d, DP=_pow2(d),
        K0=k0 is not None, STAT=stat is not None, RING=ring_q is not None)
    return q


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(name: str):
    """The kernel ``name``: compiled by Triton for the GPU, or run by its interpreter (``TRITON_INTERPRET=1`` when
    Triton is first imported: the tests on a CPU)."""
    return _kernels()[name]


@functools.cache
def _kernels() -> dict:
    import triton

    from . import graph_triton_kernels as source

    return {name: triton.jit(getattr(source, name)) for name in source.KERNELS}
