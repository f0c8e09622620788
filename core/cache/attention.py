"""kvchat's attention function, registered with transformers' AttentionInterface.

Models load with ``attn_implementation="kvchat"``. The function runs SDPA as transformers' ``sdpa`` does, with two
differences the cache needs:

* causality is applied here, per layer (and per head for per-head budgets): query i of a chunk of q sees the
  first n - q + i + 1 of the n cached positions. Layers (and heads) may therefore hold different numbers of
  positions; transformers' own mask, sized from one layer, is not built (the mask interface returns None).
* heads of different lengths arrive as a ``RaggedKV`` and attention runs per KV head.

A decode step on the CPU (one query token, fp32) runs as two batched products and a softmax per layer
(``decode_attention``), which measured as fast as SDPA's kernel here and leaves the probabilities at hand: H2O's
accumulated attention then costs no second pass over the keys (170 against 282 us per layer of 1,068 positions,
docs/speed.md). Every policy and the full cache take the same path, so equivalences between them stay exact.

On a GPU, a prefill on top of the cache (q queries, the last of n keys) runs through SDPA with its lower-right
causal bias: flash or memory-efficient kernels, no [q, n] mask in memory (docs/gpu.md).

When the engine passes ``kvchat_observer`` (transformers forwards extra keyword arguments of the model's forward
down to the attention function), the observer receives the layer's query and key states and records the attention
statistics the running policy asked for (``core/cache/observe.py``) — no eager attention, no N x N matrix kept.
Policies that need no attention pass no observer and pay nothing. While a user message is fed with recall on,
``kvchat_tap`` keeps its queries in the layers that score recall (``core/recall``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from .layer import RaggedKV

ATTN_IMPLEMENTATION = "kvchat"


def causal_mask(q: int, n: int, device) -> torch.Tensor | None:
    """[1, 1, q, n] bool, bottom-right aligned (the q queries are the last q of the n keys); None when q == 1."""
    if q == 1:
        return None
    keys = torch.arange(n, device=device)[None, :]
    return (keys <= torch.arange(n - q, n, device=device)[:, None])[None, None]


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
    """One query token's attention over one layer's keys ([1, KV heads, n, dim]), the query heads that share a KV
    head as the rows of one product: (output [1, query heads, 1, dim], probabilities [KV heads, groups, n])."""
    heads, dim = key.shape[1], query.shape[-1]
    groups = query.shape[1] // heads
    probs = torch.bmm((query[0, :, 0] * scaling).view(heads, groups, dim), key[0].transpose(1, 2)).softmax(-1)
    return torch.bmm(probs, value[0]).view(1, heads * groups, 1, -1), probs


def kvchat_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                     kvchat_observer=None, kvchat_tap=None, **kwargs):
    q = query.shape[2]
    if kvchat_tap is not None:
        kvchat_tap(module, query, scaling)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if q == 1 and query.device.type == "cpu" and query.dtype == torch.float32 and kwargs.get("softcap") is None:
        # A decode step on the CPU: the products by hand (as fast as SDPA's kernel for one query row here), so the
        # probabilities are at hand for the observer (H2O's accumulated attention) at no second pass. Every policy
        # and the full cache take this path, so a budget larger than the chat still gives the full cache's output.
        if isinstance(key, RaggedKV):
            groups = query.shape[1] // len(key.heads)
            pairs = [decode_attention(query[:, h * groups: (h + 1) * groups], k, v, scaling)
                     for h, (k, v) in enumerate(zip(key.heads, value.heads))]
        else:
            pairs = [decode_attention(query, key, value, scaling)]
        if kvchat_observer is not None:
            kvchat_observer(module, query, key, scaling, probs=[p for _, p in pairs])
        out = torch.cat([o for o, _ in pairs], dim=1) if len(pairs) > 1 else pairs[0][0]
        return out.transpose(1, 2).contiguous(), None
    if kvchat_observer is not None:
        kvchat_observer(module, query, key, scaling)
    if isinstance(key, RaggedKV):
        groups = query.shape[1] // len(key.heads)
        outs = []
        for h, (k, v) in enumerate(zip(key.heads, value.heads)):
            qh = query[:, h * groups: (h + 1) * groups]
            n = k.shape[2]
            mask = causal_mask(q, n, query.device)
            out = F.scaled_dot_product_attention(qh, k.expand(-1, groups, -1, -1), v.expand(-1, groups, -1, -1),
                                                 attn_mask=mask, scale=scaling,
                                                 is_causal=False)
            outs.append(out)
        return torch.cat(outs, dim=1).transpose(1, 2).contiguous(), None
    n = key.shape[2]
    if q > 1 and n > q and query.device.type == "cuda" and dropout == 0.0 and kwargs.get("softcap") is None:
        # A prefill on top of the cache, on a GPU: the queries are the last q of the n keys, the causality SDPA's
        # lower-right bias gives its flash and memory-efficient kernels without a mask in memory.
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q, n), scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    if q > 1 and n == q:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      is_causal=True, **kwargs)
    return sdpa_attention_forward(module, query, key, value, causal_mask(q, n, query.device), dropout=dropout,
                                  scaling=scaling, is_causal=False, **kwargs)


def _no_mask(*args, **kwargs):
    """Masks are built per layer in ``kvchat_attention``."""
    return None


def register() -> str:
    """Register the attention and mask functions (idempotent); returns the implementation name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvchat_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
