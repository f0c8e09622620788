"""Rebuilding the cache's layers from the archive, all layers at once.

A compression in ``rerotate`` mode and recall's put-back both end the same way: each (layer, KV head) holds a new
ascending list of absolute positions, and every key is the archived key rotated once from where it was computed
to its slot's position (storage/archive.py). Doing that layer by layer costs a few dozen small operations per layer;
here it is three steps:

1. which positions each head holds (``slots_of``: the kept slots' positions and statistics, and with recall the
   brought positions the head lacks, merged in position order), every head of every layer a row of the same
   operations; layers that keep the same slots (position-only policies) share one result;
2. for a chunk of layers, one read of the archive and one rotation (``Archive.read``; the rotation's cos/sin are
   computed once when the layers share their positions);
3. per layer, one copy into its buffers (``KVLayer.fill``).

A resumed cache is rebuilt the same way (``KVCache.load_slot_state``), so a live cache and its resumed copy come
from the same archived rows through the same element-wise rotation, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .positions import Rotary

CHUNK_BYTES = 32 << 20  # archive rows read at once (bounds the transient memory on large models)
_PAD = torch.iinfo(torch.long).max  # sorts after every position


@dataclass
class Slots:
    """What one layer holds after the rebuild: per head ``lens[h]`` positions ``held[h, :lens[h]]`` (ascending;
    the padding repeats position 0) and each statistic's values in the same order."""

    held: torch.Tensor  # [heads, width] int64 (CPU)
    lens: list[int]
    stats: dict[str, torch.Tensor]  # name -> [heads, width] (the layer's device)
    #: Where each head's first slot sits (``rerotate`` mode); None: the slots end right before the rebuild's
    #: ``next_pos``, as after a compression.
    pos_off: list[int] | None = None

    def offsets(self, next_pos: int | None) -> list[int]:
        return self.pos_off if self.pos_off is not None else [next_pos - n for n in self.lens]

    def targets(self, next_pos: int | None, original: bool) -> torch.Tensor:
        """[heads, width] the position each slot's key is rotated to: its absolute one in ``original`` mode, else
        its slot's (contiguous from the head's offset)."""
        if original:
            return self.held
        return torch.tensor(self.offsets(next_pos))[:, None] + torch.arange(self.held.shape[1])[None, :]


def slots(layer, index: list[torch.Tensor], bring: torch.Tensor | None) -> Slots:
    """Layer ``layer`` keeping, per head, its slots ``index[h]`` (ascending) and, with ``bring`` (absolute
    positions, ascending), gaining those of them the head lacks. A brought slot starts each statistic at the
    median of the head's kept ones (the lower middle one; 0 for a head that keeps none)."""
    return slots_of([(layer, index)], bring)[0]


def slots_of(pairs: list[tuple], bring: torch.Tensor | None) -> list[Slots]:
    """``slots(layer, index, bring)`` for every ``(layer, index)`` of ``pairs``, computed at once: every head of
    every layer is a row of the same operations (recall's put-back on a policy that chooses per layer and head
    would otherwise run them layer by layer). Layers on several devices or with other statistics are computed one
    by one."""
    layers = [layer for layer, _ in pairs]
    names = sorted(layers[0].stats) if layers else []
    if any(sorted(layer.stats) != names or layer.device != layers[0].device for layer in layers):
        return [slots_of([pair], bring)[0] for pair in pairs]
    device = layers[0].device
    heads = [layer.heads for layer in layers]
    rows = [i for _, index in pairs for i in index]
    sizes = [int(i.numel()) for i in rows]
    width = max(sizes, default=0)
    base = torch.tensor([0] + [layer.abs_pos.numel() for layer in layers[:-1]]).cumsum(0).tolist()
    starts = torch.tensor([b + o for b, layer in zip(base, layers) for o in layer.offs], device=device)
    index = torch.nn.utils.rnn.pad_sequence([i.to(device) for i in rows], batch_first=True) if width else \
        torch.zeros(len(rows), 0, dtype=torch.long, device=device)
    used = torch.arange(width, device=device)[None, :] < torch.tensor(sizes, device=device)[:, None]
    flat = index + starts[:, None]
    kept = torch.cat([layer.abs_pos for layer in layers])[flat].long().masked_fill(~used, _PAD).cpu()
    stats = {name: torch.cat([layer.stats[name] for layer in layers])[flat] * used for name in names}
    lens = sizes
    if bring is not None and bring.numel():
        b, n_rows = bring.numel(), len(rows)
        wanted = bring.cpu().long()[None].expand(n_rows, b)
        if width:
            at = torch.searchsorted(kept, wanted.contiguous()).clamp(max=width - 1)
            has = kept.gather(1, at) == wanted
        else:
            has = torch.zeros(n_rows, b, dtype=torch.bool)
        merged, order = torch.sort(torch.cat([kept, wanted.masked_fill(has, _PAD)], 1), dim=1, stable=True)
        lens = [n + int(m) for n, m in zip(sizes, (~has).sum(1).tolist())]
        full = max(lens)
        kept, order = merged[:, :full], order[:, :full].to(device)
        for name, t in stats.items():
            # each row's median over its kept slots (the lower middle one, as ``median``); 0 for a row with none
            fill = t.masked_fill(~used, float("nan")).nanmedian(dim=1).values.nan_to_num(0.0) if width else \
                t.new_zeros(n_rows)
            stats[name] = torch.cat([t, fill[:, None].expand(n_rows, b)], 1).gather(1, order)
    out, row = [], 0
    for h in heads:
        layer_lens = lens[row: row + h]
        w = max(layer_lens, default=0)
        held = kept[row: row + h, :w]
        if any(n < w for n in layer_lens):
            held = torch.where(torch.arange(w)[None, :] < torch.tensor(layer_lens)[:, None], held, 0)
        out.append(Slots(held, layer_lens, {name: t[row: row + h, :w] for name, t in stats.items()}))
        row += h
    return out


def rebuild(plans: list[tuple], archive, rotary: Rotary | None, original: bool,
            next_pos: int | None = None) -> None:
    """Refill each ``(layer, slots, caps)`` of ``plans`` from the archive: values as archived, keys rotated once
    from where they were computed to their slot's position (``Slots.targets``). A compression's slots end right
    before ``next_pos``; a resumed cache's carry their saved offsets (``KVCache.load_slot_state``)."""
    if not plans:
        return
    heads, kdim, vdim, dtype = archive.layout
    row = heads * (kdim + vdim) * torch.empty(0, dtype=dtype).element_size()
    start = 0
    while start < len(plans):
        # a chunk of layers whose rows stay within CHUNK_BYTES (one layer at least)
        end, size = start, 0
        while end < len(plans) and (end == start or size + plans[end][1].held.shape[1] * row <= CHUNK_BYTES):
            size += plans[end][1].held.shape[1] * row
            end += 1
        _rebuild_chunk(plans[start:end], archive, rotary, original, next_pos)
        start = end


def _rebuild_chunk(plans, archive, rotary, original, next_pos) -> None:
    first = plans[0][1]
    shared = all(s is first for _, s, _ in plans)  # the same positions in every layer of the chunk
    width = max(s.held.shape[1] for _, s, _ in plans)
    if width == 0:
        for layer, s, caps in plans:
            layer.fill(caps, None, None, s.held, s.lens, s.offsets(next_pos), s.stats)
        return
    if shared:
        held = first.held[None].expand(len(plans), -1, -1)
    else:
        held = torch.stack([torch.nn.functional.pad(s.held, (0, width - s.held.shape[1])) for _, s, _ in plans])
    keys, values, computed = archive.read([layer.index for layer, _, _ in plans], held)
    if rotary is not None:
        if shared:
            keys = rotary.rotate(keys, first.targets(next_pos, original) - computed[0])
        else:
            targets = torch.stack([torch.nn.functional.pad(s.targets(next_pos, original), (0, width - s.held.shape[1]))
                                   for _, s, _ in plans])
            keys = rotary.rotate(keys, targets - computed)
    for i, (layer, s, caps) in enumerate(plans):
        w = s.held.shape[1]
        layer.fill(caps, keys[i, :, :w], values[i, :, :w], s.held, s.lens, s.offsets(next_pos), s.stats)
