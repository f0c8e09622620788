"""The archive: every token's keys and values as the model first computed them, by absolute position, on disk.

One append-only file per conversation (``kv.bin``): for each position a record of ``[layers, KV heads, key dim +
value dim]`` in the model's dtype, and beside it (``pos.bin``, int32) the position each token was computed at.
Nothing that leaves the cache is lost: the archive keeps it.

It is also what makes the cache reproducible. Every key the cache holds is the archived key rotated once, from
the position it was computed at to the position its slot has now (core/cache/rebuild.py): compressions and position
mode switches take kept keys from here instead of rotating the live ones again, so the cache after any turn is a
pure function of the archive and of which positions each (layer, head) keeps. Restoring that list (core/engine/persist.py)
restores the cache bit for bit.

Writes go to the OS as tokens are fed; ``sync`` makes them durable (fsync) when a turn commits, and ``truncate``
drops what a crash or an undo left past the last committed token.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch


_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


class Archive:
    def __init__(self, folder: Path, num_layers: int):
        self.folder = Path(folder)
        self.num_layers = num_layers
        self.n = 0  # positions written
        self.layout: tuple[int, int, int, torch.dtype] | None = None  # heads, key dim, value dim, dtype
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._files = None
        self._map: torch.Tensor | None = None  # the records, over a memory map (``_tensors``)
        self._pos_map: torch.Tensor | None = None
        #: Recall's digests kept beside it (core/recall/digest.py), synced, truncated and deleted with it; set by
        #: the engine (None: none).
        self.digests = None
        if (self.folder / "layout.txt").is_file():
            heads, kdim, vdim, dtype = (self.folder / "layout.txt").read_text().split()
            self.layout = (int(heads), int(kdim), int(vdim), getattr(torch, dtype))
            # Whole records only: a crash may have cut a write short (``truncate`` drops the rest).
            sizes = [_size(self.folder / "pos.bin") // 4, _size(self.folder / "kv.bin") // self._record_bytes()]
            self.n = min(sizes)

    # -- writing ----------------------------------------------------------------------------------------------------
    def stage(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Layer ``layer``'s new keys and values ([1, heads, q, dim]) of the forward in progress."""
        self._staged[layer] = (keys, values)

    def append(self, computed_at: torch.Tensor) -> None:
        """Write the staged tokens of the forward that just ran (``computed_at``: the positions they got)."""
        if not self._staged:
            return
        if len(self._staged) != self.num_layers:
            raise RuntimeError(f"archive: {len(self._staged)} of {self.num_layers} layers staged")
        keys, values = self._staged[0]
        if self.layout is None:
            self._start(keys.shape[1], keys.shape[-1], values.shape[-1], keys.dtype)
        # [q, layers, heads, kdim + vdim]
        block = torch.stack([torch.cat([k[0], v[0]], dim=-1) for k, v in (self._staged[i]
                                                                        for i in range(self.num_layers))])
        block = block.permute(2, 0, 1, 3).contiguous().cpu()
        self._staged.clear()
        kv, pos = self._open()
        kv.write(_bytes(block))
        pos.write(computed_at.to(torch.int32).cpu().numpy().tobytes())
        self.n += block.shape[0]

    def _start(self, heads: int, kdim: int, vdim: int, dtype: torch.dtype) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.layout = (heads, kdim, vdim, dtype)
        (self.folder / "layout.txt").write_text(f"{heads} {kdim} {vdim} {str(dtype).removeprefix('torch.')}\n")
        fsync_dir(self.folder)

    def _open(self):
        if self._files is None:
            self._files = (open(self.folder / "kv.bin", "ab"), open(self.folder / "pos.bin", "ab"))
        return self._files

    def sync(self) -> None:
        """Make every written position (and digest) durable."""
        if self._files is not None:
            for f in self._files:
                f.flush()
                os.fsync(f.fileno())
        if self.digests is not None:
            self.digests.sync()

    def truncate(self, n: int) -> None:
        """Forget positions ``n`` and later (an undone turn, or what a crash left uncommitted)."""
        self._staged.clear()
        if self.digests is not None:
            self.digests.truncate(n)
        if self.layout is None:
            return
        self.close()
        record = self._record_bytes()
        for name, size in (("kv.bin", n * record), ("pos.bin", n * 4)):
            path = self.folder / name
            if _size(path) > size:
                with open(path, "r+b") as f:
                    f.truncate(size)
        self.n = min(n, self.n)

    def close(self) -> None:
        if self._files is not None:
            for f in self._files:
                f.close()
            self._files = None
        self._map = self._pos_map = None
        if self.digests is not None:
            self.digests.close()

    # -- reading ----------------------------------------------------------------------------------------------------
    def _record_bytes(self) -> int:
        heads, kdim, vdim, dtype = self.layout
        return self.num_layers * heads * (kdim + vdim) * torch.empty(0, dtype=dtype).element_size()

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The archive as tensors over its memory map: records [n, layers, heads, key dim + value dim] (the model's
        dtype) and the positions they were computed at [n] (int32). Reads touch only the rows they index."""
        if self._map is None or self._map.shape[0] < self.n:
            if self._files is not None:
                for f in self._files:
                    f.flush()
            heads, kdim, vdim, dtype = self.layout
            # copy-on-write maps: writable, so torch takes them without a copy; nothing ever writes to them
            kv = np.memmap(self.folder / "kv.bin", dtype=_NUMPY[dtype], mode="c",
                           shape=(self.n, self.num_layers, heads, kdim + vdim))
            pos = np.memmap(self.folder / "pos.bin", dtype=np.int32, mode="c", shape=(self.n,))
            self._map, self._pos_map = torch.from_numpy(kv), torch.from_numpy(pos)
            if dtype == torch.bfloat16:
                self._map = self._map.view(torch.bfloat16)
        return self._map, self._pos_map

    def read(self, layers: list[int], positions: torch.Tensor, heads: list[int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For ``positions`` [len(layers), rows, n] (absolute; row r holds KV head ``heads[r]``'s, by default head
        r): the archived keys and values [len(layers), rows, n, dim] of those layers and the positions they were
        computed at [len(layers), rows, n]. One gather, whatever the number of layers."""
        kv, pos = self._tensors()
        n, num_layers, num_heads, dims = kv.shape
        kdim = self.layout[1]
        rows = positions.shape[1]
        positions = positions.cpu().long()
        layer = torch.as_tensor(layers, dtype=torch.long)[:, None, None]
        head = (torch.arange(rows) if heads is None else torch.as_tensor(heads, dtype=torch.long))[None, :, None]
        # one row index per (layer, head, position) into the records seen as [n * layers * heads, dims]: a gather
        # of whole key (and value) vectors, not of single elements
        flat = ((positions * num_layers + layer) * num_heads + head).reshape(-1)
        table = kv.view(-1, dims)
        keys = table[:, :kdim].index_select(0, flat).view(*positions.shape, kdim)
        values = table[:, kdim:].index_select(0, flat).view(*positions.shape, dims - kdim)
        return keys, values, pos[positions]

    def keys_values(self, layer: int, positions: torch.Tensor, heads: list[int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For ``positions`` [rows, n] (absolute; row r holds KV head ``heads[r]``'s, by default head r): the
        archived keys and values [rows, n, dim] and the positions they were computed at [rows, n]."""
        k, v, computed = self.read([layer], positions[None], heads)
        return k[0], v[0], computed[0]

    def delete(self) -> None:
        self.close()
        if self.digests is not None:
            self.digests.delete()
        for name in ("kv.bin", "pos.bin", "layout.txt"):
            (self.folder / name).unlink(missing_ok=True)
        try:
            self.folder.rmdir()
        except OSError:
            pass

    @property
    def nbytes(self) -> int:
        """Bytes on disk."""
        return self.n * (self._record_bytes() + 4) if self.layout is not None else 0


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _bytes(t: torch.Tensor) -> bytes:
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    return t.numpy().tobytes()


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
