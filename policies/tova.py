"""tova: Token Omission Via Attention (Oren et al., 2024). Keep the tokens the newest query attends to most.

At each compression the newest query's attention over the cache, averaged over the heads of a layer, scores every
token, so every head of a layer keeps the same tokens.
"""

import torch

from .registry import register
from .base import Policy


@register
class TOVA(Policy):
    name = "tova"
    summary = "Keep the tokens the newest query attends to most (averaged over heads)."
    observes = frozenset({"window"})

    @property
    def obs_window(self) -> int:
        return 1

    def score(self, view):
        if view.window is None:
            return view.recency
        last = view.window[:, -1]  # [heads, n]
        # heads that hold different tokens (after a per-head policy) are scored each on its own; no read back
        same = (view.positions == view.positions[:1]).all()
        return torch.where(same, last.mean(0, keepdim=True), last)
