"""Digests: what recall scores a sentence group by, and all it keeps of evicted text besides the token ids.

For a few scoring layers spread through the model's depth and for every KV head, a group's digest is the ``REPS``
keys of the group with the largest norm among its tokens that are not template scaffolding, un-rotated to position
0 so that relevance does not depend on where the group sat; its coarse key (the first of them, in three of the
layers) lets a first pass over many groups pick the candidates. Each key is kept in int8 with one scale per key
(``quantize``): 6.9 KB per group for the default model, about 1.1 KB per token of chat, where the fp32 KV of a token
is 46 KB. Recalled text is read again from its token ids (core/recall/choose.py), so no evicted KV is kept.

Digests are computed when a turn closes, from the keys as they were computed (``KVLayer.k0``): the keys of slots a
compression is about to drop during the turn are taken first (``capture``, run by every compression), the rest at
the turn's close. They go to a capped store on disk (storage/digests.py; ``--archive-mb``): past the cap the
oldest sentences are forgotten first, a segment at a time.
"""

from __future__ import annotations

import numpy as np
import torch

from ...storage.digests import DigestStore
from .score import COARSE_DTYPE, FULL_DTYPE, coarse_index, scoring_layers

REPS = 4  # representative keys per group, layer and KV head
SEGMENT_BYTES = 8 << 20  # the store's segment files at most (a cap smaller than 16 of them gets smaller ones)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectors x [..., D] as int8 [..., D] and one fp16 scale each (symmetric: max |x| maps to 127)."""
    scale = x.abs().amax(-1).float().clamp(min=1e-8) / 127
    return (x.float() / scale[..., None]).round().clamp(-127, 127).to(torch.int8), scale.half()


def dequantize(q: np.ndarray | torch.Tensor, scale: np.ndarray | torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    q, scale = torch.as_tensor(q), torch.as_tensor(scale)
    return (q.to(dtype) * scale.to(dtype)[..., None]).to(dtype)


def representatives(keys: torch.Tensor, counts: torch.Tensor, content: torch.Tensor) -> torch.Tensor:
    """Each group's ``REPS`` keys of the largest norm, largest first: keys [layers, heads, n, dim] of n tokens in
    groups of ``counts`` tokens (in order), ``content`` [n] the tokens that are not template scaffolding (a group's
    scaffolding counts only where the group has nothing else); a group of fewer candidates repeats its first.
    Returns [groups, layers, heads, REPS, dim]. Every group at once: two stable sorts order each (layer, head)'s
    tokens by group, candidates first, then by norm; the ranks taken are known on the host."""
    layers, heads, n, dim = keys.shape
    group = torch.repeat_interleave(torch.arange(len(counts)), counts)
    firsts = torch.cumsum(counts, 0) - counts
    in_group = torch.zeros(len(counts), dtype=torch.long).index_add_(0, group, content.long())
    chosen = content | (in_group == 0)[group]  # the tokens each group's keys are chosen from
    candidates = torch.where(in_group > 0, in_group, counts)
    by_norm = keys.norm(dim=-1).sort(dim=-1, descending=True, stable=True).indices  # [layers, heads, n]
    order_key = (2 * group + (~chosen).long()).to(keys.device)
    order = by_norm.gather(-1, order_key[by_norm].sort(dim=-1, stable=True).indices)
    rank = torch.arange(REPS)
    take = firsts[:, None] + torch.where(rank < candidates[:, None], rank, 0)  # [groups, REPS] into ``order``
    top = order[..., take.reshape(-1).to(keys.device)]  # [layers, heads, groups * REPS] token indices
    out = keys.gather(2, top[..., None].expand(-1, -1, -1, dim))
    return out.view(layers, heads, len(counts), REPS, dim).permute(2, 0, 1, 3, 4).contiguous()


class Stage:
    """The computed keys of the scoring layers' slots at positions ``start`` on (the turn's, not digested yet), as
    they were computed, with the positions they were computed at: [layers, heads, rows, key dim] on the cache's
    device, filled by ``capture``, un-rotated to position 0 by ``take`` (once a turn). A capture reads nothing back from
    the device: on a GPU a compression's launches a few operations a layer and waits for none."""

    def __init__(self, layers: list[int]):
        self.layers = layers
        self.start = 0
        self.keys: torch.Tensor | None = None  # [layers, heads, rows + 1, dim]: the last row takes what is not staged
        self.at: torch.Tensor | None = None  # [layers, heads, rows + 1]: where each staged key was computed

    def capture(self, cache, start: int, end: int, rotary) -> None:
        """Take the keys of every scoring layer's slots at positions ``start`` and later (those before were
        digested), before a compression drops any of them, or when the turn closes. ``end``: the tokens fed so far
        (the stage has room up to ``end`` itself: a reply's token may be fed ahead of its log entry). Every slot is
        written, those before ``start`` (and the padding of shorter heads) into the spare last row, so that nothing
        is read back to choose them."""
        if self.keys is None or start != self.start:
            self.start, self.keys, self.at = start, None, None
        for si, li in enumerate(self.layers):
            layer = cache.layers[li]
            if not layer.is_initialized or layer.k0 is None and rotary is not None:
                continue
            keys = layer.padded(layer.k0 if layer.k0 is not None else layer.keys)
            self._grow(len(self.layers), keys.shape[0], end - start + 1, keys.shape[-1], keys.device)
            spare = self.keys.shape[2] - 1
            pos = layer.positions() - start
            mine = (pos >= 0) & (pos < spare)
            rows = torch.where(mine, pos, spare)
            heads = torch.arange(keys.shape[0], device=keys.device)[:, None].expand_as(rows)
            self.keys[si].index_put_((heads, rows), keys.float())
            self.at[si].index_put_((heads, rows), layer.padded(layer.computed).long())

    def _grow(self, layers: int, heads: int, n: int, dim: int, device) -> None:
        if self.keys is None:
            self.keys = torch.zeros(layers, heads, max(n, 64) + 1, dim, device=device)
            self.at = torch.zeros(layers, heads, max(n, 64) + 1, dtype=torch.long, device=device)
        elif n > self.keys.shape[2] - 1:
            rows = max(n, 2 * (self.keys.shape[2] - 1))
            old = self.keys.shape[2] - 1
            keys, at = self.keys.new_zeros(layers, heads, rows + 1, dim), self.at.new_zeros(layers, heads, rows + 1)
            keys[:, :, :old], at[:, :, :old] = self.keys[:, :, :old], self.at[:, :, :old]
            self.keys, self.at = keys, at

    def take(self, n: int, rotary) -> torch.Tensor | None:
        """The staged keys of positions ``start .. n``, un-rotated to position 0 ([layers, heads, n - start, dim];
        None where no scoring layer could be staged); the stage then starts at ``n``. Every token fed since ``start``
        was in the cache at a capture (each compression captures before it drops, the turn's close captures the
        rest), so a stage that exists holds them all."""
        out = None
        if self.keys is not None:
            m = min(n - self.start, self.keys.shape[2] - 1)
            out, at = self.keys[:, :, :m], self.at[:, :, :m]
            if rotary is not None:
                out = rotary.rotate(out, -at)
            if out.shape[2] < n - self.start:
                out = torch.nn.functional.pad(out, (0, 0, 0, n - self.start - out.shape[2]))
        self.keys, self.at, self.start = None, None, n
        return out


class Digests:
    """The digests of a conversation's sentence groups (on disk: ``DigestStore``), with the coarse keys of the live
    groups kept in memory once recall has read them and, per live group, whether it holds more than scaffolding."""

    def __init__(self, folder, num_layers: int, rotary, cap_mb: float):
        self.store = DigestStore(folder)
        self.layers = self.store.meta.get("layers") or scoring_layers(num_layers)
        self.rotary = rotary
        self.cap_mb = cap_mb
        self.active = True  # recall is on: the turns' groups are digested (``activate``)
        self.stage = Stage(self.layers)
        self.covered = self._last_end()  # positions digested: the end of the last group
        self._coarse: torch.Tensor | None = None  # [coarse layers, heads, capacity, dim], live groups first
        self._content = torch.zeros(0, dtype=torch.bool)

    def _last_end(self) -> int:
        return int(self.store.field("span", [self.store.count - 1])[0, 1]) if self.store.count else 0

    @property
    def count(self) -> int:
        return self.store.count

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def capture(self, cache, fed: int) -> None:
        """Registered with the cache (``KVCache.on_compress``): the turn's keys a compression may drop (while recall
        is on: ``active``); ``fed``: the tokens fed so far."""
        if self.active:
            self.stage.capture(cache, self.covered, fed, self.rotary)

    def activate(self, on: bool, n: int) -> None:
        """Recall switched on or off at position ``n``: digests are written while it is on, from ``n`` on when it
        comes on (the text fed while it was off has none)."""
        if on and not self.active:
            self.covered = max(self.covered, n)
            self.stage = Stage(self.layers)
        self.active = on

    def add(self, cache, log, scaffolding: torch.Tensor) -> int:
        """Digest the groups of the token log ``log`` not digested yet (its end ends a group), from the stage and
        the cache; returns how many. Past the cap the oldest segments leave the live window (``forget``)."""
        n = log.n
        if n <= self.covered:
            return 0
        start = self.covered
        self.stage.capture(cache, start, n, self.rotary)
        keys = self.stage.take(n, self.rotary)  # [layers, heads, n - start, dim]
        if keys is None:
            self.covered = n  # nothing staged (no scoring layer keeps its keys as computed): nothing to digest
            return 0
        sentence = log.column("sentence", start)
        content = ~torch.isin(log.column("token", start).long(), scaffolding)
        _, counts = torch.unique_consecutive(sentence, return_counts=True)
        ends = start + torch.cumsum(counts, 0)
        starts = ends - counts
        reps = representatives(keys, counts, content)
        self.append(reps, torch.stack([starts, ends], 1))
        self.covered = n
        return len(counts)

    def append(self, reps: torch.Tensor, spans: torch.Tensor) -> None:
        coarse = reps[:, coarse_index(self.layers), :, 0]  # [groups, coarse layers, heads, dim]
        q, scale = quantize(reps)
        cq, cscale = quantize(coarse)
        if self.store.dtype is None:
            fields = [("span", "<i4", (2,)), ("keys", "i1", tuple(q.shape[1:])),
                      ("scale", "<f2", tuple(scale.shape[1:])), ("coarse", "i1", tuple(cq.shape[1:])),
                      ("coarse_scale", "<f2", tuple(cscale.shape[1:]))]
            record = sum(np.dtype(d).itemsize * int(np.prod(s)) for _, d, s in fields)
            cap = int(self.cap_mb * 2**20)
            segment = int(min(max(min(SEGMENT_BYTES, cap // 16) // record, 16), 1 << 16))
            self.store.start(fields, segment, {"layers": self.layers})
        records = np.zeros(len(spans), dtype=self.store.dtype)
        records["span"] = spans.cpu().numpy()
        records["keys"], records["scale"] = q.cpu().numpy(), scale.cpu().numpy()
        records["coarse"], records["coarse_scale"] = cq.cpu().numpy(), cscale.cpu().numpy()
        if self._coarse is not None:
            self._keep_coarse(dequantize(cq, cscale).permute(1, 2, 0, 3).cpu(), self.count)
        self.store.append(records)
        if self.store.forget(int(self.cap_mb * 2**20)):
            self._reload()

    def _reload(self) -> None:
        """The in-memory coarse keys and content flags after the live window's start moved."""
        self._coarse = None
        self._content = self._content[:0]

    # -- reading ------------------------------------------------------------------------------------------------
    def read(self) -> tuple[torch.Tensor, "Rows", torch.Tensor]:
        """The live groups' spans [groups, 2] (start, end), their digests (``Rows``: only the rows scored are read)
        and the coarse keys [coarse layers, heads, groups, dim] (from memory after the first read)."""
        if not self.count:
            return torch.zeros(0, 2, dtype=torch.long), Rows(self.store), torch.zeros(0)
        if self._coarse is None or self._coarse.shape[2] < self.count:
            coarse = dequantize(self.store.field("coarse"), self.store.field("coarse_scale"))
            self._coarse = torch.zeros(coarse.shape[1], coarse.shape[2], 0, coarse.shape[3], dtype=COARSE_DTYPE)
            self._keep_coarse(coarse.permute(1, 2, 0, 3), 0)
        spans = torch.from_numpy(self.store.field("span")).long()
        return spans, Rows(self.store), self._coarse[:, :, : self.count]

    def _keep_coarse(self, rows: torch.Tensor, at: int) -> None:
        end = at + rows.shape[2]
        if end > self._coarse.shape[2]:
            grown = self._coarse.new_zeros(*self._coarse.shape[:2], max(end, 2 * self._coarse.shape[2], 256),
                                           self._coarse.shape[3])
            grown[:, :, :at] = self._coarse[:, :, :at]
            self._coarse = grown
        self._coarse[:, :, at: end] = rows.to(self._coarse.dtype)

    def has_content(self, spans: torch.Tensor, log, scaffolding: torch.Tensor) -> torch.Tensor:
        """[groups] whether each live group (``spans``, as ``read`` gives them) holds a token that is not template
        scaffolding. Kept in memory: each call looks only at the groups added since the last."""
        known = self._content[: spans.shape[0]]
        if known.numel() < spans.shape[0]:
            start = int(spans[known.numel(), 0])
            content = ~torch.isin(log.column("token", start).long(), scaffolding)
            total = torch.cat([torch.zeros(1, dtype=torch.long), content.long().cumsum(0)])
            new = spans[known.numel():] - start
            known = torch.cat([known, total[new[:, 1]] > total[new[:, 0]]])
        self._content = known
        return known

    # -- the window a turn commits -------------------------------------------------------------------------------
    def window(self) -> tuple[int, int, int]:
        """(first, end, covered): what a turn's state names (storage/statefile.py)."""
        return self.store.first, self.store.end, self.covered

    def restore(self, first: int, end: int, covered: int) -> None:
        """Back to the window a committed state names, on disk too (a reopened conversation)."""
        self.store.restore(first, end)
        self.covered = covered if self.store.end == end else self._last_end()
        self.stage = Stage(self.layers)
        self._reload()

    def rewind(self, first: int, end: int, covered: int) -> None:
        """Back to an earlier window in memory (an undone turn, a read recall takes back; the files are cut when a
        turn commits over them, or when the conversation reopens). The coarse keys stay in memory unless the
        window's start moved: a declined recall, every few messages, would read them all again."""
        start = self.store.first
        self.store.rewind(first, end)
        self.covered = covered if self.store.end == end else self._last_end()
        self.stage = Stage(self.layers)
        if self.store.first != start:
            self._reload()
        else:  # the live groups kept are the same records from the same start: what memory holds of them stays
            self._content = self._content[: self.count]  # (the coarse keys past ``count`` are written over)

    def sync(self) -> None:
        self.store.sync()

    def drop_forgotten(self, keep: tuple[int, int, int] | None = None) -> None:
        """Delete what the live window forgot, but what window ``keep`` (an undo copy's) still names."""
        self.store.drop_forgotten(keep[0] if keep is not None else None)

    def delete(self) -> None:
        self.store.delete()
        self._reload()


class Rows:
    """The live digests as the scoring reads them: ``take(index)`` dequantizes the rows ``index`` (None: all) into
    [k, layers, heads, REPS, dim] of the full pass's dtype."""

    def __init__(self, store: DigestStore):
        self.store = store
        self.shape = (store.count,)

    def take(self, index) -> torch.Tensor:
        idx = None if index is None else np.asarray(index, dtype=np.int64)
        return dequantize(self.store.field("keys", idx), self.store.field("scale", idx), FULL_DTYPE)
