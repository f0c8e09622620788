"""What happens when the cache is full, on one screen.

Before a forward would take the cache past budget + slack, ``make_room`` compresses it to the budget:

1. per layer, a ``LayerView`` of what is cached (positions, keys, group ids, the attention statistics the policy
   observes);
2. the policy may split the budget over layers and heads (``allocate``), then ``score``s each layer's slots;
3. protected slots (sink, system prompt, recent window) are always kept; ``select_keep`` turns the scores into
   whole groups to keep;
4. each layer gathers the kept slots, re-rotating their keys in ``rerotate`` mode;
5. an eviction event is recorded.

The session supplies the state (settings, policy, cache, observer, token log, model); nothing here knows which
policy runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..policies import LayerView
from .groups import select_keep
from .turns import now_iso

MAX_CHUNK = 512  # longest prefill forward


@dataclass
class Evictions:
    """What compression did since the last turn closed: its events, the cache's peak; and the chat's total."""

    total: int = 0  # positions evicted over the whole chat (summed over the per-layer mean)
    events: list[dict] = field(default_factory=list)  # since the last turn closed (a settings change's included)
    peak: int = 0  # the largest mean cache length seen in the turn in progress

    def record(self, event: dict) -> None:
        self.events.append(event)
        self.total += event["evicted_tokens"]

    def take(self) -> list[dict]:
        """The events so far, which the closing turn commits; the list starts afresh."""
        events, self.events = self.events, []
        return events


def make_room(session, m: int) -> int:
    """How many of the next ``m`` tokens to feed now, compressing first if the cache has no room for them."""
    c = min(m, MAX_CHUNK)
    if not session.policy.bounded:
        return c
    s = session.settings
    if c > session.cache.room:
        c = min(c, s.slack_tokens)
        if c > session.cache.room:
            compress(session, s.budget, "prefill" if m > 1 else "decode")
    return c


def compress(session, keep: int, reason: str, bring: torch.Tensor | None = None) -> None:
    """Compress every layer to ``keep`` positions (per head, or as the policy allocates them).

    ``bring``: absolute positions (ascending) that recall brings back from the archive into every layer and head
    (core/recall.py). They count toward ``keep``: the policy's lowest-scored slots make room for them."""
    s, cache, policy = session.settings, session.cache, session.policy
    before = cache.mean_length
    session.evictions.peak = max(session.evictions.peak, before)  # the cache is fullest right before a compression
    layers = [(li, layer) for li, layer in enumerate(cache.layers) if layer.is_initialized]
    views = [layer_view(session, li, layer) for li, layer in layers]
    minimum = s.window_tokens + (s.sink if policy.protect_start else 0) + 1
    alloc = policy.allocate(views, keep, minimum)
    shared: tuple[torch.Tensor, list[torch.Tensor]] | None = None
    plans, evicted_groups = [], 0
    # In rerotate mode the next position is the largest kept count: keep it inside the trained positions.
    ceiling = session.model.max_positions - s.slack_tokens if s.positions == "rerotate" else None
    for pos, ((li, layer), view) in enumerate(zip(layers, views)):
        counts = alloc[pos] if alloc is not None else [keep] * layer.heads
        if ceiling is not None:
            counts = [min(c, ceiling) for c in counts]
        missing, present = [0] * layer.heads, None
        if bring is not None:
            present = torch.isin(view.positions, bring.to(view.positions.device)) & view.valid
            missing = [bring.numel() - n for n in present.sum(1).tolist()]
            counts = [max(min(c, n + m) - m, 0) for c, n, m in zip(counts, layer.lens, missing)]
        if shared is not None and alloc is None and torch.equal(shared[0], view.positions):
            index = shared[1]  # a position-only policy: the same choice as the layer before
        else:
            scores = policy.score(view)
            if scores.dim() == 1:
                scores = scores.expand(layer.heads, -1)
            safe = protected(session, view.positions, layer.lens, min(counts))
            if present is not None:
                safe |= present
            index = select_keep(scores, counts, safe, view.groups, s.aggregate, view.valid)
            if policy.layer_independent:
                shared = (view.positions, index)
        if li == 0:
            held = view.positions[0][view.valid[0]]
            g = held if view.groups is None else view.groups[0][view.valid[0]]
            evicted_groups = torch.unique(g).numel() - torch.unique(g[index[0].to(g.device)]).numel()
        caps = [c + m + s.slack_tokens for c, m in zip(counts, missing)] if alloc is not None else None
        plans.append((layer, index, caps, missing))
    next_pos = max(int(i.numel()) + m for _, index, _, missing in plans for i, m in zip(index, missing))
    rotary = session.model.rotary if s.positions == "rerotate" else None
    for layer, index, caps, _ in plans:
        caps = caps or [s.capacity] * layer.heads
        if bring is None:
            layer.keep(index, rotary, next_pos, caps)
        else:
            layer.merge(index, bring, session.model.rotary, s.positions == "original", next_pos, caps)
    after = cache.mean_length
    brought = sum(sum(m) for *_, m in plans) / max(sum(len(m) for *_, m in plans), 1)
    session.evictions.record({"turn": session.turn, "reason": reason, "before": before, "after": after,
                              "evicted_tokens": round(before + brought - after), "evicted_groups": evicted_groups,
                              "total_tokens": session.log.n, "created_at": now_iso()})


def protected(session, positions: torch.Tensor, lens: list[int], keep: int) -> torch.Tensor:
    """[heads, n] True for the slots no policy may evict: the recent window, and (for policies that protect the
    start) the sink and the system prompt, while the system prompt fits beside the window."""
    s = session.settings
    window = min(s.window_tokens, keep)
    slots = torch.arange(positions.shape[1], device=positions.device)[None, :]
    lens_t = torch.tensor(lens, device=positions.device)[:, None]
    safe = (slots >= lens_t - window) & (slots < lens_t)
    if session.policy.protect_start:
        start, system = s.sink, session.system_tokens
        if system > start:
            if system + window <= keep:
                start = system
            else:
                session.warn("system", f"the system prompt ({system} tokens) does not fit the budget beside the "
                                       "window; it is no longer protected from eviction")
        safe |= (positions < start) & (positions >= 0)
    guard = session.recall_guard  # recalled in the turn in progress: kept until the reply is written
    if guard.numel():
        safe |= torch.isin(positions, guard.to(positions.device))
    return safe


def group_ids(session, positions: torch.Tensor) -> torch.Tensor | None:
    """[heads, n] the eviction group of each slot (sentence or message id; -1 for empty slots), None per token."""
    mode = session.settings.groups
    if mode == "token":
        return None
    ids = session.log.at("sentence" if mode == "sentence" else "message", positions.clamp(min=0).cpu())
    ids = ids.to(positions.device).long()
    return ids.masked_fill(positions < 0, -1)


def layer_view(session, li: int, layer) -> LayerView:
    """What the policy may look at in layer ``li``: positions, keys, groups and the statistics it observes."""
    policy, observer = session.policy, session.observer
    rerotate = session.settings.positions == "rerotate"
    positions = layer.positions()
    view = LayerView(li, positions, layer.valid(), layer.keys_dense(), groups=group_ids(session, positions),
                     fed=session.log.n)
    if "acc" in policy.observes and "acc" in layer.stats:
        view.acc = layer.padded(layer.stats["acc"])
    if "window" in policy.observes and observer is not None:
        view.window = observer.window_attention(li, session.model.rotary if rerotate else None,
                                                session.cache.length if rerotate else None)
    return view
