"""snapkv: SnapKV (Li et al., 2024). The last queries vote for the positions they attend to; neighbours count too.

At each compression the attention of the last ``obs_window`` queries (the end of the newest user message, or of
the reply being written) is summed per head and pooled over ``kernel`` neighbouring positions, so a whole phrase
around an attended token stays; each head keeps its top positions plus the recent window (protected by the
engine). In a chat the question chooses what stays.
"""

import torch.nn.functional as F

from .registry import register
from .base import OBS_WINDOW, Param, Policy


@register
class SnapKV(Policy):
    name = "snapkv"
    summary = "The last queries' attention, pooled over neighbours, picks the positions each head keeps."
    params = (
        OBS_WINDOW,
        Param("kernel", int, 7, "pooling width over neighbouring positions (odd: an even one pools one more)",
              min=1, max=63),
        Param("pool", str, "max", "pooling of the votes", choices=("max", "avg")),
    )
    observes = frozenset({"window"})

    def score(self, view):
        if view.window is None:
            return view.recency
        votes = view.window.sum(1)[:, None]  # [heads, 1, n]
        k = self.kernel | 1
        pool = F.max_pool1d if self.pool == "max" else F.avg_pool1d
        return pool(votes, k, stride=1, padding=k // 2)[:, 0]
