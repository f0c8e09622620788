"""Recall's archive on disk: one fixed-size record per sentence group (its span and its digest, core/recall/digest.py),
in segment files of ``segment`` records each (``digests/000000.bin``, ...), capped.

Records are appended when a turn closes. The store keeps the groups ``[first, end)``: when the files pass the cap,
the oldest whole segments are forgotten (``forget``): they leave the live window at once and their files are deleted
by ``drop_forgotten`` once the turn that forgot them has committed and can no longer be undone, so a crash before
that reopens the window the last committed turn names (it is saved with the turn's state, storage/statefile.py)
with every file it needs, and an undo finds the window before the turn whole. What a record holds is the engine's
(``fields``: name, numpy dtype, shape), written once in ``digests/layout.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .files import fsync_dir, fsync_file, size as _size

FOLDER = "digests"


class DigestStore:
    def __init__(self, folder: Path):
        self.folder = Path(folder) / FOLDER
        self.dtype: np.dtype | None = None
        self.segment = 0  # records per segment file
        self.first = self.end = 0  # the live groups: [first, end), by their index since the conversation began
        self.meta: dict = {}  # what the engine wrote with the layout
        self._maps: dict[int, np.memmap] = {}
        self._dirty: set[int] = set()  # segments written since the last ``sync``
        if (self.folder / "layout.json").is_file():
            layout = json.loads((self.folder / "layout.json").read_text())
            self.dtype = np.dtype([(name, dt, tuple(shape)) for name, dt, shape in layout["fields"]])
            self.segment = layout["segment"]
            self.meta = layout.get("meta", {})
            found = sorted(int(p.stem) for p in self.folder.glob("*.bin"))
            if found:
                self.first = found[0] * self.segment
                last = found[-1]
                self.end = last * self.segment + _size(self._path(last)) // self.dtype.itemsize

    def start(self, fields: list[tuple[str, str, tuple]], segment: int, meta: dict | None = None) -> None:
        """The records' fields (name, numpy dtype, shape), ``segment`` records per file, and what else the engine
        wants kept with them (``meta``)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype([(name, dt, tuple(shape)) for name, dt, shape in fields])
        self.segment, self.meta = segment, dict(meta or {})
        (self.folder / "layout.json").write_text(json.dumps({"fields": [[n, d, list(s)] for n, d, s in fields],
                                                             "segment": segment, "meta": self.meta}))
        fsync_dir(self.folder)
        fsync_dir(self.folder.parent)

    @property
    def count(self) -> int:
        return self.end - self.first

    @property
    def record_bytes(self) -> int:
        return self.dtype.itemsize if self.dtype is not None else 0

    def _path(self, seg: int) -> Path:
        return self.folder / f"{seg:06d}.bin"

    def append(self, records: np.ndarray) -> None:
        """Write ``records`` (of ``dtype``) after the last; ``sync`` makes them durable."""
        i = 0
        while i < len(records):
            seg, at = divmod(self.end, self.segment)
            take = min(len(records) - i, self.segment - at)
            with open(self._path(seg), "ab") as f:
                if f.tell() != at * self.record_bytes:
                    f.truncate(at * self.record_bytes)
                    f.seek(at * self.record_bytes)
                f.write(records[i: i + take].tobytes())
            self._maps.pop(seg, None)
            self._dirty.add(seg)
            self.end += take
            i += take

    def sync(self) -> None:
        """Make every record appended since the last sync durable (and the files they went to)."""
        for seg in sorted(self._dirty):
            if self._path(seg).is_file():
                fsync_file(self._path(seg))
        if self._dirty:
            fsync_dir(self.folder)
        self._dirty.clear()

    def _map(self, seg: int) -> np.memmap:
        m = self._maps.get(seg)
        n = _size(self._path(seg)) // self.record_bytes
        if m is None or m.shape[0] != n:
            m = self._maps[seg] = np.memmap(self._path(seg), dtype=self.dtype, mode="r", shape=(n,))
        return m

    def field(self, name: str, index: np.ndarray | None = None) -> np.ndarray:
        """Field ``name`` of the live records (or of those at live positions ``index``), in order: a segment's
        records at a time, each read once (all of them: a slice of each segment)."""
        shape, base = self.dtype[name].shape, self.dtype[name].base
        if index is None:
            out, at = np.empty((self.count, *shape), dtype=base), 0
            for seg in range(self.first // self.segment, -(-self.end // self.segment)) if self.count else ():
                lo, hi = max(self.first, seg * self.segment), min(self.end, (seg + 1) * self.segment)
                out[at: at + hi - lo] = self._map(seg)[name][lo - seg * self.segment: hi - seg * self.segment]
                at += hi - lo
            return out
        index = np.asarray(index, dtype=np.int64) + self.first
        out = np.empty((len(index), *shape), dtype=base)
        segs = index // self.segment
        order = np.argsort(segs, kind="stable")  # the positions of each segment's records, segment by segment
        cuts = np.flatnonzero(np.diff(segs[order])) + 1
        for rows in np.split(order, cuts) if len(order) else ():
            seg = int(segs[rows[0]])
            out[rows] = self._map(seg)[name][index[rows] - seg * self.segment]
        return out

    def forget(self, cap_bytes: int) -> bool:
        """Leave the oldest whole segments out of the live window while the live ones pass ``cap_bytes`` (the
        newest segment always stays); whether any were."""
        before = self.first
        while self.first // self.segment < (self.end - 1) // self.segment and \
                self._live_bytes() > cap_bytes:
            self.first = (self.first // self.segment + 1) * self.segment
        return self.first != before

    def _live_bytes(self) -> int:
        return (self.count + self.first % self.segment) * self.record_bytes

    def drop_forgotten(self, keep: int | None = None) -> None:
        """Delete the segment files wholly before the live window (once the state that forgot them committed), or
        wholly before group ``keep`` where an earlier window still names them (an undo copy's: ``rewind`` to it)."""
        first = self.first if keep is None else min(self.first, keep)
        for p in self.folder.glob("*.bin"):
            if int(p.stem) < first // self.segment:
                p.unlink(missing_ok=True)
                self._maps.pop(int(p.stem), None)

    def rewind(self, first: int, end: int) -> None:
        """The live window back to ``[first, end)`` (an undone turn), in memory: records after ``end`` stay in the
        files until the next ``append`` writes over them or a reopening cuts them (``restore``); segments dropped
        already stay dropped."""
        self._maps.clear()
        found = [int(p.stem) for p in self.folder.glob("*.bin")] if self.folder.is_dir() else []
        self.first = max(first, min(found, default=0) * self.segment)
        self.end = max(end, self.first)

    def restore(self, first: int, end: int) -> None:
        """Back to the window ``[first, end)`` a committed state names, on disk too: records after ``end`` cut off
        (what a crash left), segments wholly before ``first`` deleted (forgotten by a turn that committed)."""
        if self.dtype is None:
            return
        self.rewind(first, end)
        for p in self.folder.glob("*.bin"):
            seg = int(p.stem)
            keep = min(max(self.end - seg * self.segment, 0), self.segment)
            if keep == 0 or (seg + 1) * self.segment <= self.first:
                p.unlink()
            elif _size(p) > keep * self.record_bytes:
                with open(p, "r+b") as f:
                    f.truncate(keep * self.record_bytes)

    def delete(self) -> None:
        self._maps.clear()
        if self.folder.is_dir():
            for p in self.folder.iterdir():
                p.unlink(missing_ok=True)
            self.folder.rmdir()
        self.first = self.end = 0
        self.dtype = None

    @property
    def nbytes(self) -> int:
        return sum(_size(p) for p in self.folder.glob("*.bin")) if self.folder.is_dir() else 0

