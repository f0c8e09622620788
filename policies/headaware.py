"""headaware: Head-Aware Dynamic KV Budgeting (the seed design): each KV head gets a budget for what it does.

Every KV head is classified from its attention over the observation window (the last ``obs_window`` queries):

* local — at least ``tau_local`` (0.8) of its attention mass lies within ``local_width`` (5) positions of the
  query;
* induction — mid entropy (normalized entropy between ``entropy_low`` and ``entropy_high``) with a strong periodic
  pattern: in the FFT of its attention profile (attention by distance from the query, averaged over the window)
  the strongest harmonic series holds at least ``tau_period`` times the energy a flat spectrum would;
* retrieval — the rest: high entropy, no dominant key.

A layer's total (heads x budget) is split by class weights ``alpha_r > alpha_i > alpha_l``. Local heads keep the
recent window, retrieval heads their top-scoring tokens (the attention they received), induction heads the
pattern's key points (what the window attends to) plus uniform samples. The sink, the window and the newest group
(up to ``new_tokens``) are always kept: every head's budget covers them, so the always-kept memory stays within
M_max = layers * heads * head_dim * (sink + window + new) * 2 * bytes, which is asserted. Classes are computed on
the first observation windows and refreshed online: B_h(t+1) = B_h(t) + a_t * (target_h - B_h(t)), a_t = 1/(t+1).

Heads of one layer hold different numbers of positions, and the cache allocates each head its own slots: memory is
really freed, not masked. Thresholds are this implementation's defaults (only tau_local = 0.8 and w = 5 come from
the seed text) and every one is a parameter.
"""

import torch

from .registry import register
from .base import OBS_WINDOW, Param, Policy, split_budget, window_batches

CLASSES = ("retrieval", "induction", "local")
PROFILE = 64  # positions of the attention-by-distance profile analysed by the FFT


def periodicity(spectrum: torch.Tensor) -> torch.Tensor:
    """How periodic a profile is, from its power spectrum [..., bins] (without the constant term): the energy
    of the strongest harmonic series (a frequency and its multiples; periods of 4 to 32 positions) relative to
    what the same number of bins holds in a flat spectrum. About 1-2 for noise; a comb of period p scores ~p."""
    bins = spectrum.shape[-1]
    total = spectrum.sum(-1, keepdim=True).clamp_min(1e-12)
    # row f - 2 of the combs: 1 at the bins of frequency f and its multiples (bin i holds frequency i + 1)
    frequency = torch.arange(2, bins // 4 + 1, device=spectrum.device)[:, None]
    combs = ((torch.arange(1, bins + 1, device=spectrum.device)[None, :] % frequency) == 0).to(spectrum.dtype)
    return (spectrum @ combs.T / total * bins / combs.sum(1)).amax(-1).clamp(min=0)


@register
class HeadAware(Policy):
    name = "headaware"
    summary = "Per-head budgets by head class (retrieval > induction > local), refreshed online."
    params = (
        OBS_WINDOW,
        Param("tau_local", float, 0.8, "attention mass within local_width that makes a head local", min=0, max=1),
        Param("local_width", int, 5, "distance that counts as local", min=1),
        Param("entropy_low", float, 0.3, "normalized entropy above which a head may be induction", min=0, max=1),
        Param("entropy_high", float, 0.75, "normalized entropy above which a head is retrieval", min=0, max=1),
        Param("tau_period", float, 4.0, "periodicity (harmonic energy vs a flat spectrum) for induction", min=1),
        Param("alpha_r", float, 1.5, "budget weight of retrieval heads", min=0),
        Param("alpha_i", float, 1.0, "budget weight of induction heads", min=0),
        Param("alpha_l", float, 0.4, "budget weight of local heads", min=0),
        Param("new_tokens", int, 32, "newest tokens of the newest group always kept", min=0),
    )
    observes = frozenset({"window", "acc"})

    def __init__(self, **values):
        super().__init__(**values)
        if not self.alpha_r > self.alpha_i > self.alpha_l:
            raise ValueError("headaware needs alpha_r > alpha_i > alpha_l")
        self.step = 0
        self.classes: list[list[str]] = []
        self.budgets: list[list[float]] = []
        self.kept: list[list[int]] = []
        self.memory_bound: int | None = None

    # -- classification ---------------------------------------------------------------------------------------
    def head_features(self, window: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per head: local mass, normalized entropy and periodicity of the attention of the window queries.
        ``window`` [..., heads, rows, n], ``valid`` [..., heads, n]: one layer, or several of one shape at once."""
        rows, n = window.shape[-2:]
        lens = valid.sum(-1)  # [..., heads]
        # Query r of the window sits at slot lens - rows + r of its head.
        qslot = lens[..., None] - rows + torch.arange(rows, device=window.device)  # [..., heads, rows]
        dist = qslot[..., None] - torch.arange(n, device=window.device)  # [..., heads, rows, n]
        seen = (dist >= 0) & valid[..., None, :]
        local = (window * ((dist <= self.local_width) & seen)).sum(-1).mean(-1)
        visible = seen.sum(-1).clamp(min=2).float()
        entropy = (-(window * window.clamp_min(1e-12).log()).sum(-1) / visible.log()).mean(-1)
        profile = torch.zeros(*lens.shape, PROFILE, device=window.device)
        near = seen & (dist < PROFILE)
        profile.scatter_add_(-1, dist.clamp(0, PROFILE - 1).masked_fill(~near, 0).flatten(-2),
                             (window * near).flatten(-2))
        spectrum = torch.fft.rfft(profile - profile.mean(-1, keepdim=True), dim=-1).abs()[..., 1:] ** 2
        return {"local": local, "entropy": entropy, "period": periodicity(spectrum)}

    def classify(self, features: dict[str, torch.Tensor]) -> list:
        """Each head's class from ``head_features`` (of one layer: a list; of several: a list per layer), read
        back from the device at once."""

        def one(local: float, entropy: float, period: float) -> str:
            if local >= self.tau_local:
                return "local"
            if self.entropy_low <= entropy < self.entropy_high and period >= self.tau_period:
                return "induction"
            return "retrieval"

        table = torch.stack([features[k] for k in ("local", "entropy", "period")], -1).tolist()
        return [one(*head) for head in table] if features["local"].dim() == 1 else \
            [[one(*head) for head in layer] for layer in table]

    def layer_classes(self, views) -> list[list[str]]:
        """Every layer's head classes, layers computed together (``window_batches``)."""
        out: list = [None] * len(views)
        for batch, window, valid in window_batches(views):
            for i, classes in zip(batch, self.classify(self.head_features(window, valid))):
                out[i] = classes
        return out

    # -- budgets ----------------------------------------------------------------------------------------------
    def allocate(self, views, budget, minimum):
        if any(v.window is None for v in views):
            return None
        floor = minimum + self.new_tokens
        if floor > budget:
            floor = minimum  # the newest group cannot be guaranteed beside the window in this budget
        weight = {"retrieval": self.alpha_r, "induction": self.alpha_i, "local": self.alpha_l}
        rate = 1.0 / (self.step + 1)
        classes, budgets, kept = [], [], []
        for li, cls in enumerate(self.layer_classes(views)):
            heads = len(cls)
            target = split_budget([weight[c] for c in cls], heads * budget, floor)
            if self.step and li < len(self.budgets) and len(self.budgets[li]) == heads:
                current = [b + rate * (t - b) for b, t in zip(self.budgets[li], target)]
            else:
                current = [float(t) for t in target]
            classes.append(cls)
            budgets.append(current)
            kept.append(split_budget(current, heads * budget, floor))
        self.step += 1
        self.classes, self.budgets, self.kept = classes, budgets, kept
        head_dim = views[0].held_keys.shape[-1]
        always = minimum - 1 + (self.new_tokens if floor > minimum else 0)
        self.memory_bound = sum(len(c) for c in classes) * head_dim * always * 2 * views[0].held_keys.element_size()
        for layer_kept in kept:
            assert min(layer_kept) >= always, "a head's budget must hold its sink, window and newest group"
        return kept

    # -- scores -----------------------------------------------------------------------------------------------
    def score(self, view):
        if view.window is None or not self.classes or view.layer >= len(self.classes):
            return view.recency
        recency, classes = view.recency, self.classes[view.layer]
        n, device = recency.shape[1], recency.device
        by_class = {"local": recency}  # what the layer's classes need, no more (a GPU launches each operation)
        if "retrieval" in classes:  # attention received, per step a slot has been seen
            acc = view.acc if view.acc is not None else torch.zeros_like(recency)
            by_class["retrieval"] = acc / view.seen
        if "induction" in classes:
            # uniform samples first (every stride-th held slot, half the budget), then the pattern's key points
            votes = view.window.sum(1)
            budgets = self.kept[view.layer] if view.layer < len(self.kept) else [n] * len(classes)
            held = view.valid.sum(1, keepdim=True)
            stride = (held // torch.tensor([max(1, b // 2) for b in budgets], device=device)[:, None]).clamp(min=1)
            slots = torch.arange(n, device=device)[None, :]
            by_class["induction"] = torch.where((slots % stride == 0) & (slots < held), 2.0 + votes, votes)
        if len(set(classes)) == 1:
            scores = by_class[classes[0]]
        else:
            kind = torch.tensor([CLASSES.index(c) for c in classes], device=device)[:, None]
            scores = torch.where(kind == CLASSES.index("local"), recency,
                                 torch.where(kind == CLASSES.index("retrieval"), by_class.get("retrieval", recency),
                                             by_class.get("induction", recency)))
        if self.new_tokens and view.groups is not None:
            newest = view.groups.gather(1, (view.valid.sum(1, keepdim=True) - 1).clamp(min=0))
            slots = torch.arange(n, device=recency.device)[None, :]
            recent = slots >= view.valid.sum(1, keepdim=True) - self.new_tokens
            scores = scores.masked_fill((view.groups == newest) & recent & view.valid, float("inf"))
        return scores.masked_fill(~view.valid, float("-inf"))

    def get_state(self):
        return {"step": self.step, "classes": self.classes, "budgets": self.budgets, "kept": self.kept,
                "memory_bound": self.memory_bound}

    def set_state(self, state):
        self.step, self.classes, self.budgets = state["step"], state["classes"], state["budgets"]
        self.kept, self.memory_bound = state["kept"], state["memory_bound"]

    def report(self):
        return {"head_classes": [list(c) for c in self.classes], "head_budgets": [list(k) for k in self.kept],
                "memory_bound_bytes": self.memory_bound}
