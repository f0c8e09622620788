"""Where a cache layer's slots live, and how a compression moves the ones it keeps.

A **slab** holds consecutive layers' per-slot tensors (``KVLayer.per_slot``: keys, values, computed keys, positions,
storage rows, statistics) as one flat tensor per name, layer after layer and, within a layer, head after head; a
layer's tensors are views of its rows. ``move`` keeps, for every layer and head, the given slots at the front of the
head's region (re-rotating their keys), with one ``index_select`` and one ``index_copy_`` per tensor of a slab
however many layers and heads the slab holds: where a compression moved each layer apart (~30 operations and 2-3
host syncs a layer, which on a GPU are launches), it now moves each slab at once. A compression that changes the
capacities — or finds its layers' tensors outside one slab (a layer given buffers of its own, say by an undo of other
capacities) — writes the kept slots into new slabs of at most ``SLAB_BYTES`` each, so the old and the new storage
are held at once during that compression; one that keeps them moves the slots within their slabs, so a graph
captured over the buffers stays valid. A new cache of a fixed capacity gives its layers their first buffers from one
slab (``KVCache.first_buffers``), and a statistic made later joins its layer's slab (``Slab.stat``): the first
compression already moves in place.
"""

from __future__ import annotations

import math

import numpy as np
import torch

SLAB_BYTES = 256 << 20  # a slab's most bytes (a layer larger than that is a slab of its own)


class Slab:
    """Consecutive layers' per-slot tensors: ``bases[name]`` holds every layer's rows, layer ``i``'s from
    ``starts[i]``; ``spec``: name -> (dtype, shape of a row, the value of an empty slot)."""

    def __init__(self, caps: list[list[int]], spec: dict[str, tuple], device):
        sizes = [sum(c) for c in caps]
        self.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
        self.size = sum(sizes)
        self.bases = {name: torch.full((self.size, *shape), fill, dtype=dtype, device=device)
                      for name, (dtype, shape, fill) in spec.items()}

    def views(self, i: int, size: int) -> dict[str, torch.Tensor]:
        return {name: base[self.starts[i]: self.starts[i] + size] for name, base in self.bases.items()}

    def stat(self, layer, name: str) -> torch.Tensor:
        """A new per-slot float statistic of ``layer`` (one of this slab's), zeros: its rows of a tensor the slab
        makes for every layer's ``name`` when the first asks."""
        key = f"stat.{name}"
        if key not in self.bases:
            self.bases[key] = torch.zeros(self.size, device=layer.device)
        _, start = where(layer, "keys", layer.keys)
        return self.bases[key][start: start + layer.keys.shape[0]].zero_()


def allocate(layers, caps: list[list[int]]) -> list[tuple[Slab, int]]:
    """New slabs for ``layers`` at capacities ``caps`` (one list per layer): consecutive layers of the same per-slot
    tensors share one while it stays under ``SLAB_BYTES``. Each layer's slab and place in it."""
    out = []
    for run in _runs(layers, caps):
        slab = Slab([caps[i] for i in run], layers[run[0]].slot_spec(), layers[run[0]].device)
        out.extend((slab, j) for j in range(len(run)))
    return out


def _runs(layers, caps: list[list[int]]) -> list[list[int]]:
    """How ``allocate`` groups ``layers`` into slabs: runs of consecutive layers' indices."""
    runs: list[list[int]] = []
    used, last = 0, None
    for i, layer in enumerate(layers):
        spec = layer.slot_spec()
        size = sum(caps[i]) * slot_bytes(spec)
        if not runs or spec != last or layer.device != layers[runs[-1][0]].device or used + size > SLAB_BYTES:
            runs.append([])
            used = 0
        runs[-1].append(i)
        used, last = used + size, spec
    return runs


def move(layers, index: list[torch.Tensor], kept: list[list[int]], rotary=None, next_pos: int | None = None,
         caps: list[list[int]] | None = None, stack: bool = False) -> None:
    """Keep, in each layer ``l`` and head ``h``, the slots ``index[l][h, :kept[l][h]]`` (a padded [heads, width]
    tensor per layer) in that order at the front of the head's region, and drop the rest; then the layers have
    capacities ``caps`` (default: theirs). With ``rotary`` each kept key is its computed one rotated once to its new
    position: head h's kept slots end right before ``next_pos``. ``stack``: gather layers whose tensors are not
    yet in slabs (or whose slabs hold other rows too) into new ones even where the capacities stay."""
    caps = [list(c) for c in caps] if caps is not None else [list(layer.caps) for layer in layers]
    if any(k > c for layer_kept, layer_caps in zip(kept, caps) for k, c in zip(layer_kept, layer_caps)):
        raise ValueError(f"cannot keep {kept} slots in heads of {caps}")
    fresh = any(c != layer.caps for c, layer in zip(caps, layers)) or stack and not in_slabs(layers)
    if rotary is not None and layers[0].k0 is None:
        raise RuntimeError("a cache that rotates keys keeps their computed keys (KVCache(keeps_computed=True))")
    targets = allocate(layers, caps) if fresh else None
    width = max(i.shape[1] for i in index)
    flat = torch.cat([_pad(i.to(layers[0].device), width) for i in index])
    first_row = np.concatenate([[0], np.cumsum([layer.heads for layer in layers])[:-1]]).tolist()
    # per tensor: runs of consecutive layers read from one tensor and written to one, each run's slots moved at once;
    # tensors whose runs have the same layers and rows share the runs' indices
    groups: dict[tuple, list] = {}
    slots = [layer.per_slot() for layer in layers]
    for name in dict.fromkeys(name for held in slots for name in held):
        runs: list[tuple] = []
        for li, layer in enumerate(layers):
            if name not in slots[li]:  # a statistic this layer does not keep
                runs.append((None, None, []))
                continue
            src, s0 = where(layer, name, slots[li][name])
            dst, d0 = (targets[li][0].bases[name], targets[li][0].starts[targets[li][1]]) if fresh else (src, s0)
            if runs and runs[-1][0] is src and runs[-1][1] is dst:
                runs[-1][2].append((li, s0, d0))
            else:
                runs.append((src, dst, [(li, s0, d0)]))
        runs = [run for run in runs if run[2]]
        for src, dst, members in runs:
            groups.setdefault(tuple(members), []).append((name, src, dst))
    for members, moves in groups.items():
        src_idx, dst_idx, new_pos = _indices(layers, members, flat, width, kept, caps, first_row, next_pos)
        if src_idx.numel() == 0:
            continue
        taken = {name: [src.index_select(0, src_idx), dst] for name, src, dst in moves}
        if rotary is not None and "keys" in taken:  # a layer's keys, computed keys and positions are allocated together
            taken["keys"][0] = rotary.rotate(taken["k0"][0], new_pos - taken["computed"][0].long())
        for t, dst in taken.values():
            dst.index_copy_(0, dst_idx, t)
    for li, layer in enumerate(layers):
        if fresh:
            slab, place = targets[li]
            layer.adopt(caps[li], slab.views(place, sum(caps[li])), slab)
        layer.lens = list(kept[li])
        if next_pos is not None:
            layer.pos_off = [next_pos - k for k in kept[li]]


def places(counts) -> tuple[np.ndarray, np.ndarray]:
    """For heads holding ``counts`` slots each, every slot in order: its head, and its place within the head."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.repeat(np.arange(len(counts)), counts), \
        np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def on_host(layers, names) -> list[dict[str, torch.Tensor]]:
    """Each layer's per-slot tensors named in ``names`` on the host, [slots, ...] as ``per_slot`` gives them: one copy
    per slab tensor (or per tensor outside a slab), where a copy per layer and head would wait for the device each
    time. On the CPU, views of the tensors themselves."""
    copies: dict[int, torch.Tensor] = {}
    out = []
    for layer in layers:
        mine = {}
        for name, t in layer.per_slot().items():
            if name in names:
                base, start = where(layer, name, t)
                if id(base) not in copies:
                    copies[id(base)] = base.cpu()
                mine[name] = copies[id(base)][start: start + t.shape[0]]
        out.append(mine)
    return out


def _indices(layers, members, flat, width, kept, caps, first_row, next_pos):
    """For a run of layers (``members``: (layer, source start, target start) each): the source rows of their kept
    slots, the target rows and the new positions (with ``next_pos``), layer by layer, head by head."""
    parts = []
    for li, s0, d0 in members:
        counts = np.asarray(kept[li], dtype=np.int64)
        offs_old = np.asarray(layers[li].offs, dtype=np.int64)
        offs_new = np.concatenate([[0], np.cumsum(caps[li])[:-1]]).astype(np.int64)
        heads, j = places(counts)
        parts.append(((first_row[li] + heads) * width + j, s0 + offs_old[heads], d0 + offs_new[heads] + j,
                      (next_pos or 0) - counts[heads] + j))
    host = torch.from_numpy(np.stack([np.concatenate(column) for column in zip(*parts)])).to(flat.device)
    return flat.view(-1).index_select(0, host[0]) + host[1], host[2], host[3]


def where(layer, name: str, t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor a layer's per-slot tensor ``t`` (named ``name``) is a view of (its slab's, else itself) and its first
    row there."""
    slab = layer.slab
    if slab is not None and name in slab.bases:
        base = slab.bases[name]
        if t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
            return base, (t.storage_offset() - base.storage_offset()) // max(1, base.stride(0))
    return t, 0


def in_slabs(layers) -> bool:
    """Whether ``layers`` are in the slabs ``allocate`` would make for them now: every per-slot tensor a view of its
    layer's slab, and each slab holding the rows of the layers ``allocate`` would give it, nothing else."""
    for layer in layers:
        for name, t in layer.per_slot().items():
            base, _ = where(layer, name, t)
            if layer.slab is None or base is not layer.slab.bases.get(name):
                return False
    # each run's slab holds exactly its layers' rows (a layer in another slab leaves it short or long)
    return all(layers[run[0]].slab.size == sum(sum(layers[i].caps) for i in run)
               for run in _runs(layers, [layer.caps for layer in layers]))


def _pad(index: torch.Tensor, width: int) -> torch.Tensor:
    return index if index.shape[1] == width else torch.nn.functional.pad(index, (0, width - index.shape[1]))


def slot_bytes(spec: dict[str, tuple]) -> int:
    """The bytes one slot takes in every per-slot tensor of ``spec`` (``KVLayer.slot_spec``)."""
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape, _ in spec.values())
