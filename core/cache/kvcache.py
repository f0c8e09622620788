"""The KV cache: per layer one flat buffer in which every KV head owns its own region of slots.

Head h of a layer owns rows ``[off[h], off[h] + cap[h])`` of ``keys``, ``values``, ``abs_pos`` (the absolute
position of the token each slot holds) and of every per-slot attention statistic; its first ``lens[h]`` rows are
in use, in time order. New tokens are written after the last used slot; ``keep()`` gathers the slots to keep to the
front of each region (re-rotating their keys in ``rerotate`` mode). Capacities are fixed between compressions
(budget + slack per head), so nothing is reallocated while decoding; the unbounded ``full`` policy grows them by
doubling. ``nbytes`` is what is allocated.

When all heads of a layer have the same capacity and length — every policy with a uniform budget — the buffer is
viewed as ``[1, heads, cap, dim]`` and attention runs once over it. With per-head budgets (``headaware``) the heads
differ: ``update`` returns a ``RaggedKV`` and attention runs per head, so a head with a smaller budget really holds,
and allocates, fewer slots (no masking of evicted keys).

``KVCache`` is a transformers ``Cache`` of these layers, so any model that accepts a transformers cache runs on it
unmodified.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .layer import KVLayer, RaggedKV  # noqa: F401  (RaggedKV re-exported: what ragged heads hand attention)


class CacheFullError(RuntimeError):
    """Raised when a token would be written past the cache's fixed capacity (an engine bug, not user input)."""


class KVCache(Cache):
    """A transformers Cache of ``KVLayer``s with capacities the engine controls.

    ``capacity`` is the default number of slots per head (budget + slack) or None for a cache that grows (by
    doubling, up to ``max_capacity``). Before each forward the engine sets ``incoming_abs``, the absolute
    positions of the tokens about to be written. In ``rerotate`` mode the next token's position is ``length``:
    every compression leaves each head's kept keys ending right before the largest kept count, and every forward
    appends the same tokens to every head.
    """

    def __init__(self, num_layers: int, capacity: int | None, max_capacity: int, archive=None):
        self.capacity = capacity
        self.max_capacity = max_capacity
        self.incoming_abs: torch.Tensor | None = None
        #: Where every computed key and value is also written (storage/archive.py); kept keys are re-rotated from it.
        self.archive = archive
        super().__init__(layers=[KVLayer(self, i) for i in range(num_layers)])

    def initial_capacity(self, needed: int) -> int:
        if self.capacity is not None:
            return self.capacity
        return min(max(256, needed), self.max_capacity)

    def grown_capacity(self, needed: int, current: int) -> int:
        if needed <= current:
            return current
        if self.capacity is not None or needed > self.max_capacity:
            raise CacheFullError(f"{needed} tokens do not fit the cache's {current} slots")
        cap = max(256, current)
        while cap < needed:
            cap *= 2
        return min(cap, self.max_capacity)

    def set_capacity(self, capacity: int | None) -> None:
        """Fix (or free, with None) the number of slots per head; the layers are reallocated to it now."""
        self.capacity = capacity
        for layer in self.layers:
            if layer.is_initialized:
                # A head holding more than the new capacity (a larger per-layer or per-head budget before) keeps
                # its slots; the next step then has no room and compresses it to the new budget.
                layer.resize([max(capacity, n) if capacity is not None else max(n, 256) for n in layer.lens])

    @property
    def length(self) -> int:
        """Cached positions per layer (the fullest head of the fullest layer)."""
        return max((layer.length for layer in self.layers), default=0)

    @property
    def mean_length(self) -> int:
        """Positions per layer and head, averaged (rounded up): the length for a uniform budget."""
        slots = sum(layer.heads for layer in self.layers if layer.is_initialized)
        return -(-self.total_positions // slots) if slots else 0

    @property
    def room(self) -> int:
        """Tokens every head can still take without growing or compressing (None-capacity caches can grow)."""
        rooms = [c - n for layer in self.layers if layer.is_initialized for c, n in zip(layer.caps, layer.lens)]
        if self.capacity is None:
            return self.max_capacity - self.length
        return min(rooms) if rooms else self.capacity

    @property
    def total_positions(self) -> int:
        """Positions held, summed over layers and heads."""
        return sum(sum(layer.lens) for layer in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def kv_bytes(self) -> int:
        """Bytes of keys and values alone (allocated)."""
        return sum(layer.kv_bytes for layer in self.layers)

    @property
    def bytes_per_position(self) -> int | None:
        """Bytes one cached position costs over all layers and heads (None before the first forward)."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        if not layers:
            return None
        return round(sum(layer.nbytes * layer.heads / max(sum(layer.caps), 1) for layer in layers))

    # -- snapshots --------------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, layer in enumerate(self.layers):
            if not layer.is_initialized:
                continue
            for h in range(layer.heads):
                a, n = layer.offs[h], layer.lens[h]
                out[f"{i}.{h}.keys"] = layer.keys[a: a + n].contiguous()
                out[f"{i}.{h}.values"] = layer.values[a: a + n].contiguous()
                out[f"{i}.{h}.abs_pos"] = layer.abs_pos[a: a + n].contiguous()
            out[f"{i}.pos_off"] = torch.tensor(layer.pos_off)
            out[f"{i}.caps"] = torch.tensor(layer.caps)
            for name, t in layer.stats.items():
                out[f"{i}.stat.{name}"] = t.contiguous()
        return out

    def slot_state(self) -> dict[str, torch.Tensor]:
        """Which positions each (layer, head) holds, where its slots sit, and the per-slot statistics: with the
        archive, everything needed to rebuild the cache exactly (``load_slot_state``)."""
        out = {}
        for i, layer in enumerate(self.layers):
            if not layer.is_initialized:
                continue
            for h in range(layer.heads):
                out[f"{i}.{h}.abs_pos"] = layer.head_view(layer.abs_pos, h).contiguous()
            out[f"{i}.pos_off"] = torch.tensor(layer.pos_off)
            out[f"{i}.caps"] = torch.tensor(layer.caps)
            for name, t in layer.stats.items():
                out[f"{i}.stat.{name}"] = t.contiguous()
        return out

    def load_slot_state(self, tensors: dict[str, torch.Tensor], rotary, original: bool, device) -> None:
        """Rebuild the layers from ``slot_state()`` and the archive, as a compression does (core/cache/rebuild.py): values
        as archived, keys rotated once from where they were computed to their slot's position (the absolute one in
        ``original`` mode)."""
        from .rebuild import Slots, rebuild

        _, kdim, vdim, dtype = self.archive.layout
        plans = []
        for i, layer in enumerate(self.layers):
            if f"{i}.caps" not in tensors:
                continue
            caps, pos_off = tensors[f"{i}.caps"].tolist(), tensors[f"{i}.pos_off"].tolist()
            held = [tensors[f"{i}.{h}.abs_pos"].long() for h in range(len(caps))]
            lens = [int(p.numel()) for p in held]
            width = max(lens, default=0)
            padded = torch.stack([torch.nn.functional.pad(p, (0, width - p.numel())) for p in held])
            layer.start(dtype, device, kdim, vdim)
            plans.append((layer, Slots(padded, lens, {}, pos_off), caps))
        rebuild(plans, self.archive, rotary, original)
        for layer, _, _ in plans:  # the per-slot statistics as saved, whole buffers
            prefix = f"{layer.index}.stat."
            layer.stats = {k[len(prefix):]: t.to(device) for k, t in tensors.items() if k.startswith(prefix)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], device, dtype) -> None:
        for i, layer in enumerate(self.layers):
            caps = tensors[f"{i}.caps"].tolist()
            heads = range(len(caps))
            prefix = f"{i}.stat."
            layer.load(caps, [tensors[f"{i}.{h}.keys"].to(device=device, dtype=dtype) for h in heads],
                       [tensors[f"{i}.{h}.values"].to(device=device, dtype=dtype) for h in heads],
                       [tensors[f"{i}.{h}.abs_pos"] for h in heads], tensors[f"{i}.pos_off"].tolist(),
                       {k[len(prefix):]: t.to(device) for k, t in tensors.items() if k.startswith(prefix)})
