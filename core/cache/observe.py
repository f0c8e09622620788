"""What attention-reading policies see, computed from the query and key states the attention function receives.

Two statistics, each only when the running policy asks for it:

* ``acc`` (H2O): per cached slot, the attention it has received from every query so far — prefill queries and
  every decode step — averaged over the query heads that share its KV head. Kept in the cache layer as a per-slot
  statistic, so it is gathered along with the keys at every eviction. Beside it, ``since``: where a slot's attention
  began to count, where later than its position — recall read it again unobserved, or a policy that observes
  ``acc`` was switched in over one that did not (``unobserved``, ``restart``) — so that an average over the queries
  counted (``LayerView.seen``) is fair to it. 8 bytes per slot and head, the two made together (``counted``).
* ``window`` (SnapKV, CAKE, head-aware, TOVA with a window of 1): the last ``obs_window`` query vectors of every
  layer (a fixed [window, query heads, dim] buffer, whatever the cache length). At a compression their attention
  over the current keys is computed once: the queries are moved (RoPE) to the last ``window`` positions, so they
  ask about the cache as it is now. In a chat the newest queries are the end of the user's message (or the reply
  being written), so the question chooses what stays.

Nothing N x N is kept. A decode step on the CPU costs, for ``acc``, the average of the probabilities attention
itself computed (``probs``; added inside kvchat's one-call layers, ``step_sums``; elsewhere one [query heads x n]
product per layer), and for ``window`` a reference to the query: decode steps' queries are copied into the window
in one stack when it is read (a compression, a saved state, a ``mark``), the newest ``obs_window`` of them kept
until then.
"""

from __future__ import annotations

import torch

from .attention import causal_mask
from .kvcache import KVCache
from .layer import RaggedKV
from .positions import Rotary

#: the most key elements the window's product over several layers copies at once in fp32 (256 MiB): more layers go
#: in further products (an 8B model's 32 layers at budget 4096 in three)
WINDOW_KEYS = 1 << 26


def counted(layer) -> torch.Tensor:
    """The layer's ``acc``, with ``since`` made beside it (zeros: counted from each slot's position), so that a slab,
    a graph step's plan and the memory a session reserves hold both from the first count on. Called by every decode
    step: one lookup for ``since`` once made (a new capacity carries every statistic over)."""
    if "since" not in layer.stats:
        layer.ensure_stat("since")
    return layer.ensure_stat("acc")


class Observer:
    def __init__(self, cache: KVCache, accumulate: bool, window: int):
        self.cache = cache
        self.accumulate = accumulate
        self.window = window
        self.positions: torch.Tensor | None = None  # positions of the queries of the forward in progress
        self._queries: dict[int, torch.Tensor] = {}  # layer -> [window, query heads, dim], oldest first
        self._qpos: dict[int, torch.Tensor] = {}  # layer -> [window] positions of those queries
        self._count: dict[int, int] = {}
        self._scaling: dict[int, float] = {}
        #: layer -> decode steps' (query, positions) not yet copied into the window (``_flush``)
        self._pending: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        #: the graph step's rows of decode steps' queries (core/decode/graph.py ``Ring``), and per layer the steps
        #: of it already in the window; at any time only the ring or ``_pending`` holds rows not yet taken
        self._ring = None
        self._ring_seen: dict[int, int] = {}

    def mark(self) -> tuple:
        """The query window as it is now, for ``restore`` (references: window tensors are replaced, never written
        into)."""
        self._flush()
        return dict(self._queries), dict(self._qpos), dict(self._count), dict(self._scaling)

    def restore(self, mark: tuple) -> None:
        """Back to the window of ``mark``: what was observed since is forgotten."""
        self._queries, self._qpos, self._count, self._scaling = (dict(d) for d in mark)
        self._pending = {}
        self._skip_ring()

    def take_window(self, other: "Observer") -> None:
        """The newest of the queries ``other`` remembers, as many as this window holds (a policy switched in over
        another that observed a window goes on from what that one saw)."""
        queries, qpos, count, scaling = other.mark()
        for li, q in queries.items():
            if (n := min(count[li], self.window)) > 0:
                self._append(li, q[-n:], qpos[li][-n:])
        self._scaling.update(scaling)

    def restart(self, since: int) -> None:
        """Attention received counts afresh from the absolute position ``since`` on (this observer accumulates, and
        the one before it did not): every slot's ``acc`` dropped, to start again at zeros, and its ``since`` set."""
        self.cache.restart_stat("acc")
        self.cache.fill_stat("since", since)

    def unobserved(self, k: int, since: int) -> None:
        """Each head's newest ``k`` slots were written with no observer (recall read them again): where this observer
        accumulates, their attention counts from the absolute position ``since`` on."""
        if self.accumulate:
            self.cache.fill_stat("since", since, last=k)

    @property
    def observed(self) -> bool:
        """Whether any query is remembered (in the window, or a decode step's not taken into it yet)."""
        self._flush()
        return any(self._count.values())

    def state_tensors(self) -> dict[str, torch.Tensor]:
        self._flush()
        out = {}
        for li, queries in self._queries.items():
            out[f"obs.{li}.queries"] = queries.contiguous()
            out[f"obs.{li}.qpos"] = self._qpos[li].contiguous()
            out[f"obs.{li}.meta"] = torch.tensor([self._count[li], self._scaling.get(li, 0.0)], dtype=torch.float64)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], device) -> None:
        self._pending = {}
        self._skip_ring()
        for key, t in tensors.items():
            parts = key.split(".")
            if parts[0] != "obs" or parts[2] != "queries":
                continue
            li = int(parts[1])
            if t.shape[0] != self.window:
                continue  # saved with another observation window: start observing afresh
            self._queries[li] = t.to(device)
            self._qpos[li] = tensors[f"obs.{li}.qpos"].to(device)
            count, scaling = tensors[f"obs.{li}.meta"].tolist()
            self._count[li], self._scaling[li] = int(count), scaling

    @property
    def nbytes(self) -> int:
        self._flush()
        return sum(t.numel() * t.element_size() for t in self._queries.values())

    def __call__(self, module, query: torch.Tensor, key, scaling: float | None,
                 probs: list[torch.Tensor] | None = None, summed: bool = False) -> None:
        """``probs``: a decode step's attention probabilities as the attention function computed them ([KV heads,
        groups, n], one entry per head for ragged heads), so ``acc`` needs no second pass over the keys. ``summed``:
        the step has added them to ``step_sums`` already."""
        layer_idx = module.layer_idx
        head_dim = query.shape[-1]
        scaling = scaling if scaling is not None else head_dim ** -0.5
        self._scaling[layer_idx] = scaling
        if self.window:
            self._remember(layer_idx, query)
        if self.accumulate and not summed:
            self._accumulate(self.cache.layers[layer_idx], query, key, scaling, probs)

    def step_sums(self, layer) -> torch.Tensor | None:
        """The per-slot statistic a decode step that computes attention's probabilities itself may add them to
        (each slot's, averaged over its KV head's query heads, as ``_accumulate`` adds them), then calling this
        observer with ``summed``: ``acc`` when this observer keeps it, else None."""
        return counted(layer) if self.accumulate else None

    def ring_written(self, ring) -> None:
        """The graph step wrote one more decode step's query of every layer into ``ring`` (its row ``total - 1``),
        to be taken into the window when the window is next read, as ``_pending`` steps are."""
        if ring is not self._ring:
            self._flush()
            self._ring, self._ring_seen = ring, {li: ring.total - 1 for li in ring.queries}
            self._scaling.update(ring.scaling)
        elif self._pending:  # eager steps before this one: theirs go first
            self._flush()

    def _skip_ring(self) -> None:
        """Forget the ring's rows not taken yet."""
        if self._ring is not None:
            self._ring_seen = {li: self._ring.total for li in self._ring.queries}

    def _remember(self, layer_idx: int, query: torch.Tensor) -> None:
        if query.shape[2] == 1:
            if self._ring is not None and any(self._ring.total > n for n in self._ring_seen.values()):
                self._flush()  # the graph's steps before this one go first
            # A decode step: its query joins the window when the window is next read (a compression, a turn's
            # saved state, a mark), with the other pending ones in one copy; until then it is kept as it is
            # (attention creates the query anew every step and never writes into it). Only the newest ``window``
            # can still be in the window by then: older ones are dropped, not copied in and pushed out again.
            steps = self._pending.setdefault(layer_idx, [])
            steps.append((query, self.positions))
            if len(steps) > self.window:
                del steps[0]
            return
        self._flush(layer_idx)
        take = min(query.shape[2], self.window)
        self._append(layer_idx, query[0, :, -take:].transpose(0, 1), self.positions[-take:])

    def _flush(self, layer_idx: int | None = None) -> None:
        """Copy the pending decode steps' queries into the window (of ``layer_idx``, or of every layer): the graph
        step's rows not taken yet, or the eager steps' queries."""
        ring = self._ring
        if ring is not None:
            for li in [layer_idx] if layer_idx is not None else list(self._ring_seen):
                new = ring.total - self._ring_seen.get(li, ring.total)
                if new > 0 and li in ring.queries:
                    self._append(li, *ring.newest(li, min(new, ring.size)))
                    self._ring_seen[li] = ring.total
        for li in [layer_idx] if layer_idx is not None else list(self._pending):
            steps = self._pending.pop(li, None)
            if steps:
                self._append(li, torch.stack([q[0, :, -1] for q, _ in steps]),
                             torch.cat([p[-1:] for _, p in steps]))

    def _append(self, layer_idx: int, new: torch.Tensor, pos: torch.Tensor) -> None:
        """The window after ``new`` ([take <= window, heads, dim], at positions ``pos``): the oldest rows leave."""
        w = self.window
        take = new.shape[0]
        new, pos = new.float(), pos.float()
        if take >= w:  # the new rows fill the window (TOVA's window of one, every step): nothing older stays
            # (contiguous: a prefill's rows are a view of all its queries, which the window must not keep alive)
            self._queries[layer_idx], self._qpos[layer_idx] = new[-w:].contiguous(), pos[-w:].contiguous()
            self._count[layer_idx] = w
            return
        buf = self._queries.get(layer_idx)
        if buf is None or buf.shape[1:] != new.shape[1:]:
            buf = torch.zeros(w, *new.shape[1:], device=new.device)
            self._qpos[layer_idx] = torch.zeros(w, device=new.device)
            self._count[layer_idx] = 0
        self._queries[layer_idx] = torch.cat([buf[take:], new])
        self._qpos[layer_idx] = torch.cat([self._qpos[layer_idx][take:], pos.to(new.device)])
        self._count[layer_idx] = min(w, self._count[layer_idx] + take)

    def _accumulate(self, layer, query: torch.Tensor, key, scaling: float, probs=None) -> None:
        acc = counted(layer)
        heads = layer.heads
        groups = query.shape[1] // heads
        q = query.shape[2]
        if probs is not None:  # a decode step's probabilities, averaged over the query heads of each KV head
            if isinstance(key, RaggedKV):
                for h, p in enumerate(probs):
                    layer.head_view(acc, h).add_(p[0].mean(0))
            else:
                acc.view(heads, layer.caps[0])[:, : key.shape[2]] += probs[0].mean(1)
            return
        if isinstance(key, RaggedKV):
            for h, k in enumerate(key.heads):
                qh = query[0, h * groups: (h + 1) * groups].float()  # [groups, q, dim]
                probs = _probs(qh[None], k[0].float(), scaling)[0]  # [q, n]
                layer.head_view(acc, h).add_(probs.sum(0))
            return
        n = key.shape[2]
        target = acc.view(heads, layer.caps[0])[:, :n]
        if q == 1:  # a decode step: the fewest kernels (this runs on every step of every layer)
            qs = (query[0, :, 0].float() * scaling).view(heads, groups, -1)
            target += torch.bmm(qs, key[0].float().transpose(1, 2)).softmax(-1).mean(1)
            return
        qf = query[0].float().view(heads, groups, q, -1)
        target += _probs(qf, key[0].float(), scaling).sum(1)  # [heads, n]

    def window_attention(self, layer_idx: int, rotary: Rotary | None, next_pos: int | None) -> torch.Tensor | None:
        """Attention of the remembered queries over layer ``layer_idx``'s current keys (``window_attentions``)."""
        return self.window_attentions([layer_idx], rotary, next_pos)[0]

    def window_attentions(self, layers: list[int], rotary: Rotary | None, next_pos: int | None,
                          width: int | None = None) -> list:
        """Attention of the remembered queries over each of ``layers``' current keys: [heads, rows, width] each
        (``width``: the layer's longest head unless given, at least that; rows = queries remembered, oldest first,
        moved to the last positions before ``next_pos``; zeros where a head holds nothing; None for a layer with no
        query remembered). Layers whose heads hold equally many (as many queries, the same shapes and scaling) in one
        batched product, those of different lengths padded to the longest (``cake``'s layers); a layer whose heads
        hold different numbers head by head."""
        for li in layers:
            self._flush(li)
        out, alike = {}, {}
        for li in layers:
            layer, count = self.cache.layers[li], self._count.get(li, 0)
            if not count:
                out[li] = None
                continue
            key = (count, layer.heads, self._queries[li].shape, self._scaling[li], layer.device) \
                if layer.uniform else li
            alike.setdefault(key, []).append(li)
        batches = []
        for group in alike.values():
            layer = self.cache.layers[group[0]]
            most = max(1, WINDOW_KEYS // (layer.heads * max(width or self.cache.length, 1) * layer.keys.shape[-1]))
            batches += [group[at: at + most] for at in range(0, len(group), most)]
        for group in batches:
            count, layer, scaling = self._count[group[0]], self.cache.layers[group[0]], self._scaling[group[0]]
            lens = [self.cache.layers[li].length for li in group]
            n = max(lens) if width is None else width
            queries = torch.stack([self._queries[li][-count:] for li in group]).transpose(1, 2)  # [L, qh, rows, d]
            if rotary is not None and next_pos is not None:
                target = torch.arange(next_pos - count, next_pos, device=queries.device, dtype=torch.float32)
                delta = target - torch.stack([self._qpos[li][-count:] for li in group])
                queries = rotary.rotate(queries, delta[:, None, :])
            heads = layer.heads
            qf = queries.reshape(len(group) * heads, -1, count, queries.shape[-1])
            if layer.uniform:  # [L, heads, n, d] keys; layers of other lengths padded, each row ending at its own slot
                held = [self.cache.layers[li].held_keys()[0] for li in group]
                if set(lens) == {n}:
                    keys, ends = torch.stack(held).float(), None
                else:
                    keys = torch.zeros(len(group), heads, n, qf.shape[-1], device=qf.device)
                    for i, k in enumerate(held):
                        keys[i, :, : lens[i]] = k
                    ends = torch.tensor(lens, device=qf.device).repeat_interleave(heads)
                probs = _probs(qf, keys.flatten(0, 1), scaling, ends).view(len(group), heads, count, -1)
                out.update((li, p if width is not None else p[..., :m]) for li, p, m in zip(group, probs, lens))
                continue
            probs = torch.zeros(heads, count, n, device=queries.device)
            for h in range(heads):
                keys = layer.keys[layer.offs[h]: layer.offs[h] + layer.lens[h]].float()
                probs[h, :, : layer.lens[h]] = _probs(qf[h: h + 1], keys[None].expand(1, -1, -1), scaling)[0]
            out[group[0]] = probs
        return [out[li] for li in layers]


def _probs(q: torch.Tensor, k: torch.Tensor, scaling: float, ends: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of queries q [heads, groups, rows, dim] over keys k [heads, n, dim], the rows being the
    last of the n positions (of each head's first ``ends[h]``, where given: the keys past them are padding);
    averaged over the groups: [heads, rows, n]."""
    heads, groups, rows, dim = q.shape
    # One batched matmul per KV head (a broadcast matmul against the strided key view would copy the keys).
    logits = torch.bmm(q.reshape(heads, groups * rows, dim), k.transpose(1, 2)).view(heads, groups, rows, -1)
    logits = logits * scaling
    if ends is not None:  # row r sees the slots up to its own, ends - rows + r, and nothing past a head's keys
        last = ends[:, None] - rows + torch.arange(rows, device=q.device)
        logits = logits.masked_fill(torch.arange(k.shape[1], device=q.device) > last[:, None, :, None],
                                    float("-inf"))
        return torch.softmax(logits, dim=-1).mean(1)
    mask = causal_mask(q.shape[2], k.shape[1], q.device)
    if mask is not None:
        logits = logits.masked_fill(~mask[0], float("-inf"))
    return torch.softmax(logits, dim=-1).mean(1)
