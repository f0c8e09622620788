"""Recall's digests on disk, beside a conversation's archive: per sentence group ``digest.bin`` ([layers, heads,
reps, key dim] float16), ``coarse.bin`` ([coarse layers, heads, key dim] float16) and ``groups.bin`` (int32 start
and end position), appended as turns close, synced with the archive, truncated with it after a crash or an undo.
What a digest holds, and how it is computed and scored, is core/recall's."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .archive import fsync_dir

FILES = ("digest.bin", "coarse.bin", "groups.bin")


class DigestFiles:
    """Append-only group records in three files of fixed-size rows; ``layout`` (heads, key dim, scoring layers,
    reps, coarse layers) is known from ``digest.txt`` (heads, key dim and the scoring layers) and ``shape``, the
    engine's (reps, coarse layers) for those scoring layers."""

    def __init__(self, folder: Path, shape):
        self.folder = Path(folder)
        self._shape = shape
        self.count = 0  # groups written
        self.covered = 0  # positions digested (the end of the last group)
        self.layout: tuple[int, int, list[int], int, int] | None = None
        self._files = None
        if (self.folder / "digest.txt").is_file():
            heads, kdim, *layers = map(int, (self.folder / "digest.txt").read_text().split())
            self.layout = (heads, kdim, layers, *shape(layers))
            self.count = min(_size(self.folder / name) // size for name, size in zip(FILES, self.record_bytes))
            self._cut(self.count)  # a crash may have left one file a record ahead of the others
            if self.count:
                self.covered = int(self.spans()[-1, 1])

    def start(self, heads: int, kdim: int, layers: list[int]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.layout = (heads, kdim, list(layers), *self._shape(layers))
        (self.folder / "digest.txt").write_text(" ".join(map(str, [heads, kdim, *layers])) + "\n")
        fsync_dir(self.folder)

    @property
    def record_bytes(self) -> tuple[int, int, int]:
        """Bytes per group in each of ``FILES``."""
        heads, kdim, layers, reps, coarse = self.layout
        return len(layers) * heads * reps * kdim * 2, coarse * heads * kdim * 2, 8

    def append(self, digests: np.ndarray, coarse: np.ndarray, spans: np.ndarray) -> None:
        """Groups' digests [g, layers, heads, reps, kdim] and coarse keys [g, coarse layers, heads, kdim] (float16),
        and their [start, end) spans [g, 2]."""
        files = self._open()
        files[0].write(digests.astype(np.float16).tobytes())
        files[1].write(coarse.astype(np.float16).tobytes())
        files[2].write(spans.astype(np.int32).tobytes())
        self.count += spans.shape[0]
        self.covered = int(spans[-1, 1]) if spans.shape[0] else self.covered

    def _open(self):
        if self._files is None:
            self._files = tuple(open(self.folder / name, "ab") for name in FILES)
        return self._files

    def _flush(self) -> None:
        if self._files is not None:
            for f in self._files:
                f.flush()

    def spans(self) -> np.ndarray:
        """[count, 2] each group's start and end position."""
        self._flush()
        return np.fromfile(self.folder / "groups.bin", dtype=np.int32, count=2 * self.count).reshape(-1, 2)

    def digests(self) -> np.ndarray:
        """[count, layers, heads, reps, kdim] float16, a read-only memory map (only the rows read are read)."""
        self._flush()
        heads, kdim, layers, reps, _ = self.layout
        return np.memmap(self.folder / "digest.bin", dtype=np.float16, mode="r",
                         shape=(self.count, len(layers), heads, reps, kdim))

    def coarse(self) -> np.ndarray:
        """[count, coarse layers, heads, kdim] float16."""
        self._flush()
        heads, kdim, _, _, coarse = self.layout
        return np.fromfile(self.folder / "coarse.bin", dtype=np.float16,
                           count=self.count * coarse * heads * kdim).reshape(self.count, coarse, heads, kdim)

    def _cut(self, count: int) -> None:
        for name, size in zip(FILES, self.record_bytes):
            if _size(self.folder / name) > count * size:
                with open(self.folder / name, "r+b") as f:
                    f.truncate(count * size)

    def sync(self) -> None:
        if self._files is not None:
            for f in self._files:
                f.flush()
                os.fsync(f.fileno())

    def truncate(self, n: int) -> int:
        """Forget the groups that end after position ``n``; returns how many groups are left."""
        if not self.count:
            return 0
        spans = self.spans()
        self.close()
        keep = int(np.searchsorted(spans[:, 1], n, side="right"))
        self._cut(keep)
        self.count = keep
        self.covered = int(spans[keep - 1, 1]) if keep else 0
        return keep

    def close(self) -> None:
        if self._files is not None:
            for f in self._files:
                f.close()
            self._files = None

    def delete(self) -> None:
        self.close()
        for name in (*FILES, "digest.txt"):
            (self.folder / name).unlink(missing_ok=True)

    @property
    def nbytes(self) -> int:
        return sum(_size(self.folder / name) for name in FILES)


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0
