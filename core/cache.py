"""The KV cache: one preallocated buffer per layer, compacted in place when positions are evicted.

A ``KVLayer`` holds keys and values as ``[1, heads, capacity, head_dim]`` plus, for every slot, the absolute
position of the token it holds (per head, so per-head selections can be represented). Slots are kept in time
order. New tokens are written after the last slot; ``keep()`` gathers the slots to keep to the front (re-rotating
their keys when positions are re-rotated). Capacity is fixed at budget + slack for bounded policies, so nothing
is reallocated while decoding; the unbounded ``full`` policy grows it by doubling. ``nbytes`` is what is
allocated, not an estimate.

``KVCache`` is a transformers ``Cache`` whose layers are ``KVLayer``s, so any model that accepts
``past_key_values`` runs on it unmodified.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .positions import Rotary


class CacheFullError(RuntimeError):
    """Raised when a token would be written past the cache's fixed capacity (an engine bug, not user input)."""


class KVLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "KVCache"):
        super().__init__()
        self._owner = owner
        self.length = 0
        self.capacity = 0
        self.abs_pos: torch.Tensor | None = None  # [heads, capacity] int32: absolute position held by each slot

    # -- transformers' layer interface ------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[0] != 1:
            raise ValueError("kvchat sessions run one conversation per cache (batch size 1)")
        self.dtype, self.device = key_states.dtype, key_states.device
        self._shape = (key_states.shape[1], key_states.shape[-1], value_states.shape[-1])
        self._allocate(self._owner.initial_capacity(key_states.shape[-2]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.length, key_states.shape[-2]
        if n + q > self.capacity:
            self.resize(self._owner.grown_capacity(n + q))
        self.keys[:, :, n : n + q] = key_states
        self.values[:, :, n : n + q] = value_states
        self.abs_pos[:, n : n + q] = self._owner.incoming_abs
        self.length = n + q
        return self.keys[:, :, : n + q], self.values[:, :, : n + q]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0

    # -- kvchat's interface -----------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        heads, kdim, vdim = self._shape
        self.keys = torch.empty(1, heads, capacity, kdim, dtype=self.dtype, device=self.device)
        self.values = torch.empty(1, heads, capacity, vdim, dtype=self.dtype, device=self.device)
        self.abs_pos = torch.empty(heads, capacity, dtype=torch.int32, device=self.device)
        self.capacity = capacity

    def resize(self, capacity: int) -> None:
        """Reallocate to exactly ``capacity`` slots, keeping the current contents."""
        if capacity < self.length:
            raise ValueError(f"cannot shrink a layer holding {self.length} tokens to {capacity} slots")
        if capacity == self.capacity:
            return
        old = (self.keys, self.values, self.abs_pos, self.length)
        self._allocate(capacity)
        keys, values, abs_pos, n = old
        self.keys[:, :, :n] = keys[:, :, :n]
        self.values[:, :, :n] = values[:, :, :n]
        self.abs_pos[:, :n] = abs_pos[:, :n]

    @property
    def heads(self) -> int:
        return self._shape[0]

    def positions(self) -> torch.Tensor:
        """Absolute positions of the held tokens, [heads, length] (int64)."""
        return self.abs_pos[:, : self.length].long()

    def keep(self, index: torch.Tensor, rotary: Rotary | None = None) -> None:
        """Keep the slots ``index`` ([heads, k] or [k], ascending per head), dropping the rest.

        With ``rotary``, the kept keys are rotated from their current position (their slot) to their new slot,
        so they sit at contiguous positions 0..k-1.
        """
        heads = self.heads
        if index.dim() == 1:
            index = index.expand(heads, -1)
        index = index.to(self.device)
        k = index.shape[-1]
        kidx = index[None, :, :, None]
        keys = torch.gather(self.keys[:, :, : self.length], 2, kidx.expand(1, heads, k, self.keys.shape[-1]))
        values = torch.gather(self.values[:, :, : self.length], 2, kidx.expand(1, heads, k, self.values.shape[-1]))
        abs_pos = torch.gather(self.abs_pos[:, : self.length], 1, index)
        if rotary is not None:
            delta = torch.arange(k, device=self.device)[None, :] - index
            keys = rotary.rotate(keys, delta)
        self.keys[:, :, :k] = keys
        self.values[:, :, :k] = values
        self.abs_pos[:, :k] = abs_pos
        self.length = k

    def shift_positions(self, rotary: Rotary, delta: torch.Tensor) -> None:
        """Rotate every held key by ``delta`` [heads, length] positions (used when the position mode changes)."""
        self.keys[:, :, : self.length] = rotary.rotate(self.keys[:, :, : self.length], delta)

    @property
    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.abs_pos))


class KVCache(Cache):
    """A transformers Cache of ``KVLayer``s with a capacity the engine controls.

    ``capacity`` is the fixed number of slots per layer (budget + slack) or None for a cache that grows
    (by doubling, up to ``max_capacity``). Before each forward the engine sets ``incoming_abs``, the absolute
    positions of the tokens about to be written.
    """

    def __init__(self, num_layers: int, capacity: int | None, max_capacity: int):
        self.capacity = capacity
        self.max_capacity = max_capacity
        self.incoming_abs: torch.Tensor | None = None
        super().__init__(layers=[KVLayer(self) for _ in range(num_layers)])

    def initial_capacity(self, needed: int) -> int:
        if self.capacity is not None:
            return self.capacity
        return min(max(256, needed), self.max_capacity)

    def grown_capacity(self, needed: int) -> int:
        if self.capacity is not None or needed > self.max_capacity:
            raise CacheFullError(f"{needed} tokens do not fit the cache's {self.capacity or self.max_capacity} slots")
        cap = max(256, self.layers[0].capacity)
        while cap < needed:
            cap *= 2
        return min(cap, self.max_capacity)

    def set_capacity(self, capacity: int | None) -> None:
        """Fix (or free, with None) the number of slots; the layers are reallocated to it now."""
        self.capacity = capacity
        for layer in self.layers:
            if layer.is_initialized:
                layer.resize(capacity if capacity is not None else max(layer.length, 256))

    @property
    def length(self) -> int:
        """Cached positions per layer (the largest layer when layers differ)."""
        return max((layer.length for layer in self.layers), default=0)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    # -- snapshots --------------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, layer in enumerate(self.layers):
            if layer.is_initialized:
                n = layer.length
                out[f"{i}.keys"] = layer.keys[:, :, :n].contiguous()
                out[f"{i}.values"] = layer.values[:, :, :n].contiguous()
                out[f"{i}.abs_pos"] = layer.abs_pos[:, :n].contiguous()
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], device, dtype) -> None:
        for i, layer in enumerate(self.layers):
            keys = tensors[f"{i}.keys"].to(device=device, dtype=dtype)
            values = tensors[f"{i}.values"].to(device=device, dtype=dtype)
            abs_pos = tensors[f"{i}.abs_pos"].to(device=device, dtype=torch.int32)
            n = keys.shape[-2]
            layer.dtype, layer.device = dtype, device
            layer._shape = (keys.shape[1], keys.shape[-1], values.shape[-1])
            layer._allocate(self.capacity if self.capacity is not None else max(256, n))
            layer.is_initialized = True
            layer.keys[:, :, :n] = keys
            layer.values[:, :, :n] = values
            layer.abs_pos[:, :n] = abs_pos
            layer.length = n
