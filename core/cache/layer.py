"""One layer of the KV cache: a flat buffer in which every KV head owns its own region of slots.

Head h owns rows ``[offs[h], offs[h] + caps[h])`` of every per-slot tensor; its first ``lens[h]`` rows are in use,
in time order. Per slot:

* ``keys`` (at the slot's position: what attention reads) and ``values``;
* ``k0``: the key as it was computed (rotated to the position it was computed at), for models with RoPE. Every
  re-rotation starts from it (``keep``, ``shift_positions``), so a kept key is rotated once from where it was
  computed, however many compressions it lives through: it equals the key computed at its new position (tested);
* ``abs_pos`` (the token's absolute position in the conversation), ``computed`` (where its key was computed) and
  ``rows`` (where the storage keeps its computed key and value, storage/kvrows.py; -1 until the turn commits);
* the policy's statistics (``stats``, e.g. H2O's "acc").

New tokens are written after the last used slot (``claim``, then the keys and values); ``keep()`` gathers the
slots to keep to the front of each region (``slab.move``, which moves every layer of a slab at once, does it for a
compression). The interface transformers calls is ``update``; the engine calls ``resize`` and reads ``positions()`` /
``keys_dense()``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from . import slab as slabs
from .positions import Rotary

#: The per-slot tensors besides the statistics, with their dtypes (None: the model's).
SLOT_TENSORS = {"keys": None, "values": None, "k0": None, "abs_pos": torch.int32, "computed": torch.int32,
                "rows": torch.int64}


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
        self.abs_pos = self.computed = self.rows = self.k0 = None
        self.version = 0  # counts new buffers (``adopt``, a new statistic): a graph captured over them is stale
        self.slab = None  # the slab (core/cache/slab.py) the per-slot tensors are views of, once allocated

    # -- transformers' layer interface ------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[0] != 1:
            raise ValueError("kvchat sessions run one conversation per cache (batch size 1)")
        self.start(key_states.dtype, key_states.device, key_states.shape[-1], value_states.shape[-1])
        self.lens = [0] * key_states.shape[1]
        self.pos_off = [0] * key_states.shape[1]  # a fresh cache: slot i holds position i
        caps = [self._owner.initial_capacity(key_states.shape[-2])] * key_states.shape[1]
        first = self._owner.first_buffers(self, caps)  # a slab shared with the layers after it, where alike
        if first is None:
            self._allocate(caps)
        else:
            shared, place = first
            self.adopt(caps, shared.views(place, sum(caps)), shared)

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
        used slot: the tokens' positions, zeroed statistics, the computed keys; then every head holds q more. The
        compiled decode step (core/decode) writes a token's key and value itself and calls this; the caller checked
        the room."""
        self.claim(key_states.shape[-2])
        self.staged(key_states)

    def claim(self, q: int) -> None:
        """The next q slots of every head taken for the tokens being appended: their absolute positions and the
        positions their keys are computed at recorded, no storage row yet, statistics zeroed, every head holding q
        more (the caller writes their keys and values, and ``staged`` the keys; the eager step's one-call layers
        claim the slot first, so that the call adds attention's sums to zeroed statistics)."""
        incoming, at = self._owner.incoming_abs, self._owner.incoming_pos
        at = incoming if at is None else at  # a cache fed by hand (tests): computed where it sits
        if self.uniform:
            n = self.lens[0]
            self._slots(self.abs_pos, n, q).copy_(incoming)
            self._slots(self.computed, n, q).copy_(at)
            self._slots(self.rows, n, q).fill_(-1)
            for t in self.stats.values():
                self._slots(t, n, q).zero_()
            self.lens = [n + q] * self.heads
            return
        for h in range(self.heads):
            a = self.offs[h] + self.lens[h]
            self.abs_pos[a: a + q], self.computed[a: a + q], self.rows[a: a + q] = incoming, at, -1
            for t in self.stats.values():
                t[a: a + q] = 0
            self.lens[h] += q

    def staged(self, key_states: torch.Tensor) -> None:
        """The computed keys ([1, heads, q, dim]) of the q slots each head claimed last, kept as ``k0``."""
        if self.k0 is None:
            return
        q = key_states.shape[-2]
        if self.uniform:
            n, cap = self.lens[0] - q, self.caps[0]
            self.k0.view(self.heads, cap, -1)[:, n: n + q] = key_states[0]
            return
        for h in range(self.heads):
            a = self.offs[h] + self.lens[h] - q
            self.k0[a: a + q] = key_states[0, h]

    def advanced(self, q: int) -> None:
        """Every head holds q more: a step that wrote the tokens' slots itself (keys, values, computed keys,
        positions, zeroed statistics, no storage row: core/decode/graph.py) counts them."""
        self.lens = [n + q for n in self.lens]

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
    def uniform_caps(self) -> bool:
        """Whether every head has the same capacity (its buffers then view as [heads, capacity, dim])."""
        return len(set(self.caps)) == 1

    @property
    def uniform(self) -> bool:
        return len(set(self.caps)) == 1 and len(set(self.lens)) == 1

    def per_slot(self) -> dict[str, torch.Tensor]:
        """Every per-slot tensor of the layer by name (``SLOT_TENSORS`` the layer has, then ``stat.<name>``)."""
        out = {name: getattr(self, name) for name in SLOT_TENSORS if getattr(self, name) is not None}
        out.update({f"stat.{name}": t for name, t in self.stats.items()})
        return out

    def _allocate(self, caps: list[int]) -> None:
        """New buffers of ``caps`` slots per head: a slab of this layer alone."""
        slab = slabs.Slab([caps], self.slot_spec(), self.device)
        self.adopt(caps, slab.views(0, sum(caps)), slab)

    def slot_spec(self) -> dict[str, tuple]:
        """The layer's per-slot tensors as a slab allocates them: name -> (dtype, row shape, empty value). Zeros, not
        uninitialised memory: the compiled decode step (core/decode) attends over every slot with the unused ones
        masked, and a masked probability times a NaN left in an unused value slot would still be NaN."""
        kdim, vdim = self._dims
        spec = {"keys": (self.dtype, (kdim,), 0), "values": (self.dtype, (vdim,), 0), "k0": (self.dtype, (kdim,), 0),
                "abs_pos": (torch.int32, (), 0), "computed": (torch.int32, (), 0), "rows": (torch.int64, (), -1)}
        if not self._owner.keeps_computed:
            del spec["k0"]
        spec = {name: spec[name] for name in SLOT_TENSORS if name in spec}  # ``per_slot``'s order
        spec.update({f"stat.{name}": (t.dtype, (), 0) for name, t in self.stats.items()})
        return spec

    def adopt(self, caps: list[int], buffers: dict[str, torch.Tensor], slab=None) -> None:
        """Hold the per-slot tensors ``buffers`` (named as ``per_slot`` names them) of ``caps`` slots per head, views of
        ``slab``'s if given: new buffers, so a graph captured over the old ones is stale."""
        self.version += 1
        self.caps, self.offs = list(caps), [sum(caps[:h]) for h in range(len(caps))]
        for name in SLOT_TENSORS:
            setattr(self, name, buffers.get(name))
        self.stats = {name[5:]: t for name, t in buffers.items() if name.startswith("stat.")}
        self.slab = slab

    def resize(self, caps: list[int]) -> None:
        """Reallocate to exactly ``caps`` slots per head, keeping the current contents."""
        if any(c < n for c, n in zip(caps, self.lens)):
            raise ValueError(f"cannot shrink heads holding {self.lens} tokens to {caps} slots")
        if list(caps) != self.caps:
            slabs.move([self], [self.held_slots()], [self.lens], caps=[caps])

    def held_slots(self) -> torch.Tensor:
        """[heads, the longest head's length]: each head's slots in order (a ``keep`` of everything held)."""
        return torch.arange(self.length, device=self.device)[None, :].expand(self.heads, -1)

    def ensure_stat(self, name: str) -> torch.Tensor:
        """A per-slot float statistic (zeros for slots that held nothing yet)."""
        if name not in self.stats or self.stats[name].numel() != self.keys.shape[0]:
            # in the layer's slab, beside the other layers' (a compression moves them together)
            self.stats[name], self.version = self.slab.stat(self, name), self.version + 1
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

    def load(self, caps: list[int], tensors: list[dict[str, torch.Tensor]], pos_off: list[int]) -> None:
        """Fill the layer from saved per-head slot tensors (``tensors[h]``: name -> [n_h, ...], as ``per_slot``
        names them; an undo copy). Buffers of the same capacities, dtype and statistics are written in place (the
        graph step's capture over them stays valid), else allocated anew."""
        first = tensors[0]["keys"]
        stats = {name[5:]: t.dtype for name, t in tensors[0].items() if name.startswith("stat.")}
        same = (self.is_initialized and list(caps) == self.caps and self.keys is not None and
                self.keys.dtype == first.dtype and self.keys.device == first.device and
                self._dims == (first.shape[-1], tensors[0]["values"].shape[-1]) and
                {n: t.dtype for n, t in self.stats.items()} == stats and (self.k0 is not None) == ("k0" in tensors[0]))
        if not same:
            self.start(first.dtype, first.device, first.shape[-1], tensors[0]["values"].shape[-1])
            self.stats = {name: torch.zeros(0, dtype=dtype) for name, dtype in stats.items()}
            self.lens = [0] * len(caps)
            self._allocate(caps)
        slots = self.per_slot()
        for h, saved in enumerate(tensors):
            n = saved["keys"].shape[0]
            for name, t in saved.items():
                if name in slots:
                    slots[name][self.offs[h]: self.offs[h] + n] = t
        self.lens = [saved["keys"].shape[0] for saved in tensors]
        self.pos_off = list(pos_off)

    # -- compression ------------------------------------------------------------------------------------------
    def keep(self, index: list[torch.Tensor], rotary: Rotary | None = None, next_pos: int | None = None,
             caps: list[int] | None = None) -> None:
        """Keep, per head, the slots ``index[h]`` in that order and drop the rest; then set capacities ``caps``.

        With ``rotary`` each kept key is the computed one rotated once to its new position: head h's kept slots end
        right before ``next_pos`` (the position the next token will get in every layer).
        """
        padded = torch.nn.utils.rnn.pad_sequence([i.to(self.device) for i in index], batch_first=True)
        slabs.move([self], [padded], [[int(i.numel()) for i in index]], rotary, next_pos, [caps or self.caps])

    def _rotated(self, taken: dict[str, torch.Tensor], target: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """The keys of slots ``taken`` (their per-slot tensors, gathered) at positions ``target``: each computed key
        rotated once, from where it was computed."""
        if taken.get("k0") is None:
            raise RuntimeError("a cache that rotates keys keeps their computed keys (KVCache(keeps_computed=True))")
        return rotary.rotate(taken["k0"], target - taken["computed"].long())

    def start(self, dtype: torch.dtype, device, kdim: int, vdim: int) -> None:
        """Make an empty layer ready for ``fill`` or the first ``update``."""
        self.dtype, self.device, self._dims = dtype, device, (kdim, vdim)
        self.lens, self.caps, self.stats = [], [], {}
        self.is_initialized = True

    def fill(self, caps: list[int], tensors: dict[str, torch.Tensor], lens: list[int], pos_off: list[int]) -> None:
        """Hold, per head h, the first ``lens[h]`` rows of each of ``tensors`` (name -> [heads, width, ...], as
        ``per_slot`` names them), head h's first slot at position ``pos_off[h]``, with ``caps`` slots per head
        (the buffers are reused when the capacities stay)."""
        for name in tensors:
            if name.startswith("stat."):
                self.stats.setdefault(name[5:], torch.zeros(0, device=self.device))
        if list(caps) != self.caps:
            self.lens = [0] * len(caps)
            self._allocate(caps)
        for name in tensors:
            if name.startswith("stat."):
                self.ensure_stat(name[5:])
        slots = self.per_slot()
        for h, n in enumerate(lens):
            dst = slice(self.offs[h], self.offs[h] + n)
            for name, t in tensors.items():
                if name in slots and n:
                    slots[name][dst] = t[h, :n].to(device=self.device, dtype=slots[name].dtype)
        self.lens = list(lens)
        self.pos_off = list(pos_off)

    def shift_positions(self, rotary: Rotary, to_original: bool) -> None:
        """Rotate every held key to its absolute position (``to_original``) or to its slot's ``rerotate`` position,
        from its computed key."""
        for h in range(self.heads):
            a, n = self.offs[h], self.lens[h]
            target = self.abs_pos[a: a + n].long() if to_original else \
                self.pos_off[h] + torch.arange(n, device=self.device)
            taken = {name: t[a: a + n] for name, t in self.per_slot().items()}
            self.keys[a: a + n] = self._rotated(taken, target, rotary)

    @property
    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in self.per_slot().values())

    @property
    def kv_bytes(self) -> int:
        """Bytes of keys and values alone."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))
