"""The KV a conversation's cache holds, on disk: what exact resume needs, and nothing the cache no longer holds.

``rows.bin`` is a file of fixed-size rows: each the key of one (layer, KV head, position) as it was computed (rotated
to the position it was computed at) and its value, ``key dim + value dim`` numbers in the model's dtype. Which row
holds what is the cache's business: each cache slot carries its row, saved with the turn's state
(storage/statefile.py). Rows are written when a turn commits, for the slots that have none yet (the turn's tokens
still held, recalled text), into rows that neither the last committed state nor the undo copy names
(``allocate``), so a crash at any moment leaves every row the last committed state names as it was. Rows no one
names any more are reused, and a free tail is cut off (``shrink``): the file stays about as large as the cache plus
one turn, however long the chat.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .files import fsync_dir, fsync_file, size as _size

_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


class RowFile:
    FILE, LAYOUT = "rows.bin", "rows.txt"

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.layout: tuple[int, int, torch.dtype] | None = None  # key dim, value dim, dtype
        self.rows = 0  # rows the file holds (named or free)
        if (self.folder / self.LAYOUT).is_file():
            kdim, vdim, dtype = (self.folder / self.LAYOUT).read_text().split()
            self.layout = (int(kdim), int(vdim), getattr(torch, dtype))
            self.rows = _size(self.path) // self.row_bytes

    @property
    def path(self) -> Path:
        return self.folder / self.FILE

    def start(self, kdim: int, vdim: int, dtype: torch.dtype) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.layout = (kdim, vdim, dtype)
        (self.folder / self.LAYOUT).write_text(f"{kdim} {vdim} {str(dtype).removeprefix('torch.')}\n")
        fsync_dir(self.folder)

    @property
    def width(self) -> int:
        return self.layout[0] + self.layout[1]

    @property
    def row_bytes(self) -> int:
        return self.width * torch.empty(0, dtype=self.layout[2]).element_size()

    @staticmethod
    def allocate(count: int, rows: int, named: np.ndarray) -> np.ndarray:
        """``count`` rows to write to: the lowest of the file's ``rows`` that are not ``named`` (by a committed
        state or an undo copy, or by the cache itself), then new ones after the file's end."""
        taken = np.zeros(rows, dtype=bool)
        named = named[(named >= 0) & (named < rows)]
        taken[named] = True
        free = np.flatnonzero(~taken)[:count]
        return np.concatenate([free, np.arange(rows, rows + count - free.size)]).astype(np.int64)

    def write(self, at: np.ndarray, data: torch.Tensor) -> None:
        """Rows ``at`` ([m]) := ``data`` ([m, key dim + value dim], the model's dtype); ``sync`` makes them durable."""
        if not at.size:
            return
        end = int(at.max()) + 1
        if end > self.rows:
            with open(self.path, "ab") as f:
                f.truncate(end * self.row_bytes)
            self.rows = end
        table = self._map("r+")
        table[at] = _numpy(data.detach().to(device="cpu", dtype=self.layout[2]).contiguous())
        table.flush()
        del table

    def read(self, at: np.ndarray) -> torch.Tensor:
        """Rows ``at`` as [m, key dim + value dim] in the model's dtype."""
        if not at.size:
            return torch.zeros(0, self.width, dtype=self.layout[2])
        out = torch.from_numpy(np.array(self._map("r")[at]))
        return out.view(torch.bfloat16) if self.layout[2] == torch.bfloat16 else out

    def _map(self, mode: str) -> np.memmap:
        return np.memmap(self.path, dtype=_NUMPY[self.layout[2]], mode=mode, shape=(self.rows, self.width))

    def sync(self) -> None:
        if self.path.is_file():
            fsync_file(self.path)

    def shrink(self, named: np.ndarray) -> None:
        """Cut off the rows after the last one ``named``."""
        end = int(named.max()) + 1 if named.size else 0
        if end < self.rows:
            with open(self.path, "r+b") as f:
                f.truncate(end * self.row_bytes)
            self.rows = end

    def delete(self) -> None:
        for name in (self.FILE, self.LAYOUT):
            (self.folder / name).unlink(missing_ok=True)
        self.rows = 0

    @property
    def nbytes(self) -> int:
        return _size(self.path)


def _numpy(t: torch.Tensor) -> np.ndarray:
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()

