"""Digests: what recall scores a sentence group by.

For a few scoring layers spread through the model's depth and for every KV head, a group's digest is the ``REPS``
keys of the group with the largest norm among its tokens that are not template scaffolding, un-rotated to position
0 so that relevance does not depend on where the group sat; a coarse key (the first of them, in three of the
layers) lets a first pass over many groups pick the candidates. Digests are computed when a turn closes from the
archive's keys and kept on disk beside it (storage/digests.py); a conversation with recall off keeps them too, so
recall switched on later reaches the whole chat.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...storage.digests import DigestFiles
from .score import COARSE_DTYPE, coarse_index, scoring_layers

REPS = 4  # representative keys per group, layer and KV head
BLOCK = 8192  # positions digested at a time


def _shape(layers: list[int]) -> tuple[int, int]:
    """(reps, coarse layers) of a digest over ``layers``."""
    return REPS, len(coarse_index(layers))


class Digests:
    """The digests of a conversation's sentence groups (on disk: ``DigestFiles``), with the coarse keys kept in
    memory once recall has read them and, per group, whether it holds more than scaffolding."""

    def __init__(self, folder: Path, num_layers: int):
        self.files = DigestFiles(folder, _shape)
        self.folder = self.files.folder
        self.layers = self.files.layout[2] if self.files.layout else scoring_layers(num_layers)
        #: The coarse keys in memory once recall has read them ([coarse layers, heads, capacity, key dim] in
        #: ``COARSE_DTYPE``; rows below ``count`` valid), kept current as groups are added: the coarse pass reads
        #: them every message.
        self._coarse: torch.Tensor | None = None
        self._content = torch.zeros(0, dtype=torch.bool)  # per group, whether it holds more than scaffolding

    @property
    def count(self) -> int:
        return self.files.count

    @property
    def covered(self) -> int:
        return self.files.covered

    @property
    def layout(self) -> tuple[int, int] | None:
        """(KV heads, key dim) once the first group is written."""
        return self.files.layout[:2] if self.files.layout else None

    def add(self, archive, log, scaffolding: torch.Tensor, rotary) -> int:
        """Digest the groups of the token log ``log`` not digested yet (its end ends a group); returns how many.
        ``scaffolding``: the template's token ids, which no group is represented by while it has other tokens. A
        long stretch (a conversation from before digests, reopened) goes a block of whole groups at a time."""
        n, start = log.n, self.covered
        if n <= start or archive.layout is None:
            return 0
        sentence = log.column("sentence", start)
        content = ~torch.isin(log.column("token", start).long(), scaffolding)
        done = 0
        while n - self.covered > BLOCK:
            ids = sentence[self.covered - start: self.covered - start + BLOCK + 1]
            cut = int((ids[1:] != ids[:-1]).nonzero().max()) + 1 if (ids[1:] != ids[:-1]).any() else BLOCK
            done += self._add(archive, sentence[self.covered - start:], content[self.covered - start:],
                              self.covered + cut, rotary)
        return done + self._add(archive, sentence[self.covered - start:], content[self.covered - start:], n, rotary)

    def _add(self, archive, sentence: torch.Tensor, content: torch.Tensor, n: int, rotary) -> int:
        """Digest positions ``covered .. n`` (``sentence``, ``content``: theirs, from ``covered`` on). A group's
        representative keys are its content tokens' (the template's role headers and end markers draw attention
        from any message, whatever it asks)."""
        heads, kdim = archive.layout[0], archive.layout[1]
        if self.files.layout is None:
            self.files.start(heads, kdim, self.layers)
        covered = self.covered
        _, counts = torch.unique_consecutive(sentence[: n - covered], return_counts=True)
        ends = covered + torch.cumsum(counts, 0)
        starts = ends - counts
        positions = torch.arange(covered, n)[None].expand(heads, -1)
        keys = []
        for li in self.layers:
            k, _, computed = archive.keys_values(li, positions)
            k = k.float()
            keys.append(rotary.rotate(k, -computed.long()) if rotary is not None else k)
        keys = torch.stack(keys)  # [layers, heads, m, kdim]
        norms = keys.norm(dim=-1)
        out = torch.empty(len(counts), len(self.layers), heads, REPS, kdim)
        for g, (a, c) in enumerate(zip((starts - covered).tolist(), counts.tolist())):
            own = torch.arange(a, a + c)
            if content[a: a + c].any():  # scaffolding only where the group has nothing else
                own = own[content[a: a + c]]
            top = own[norms[..., own].topk(min(REPS, own.numel()), -1).indices]  # [layers, heads, <= REPS]
            top = torch.cat([top, top[..., :1].expand(-1, -1, REPS - top.shape[-1])], -1)
            out[g] = torch.gather(keys, 2, top[..., None].expand(-1, -1, -1, kdim))
        coarse = out[:, coarse_index(self.layers), :, 0].half().contiguous()  # [groups, coarse layers, heads, kdim]
        if self._coarse is not None:
            self._keep_coarse(coarse.permute(1, 2, 0, 3))
        self.files.append(out.half().numpy(), coarse.numpy(), torch.stack([starts, ends], 1).numpy())
        return len(counts)

    def read(self) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        """Group spans [groups, 2] (start, end), digests [groups, layers, heads, REPS, kdim] (float16, a read-only
        memory map: only the rows scored are read) and the coarse keys [3, heads, groups, kdim] (float16, from
        memory after the first read)."""
        if not self.count:
            return torch.zeros(0, 2, dtype=torch.long), np.zeros((0,), np.float16), torch.zeros(0)
        heads, kdim = self.layout
        if self._coarse is None:
            coarse = torch.from_numpy(self.files.coarse())
            self._coarse = torch.zeros(coarse.shape[1], heads, 0, kdim, dtype=COARSE_DTYPE)
            self._keep_coarse(coarse.permute(1, 2, 0, 3), at=0)
        return torch.from_numpy(self.files.spans()).long(), self.files.digests(), self._coarse[:, :, : self.count]

    def has_content(self, spans: torch.Tensor, log, scaffolding: torch.Tensor) -> torch.Tensor:
        """[groups] whether each group (``spans``, as ``read`` gives them) holds a token that is not template
        scaffolding (``scaffolding``: token ids; ``log``: the token log). Kept in memory: each call looks only at
        the groups added since the last."""
        known = self._content[: spans.shape[0]]
        if known.numel() < spans.shape[0]:
            start = int(spans[known.numel(), 0])
            content = ~torch.isin(log.column("token", start).long(), scaffolding)
            total = torch.cat([torch.zeros(1, dtype=torch.long), content.long().cumsum(0)])
            new = spans[known.numel():] - start
            known = torch.cat([known, total[new[:, 1]] > total[new[:, 0]]])
        self._content = known
        return known

    def _keep_coarse(self, rows: torch.Tensor, at: int | None = None) -> None:
        """Write ``rows`` ([coarse layers, heads, n, kdim]) after the first ``at`` (default: ``count``) rows of the
        coarse keys in memory, growing them by doubling."""
        at = self.count if at is None else at
        end = at + rows.shape[2]
        if end > self._coarse.shape[2]:
            grown = self._coarse.new_zeros(*self._coarse.shape[:2], max(end, 2 * self._coarse.shape[2], 256),
                                           self._coarse.shape[3])
            grown[:, :, :at] = self._coarse[:, :, :at]
            self._coarse = grown
        self._coarse[:, :, at: end] = rows.to(self._coarse.dtype)

    def sync(self) -> None:
        self.files.sync()

    def truncate(self, n: int) -> None:
        """Forget the groups that end after position ``n``."""
        keep = self.files.truncate(n)
        self._content = self._content[:keep]

    def close(self) -> None:
        self.files.close()

    def delete(self) -> None:
        self.files.delete()
        self._coarse = None
        self._content = self._content[:0]
