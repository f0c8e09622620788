"""One layer of the KV cache: a flat buffer in which every KV head owns its own region of slots.

Head h owns rows ``[offs[h], offs[h] + caps[h])`` of ``keys``, ``values``, ``abs_pos`` (the absolute position of
the token each slot holds) and of every per-slot statistic; its first ``lens[h]`` rows are in use, in time order.
New tokens are written after the last used slot; ``keep()`` gathers the slots to keep to the front of each region
(re-rotating their keys in ``rerotate`` mode). The interface transformers calls is ``update``; the engine calls
``keep``, ``resize`` and reads ``positions()`` / ``keys_dense()``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .positions import Rotary


class RaggedKV:
    """Keys (or values) of one layer whose heads hold different numbers of positions: one [1, 1, n_h, d] per head."""

    __slots__ = ("heads",)

    def __init__(self, heads: list[torch.Tensor]):
        self.heads = heads


class KVLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner, index: int):
        super().__init__()
        self._owner = owner
        self.index = index
        self.lens: list[int] = []
        self.caps: list[int] = []
        self.offs: list[int] = []
        self.pos_off: list[int] = []  # rerotate mode: slot i of head h sits at position pos_off[h] + i
        self.stats: dict[str, torch.Tensor] = {}  # per-slot statistics, one float per slot (e.g. "acc")
        self.abs_pos: torch.Tensor | None = None

    # -- transformers' layer interface ------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[0] != 1:
            raise ValueError("kvchat sessions run one conversation per cache (batch size 1)")
        self.dtype, self.device = key_states.dtype, key_states.device
        heads = key_states.shape[1]
        self._dims = (key_states.shape[-1], value_states.shape[-1])
        self.lens = [0] * heads
        self.pos_off = [0] * heads  # a fresh cache: slot i holds position i
        self._allocate([self._owner.initial_capacity(key_states.shape[-2])] * heads)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if any(n + q > c for n, c in zip(self.lens, self.caps)):
            self.resize([self._owner.grown_capacity(n + q, c) for n, c in zip(self.lens, self.caps)])
        if self.uniform:
            n, cap = self.lens[0], self.caps[0]
            keys, values = self.keys.view(self.heads, cap, -1), self.values.view(self.heads, cap, -1)
            keys[:, n: n + q] = key_states[0]
            values[:, n: n + q] = value_states[0]
            self.appended(key_states, value_states)
            return keys[None, :, : n + q], values[None, :, : n + q]
        for h in range(self.heads):
            a = self.offs[h] + self.lens[h]
            self.keys[a: a + q] = key_states[0, h]
            self.values[a: a + q] = value_states[0, h]
        self.appended(key_states, value_states)
        return self.split()

    def appended(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """What ``update`` records besides writing the keys and values ([1, heads, q, dim]) after each head's last
        used slot: the archive's copy, the tokens' positions, zeroed statistics; then every head holds q more. The
        compiled decode step (core/decode) writes a token's key and value itself and calls this; the caller checked
        the room."""
        self.staged(key_states, value_states)
        self.claim(key_states.shape[-2])

    def staged(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The archive's copy of the keys and values ([1, heads, q, dim]) a forward appends to this layer."""
        if self._owner.archive is not None:
            self._owner.archive.stage(self.index, key_states, value_states)

    def claim(self, q: int) -> None:
        """The next q slots of every head taken for the tokens being appended: their positions recorded, their
        statistics zeroed, every head holding q more (the caller writes their keys and values, and ``staged`` them;
        the eager step's one-call layers claim the slot first, so that the call adds attention's sums to zeroed
        statistics)."""
        incoming = self._owner.incoming_abs
        if self.uniform:
            n = self.lens[0]
            self._slots(self.abs_pos, n, q).copy_(incoming)
            for t in self.stats.values():
                self._slots(t, n, q).zero_()
            self.lens = [n + q] * self.heads
            return
        for h in range(self.heads):
            a = self.offs[h] + self.lens[h]
            self.abs_pos[a: a + q] = incoming
            for t in self.stats.values():
                t[a: a + q] = 0
            self.lens[h] += q

    def free_slot(self) -> int | None:
        """The slot a one-token step writes in every head, when every head holds the same number of tokens in
        buffers of one capacity with room for one more (None otherwise: ``update`` starts, resizes or writes head by
        head). A caller that writes the token's key and value there itself records them with ``appended`` (or with
        ``claim`` before and ``staged`` after)."""
        lens, caps = self.lens, self.caps
        if not lens:
            return None
        n, cap = lens[0], caps[0]
        if n >= cap or lens.count(n) != len(lens) or caps.count(cap) != len(caps):
            return None
        return n

    def held_keys(self) -> torch.Tensor:
        """The keys of a layer whose heads hold equally many in buffers of one capacity, [1, heads, n, dim] (a view;
        what ``update`` returns)."""
        return self.keys.view(self.heads, self.caps[0], -1)[None, :, : self.lens[0]]

    def _slots(self, t: torch.Tensor, n: int, q: int) -> torch.Tensor:
        """Slots ``[n, n + q)`` of every head of a per-slot buffer (``abs_pos``, a statistic) whose heads all hold
        ``caps[0]`` slots, as [heads, q]: one view (``t.view(heads, cap)[:, n: n + q]`` takes three, and this runs
        for every layer at every token)."""
        step = t.stride(0)
        return t.as_strided((self.heads, q), (self.caps[0] * step, step), t.storage_offset() + n * step)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(self.lens, default=0) + query_length, 0

    def get_seq_length(self) -> int:
        return max(self.lens, default=0)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.lens = [0] * len(self.lens)

    # -- layout -----------------------------------------------------------------------------------------------
    @property
    def heads(self) -> int:
        return len(self.caps)

    @property
    def length(self) -> int:
        """Positions held by the fullest head."""
        return max(self.lens, default=0)

    @property
    def uniform(self) -> bool:
        return len(set(self.caps)) == 1 and len(set(self.lens)) == 1

    def _allocate(self, caps: list[int]) -> None:
        kdim, vdim = self._dims
        total = sum(caps)
        self.caps = list(caps)
        self.offs = [sum(caps[:h]) for h in range(len(caps))]
        # Zeros, not uninitialised memory: the compiled decode step (core/decode) attends over every slot with the
        # unused ones masked, and a masked probability times a NaN left in an unused value slot would still be NaN.
        self.keys = torch.zeros(total, kdim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(total, vdim, dtype=self.dtype, device=self.device)
        self.abs_pos = torch.empty(total, dtype=torch.int32, device=self.device)
        self.stats = {name: torch.zeros(total, dtype=t.dtype, device=self.device) for name, t in self.stats.items()}

    def resize(self, caps: list[int]) -> None:
        """Reallocate to exactly ``caps`` slots per head, keeping the current contents."""
        if any(c < n for c, n in zip(caps, self.lens)):
            raise ValueError(f"cannot shrink heads holding {self.lens} tokens to {caps} slots")
        if list(caps) == self.caps:
            return
        old = (self.keys, self.values, self.abs_pos, dict(self.stats), list(self.offs))
        self._allocate(caps)
        keys, values, abs_pos, stats, offs = old
        for h, n in enumerate(self.lens):
            src, dst = slice(offs[h], offs[h] + n), slice(self.offs[h], self.offs[h] + n)
            self.keys[dst] = keys[src]
            self.values[dst] = values[src]
            self.abs_pos[dst] = abs_pos[src]
            for name, t in stats.items():
                self.stats[name][dst] = t[src]

    def ensure_stat(self, name: str) -> torch.Tensor:
        """A per-slot float statistic (zeros for slots that held nothing yet)."""
        if name not in self.stats:
            self.stats[name] = torch.zeros(self.keys.shape[0], device=self.device)
        return self.stats[name]

    def split(self) -> tuple[RaggedKV, RaggedKV]:
        ks, vs = [], []
        for h in range(self.heads):
            a, n = self.offs[h], self.lens[h]
            ks.append(self.keys[a: a + n][None, None])
            vs.append(self.values[a: a + n][None, None])
        return RaggedKV(ks), RaggedKV(vs)

    def head_view(self, t: torch.Tensor, h: int) -> torch.Tensor:
        """Head h's used slots of a per-slot tensor (slots first)."""
        return t[self.offs[h]: self.offs[h] + self.lens[h]]

    def padded(self, t: torch.Tensor, fill=0) -> torch.Tensor:
        """A per-slot tensor ([slots, ...]) as [heads, max_len, ...], padding shorter heads with ``fill``."""
        if self.uniform:
            return t.view(self.heads, self.caps[0], *t.shape[1:])[:, : self.lens[0]]
        out = torch.full((self.heads, self.length, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
        for h in range(self.heads):
            out[h, : self.lens[h]] = self.head_view(t, h)
        return out

    def valid(self) -> torch.Tensor:
        """[heads, max_len] True where a head holds a position."""
        idx = torch.arange(self.length, device=self.device)[None, :]
        return idx < torch.tensor(self.lens, device=self.device)[:, None]

    def positions(self) -> torch.Tensor:
        """Absolute positions of the held tokens, [heads, max_len] (int64; -1 where a shorter head has none)."""
        return self.padded(self.abs_pos, fill=-1).long()

    def keys_dense(self) -> torch.Tensor:
        """Keys as [1, heads, max_len, dim] (zeros where a shorter head has none)."""
        return self.padded(self.keys)[None]

    def load(self, caps: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
             abs_pos: list[torch.Tensor], pos_off: list[int], stats: dict[str, torch.Tensor]) -> None:
        """Fill the layer from saved per-head keys, values and positions (a snapshot or an undo copy)."""
        self.dtype, self.device = keys[0].dtype, keys[0].device
        self._dims = (keys[0].shape[-1], values[0].shape[-1])
        self.stats = {}
        self.lens = [0] * len(caps)
        self._allocate(caps)
        self.is_initialized = True
        for h, (k, v, p) in enumerate(zip(keys, values, abs_pos)):
            dst = slice(self.offs[h], self.offs[h] + k.shape[0])
            self.keys[dst], self.values[dst] = k, v
            self.abs_pos[dst] = p.to(device=self.device, dtype=torch.int32)
            self.lens[h] = k.shape[0]
        self.pos_off = list(pos_off)
        self.stats = dict(stats)

    # -- compression ------------------------------------------------------------------------------------------
    def keep(self, index: list[torch.Tensor], rotary: Rotary | None = None, next_pos: int | None = None,
             caps: list[int] | None = None) -> None:
        """Keep, per head, the slots ``index[h]`` (ascending) and drop the rest; then set capacities ``caps``.

        With ``rotary`` the kept keys are rotated from their current position to their new one: head h's kept
        slots end right before ``next_pos`` (the position the next token will get in every layer).
        """
        caps = caps or self.caps
        kept = [int(i.numel()) for i in index]
        if self.uniform and len(set(kept)) == 1 and len(set(caps)) == 1 and caps == self.caps:
            self._keep_uniform(torch.stack(list(index)).to(self.device), rotary, next_pos)
            return
        gathered = []
        for h, idx in enumerate(index):
            src = idx.to(self.device) + self.offs[h]
            keys = self.keys[src]
            if rotary is not None:
                new_pos = next_pos - kept[h] + torch.arange(kept[h], device=self.device)
                keys = self._rotated(keys[None], self.abs_pos[src][None], new_pos[None],
                                     (self.pos_off[h] + idx.to(self.device))[None], rotary, [h])[0]
            gathered.append((keys, self.values[src], self.abs_pos[src],
                             {name: t[src] for name, t in self.stats.items()}))
        if caps != self.caps:
            self.lens = [0] * self.heads
            self._allocate(caps)
        for h, (keys, values, abs_pos, stats) in enumerate(gathered):
            dst = slice(self.offs[h], self.offs[h] + kept[h])
            self.keys[dst] = keys
            self.values[dst] = values
            self.abs_pos[dst] = abs_pos
            for name, t in stats.items():
                self.stats[name][dst] = t
        self.lens = kept
        if next_pos is not None:
            self.pos_off = [next_pos - k for k in kept]

    def _keep_uniform(self, index: torch.Tensor, rotary: Rotary | None, next_pos: int | None) -> None:
        """``keep`` for heads of equal capacity keeping equally many slots: one batched gather per tensor."""
        heads, k = index.shape
        cap = self.caps[0]
        keys = torch.gather(self.keys.view(heads, cap, -1), 1, index[:, :, None].expand(-1, -1, self.keys.shape[-1]))
        values = torch.gather(self.values.view(heads, cap, -1), 1,
                              index[:, :, None].expand(-1, -1, self.values.shape[-1]))
        abs_pos = self.abs_pos.view(heads, cap)
        kept_abs = torch.gather(abs_pos, 1, index)
        if rotary is not None:
            old_pos = index + torch.tensor(self.pos_off, device=self.device)[:, None]
            new_pos = next_pos - k + torch.arange(k, device=self.device)[None, :].expand(heads, -1)
            keys = self._rotated(keys, kept_abs, new_pos, old_pos, rotary)
        self.keys.view(heads, cap, -1)[:, :k] = keys
        self.values.view(heads, cap, -1)[:, :k] = values
        abs_pos[:, :k] = kept_abs
        for t in self.stats.values():
            view = t.view(heads, cap)
            view[:, :k] = torch.gather(view, 1, index)
        self.lens = [k] * heads
        if next_pos is not None:
            self.pos_off = [next_pos - k] * heads

    def start(self, dtype: torch.dtype, device, kdim: int, vdim: int) -> None:
        """Make an empty layer ready for ``fill`` (a cache rebuilt from the archive, before any forward)."""
        self.dtype, self.device, self._dims = dtype, device, (kdim, vdim)
        self.lens, self.caps, self.stats = [], [], {}
        self.is_initialized = True

    def fill(self, caps: list[int], keys: torch.Tensor | None, values: torch.Tensor | None, held: torch.Tensor,
             lens: list[int], pos_off: list[int], stats: dict[str, torch.Tensor]) -> None:
        """Hold, per head h, the first ``lens[h]`` rows of ``keys[h]``, ``values[h]`` ([heads, width, dim]),
        ``held[h]`` (absolute positions) and of each statistic ([heads, width]), head h's first slot at position
        ``pos_off[h]``; with ``caps`` slots per head (the buffers are reused when the capacities stay)."""
        if list(caps) != self.caps:
            self.lens = [0] * len(caps)
            self._allocate(caps)
        for name in stats:
            self.ensure_stat(name)
        if keys is not None:
            keys = keys.to(device=self.device, dtype=self.dtype)
            values = values.to(device=self.device, dtype=self.dtype)
        held = held.to(device=self.device, dtype=torch.int32)
        if len(set(self.caps)) == 1 and len(set(lens)) == 1:
            n, cap = lens[0], self.caps[0]
            if n:
                self.keys.view(self.heads, cap, -1)[:, :n] = keys[:, :n]
                self.values.view(self.heads, cap, -1)[:, :n] = values[:, :n]
                self.abs_pos.view(self.heads, cap)[:, :n] = held[:, :n]
                for name, t in stats.items():
                    self.stats[name].view(self.heads, cap)[:, :n] = t[:, :n]
        else:
            for h, n in enumerate(lens):
                dst = slice(self.offs[h], self.offs[h] + n)
                if n:
                    self.keys[dst], self.values[dst], self.abs_pos[dst] = keys[h, :n], values[h, :n], held[h, :n]
                    for name, t in stats.items():
                        self.stats[name][dst] = t[h, :n]
        self.lens = list(lens)
        self.pos_off = list(pos_off)

    def shift_positions(self, rotary: Rotary, to_original: bool) -> None:
        """Rotate every held key between its ``rerotate`` position and its absolute position."""
        for h in range(self.heads):
            a, n = self.offs[h], self.lens[h]
            slots = self.pos_off[h] + torch.arange(n, device=self.device)
            held = self.abs_pos[a: a + n].long()
            new, old = (held, slots) if to_original else (slots, held)
            self.keys[a: a + n] = self._rotated(self.keys[a: a + n][None], held[None], new[None], old[None],
                                                rotary, [h])[0]

    def _rotated(self, keys: torch.Tensor, held: torch.Tensor, new: torch.Tensor, old: torch.Tensor,
                 rotary: Rotary, heads: list[int] | None = None) -> torch.Tensor:
        """Keys [rows, n, dim] of absolute positions ``held`` (row r: head ``heads[r]``, by default r) moved from
        positions ``old`` to ``new`` (each [rows, n]): taken from the archive and rotated once from where they
        were computed, when the cache has one."""
        archive = self._owner.archive
        if archive is None:
            return rotary.rotate(keys, new - old)
        archived, _, computed = archive.keys_values(self.index, held.long(), heads)
        return rotary.rotate(archived, new.cpu().long() - computed.long()).to(device=self.device, dtype=self.dtype)

    @property
    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        tensors = [self.keys, self.values, self.abs_pos, *self.stats.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def kv_bytes(self) -> int:
        """Bytes of keys and values alone."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))
