"""What happens when the cache is full, on one screen.

Before a forward would take the cache past budget + slack, ``make_room`` compresses it to the budget:

1. per layer, a ``LayerView`` of what is cached (positions, keys, group ids, the attention statistics the policy
   observes);
2. the policy may split the budget over layers and heads (``allocate``), then ``score``s each layer's slots;
3. protected slots (sink, system prompt, recent window) are always kept; ``select_keep`` turns the scores into
   whole groups to keep;
4. the kept slots move to the front of their heads' regions, all layers of a slab at once (``slab.move``); in
   ``rerotate`` mode each kept key is its computed key rotated once to its new slot;
5. an eviction event is recorded.

Recall (core/recall) asks a compression to ``drop`` the positions it will read again and to leave ``room`` for
them in every head; ``reorder`` then puts what it read back into conversation order.

The session supplies the state (settings, policy, cache, observer, token log, model); nothing here knows which
policy runs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ...policies import LayerView
from ...storage.db import now_iso
from . import slab
from .groups import select_keep_padded

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

    def settle(self) -> list[dict]:
        """The events so far, their counts left on the device (``groups_given_up``) read back, all at once."""
        pending = [e for e in self.events if isinstance(e["evicted_groups"], torch.Tensor)]
        if pending:
            for e, n in zip(pending, torch.stack([e["evicted_groups"] for e in pending]).tolist()):
                e["evicted_groups"] = n
        return self.events

    def take(self) -> list[dict]:
        """The events so far, which the closing turn commits; the list starts afresh."""
        events, self.events = self.settle(), []
        return events


def chunk(session, m: int, room: int | None = None) -> int:
    """How many of the next ``m`` tokens ``make_room`` feeds now: at most the free slots (``room``: the cache's
    unless given), or ``slack`` after a compression."""
    c = min(m, MAX_CHUNK)
    if session.policy.bounded and c > (session.cache.room if room is None else room):
        c = min(c, session.settings.slack_tokens)
    return c


def reads_without_compressing(session, n: int, more: int = 0) -> bool:
    """Whether the next ``n`` tokens, followed by ``more`` in the same turn, are read in the chunks ``make_room``
    plans without a compression (fitting the free slots is not enough: a chunk planned over the tokens that follow
    may need more room than is left)."""
    if not session.policy.bounded:
        return True
    room, left = session.cache.room, n
    while left > 0:
        c = chunk(session, left + more, room)
        if c > room:
            return False
        room, left = room - min(c, left), left - c
    return True


def make_room(session, m: int, logged: int = 0) -> int:
    """How many of the next ``m`` tokens to feed now, compressing first if the cache has no room for them.
    ``logged``: how many of them the token log already holds (the rest of a long message): the compression's policy
    counts those past this chunk as not read yet (``session.unread``; H2O's average)."""
    if not session.policy.bounded:
        return min(m, MAX_CHUNK)
    room = session.cache.room  # once: every fed token asks
    c = chunk(session, m, room)
    if c > room:
        session.unread = max(logged - c, 0)
        try:
            compress(session, session.settings.budget, "prefill" if m > 1 else "decode")
        finally:
            session.unread = 0
    return c


@dataclass(eq=False)
class Plan:
    """One layer's part of a compression: how many slots each head keeps (``counts``), its capacities, and the
    slots kept (``index``: [heads, most kept], head h's ``kept[h]`` first ones, ascending)."""

    layer: object
    view: LayerView
    counts: list[int]
    caps: list[int] | None = None
    scores: torch.Tensor | None = None
    same_as: "Plan | None" = None
    index: torch.Tensor | None = None
    kept: list[int] | None = None


def select(session, plans: list[Plan], prefixes: bool = True) -> None:
    """Turn each plan's scores into the slots it keeps (``select_keep``), one call for all layers of the same shape
    (their heads stacked as rows). ``prefixes``: each head's valid slots are its first ``lens`` (nothing dropped),
    so that how many each holds is known without reading it back."""
    batches: dict[tuple, list[Plan]] = {}
    for p in plans:
        key = (tuple(p.view.positions.shape[1:]), p.view.groups is None, p.scores.dim() == 1)
        batches.setdefault(key, []).append(p)
    for batch in batches.values():
        heads = [p.layer.heads for p in batch]
        positions = torch.cat([p.view.positions for p in batch])
        lens = [n for p in batch for n in p.layer.lens]
        safe = protected(session, positions, lens, [min(p.counts) for p in batch for _ in range(p.layer.heads)])
        scores = torch.cat([p.scores.expand(h, -1) for p, h in zip(batch, heads)])
        groups = None if batch[0].view.groups is None else torch.cat([p.view.groups for p in batch])
        index, kept = select_keep_padded(scores, [c for p in batch for c in p.counts], safe, groups,
                                         session.settings.aggregate, torch.cat([p.view.valid for p in batch]),
                                         lens if prefixes else None)
        for p, rows in zip(batch, itertools.accumulate(heads)):
            p.index, p.kept = index[rows - p.layer.heads: rows], kept[rows - p.layer.heads: rows]


def compress(session, keep: int, reason: str, drop: torch.Tensor | None = None, room: int = 0) -> None:
    """Compress every layer to ``keep`` positions (per head, or as the policy allocates them).

    ``drop``: absolute positions no head keeps (recall reads them again); ``room``: slots every head keeps free
    beyond its slack for them, taken from ``keep`` (the policy's lowest-scored slots make room)."""
    s, cache, policy = session.settings, session.cache, session.policy
    for hook in cache.on_compress:
        hook(cache, session.log.n)
    before = cache.mean_length
    session.evictions.peak = max(session.evictions.peak, before)  # the cache is fullest right before a compression
    layers = [(li, layer) for li, layer in enumerate(cache.layers) if layer.is_initialized]
    # every layer's view as wide as the longest (where layers hold different lengths, as cake's do): one selection,
    # one window product for all, not one per length
    width = max(layer.length for _, layer in layers)
    windows = [None] * len(layers)
    if "window" in policy.observes and session.observer is not None:
        rerotate = s.positions == "rerotate"
        windows = session.observer.window_attentions([li for li, _ in layers], session.model.rotary if rerotate
                                                     else None, cache.length if rerotate else None, width)
    views = [layer_view(session, li, layer, mask, w, width)
             for (li, layer), mask, w in zip(layers, valid_masks([layer for _, layer in layers], width), windows)]
    for view, ids in zip(views, group_ids(session, [view.positions for view in views])):
        view.groups = ids
    if drop is not None and drop.numel():
        for view in views:
            view.valid = view.valid & ~torch.isin(view.positions, drop.to(view.positions.device))
    minimum = s.window_tokens + (s.sink if policy.protect_start else 0) + 1
    alloc = policy.allocate(views, keep, minimum)
    # In rerotate mode the next position is the largest kept count: keep it inside the trained positions.
    ceiling = session.model.max_positions - s.slack_tokens - room if s.positions == "rerotate" else None
    plans, reference = [], None
    alike = like_first(views) if policy.layer_independent and alloc is None else [False] * len(views)
    for (li, layer), view, same in zip(layers, views, alike):
        plan = Plan(layer, view, alloc[len(plans)] if alloc is not None else [keep] * layer.heads)
        if ceiling is not None:
            plan.counts = [min(c, ceiling) for c in plan.counts]
        plan.counts = [max(c - room, 0) for c in plan.counts]
        plan.caps = [c + room + s.slack_tokens for c in plan.counts] if alloc is not None \
            else [max(s.capacity, c + room + s.slack_tokens) for c in plan.counts]
        if same and reference is not None:
            plan.same_as = reference  # a position-only policy: the same choice as the layer with the same positions
        else:
            plan.scores = policy.score(view)
            if policy.layer_independent and reference is None:
                reference = plan
        plans.append(plan)
    select(session, [p for p in plans if p.same_as is None], drop is None or not drop.numel())
    for plan in plans:
        if plan.same_as is not None:
            plan.index, plan.kept = plan.same_as.index, plan.same_as.kept
    evicted_groups = groups_given_up(plans[0])
    next_pos = max(k for p in plans for k in p.kept)
    rotary = session.model.rotary if s.positions == "rerotate" else None
    slab.move([p.layer for p in plans], [p.index for p in plans], [p.kept for p in plans], rotary, next_pos,
              [p.caps for p in plans], stack=True)
    after = cache.mean_length
    session.evictions.record({"turn": session.turn, "reason": reason, "before": before, "after": after,
                              "evicted_tokens": before - after, "evicted_groups": evicted_groups,
                              "total_tokens": session.log.n, "created_at": now_iso()})
    if session.recall_release:  # the reply's first compression kept what recall brought back; now the policy decides
        session.recall_guard, session.recall_release = session.recall_guard[:0], False


def groups_given_up(plan: Plan) -> torch.Tensor:
    """How many groups (tokens, per token) the first head of ``plan``'s layer held and kept none of: a count left
    on the device, read back when the turn closes (``Evictions.settle``), so that a compression does not wait for
    the GPU for a statistic. Distinct groups are counted on sorted ids (empty and dropped slots as -1)."""
    view = plan.view
    ids = view.positions[0] if view.groups is None else view.groups[0]

    def distinct(values: torch.Tensor) -> torch.Tensor:
        ordered = values.sort().values
        return (ordered[1:] != ordered[:-1]).sum() + (ordered[:1] >= 0).sum()  # runs; the first unless it is -1

    held = distinct(ids.masked_fill(~view.valid[0], -1))
    return held - distinct(ids[plan.index[0, :plan.kept[0]].to(ids.device)])


def reorder(session) -> None:
    """Every head's slots back in conversation order after recall read positions again at the end of the cache: each
    key rotated once from where it was computed to its slot (``rerotate``) or to its absolute position
    (``original``); the slots read again keep the statistics the read left them (an accumulating observer counts
    their attention from the read's end on: ``Observer.unobserved``). Every head of every layer at once: no host sync
    per head."""
    rotary = session.model.rotary
    original = session.settings.positions == "original"
    layers = [layer for layer in session.cache.layers if layer.is_initialized]
    next_pos = max(layer.length for layer in layers)
    orders = []
    for layer in layers:
        positions, valid = layer.positions(), layer.valid()
        big = torch.iinfo(positions.dtype).max  # slots past a head's length after every held one
        orders.append(torch.argsort(positions.masked_fill(~valid, big), dim=1, stable=True))
    slab.move(layers, orders, [list(layer.lens) for layer in layers], None if original else rotary,
              None if original else next_pos)
    if original and rotary is not None:
        for layer in layers:
            layer.shift_positions(rotary, to_original=True)


def protected(session, positions: torch.Tensor, lens: list[int], keep: int | list[int]) -> torch.Tensor:
    """[heads, n] True for the slots no policy may evict: the recent window, and (for policies that protect the
    start) the sink and the system prompt, while the system prompt fits beside the window. ``keep``: what each head
    (row) keeps, or every head."""
    s = session.settings
    keep = [keep] * len(lens) if isinstance(keep, int) else keep
    window = [min(s.window_tokens, k) for k in keep]
    slots = torch.arange(positions.shape[1], device=positions.device)[None, :]
    rows = torch.tensor([lens, [n - w for n, w in zip(lens, window)]], device=positions.device)[:, :, None]
    safe = (slots >= rows[1]) & (slots < rows[0])
    if session.policy.protect_start:
        sink, system = s.sink, session.system_tokens
        start = [system if system > sink and system + w <= k else sink for w, k in zip(window, keep)]
        if system > sink and min(start) < system:
            session.warn("system", f"the system prompt ({system} tokens) does not fit the budget beside the "
                                   "window; it is no longer protected from eviction")
        first = torch.tensor(start, device=positions.device)[:, None] if len(set(start)) > 1 else start[0]
        safe |= (positions < first) & (positions >= 0)
    guard = session.recall_guard  # just recalled: kept while the message is read again, and through one compression
    if guard.numel():
        safe |= torch.isin(positions, guard.to(positions.device))
    return safe


def group_ids(session, positions: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Each [heads, n] tensor of ``positions``' eviction group of each slot (sentence or message id; -1 for empty
    slots), None per token. The token log is on the host: one copy there and back per device for every layer (a copy
    per layer waited for a GPU each time)."""
    mode = session.settings.groups
    if mode == "token":
        return [None] * len(positions)
    column = "sentence" if mode == "sentence" else "message"
    out: list[torch.Tensor | None] = [None] * len(positions)
    by_device: dict[object, list[int]] = {}
    for i, p in enumerate(positions):
        by_device.setdefault((p.device, p.shape[1]), []).append(i)
    for (device, _), members in by_device.items():
        held = torch.cat([positions[i] for i in members])
        ids = session.log.at(column, held.clamp(min=0).cpu()).to(device).long().masked_fill(held < 0, -1)
        for i, part in zip(members, ids.split([positions[i].shape[0] for i in members])):
            out[i] = part
    return out


def like_first(views: list[LayerView]) -> list[bool]:
    """Whether each layer holds the first layer's positions in the same slots: one comparison (and one host sync)
    for every layer of the first's shape."""
    first = views[0]
    alike = [i for i, v in enumerate(views) if v.positions.shape == first.positions.shape]
    same = ((torch.stack([views[i].positions for i in alike]) == first.positions) &
            (torch.stack([views[i].valid for i in alike]) == first.valid)).flatten(1).all(1).tolist()
    out = [False] * len(views)
    for i, s in zip(alike, same):
        out[i] = s
    return out


def valid_masks(layers, width: int) -> list[torch.Tensor]:
    """Each layer's [heads, width] mask of the slots its heads hold: one comparison per device for every layer
    (read-only slices of one mask)."""
    rows: dict[object, list[int]] = {}
    for layer in layers:
        rows.setdefault(layer.device, []).extend(layer.lens)
    masks = {device: torch.arange(width, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
             for device, lens in rows.items()}
    out, at = [], dict.fromkeys(rows, 0)
    for layer in layers:
        out.append(masks[layer.device][at[layer.device]: at[layer.device] + layer.heads])
        at[layer.device] += layer.heads
    return out


def layer_view(session, li: int, layer, valid: torch.Tensor, window: torch.Tensor | None, width: int) -> LayerView:
    """What the policy may look at in layer ``li``, [heads, width] (``width``: at least the layer's longest head;
    padded past it as past a shorter head): positions, keys and the statistics it observes (the window's attention,
    ``window``, computed for every layer at once); ``valid``: the mask of the heads' held slots. Its groups are set
    for every layer at once (``group_ids``)."""
    positions = layer.positions()
    if positions.shape[1] < width:
        positions = torch.nn.functional.pad(positions, (0, width - positions.shape[1]), value=-1)
    view = LayerView(li, positions, valid, layer.keys_dense(), fed=session.log.n - session.unread)
    if "acc" in session.policy.observes and "acc" in layer.stats:
        view.acc = _padded_stat(layer, "acc", width)
        if "since" in layer.stats:  # where attention began to count, where later than a slot's position
            view.since = _padded_stat(layer, "since", width).to(positions.dtype)
    view.window = window
    return view


def _padded_stat(layer, name: str, width: int) -> torch.Tensor:
    t = layer.padded(layer.stats[name])
    return t if t.shape[1] == width else torch.nn.functional.pad(t, (0, width - t.shape[1]))
