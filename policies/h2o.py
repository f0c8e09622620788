"""h2o: Heavy-Hitter Oracle (Zhang et al., 2023). Keep the tokens that drew the most attention, plus a recent window.

Every cached token accumulates the attention it receives — from the prefill queries and from every decode step —
per KV head (the query heads sharing a KV head are averaged). The engine protects the sink and the recent window;
the rest of the budget goes to the heaviest hitters. ``average`` divides a token's total by the number of queries
that saw it and were counted (kvpress's ObservedAttention; ``view.seen``: from where recall brought it back, or
where h2o was switched in, when later), so old tokens do not win by age alone; ``--heavy`` keeps only that many
heavy hitters and gives the remaining budget to the most recent tokens. Evicted tokens leave memory (the reference
code only masks them).
"""

import torch

from .registry import register
from .base import Param, Policy


@register
class H2O(Policy):
    name = "h2o"
    summary = "Heavy-Hitter Oracle: tokens that received the most attention, plus a recent window."
    params = (
        Param("heavy", int, 0, "heavy hitters to keep (0: all of the budget beyond sink and window)", min=0),
        Param("average", bool, True, "average over the queries that saw a token instead of summing"),
    )
    observes = frozenset({"acc"})

    def score(self, view):
        if view.acc is None:
            return view.recency
        acc = view.acc
        if self.average:
            acc = acc / view.seen
        elif view.since is not None:  # a slot counted only lately: its total at that rate over its whole time
            acc = acc * ((view.fed - view.positions).clamp(min=1) / view.seen)  # exactly x1 where counted all along
        acc = acc.masked_fill(~view.valid, float("-inf"))
        if not self.heavy:
            return acc
        top = torch.topk(acc, min(self.heavy, acc.shape[1]), dim=-1).indices
        score = view.recency
        return score.scatter(1, top, torch.full_like(score, float(score.max()) + 1).gather(1, top))
