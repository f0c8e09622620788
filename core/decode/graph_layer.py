"""One layer of the graph step (core/decode/graph.py) as a function of tensors and constants alone: the step runs it
as written, or compiled by ``torch.compile`` (``--decode compiled`` on CUDA: inductor fuses a layer's ~25 operations
into about a dozen kernels), and either way a CUDA graph captures it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .parts import NORMS, norm, project as _project


def layer(x, cos, sin, n, at, later, positions, weights, buffers, shape) -> torch.Tensor:
    """One layer of one token's step over its cache layer's buffers; tensors and constants only, so that
    ``torch.compile`` takes it whole (``GraphStep(compiled=True)``) and every layer of one shape shares one compiled
    graph. ``n``/``at``: each head's slot and row for the token; ``later``: the mask of the slots after it, or None;
    ``weights``/``shape``: ``GraphStep.weights``/``shapes``; ``buffers``: the cache layer's (``GraphStep._body``)."""
    nq, nk, d, heads, inner, scaling = shape
    norm1, qkv, o, norm2, gate_up, down, act = weights
    keys, values, k0, abs_pos, computed, rows, stats, acc, ring_q, ring_pos, gather, slots = buffers
    pos32, abs32, posf, row = positions
    qkv = _project(qkv, norm(norm1, x))
    qk = qkv[..., : nq + nk].view(1, -1, 1, d)
    qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
    q, k = qk[0, : nq // d, 0], qk[0, nq // d:, 0]  # [query heads, d], [heads, d]
    v = qkv[0, 0, nq + nk:].view(heads, d)
    keys.index_put_((at,), k)
    values.index_put_((at,), v)
    if k0 is not None:
        k0.index_put_((at,), k)
    abs_pos.index_put_((at,), abs32.expand(heads))
    computed.index_put_((at,), pos32.expand(heads))
    rows.index_fill_(0, at, -1)
    for stat in stats:
        stat.index_fill_(0, at, 0.0)
    out = _attend((q * scaling).view(heads, -1, d), keys, values, n, later, acc, gather, slots)
    if ring_q is not None:
        ring_q.index_put_((row,), q.float()[None])
        ring_pos.index_put_((row,), posf)
    x = x + _project(o, out.reshape(1, 1, -1))
    gu = _project(gate_up, norm(norm2, x))
    return x + _project(down, act(gu[..., :inner]) * gu[..., inner:])


def _attend(q, keys, values, n, later, acc, gather, slots) -> torch.Tensor:
    """Attention of the scaled queries ``q`` ([heads, groups, d]) over each head's region of slots, the slots
    after the new token's (``n``: its slot per head; ``later``: their mask if made already) masked; H2O's sums added
    to ``acc`` (each slot's probability averaged over its head's queries, as the observer adds them). [heads, groups,
    d]. Heads of different capacities (``headaware``) read their regions through one gather each for keys and values
    (``gather``: [heads, largest capacity] rows of the layer's buffers), padded to the largest; the padding is masked,
    as the slots past a head's length are."""
    heads, d = q.shape[0], q.shape[-1]
    cap = slots.shape[0]
    if gather is None:
        keys, values = keys.view(heads, cap, d), values.view(heads, cap, d)
    else:
        keys, values = keys[gather], values[gather]
    if later is None:
        later = slots[None, None, :] > n[:, None, None]
    probs = _scores(q, keys.transpose(1, 2)).masked_fill(later, float("-inf")).softmax(-1)
    if acc is not None:
        if gather is None:
            acc.view(heads, cap).add_(probs.mean(1))
        else:  # the padding's probabilities are 0: adding them anywhere changes nothing
            acc.index_put_((gather.flatten(),), probs.mean(1).flatten(), accumulate=True)
    return torch.bmm(probs.to(values.dtype), values)


def norm_of(norm) -> tuple | object:
    """A layer's ``parts.Norm`` as ``norm`` takes it: (weight, eps) for Llama's RMS norm, else its module."""
    if type(norm.module).__name__ in NORMS and norm.eps is not None:
        return norm.weight, norm.eps
    return norm.module


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
