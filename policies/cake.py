"""cake: Cascading and Adaptive KV cache Eviction (Qin et al., 2025): layer budgets from layer preferences.

From the attention A of the last ``obs_window`` queries, each layer gets a preference
P_l = H_l^(1/tau1) * V_l^(1/tau2), where H_l is the mean entropy of the attention rows (spatial dispersion: how
widely the layer looks) and V_l the mean variance of the attention columns over those queries (temporal shift: how
much what it looks at changes). Budgets B_l = P_l / sum(P) * (layers * budget): the total equals the uniform
budget, layers that need more get more, and each layer's buffer is allocated at its own size. Inside a layer
tokens are ranked by CAKE's indicator, mean + gamma * variance of the attention they receive.
"""

import torch

from .registry import register
from .base import OBS_WINDOW, Param, Policy, split_budget, window_batches


@register
class CAKE(Policy):
    name = "cake"
    summary = "Per-layer budgets from attention entropy and variance; CAKE's mean + gamma*variance inside a layer."
    params = (
        OBS_WINDOW,
        Param("tau1", float, 1.0, "temperature of the entropy term", min=1e-3),
        Param("tau2", float, 1.0, "temperature of the variance term", min=1e-3),
        Param("gamma", float, 200.0, "weight of the variance in the eviction indicator", min=0.0),
    )
    observes = frozenset({"window"})

    def __init__(self, **values):
        super().__init__(**values)
        self.budgets: list[int] = []
        self.preferences: list[float] = []

    @staticmethod
    def preference_terms(window: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(H_l, V_l) from the window attention [..., heads, rows, n] of one layer or of several of one shape."""
        entropy = -(window * window.clamp_min(1e-12).log()).sum(-1).mean((-2, -1))
        variance = window.var(dim=-2, unbiased=False)  # [..., heads, n]
        variance = (variance * valid).sum((-2, -1)) / valid.sum((-2, -1)).clamp(min=1)
        return entropy, variance

    def preference(self, h: float, v: float) -> float:
        return max(h, 1e-12) ** (1 / self.tau1) * max(v, 1e-12) ** (1 / self.tau2)

    def allocate(self, views, budget, minimum):
        if any(v.window is None for v in views):
            return None
        layers, terms = [], []  # several layers' terms at once, read back once
        for batch, window, valid in window_batches(views):
            layers += batch
            terms.append(torch.stack(self.preference_terms(window, valid), -1))
        self.preferences = [0.0] * len(views)
        for layer, (h, v) in zip(layers, torch.cat(terms).tolist()):
            self.preferences[layer] = self.preference(h, v)
        self.budgets = split_budget(self.preferences, budget * len(views), minimum)
        return [[b] * v.positions.shape[0] for b, v in zip(self.budgets, views)]

    def score(self, view):
        if view.window is None:
            return view.recency
        return view.window.mean(1) + self.gamma * view.window.var(dim=1, unbiased=False)

    def get_state(self):
        return {"budgets": self.budgets, "preferences": self.preferences}

    def set_state(self, state):  # a conversation saved before CAKE kept its state stored {}
        self.budgets, self.preferences = list(state.get("budgets", [])), list(state.get("preferences", []))

    def report(self):
        return {"layer_budgets": list(self.budgets), "layer_preferences": [round(p, 6) for p in self.preferences]}
