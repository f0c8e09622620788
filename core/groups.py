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
    keep: int,
    protected: torch.Tensor,
    groups: torch.Tensor | None = None,
    aggregate: str = "mean",
) -> torch.Tensor:
    """Slots to keep, ascending, shape [heads, keep].

    scores: [heads, n] (higher = keep); protected: [heads, n] bool; groups: [heads, n] group ids or None for
    token-level eviction. Exactly ``keep`` slots are returned per head (protected ones first in priority).
    """
    heads, n = scores.shape
    if keep >= n:
        return torch.arange(n, device=scores.device).expand(heads, n)
    scores = scores.float()
    if groups is None:
        key = scores.masked_fill(protected, float("inf"))
        idx = torch.topk(key, keep, dim=-1).indices
        return idx.sort(dim=-1).values

    # Per-head group aggregate over the unprotected tokens of each group.
    _, inverse = torch.unique(groups, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    free = ~protected
    masked = torch.where(free, scores, torch.zeros_like(scores))
    count = torch.zeros(heads, n_groups, device=scores.device).scatter_add_(1, inverse, free.float())
    if aggregate == "max":
        agg = torch.full((heads, n_groups), float("-inf"), device=scores.device)
        agg = agg.scatter_reduce(1, inverse, scores.masked_fill(protected, float("-inf")), "amax")
    else:
        agg = torch.zeros(heads, n_groups, device=scores.device).scatter_add_(1, inverse, masked)
        if aggregate == "mean":
            agg = agg / count.clamp(min=1)
    token_group_score = torch.gather(agg, 1, inverse)

    # Priority order, by successive stable sorts from the least to the most significant key:
    # token score desc < group id (keeps a group's tokens together) < group score desc < protected first.
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    for key, descending in ((inverse, False), (token_group_score, True), (protected.to(torch.int8), True)):
        k = torch.gather(key, 1, order)
        order = torch.gather(order, 1, torch.argsort(k, dim=-1, descending=descending, stable=True))
    return order[:, :keep].sort(dim=-1).values
