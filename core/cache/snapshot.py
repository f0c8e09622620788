"""A copy of the slots a cache holds, as an undo checkpoint keeps it (core/engine/checkpoint.py): taken and put back a
slab at a time.

``take`` reads, for each slab (core/cache/slab.py), the held slots of every layer and head in it with one
``index_select`` per tensor; ``CacheCopy.put_back`` writes them back with one ``index_copy_`` per tensor, in place, so
a graph step captured over the buffers stays valid. A copy per layer, head and tensor, taken and put back, ran 848
operations for a tiny Llama of 16 layers and 4 KV heads where this runs 29 (``scripts/compression_ops.py --undo``,
docs/gpu.md), every turn for undo and once more for each recall the gate declines; on a GPU each is a launch. Where
the cache has other buffers by then (a budget change, a statistic a policy started since, a growing cache that grew),
the copy goes back layer by layer from the per-head form ``KVCache.state_tensors`` gives (``as_state``), as before.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from . import slab as slabs


@dataclass
class Part:
    """The held slots of consecutive layers whose tensors are rows of one slab (``bases``), taken at once."""

    slab: weakref.ref | None  # the slab the rows were taken from (None: a layer outside one, read from its tensors)
    layers: list[int]
    caps: list[list[int]]
    lens: list[list[int]]
    pos_off: list[list[int]]
    names: list[tuple[str, ...]]  # each layer's per-slot tensors (``KVLayer.per_slot``)
    starts: list[int]  # each layer's first row in the slab
    index: torch.Tensor  # the held rows, layer after layer, head after head, in the slab's tensors
    saved: dict[str, torch.Tensor]  # name -> those rows of the slab's tensor


class CacheCopy:
    """The held slots of every initialized layer of a ``KVCache``, with each layer's capacities and offsets."""

    def __init__(self, parts: list[Part]):
        self.parts = parts
        self._rows: np.ndarray | None = None

    @property
    def layers(self) -> set[int]:
        return {i for part in self.parts for i in part.layers}

    def put_back(self, cache) -> None:
        """Make ``cache``'s layers hold what they held when the copy was taken: in place where a part's layers are
        still rows of the same slab, at the same capacities, with the same tensors; else layer by layer."""
        rest = [part for part in self.parts if not self._in_place(part, cache)]
        if rest:
            cache.load_state_tensors(CacheCopy(rest).as_state())

    @staticmethod
    def _in_place(part: Part, cache) -> bool:
        slab = part.slab() if part.slab is not None else None
        if slab is None or set(slab.bases) != set(part.saved):
            return False
        for i, caps, names, start in zip(part.layers, part.caps, part.names, part.starts):
            layer = cache.layers[i]
            if not layer.is_initialized or layer.slab is not slab or layer.caps != caps \
                    or tuple(layer.per_slot()) != names:
                return False
            base, at = slabs.where(layer, "keys", layer.keys)
            if base is not slab.bases["keys"] or at != start:
                return False
        for name, t in part.saved.items():
            slab.bases[name].index_copy_(0, part.index, t)
        for i, lens, pos_off in zip(part.layers, part.lens, part.pos_off):
            cache.layers[i].lens, cache.layers[i].pos_off = list(lens), list(pos_off)
        return True

    def as_state(self) -> dict[str, torch.Tensor]:
        """The copy in ``KVCache.state_tensors``' form: ``{layer}.{head}.{name}`` per head, ``{layer}.caps`` and
        ``{layer}.pos_off``."""
        out = {}
        for part in self.parts:
            at = 0
            for i, caps, lens, pos_off, names in zip(part.layers, part.caps, part.lens, part.pos_off, part.names):
                for h, n in enumerate(lens):
                    for name in names:
                        out[f"{i}.{h}.{name}"] = part.saved[name][at: at + n]
                    at += n
                out[f"{i}.pos_off"], out[f"{i}.caps"] = torch.tensor(pos_off), torch.tensor(caps)
        return out

    def rows_named(self) -> np.ndarray:
        """The storage rows the copy's slots name (-1 for slots not written yet), read off the device once."""
        if self._rows is None:
            named = [part.saved["rows"] for part in self.parts if "rows" in part.saved]
            self._rows = torch.cat(named).cpu().numpy() if named else np.zeros(0, dtype=np.int64)
        return self._rows


def take(cache) -> CacheCopy:
    """A copy of every held slot of ``cache``'s initialized layers: one ``index_select`` per tensor of each slab."""
    runs: list[tuple[object, list[int]]] = []  # (slab, consecutive layers whose tensors are its rows)
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            continue
        slab = _slab_of(layer)
        if slab is not None and runs and runs[-1][0] is slab:
            runs[-1][1].append(i)
        else:  # a new slab, or a layer whose tensors are not its slab's rows: a part of its own
            runs.append((slab, [i]))
    return CacheCopy([_part(cache, slab, members) for slab, members in runs])


def _slab_of(layer):
    """The slab every per-slot tensor of ``layer`` is rows of, or None."""
    slab = layer.slab
    if slab is None:
        return None
    for name, t in layer.per_slot().items():
        if slabs.where(layer, name, t)[0] is not slab.bases.get(name):
            return None
    return slab


def _part(cache, slab, members: list[int]) -> Part:
    layers = [cache.layers[i] for i in members]
    if slab is not None:
        bases = slab.bases
        starts = [slabs.where(layer, "keys", layer.keys)[1] for layer in layers]
    else:
        bases, starts = layers[0].per_slot(), [0]
    rows = []
    for layer, start in zip(layers, starts):
        heads, j = slabs.places(layer.lens)
        rows.append(start + np.asarray(layer.offs, dtype=np.int64)[heads] + j)
    index = torch.from_numpy(np.concatenate(rows)).to(layers[0].device)
    return Part(slab=weakref.ref(slab) if slab is not None else None, layers=list(members),
                caps=[list(layer.caps) for layer in layers], lens=[list(layer.lens) for layer in layers],
                pos_off=[list(layer.pos_off) for layer in layers],
                names=[tuple(layer.per_slot()) for layer in layers], starts=starts, index=index,
                saved={name: base.index_select(0, index) for name, base in bases.items()})
