"""Scoring recall's candidates: the user message's queries against the groups' digests, with the model's own
attention.

When a user message has been fed, its queries in the scoring layers (``QueryTap``, un-rotated to position 0 as the
digests are, template scaffolding rows left out) score every group (``relevance``): per layer, each query's softmax
over the groups' representative keys; a group's score is the largest share any query (and query head) gives it,
averaged over the scoring layers. Past ``CANDIDATES`` groups a coarse pass over one key per group picks the ones
scored in full.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

SCORING_LAYERS = 8  # layers whose queries and keys score relevance
QUERY_ROWS = 64  # the latest query rows of a user message kept for scoring
CANDIDATES = 512  # past this many groups, a coarse pass (one key per group, a few layers) picks the ones scored
COARSE_ROWS = 24  # query rows (spread evenly over the message) the coarse pass uses; the full pass uses all
BLOCK = 4096  # groups the coarse pass multiplies at once: its memory (on a GPU too) is bounded, not the chat's length
KEPT_LOGITS_MB = 96  # on the CPU the coarse pass's products kept for its second pass (bf16: 230,000 groups of 3 KV
# heads x 72 query rows, the default model's long message)


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16): there the scoring's products ran 1.7-6x faster than
    fp32 on this project's machine."""
    return getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()


#: The dtype the coarse keys are kept in memory and multiplied in: bf16 where the CPU has native bf16 products (the
#: coarse pass only picks candidates), else fp16 (half the memory, multiplied in fp32).
COARSE_DTYPE = torch.bfloat16 if native_bf16() else torch.float16
#: The dtype the full pass multiplies the candidates' digests in: bf16 where native (the shares it gives are within
#: ~1e-3 of fp32's; for 64 query rows and 512 candidates the pass took 8.5 ms, 14.5 in fp32), else fp32.
FULL_DTYPE = torch.bfloat16 if native_bf16() else torch.float32


def scoring_layers(num_layers: int) -> list[int]:
    """Up to ``SCORING_LAYERS`` layers evenly spread over the middle of the network (its first and last fifth
    attend mostly locally or to the output)."""
    lo, hi = num_layers // 5, max(num_layers // 5, num_layers - 1 - num_layers // 5)
    return sorted({round(x) for x in np.linspace(lo, hi, min(SCORING_LAYERS, hi - lo + 1))})


def coarse_index(layers: list[int]) -> list[int]:
    """Which scoring layers the coarse pass reads: three spread over them."""
    return sorted({round(x) for x in np.linspace(0, len(layers) - 1, min(3, len(layers)))})


class QueryTap:
    """Keeps the latest query rows of the scoring layers while a user message is fed (the attention function calls
    it with each layer's query states); ``positions`` is set by the engine before each forward."""

    def __init__(self, layers: list[int]):
        self.layers = set(layers)
        self.positions: torch.Tensor | None = None
        self.queries: dict[int, torch.Tensor] = {}  # layer -> [query heads, rows, dim]
        self.qpos: dict[int, torch.Tensor] = {}
        self.keep: torch.Tensor | None = None  # the indices of the forward's rows to keep, None: all
        self.scaling: dict[int, float] = {}

    def __call__(self, module, query: torch.Tensor, scaling: float | None) -> None:
        li = module.layer_idx
        if li not in self.layers:
            return
        self.scaling[li] = scaling if scaling is not None else query.shape[-1] ** -0.5
        q, pos = query[0].float(), self.positions
        if self.keep is not None:
            q, pos = q.index_select(1, self.keep), pos.index_select(0, self.keep)
            if not q.shape[1]:  # a chunk of scaffolding alone (a message typed as "<|im_start|>"): no query to keep
                return
        if li in self.queries:
            q, pos = torch.cat([self.queries[li], q], 1), torch.cat([self.qpos[li], pos])
        self.queries[li], self.qpos[li] = q[:, -QUERY_ROWS:], pos[-QUERY_ROWS:]

    def unrotated(self, rotary) -> dict[int, torch.Tensor]:
        if rotary is None:
            return self.queries
        return {li: rotary.rotate(q, -self.qpos[li].long()[None].to(q.device)) for li, q in self.queries.items()}


def _take(digests, index) -> torch.Tensor:
    """Rows ``index`` (None: all) of the digests: an array [groups, layers, heads, reps, dim], or an object whose
    ``take`` reads them (core/recall/digest.py: ``Rows``)."""
    if not isinstance(digests, np.ndarray):
        return digests.take(index)
    return torch.from_numpy(np.array(digests if index is None else digests[np.asarray(index)]))


def relevance(digests, coarse: torch.Tensor, layers: list[int], queries: dict[int, torch.Tensor],
              scaling: dict[int, float]) -> torch.Tensor:
    """[groups] how much the queries want each group (``score``; ``digests`` as ``_take`` reads them). Past
    ``CANDIDATES`` groups, a coarse pass over one key per group in three layers (``coarse``: [3, heads, groups,
    kdim]) and ``COARSE_ROWS`` of the query rows picks the candidates whose digests are read and scored in full; the
    others get 0."""
    groups = digests.shape[0]
    if groups <= CANDIDATES:
        return score(_take(digests, None), layers, queries, scaling)
    first, used = torch.zeros(groups), 0
    for ci, li in zip(range(coarse.shape[0]), [layers[i] for i in coarse_index(layers)]):
        q = queries.get(li)
        if q is not None:
            if q.shape[1] > COARSE_ROWS:  # its cost grows with rows x groups: a long message is sampled
                q = q[:, torch.linspace(0, q.shape[1] - 1, COARSE_ROWS).round().long().to(q.device)]
            first += _blocked_shares(q, coarse[ci], scaling.get(li, q.shape[-1] ** -0.5))
            used += 1
    picked = (first / max(used, 1)).topk(CANDIDATES).indices.sort().values
    out = torch.zeros(groups)
    out[picked] = score(_take(digests, picked.numpy()), layers, queries, scaling)
    return out


def score(digests: torch.Tensor, layers: list[int], queries: dict[int, torch.Tensor],
          scaling: dict[int, float]) -> torch.Tensor:
    """[groups] the mean over ``layers`` of the largest attention share (softmax over groups of the best
    representative key) any query row and query head gives each group (digests: [groups, layers, heads, reps,
    dim])."""
    groups, _, heads, reps, kdim = digests.shape
    # one conversion for all layers, the representatives outermost: the best of them is an elementwise maximum
    keys = torch.empty(len(layers), heads, reps, groups, kdim, dtype=FULL_DTYPE)
    keys.copy_(digests.permute(1, 2, 3, 0, 4))
    keys = keys.view(len(layers), heads, reps * groups, kdim)
    total = torch.zeros(groups)
    used = 0
    for si, li in enumerate(layers):
        q = queries.get(li)
        if q is None:
            continue
        total += _shares(q, keys[si].to(q.device), scaling.get(li, kdim ** -0.5), reps)
        used += 1
    return total / max(used, 1)


def _shares(q: torch.Tensor, keys: torch.Tensor, scale: float, reps: int, rough: bool = False) -> torch.Tensor:
    """[groups] the largest attention share any row of ``q`` ([query heads, rows, dim]; the query heads sharing a
    KV head go together) gives each group, the softmax taken over the groups' best of ``reps`` keys (``keys``:
    [KV heads, reps * groups, dim], representative r of group g at row r * groups + g). ``rough``: the softmax's
    output in the keys' dtype where that is bf16 (the coarse pass, which only ranks: 18-31% faster there)."""
    s = _logits(q, keys, scale, reps)
    if rough and s.dtype == torch.bfloat16:
        return s.softmax(-1).amax((0, 1)).float().cpu()
    return s.float().softmax(-1).amax((0, 1)).cpu()


def _logits(q: torch.Tensor, keys: torch.Tensor, scale: float, reps: int = 1) -> torch.Tensor:
    """[KV heads, rows, groups] each row's logit for each group's best of ``reps`` keys (as ``_shares`` reads them)."""
    heads = keys.shape[0]
    qh = q.reshape(heads, -1, keys.shape[-1]) * scale
    if keys.dtype == torch.bfloat16:  # where the CPU multiplies bf16 natively
        s = _bf16_scores(qh.to(keys.dtype), keys)
    else:
        s = torch.bmm(qh, keys.float().transpose(1, 2))
    return s.view(heads, qh.shape[1], reps, -1).amax(2) if reps > 1 else s


def _blocked_shares(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``_shares(q, keys, scale, 1, rough=True)`` (``keys``: one per group, in memory, moved to ``q``'s device a
    ``BLOCK`` of groups at a time) in bounded memory: past one block, each row's softmax normaliser is summed block by
    block first (log-sum-exp), then each block's shares are taken against it (in fp32, where one block's may be taken
    in bf16: the coarse pass only ranks). On the CPU the first pass's products are kept for the second up to
    ``KEPT_LOGITS_MB`` and made again past it (docs/recall.md: 30-36% less time kept, at 60,000-156,250 groups).
    A group's share is the exponential of its best row's normalised logit, taken after the maximum: the same
    numbers, one exponential per group instead of one per row and group."""
    groups = keys.shape[1]
    if groups <= BLOCK:
        return _shares(q, keys.to(q.device), scale, 1, rough=True)
    # on a GPU the products are cheap and the device memory stays a block's (a long chat's peak stays flat)
    kept, norms, room = [], [], KEPT_LOGITS_MB * 2**20 if q.device.type == "cpu" else 0
    for a in range(0, groups, BLOCK):
        s = _logits(q, keys[:, a: a + BLOCK].to(q.device), scale)
        norms.append(s.float().logsumexp(-1))
        room -= s.numel() * s.element_size()
        kept.append(s if room >= 0 else None)
    norm = torch.stack(norms).logsumexp(0)[..., None]
    shares = []
    for i, a in enumerate(range(0, groups, BLOCK)):
        s = kept[i] if kept[i] is not None else _logits(q, keys[:, a: a + BLOCK].to(q.device), scale)
        kept[i] = None
        shares.append((s.float() - norm).amax((0, 1)).exp())
    return torch.cat(shares).cpu()  # on a GPU one copy back, not one per block


def bucket(n: int, step: int) -> int:
    """``n`` rounded up to one of a few sizes: a multiple of ``step``, then (past 4 steps) the next of 2^k and 1.5 x 2^k
    steps (at most half as much again)."""
    k = -(-n // step)
    if k > 4:
        top = 1 << (k - 1).bit_length()  # the power of two at or above k
        k = top * 3 // 4 if top * 3 // 4 >= k else top
    return k * step


def _bf16_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q @ keysᵀ ([heads, m, d] @ [heads, n, d]ᵀ) in bf16 on the CPU, its m and n padded to ``bucket`` sizes (zero
    rows, sliced off after): the CPU's bf16 products (oneDNN's) make and keep a kernel for every shape they multiply,
    about 0.5 MB each here, never freed; the rows and groups change with every message, and a long chat's process
    grew ~20 KB a turn (docs/memory.md). Bucketed, a chat multiplies a few dozen shapes."""
    m, n = q.shape[1], keys.shape[1]
    mp, np_ = bucket(m, 64), bucket(n, 64)
    if mp != m:
        q = F.pad(q, (0, 0, 0, mp - m))
    if np_ != n:
        keys = F.pad(keys, (0, 0, 0, np_ - n))
    return torch.bmm(q, keys.transpose(1, 2))[:, :m, :n]
