"""Eviction units and the rule that turns per-token scores into the slots to keep.

``--groups token|sentence|turn``:

* ``token``: every token is its own group.
* ``sentence``: within each message, a group ends after a token whose text ends a sentence (``.``, ``!``,
  ``?``, ``…`` and their full-width forms, optionally followed by closing quotes/brackets) or holds a newline.
  A message always starts a new group, so template tokens belong to the message's first sentence.
* ``turn``: every message (with its chat-template wrapper) is one group.

``select_keep`` is the one place where scores become a keep set. Protected slots (sink, system prompt, recent
window) are always kept. The rest of the budget goes to whole groups in order of their aggregated score (mean of
their unprotected tokens' scores by default); the first group that no longer fits is cut token by token (its
best tokens kept), so the budget is met exactly and never broken.
"""

from __future__ import annotations

import re

import torch

GROUP_MODES = ("token", "sentence", "turn")
AGGREGATES = ("mean", "max", "sum")

_SENTENCE_END = re.compile(r"[.!?…。！？][\"'”’)\]»]*\s*$")


def ends_group(piece: str) -> bool:
    """Whether a token whose decoded text is ``piece`` closes a sentence group."""
    return "\n" in piece or bool(_SENTENCE_END.search(piece))


def sentence_ids(pieces: list[str], last_id: int, start_new: bool) -> tuple[list[int], int, bool]:
    """Sentence group ids for consecutive tokens, continuing from the state (last_id, start_new).

    ``start_new`` says whether the next token opens a new group (True at the start of every message).
    Returns the ids and the state after the last token.
    """
    ids = []
    for piece in pieces:
        if start_new:
            last_id += 1
            start_new = False
        ids.append(last_id)
        start_new = ends_group(piece)
    return ids, last_id, start_new


def select_keep(
    scores: torch.Tensor,
    keep: int | list[int],
    protected: torch.Tensor,
    groups: torch.Tensor | None = None,
    aggregate: str = "mean",
    valid: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Slots to keep per head, each ascending.

    scores: [heads, n] (higher = keep); keep: positions to keep, for every head or per head; protected:
    [heads, n] bool; groups: [heads, n] group ids, or None for token-level eviction; valid: [heads, n] bool
    where heads of different lengths are padded. Exactly ``keep`` slots per head are returned (fewer only if a
    head holds fewer), protected ones first.
    """
    index, counts = select_keep_padded(scores, keep, protected, groups, aggregate, valid)
    return [index[h, :c] for h, c in enumerate(counts)]


def select_keep_padded(scores, keep, protected, groups=None, aggregate="mean", valid=None, held=None) \
        -> tuple[torch.Tensor, list[int]]:
    """``select_keep`` as one tensor: [heads, most kept], head h's slots ascending in its first ``counts[h]``
    columns (the rest padding), and the counts. ``held``: how many slots each head holds where ``valid`` is each
    head's first ones and the caller knows them (else they are read back from ``valid``)."""
    heads, n = scores.shape
    if valid is None:
        valid = torch.ones(heads, n, dtype=torch.bool, device=scores.device)
    held = valid.sum(1).tolist() if held is None else held
    counts = [min(k, m) for k, m in zip([keep] * heads if isinstance(keep, int) else keep, held)]
    scores = scores.float().masked_fill(~valid, float("-inf"))
    protected = protected & valid
    if groups is None:
        key = scores.masked_fill(protected, float("inf"))
        if len(set(counts)) == 1 and min(held, default=n) == n:  # every slot of every head held
            return torch.topk(key, counts[0], dim=-1).indices.sort(dim=-1).values, counts
        order = torch.argsort(key, dim=-1, descending=True, stable=True)
    else:
        order = _group_order(scores, protected, groups.masked_fill(~valid, -1), aggregate)
    order = torch.gather(order, 1, torch.argsort(torch.gather(valid.to(torch.int8), 1, order), dim=-1,
                                                 descending=True, stable=True))
    width = max(counts, default=0)
    if len(set(counts)) == 1:
        return order[:, :width].sort(dim=-1).values, counts
    # each head's first counts[h] slots, ascending, then n (past every slot) as padding: one sort for all heads
    past = torch.arange(width, device=order.device)[None, :] >= torch.tensor(counts, device=order.device)[:, None]
    return order[:, :width].masked_fill(past, n).sort(dim=-1).values, counts


def _group_order(scores, protected, groups, aggregate) -> torch.Tensor:
    """Slots best first: protected, then whole groups by aggregated score, tokens within a group by score."""
    heads = scores.shape[0]
    _, inverse = torch.unique(groups, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    free = ~protected & torch.isfinite(scores)
    device = scores.device
    count = torch.zeros(heads, n_groups, device=device).scatter_add_(1, inverse, free.float())
    if aggregate == "max":
        agg = torch.full((heads, n_groups), float("-inf"), device=device)
        agg = agg.scatter_reduce(1, inverse, scores.masked_fill(~free, float("-inf")), "amax")
    else:
        agg = torch.zeros(heads, n_groups, device=device).scatter_add_(
            1, inverse, torch.where(free, scores, torch.zeros_like(scores)))
        if aggregate == "mean":
            agg = agg / count.clamp(min=1)
    token_group_score = torch.gather(agg, 1, inverse)
    # Successive stable sorts from the least to the most significant key:
    # token score desc < group id (keeps a group's tokens together) < group score desc < protected first.
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    for key, descending in ((inverse, False), (token_group_score, True), (protected.to(torch.int8), True)):
        k = torch.gather(key, 1, order)
        order = torch.gather(order, 1, torch.argsort(k, dim=-1, descending=descending, stable=True))
    return order
