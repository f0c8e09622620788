"""Conversations stored by kvchat before the bounded storage (its archive kept every token's KV forever): read
once, when such a conversation is reopened, to rebuild its cache and its recall digests; the files go once the
first turn in the new form commits (core/engine/persist.py).

The old archive: ``kv.bin`` (per position ``[layers, KV heads, key dim + value dim]`` in the model's dtype),
``pos.bin`` (int32, the position each was computed at), ``layout.txt`` (heads, key dim, value dim, dtype); its
digests ``digest.bin`` ([scoring layers, heads, reps, key dim] float16 per group), ``coarse.bin`` and
``groups.bin`` (int32 start and end) with ``digest.txt`` (heads, key dim, scoring layers).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .files import size

FILES = ("kv.bin", "pos.bin", "layout.txt", "digest.bin", "coarse.bin", "groups.bin", "digest.txt")
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


class LegacyArchive:
    """An old archive, read-only: ``read`` by absolute position."""

    def __init__(self, folder: Path, num_layers: int):
        self.folder = Path(folder)
        self.num_layers = num_layers
        heads, kdim, vdim, dtype = (self.folder / "layout.txt").read_text().split()
        self.layout = (int(heads), int(kdim), int(vdim), getattr(torch, dtype))
        record = num_layers * self.layout[0] * (self.layout[1] + self.layout[2]) * \
            torch.empty(0, dtype=self.layout[3]).element_size()
        self.n = min(size(self.folder / "pos.bin") // 4, size(self.folder / "kv.bin") // record)

    @staticmethod
    def present(folder: Path) -> bool:
        return (Path(folder) / "layout.txt").is_file() and (Path(folder) / "kv.bin").is_file()

    def read(self, layer: int, positions: torch.Tensor, heads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """For ``positions`` [rows, n] (row r: KV head ``heads[r]``): the computed keys and values as one
        [rows, n, key dim + value dim] tensor, and the positions they were computed at [rows, n]."""
        h, kdim, vdim, dtype = self.layout
        kv = np.memmap(self.folder / "kv.bin", dtype=_NUMPY[dtype], mode="r",
                       shape=(self.n, self.num_layers, h, kdim + vdim))
        pos = np.memmap(self.folder / "pos.bin", dtype=np.int32, mode="r", shape=(self.n,))
        at = positions.cpu().long().numpy()
        rows = torch.from_numpy(np.array(kv[at, layer, np.asarray(heads)[:, None]]))
        if dtype == torch.bfloat16:
            rows = rows.view(torch.bfloat16)
        return rows, torch.from_numpy(np.array(pos[at]))

    def digests(self) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
        """The old digests: spans [groups, 2], representative keys [groups, layers, heads, reps, key dim] float16
        and the scoring layers; None when there are none."""
        if not (self.folder / "digest.txt").is_file():
            return None
        heads, kdim, *layers = map(int, (self.folder / "digest.txt").read_text().split())
        reps = 4
        per = len(layers) * heads * reps * kdim * 2
        count = min(size(self.folder / "digest.bin") // per, size(self.folder / "groups.bin") // 8)
        spans = np.fromfile(self.folder / "groups.bin", dtype=np.int32, count=2 * count).reshape(-1, 2)
        reps_keys = np.fromfile(self.folder / "digest.bin", dtype=np.float16,
                                count=count * per // 2).reshape(count, len(layers), heads, reps, kdim)
        return spans, reps_keys, layers

    def delete(self) -> None:
        for name in FILES:
            (self.folder / name).unlink(missing_ok=True)
