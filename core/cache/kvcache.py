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

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache

from . import slab
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

    def __init__(self, num_layers: int, capacity: int | None, max_capacity: int, keeps_computed: bool = False):
        self.capacity = capacity
        self.max_capacity = max_capacity
        self.incoming_abs: torch.Tensor | None = None
        self.incoming_pos: torch.Tensor | None = None  # the positions the incoming tokens' keys are computed at
        #: Whether each slot keeps its key as computed (``KVLayer.k0``): models with RoPE, whose kept keys are
        #: re-rotated from it.
        self.keeps_computed = keeps_computed
        #: Called with the cache and the number of tokens fed (no slot holds a later position) before a compression
        #: drops any slot (recall's digests take the keys they need).
        self.on_compress: list = []
        # the slab the next layers' first buffers come from, the index of its first layer, their capacities and spec
        self._first: tuple[slab.Slab, int, list[int], dict] | None = None
        super().__init__(layers=[KVLayer(self, i) for i in range(num_layers)])

    def initial_capacity(self, needed: int) -> int:
        if self.capacity is not None:
            return self.capacity
        return min(max(256, needed), self.max_capacity)

    def first_buffers(self, layer: KVLayer, caps: list[int]) -> tuple[slab.Slab, int] | None:
        """The slab a layer's first buffers are views of where the capacity is fixed, and the layer's place in it: one
        allocated for it and the layers after it (as many as ``slab.SLAB_BYTES`` holds; a model's layers are alike),
        so that compressions move them together from the first, in place. None where the layer allocates its own (a
        growing cache)."""
        if self.capacity is None:
            return None
        spec = layer.slot_spec()
        if self._first is not None:
            first, start, first_caps, first_spec = self._first
            place = layer.index - start
            if 0 <= place < len(first.starts) and (first_caps, first_spec) == (caps, spec) \
                    and first.bases["keys"].device == layer.device:
                if place == len(first.starts) - 1:
                    self._first = None  # the last layer it was made for: the layers' views hold it from now on
                return first, place
        size = sum(caps) * slab.slot_bytes(spec)
        count = max(1, min(len(self.layers) - layer.index, slab.SLAB_BYTES // max(1, size)))
        self._first = slab.Slab([list(caps)] * count, spec, layer.device), layer.index, list(caps), spec
        return self.first_buffers(layer, caps)

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
        layers = [layer for layer in self.layers if layer.is_initialized]
        # A head holding more than the new capacity (a larger per-layer or per-head budget before) keeps its slots;
        # the next step then has no room and compresses it to the new budget.
        caps = [[max(capacity, n) if capacity is not None else max(n, 256) for n in layer.lens] for layer in layers]
        if any(c != layer.caps for c, layer in zip(caps, layers)):
            slab.move(layers, [layer.held_slots() for layer in layers], [layer.lens for layer in layers], caps=caps,
                      stack=True)

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

    # -- reading the newest tokens again ----------------------------------------------------------------------
    def newest_shared(self, most: int) -> torch.Tensor:
        """The absolute positions (ascending, int64, on the host) of the newest tokens that every head of every layer
        holds as its last slots, in one order: at most ``most``, none in an empty cache."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        n = min([most] + [min(layer.lens) for layer in layers]) if layers else 0
        if n <= 0:
            return torch.zeros(0, dtype=torch.long)
        tails = torch.cat([layer.abs_pos.index_select(0, _last(layer, n)).view(-1, n).cpu() for layer in layers])
        same = (tails == tails[:1]).all(0)
        k = n if bool(same.all()) else n - 1 - int(torch.nonzero(~same)[-1])
        return tails[0, n - k:].long()

    @contextmanager
    def rewound(self, k: int):
        """Every head's last ``k`` slots given back for a forward that writes the same tokens there again (to observe
        their queries), then put back as they were, bit for bit: keys, values, positions, rows on disk, statistics
        and lengths (a statistic that forward started stays)."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        slots = [_last(layer, k) for layer in layers]
        saved = [({name: t.index_select(0, idx) for name, t in layer.per_slot().items()}, list(layer.lens))
                 for layer, idx in zip(layers, slots)]
        for layer in layers:
            layer.lens = [n - k for n in layer.lens]
        try:
            yield
        finally:
            for layer, idx, (tensors, lens) in zip(layers, slots, saved):
                now = layer.per_slot()
                for name, t in tensors.items():
                    now[name].index_copy_(0, idx, t)
                layer.lens = lens

    def restart_stat(self, name: str) -> None:
        """Statistic ``name`` dropped from every layer: the next forward that keeps it starts it at zeros."""
        for layer in self.layers:
            if layer.stats.pop(name, None) is not None:
                layer.version += 1  # a graph captured over it is stale

    def fill_stat(self, name: str, value: float, last: int | None = None) -> None:
        """Per-slot statistic ``name`` set to ``value`` in every layer: in every slot, or in each head's ``last``."""
        for layer in self.layers:
            if layer.is_initialized:
                stat = layer.ensure_stat(name)
                if last is None:
                    stat.fill_(value)
                elif last > 0:
                    stat.index_fill_(0, _last(layer, last), value)

    # -- snapshots --------------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every used slot's tensors, per layer and head (``{layer}.{head}.{name}``), with each layer's capacities
        and offsets: an in-memory copy (the undo checkpoint, core/engine/checkpoint.py)."""
        out = {}
        for i, layer in enumerate(self.layers):
            if not layer.is_initialized:
                continue
            for h in range(layer.heads):
                for name, t in layer.per_slot().items():
                    out[f"{i}.{h}.{name}"] = layer.head_view(t, h).contiguous()
            out[f"{i}.pos_off"] = torch.tensor(layer.pos_off)
            out[f"{i}.caps"] = torch.tensor(layer.caps)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for i, layer in enumerate(self.layers):
            if f"{i}.caps" not in tensors:
                continue
            caps = tensors[f"{i}.caps"].tolist()
            per_head = [{name.split(".", 2)[2]: t for name, t in tensors.items() if name.startswith(f"{i}.{h}.")}
                        for h in range(len(caps))]
            layer.load(caps, per_head, tensors[f"{i}.pos_off"].tolist())
        self.gather_slabs()

    #: What the durable state keeps of each slot (``slot_state``); keys and values are in the storage's rows.
    SLOT_STATE = ("abs_pos", "computed", "rows")

    def slot_state(self) -> dict[str, torch.Tensor]:
        """Which positions each (layer, head) holds, where each key was computed, the storage row of each slot's
        computed key and value (storage/kvrows.py), the per-slot statistics, and each layer's capacities and
        offsets: with the rows, everything needed to rebuild the cache exactly (``load_slot_state``)."""
        out = {}
        layers = [(i, layer) for i, layer in enumerate(self.layers) if layer.is_initialized]
        names = [*self.SLOT_STATE, *(f"stat.{n}" for layer in self.layers if layer.is_initialized for n in layer.stats)]
        for (i, layer), host in zip(layers, slab.on_host([layer for _, layer in layers], set(names))):
            for h in range(layer.heads):
                for name, t in host.items():
                    out[f"{i}.{h}.{name}"] = layer.head_view(t, h).clone()
            out[f"{i}.pos_off"] = torch.tensor(layer.pos_off)
            out[f"{i}.caps"] = torch.tensor(layer.caps)
        return out

    def load_slot_state(self, tensors: dict[str, torch.Tensor], read, rotary, original: bool, device,
                        dtype: torch.dtype, dims: tuple[int, int]) -> None:
        """Rebuild the layers from ``slot_state()``: each slot's computed key and value read from the storage
        (``read(layer, rows) -> [heads, width, key dim + value dim]`` for the slots' rows [heads, width], padded with
        row 0), the key rotated once from where it was computed to its slot's position (its absolute one in
        ``original`` mode), as a compression does."""
        kdim, vdim = dims
        for i, layer in enumerate(self.layers):
            if f"{i}.caps" not in tensors:
                continue
            caps, pos_off = tensors[f"{i}.caps"].tolist(), tensors[f"{i}.pos_off"].tolist()
            heads = range(len(caps))
            lens = [int(tensors[f"{i}.{h}.abs_pos"].numel()) for h in heads]
            width = max(lens, default=0)
            names = sorted({k.split(".", 2)[2] for k in tensors if k.startswith(f"{i}.0.")})

            def padded(name: str, h: int) -> torch.Tensor:
                t = tensors[f"{i}.{h}.{name}"]
                return torch.nn.functional.pad(t, (0, width - t.numel()))

            fields = {name: torch.stack([padded(name, h) for h in heads]) for name in names}
            data = read(i, fields["rows"])
            # on the device, where the live cache rotated them: a GPU's cos and sin may differ from the CPU's in the
            # last bit, and the reopened keys are to be the live ones bit for bit
            fields = {name: t.to(device) for name, t in fields.items()}
            fields["k0"], fields["values"] = data[..., :kdim].to(device), data[..., kdim:].to(device)
            if rotary is None:
                fields["keys"] = fields["k0"]
            else:
                target = fields["abs_pos"].long() if original else \
                    (torch.tensor(pos_off)[:, None] + torch.arange(width)[None, :]).to(device)
                fields["keys"] = rotary.rotate(fields["k0"], target - fields["computed"].long())
            layer.start(dtype, device, kdim, vdim)
            layer.fill(caps, fields, lens, pos_off)
        self.gather_slabs()

    def gather_slabs(self) -> None:
        """Layers filled one by one (a reopened conversation, an undo to other capacities), each in a slab of its
        own, moved with their slots into the slabs a compression moves at once; nothing where they are in them."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        if layers and not slab.in_slabs(layers):
            slab.move(layers, [layer.held_slots() for layer in layers], [layer.lens for layer in layers], stack=True)

    def rows_named(self) -> torch.Tensor:
        """The storage rows every used slot names (-1 for slots not written yet), one flat CPU tensor."""
        named = [layer.head_view(layer.rows, h) for layer in self.layers if layer.is_initialized
                 for h in range(layer.heads)]
        return torch.cat(named).cpu() if named else torch.zeros(0, dtype=torch.int64)


def _last(layer: KVLayer, k: int) -> torch.Tensor:
    """The flat slot indices of each head's last ``k`` held slots ([heads * k], head by head, oldest first)."""
    ends = torch.tensor(layer.offs) + torch.tensor(layer.lens)
    return (ends[:, None] - k + torch.arange(k)[None, :]).flatten().to(layer.device)
