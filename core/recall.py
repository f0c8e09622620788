"""Recall: evicted text comes back when a new user message needs it.

Every sentence group ever fed has a *digest* on disk beside the archive (``Digests``): for a few scoring layers
spread through the model's depth and for every KV head, the ``REPS`` keys of the group with the largest norm among
its tokens that are not template scaffolding, un-rotated to position 0 so that relevance does not depend on where
the group sat. When a user message has been fed, its queries in those layers (``QueryTap``, un-rotated the same way,
scaffolding rows left out) score every group with the model's own
attention (``relevance``): per layer, each query's softmax over the groups' representative keys; a group's score is
the largest share any query (and query head) gives it, averaged over the scoring layers. The best groups the cache
has (mostly) evicted are chosen (``choose``) and ``compress.compress(..., bring=...)`` puts them back into every
layer and head, displacing the running policy's lowest-scored tokens: kept and recalled keys alike are the archived
keys rotated once to their place in conversation order, so the cache stays a pure function of the archive and its
slot state (and resumes exactly). They are protected while the message is read again and through the reply's first
compression (``bring_back``); then the running policy keeps them as long as it scores them high enough.

Digests are written when a turn closes, synced and truncated with the archive; a conversation with recall off keeps
them too, so recall switched on later reaches the whole chat.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

REPS = 4  # representative keys per group, layer and KV head
SCORING_LAYERS = 8  # layers whose queries and keys score relevance
QUERY_ROWS = 64  # the latest query rows of a user message kept for scoring
CANDIDATES = 512  # past this many groups, a coarse pass (one key per group, a few layers) picks the ones scored
COARSE_ROWS = 24  # query rows (spread evenly over the message) the coarse pass uses; the full pass uses all
HELD_QUANTILE = 0.9  # a recalled group must outscore this share of the groups the cache holds
BLOCK = 8192  # positions digested at a time


def _native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16): there the scoring's products ran 1.7-6x faster than
    fp32 on this project's machine."""
    return getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()


#: The dtype the coarse keys are kept in memory and multiplied in: bf16 where the CPU has native bf16 products (the
#: coarse pass only picks candidates), else fp16 (half the memory, multiplied in fp32).
COARSE_DTYPE = torch.bfloat16 if _native_bf16() else torch.float16
#: The dtype the full pass multiplies the candidates' digests in: bf16 where native (the shares it gives are within
#: ~1e-3 of fp32's; for 64 query rows and 512 candidates the pass took 8.5 ms, 14.5 in fp32), else fp32.
FULL_DTYPE = torch.bfloat16 if _native_bf16() else torch.float32


def scoring_layers(num_layers: int) -> list[int]:
    """Up to ``SCORING_LAYERS`` layers evenly spread over the middle of the network (its first and last fifth
    attend mostly locally or to the output)."""
    lo, hi = num_layers // 5, max(num_layers // 5, num_layers - 1 - num_layers // 5)
    return sorted({round(x) for x in np.linspace(lo, hi, min(SCORING_LAYERS, hi - lo + 1))})


def coarse_index(layers: list[int]) -> list[int]:
    """Which scoring layers the coarse pass reads: three spread over them."""
    return sorted({round(x) for x in np.linspace(0, len(layers) - 1, min(3, len(layers)))})


class Digests:
    """Append-only digests of sentence groups: ``digest.bin`` ([layers, heads, REPS, key dim] float16 per group),
    ``coarse.bin`` (the largest-norm key of a few of those layers, [3, heads, key dim] float16 per group) and
    ``groups.bin`` (int32 start and end position per group)."""

    FILES = ("digest.bin", "coarse.bin", "groups.bin")

    def __init__(self, folder: Path, num_layers: int):
        self.folder = Path(folder)
        self.layers = scoring_layers(num_layers)
        self.count = 0  # groups written
        self.covered = 0  # positions digested (the end of the last group)
        self.layout: tuple[int, int] | None = None  # heads, key dim
        self._files = None
        #: The coarse keys in memory once recall has read them ([coarse layers, heads, capacity, key dim] in
        #: ``COARSE_DTYPE``; rows below ``count`` valid), kept current as groups are added: the coarse pass reads
        #: them every message.
        self._coarse: torch.Tensor | None = None
        self._content = torch.zeros(0, dtype=torch.bool)  # per group, whether it holds more than scaffolding
        if (self.folder / "digest.txt").is_file():
            heads, kdim, *layers = map(int, (self.folder / "digest.txt").read_text().split())
            self.layout, self.layers = (heads, kdim), layers
            self.count = min(_size(self.folder / name) // size for name, size in zip(self.FILES, self._records))
            self._cut(self.count)  # a crash may have left one file a record ahead of the others
            if self.count:
                self.covered = int(np.fromfile(self.folder / "groups.bin", dtype=np.int32,
                                               count=2 * self.count)[-1])

    @property
    def _records(self) -> tuple[int, int, int]:
        """Bytes per group in each of ``FILES``."""
        heads, kdim = self.layout
        return (len(self.layers) * heads * REPS * kdim * 2, len(coarse_index(self.layers)) * heads * kdim * 2, 8)

    def _cut(self, count: int) -> None:
        for name, size in zip(self.FILES, self._records):
            if _size(self.folder / name) > count * size:
                with open(self.folder / name, "r+b") as f:
                    f.truncate(count * size)

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
        if self.layout is None:
            from .archive import fsync_dir

            self.folder.mkdir(parents=True, exist_ok=True)
            self.layout = (heads, kdim)
            (self.folder / "digest.txt").write_text(" ".join(map(str, [heads, kdim, *self.layers])) + "\n")
            fsync_dir(self.folder)
        _, counts = torch.unique_consecutive(sentence[: n - self.covered], return_counts=True)
        ends = self.covered + torch.cumsum(counts, 0)
        starts = ends - counts
        positions = torch.arange(self.covered, n)[None].expand(heads, -1)
        keys = []
        for li in self.layers:
            k, _, computed = archive.keys_values(li, positions)
            k = k.float()
            keys.append(rotary.rotate(k, -computed.long()) if rotary is not None else k)
        keys = torch.stack(keys)  # [layers, heads, m, kdim]
        norms = keys.norm(dim=-1)
        out = torch.empty(len(counts), len(self.layers), heads, REPS, kdim)
        for g, (a, c) in enumerate(zip((starts - self.covered).tolist(), counts.tolist())):
            own = torch.arange(a, a + c)
            if content[a: a + c].any():  # scaffolding only where the group has nothing else
                own = own[content[a: a + c]]
            top = own[norms[..., own].topk(min(REPS, own.numel()), -1).indices]  # [layers, heads, <= REPS]
            top = torch.cat([top, top[..., :1].expand(-1, -1, REPS - top.shape[-1])], -1)
            out[g] = torch.gather(keys, 2, top[..., None].expand(-1, -1, -1, kdim))
        files = self._open()
        coarse = out[:, coarse_index(self.layers), :, 0].half().contiguous()  # [groups, coarse layers, heads, kdim]
        files[0].write(out.half().numpy().tobytes())
        files[1].write(coarse.numpy().tobytes())
        if self._coarse is not None:
            self._keep_coarse(coarse.permute(1, 2, 0, 3))
        files[2].write(torch.stack([starts, ends], 1).to(torch.int32).numpy().tobytes())
        self.count += len(counts)
        self.covered = n
        return len(counts)

    def _open(self):
        if self._files is None:
            self._files = tuple(open(self.folder / name, "ab") for name in self.FILES)
        return self._files

    def read(self) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        """Group spans [groups, 2] (start, end), digests [groups, layers, heads, REPS, kdim] (float16, a read-only
        memory map: only the rows scored are read) and the coarse keys [3, heads, groups, kdim] (float16, from
        memory after the first read)."""
        if not self.count:
            return torch.zeros(0, 2, dtype=torch.long), np.zeros((0,), np.float16), torch.zeros(0)
        if self._files is not None:
            for f in self._files:
                f.flush()
        heads, kdim = self.layout
        spans = np.fromfile(self.folder / "groups.bin", dtype=np.int32, count=2 * self.count).reshape(-1, 2)
        digests = np.memmap(self.folder / "digest.bin", dtype=np.float16, mode="r",
                            shape=(self.count, len(self.layers), heads, REPS, kdim))
        if self._coarse is None:
            coarse = np.fromfile(self.folder / "coarse.bin", dtype=np.float16,
                                 count=self.count * self._records[1] // 2)
            self._coarse = torch.zeros(len(coarse_index(self.layers)), heads, 0, kdim, dtype=COARSE_DTYPE)
            written, self.count = self.count, 0
            self._keep_coarse(torch.from_numpy(coarse).view(written, -1, heads, kdim).permute(1, 2, 0, 3))
            self.count = written
        return torch.from_numpy(spans).long(), digests, self._coarse[:, :, : self.count]

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

    def _keep_coarse(self, rows: torch.Tensor) -> None:
        """Write ``rows`` ([coarse layers, heads, n, kdim]) after the first ``count`` rows of the coarse keys in
        memory, growing them by doubling."""
        end = self.count + rows.shape[2]
        if end > self._coarse.shape[2]:
            grown = self._coarse.new_zeros(*self._coarse.shape[:2], max(end, 2 * self._coarse.shape[2], 256),
                                           self._coarse.shape[3])
            grown[:, :, : self.count] = self._coarse[:, :, : self.count]
            self._coarse = grown
        self._coarse[:, :, self.count: end] = rows.to(self._coarse.dtype)

    def sync(self) -> None:
        if self._files is not None:
            for f in self._files:
                f.flush()
                os.fsync(f.fileno())

    def truncate(self, n: int) -> None:
        """Forget the groups that end after position ``n``."""
        if not self.count:
            return
        self.close()
        spans = np.fromfile(self.folder / "groups.bin", dtype=np.int32, count=2 * self.count).reshape(-1, 2)
        keep = int(np.searchsorted(spans[:, 1], n, side="right"))
        self._cut(keep)
        self._content = self._content[:keep]
        self.count = keep
        self.covered = int(spans[keep - 1, 1]) if keep else 0

    def close(self) -> None:
        if self._files is not None:
            for f in self._files:
                f.close()
            self._files = None

    def delete(self) -> None:
        self.close()
        self._coarse = None
        self._content = self._content[:0]
        for name in (*self.FILES, "digest.txt"):
            (self.folder / name).unlink(missing_ok=True)


class QueryTap:
    """Keeps the latest query rows of the scoring layers while a user message is fed (the attention function calls
    it with each layer's query states); ``positions`` is set by the engine before each forward."""

    def __init__(self, layers: list[int]):
        self.layers = set(layers)
        self.positions: torch.Tensor | None = None
        self.queries: dict[int, torch.Tensor] = {}  # layer -> [query heads, rows, dim]
        self.qpos: dict[int, torch.Tensor] = {}
        self.keep: torch.Tensor | None = None  # rows of the forward to keep (bool), None: all
        self.scaling: dict[int, float] = {}

    def __call__(self, module, query: torch.Tensor, scaling: float | None) -> None:
        li = module.layer_idx
        if li not in self.layers:
            return
        self.scaling[li] = scaling if scaling is not None else query.shape[-1] ** -0.5
        q, pos = query[0].float(), self.positions
        if self.keep is not None:
            q, pos = q[:, self.keep], pos[self.keep]
        if li in self.queries:
            q, pos = torch.cat([self.queries[li], q], 1), torch.cat([self.qpos[li], pos])
        self.queries[li], self.qpos[li] = q[:, -QUERY_ROWS:], pos[-QUERY_ROWS:]

    def unrotated(self, rotary) -> dict[int, torch.Tensor]:
        if rotary is None:
            return self.queries
        return {li: rotary.rotate(q, -self.qpos[li].long()[None].to(q.device)) for li, q in self.queries.items()}


def relevance(digests: np.ndarray, coarse: torch.Tensor, layers: list[int], queries: dict[int, torch.Tensor],
              scaling: dict[int, float]) -> torch.Tensor:
    """[groups] how much the queries want each group (``score``). Past ``CANDIDATES`` groups, a coarse pass over
    one key per group in three layers (``coarse``: [3, heads, groups, kdim]) and ``COARSE_ROWS`` of the query rows
    picks the candidates whose digests are read and scored in full; the others get 0."""
    groups = digests.shape[0]
    if groups <= CANDIDATES:
        return score(torch.from_numpy(np.array(digests)), layers, queries, scaling)
    first, used = torch.zeros(groups), 0
    for ci, li in zip(range(coarse.shape[0]), [layers[i] for i in coarse_index(layers)]):
        q = queries.get(li)
        if q is not None:
            if q.shape[1] > COARSE_ROWS:  # its cost grows with rows x groups: a long message is sampled
                q = q[:, torch.linspace(0, q.shape[1] - 1, COARSE_ROWS).round().long().to(q.device)]
            first += _shares(q, coarse[ci].to(q.device), scaling.get(li, q.shape[-1] ** -0.5), 1, rough=True)
            used += 1
    picked = (first / max(used, 1)).topk(CANDIDATES).indices.sort().values
    out = torch.zeros(groups)
    out[picked] = score(torch.from_numpy(digests[picked.numpy()]), layers, queries, scaling)
    return out


def score(digests: torch.Tensor, layers: list[int], queries: dict[int, torch.Tensor],
          scaling: dict[int, float]) -> torch.Tensor:
    """[groups] the mean over ``layers`` of the largest attention share (softmax over groups of the best
    representative key) any query row and query head gives each group (digests: [groups, layers, heads, reps,
    dim])."""
    groups, _, heads, reps, kdim = digests.shape
    # one conversion for all layers, the representatives outermost: the best of them is an elementwise maximum
    keys = torch.empty(len(layers), heads, reps, groups, kdim, dtype=FULL_DTYPE)
    keys.copy_(digests.permute(1, 2, 3, 0, 4))
    keys = keys.view(len(layers), heads, reps * groups, kdim)
    total = torch.zeros(groups)
    used = 0
    for si, li in enumerate(layers):
        q = queries.get(li)
        if q is None:
            continue
        total += _shares(q, keys[si].to(q.device), scaling.get(li, kdim ** -0.5), reps)
        used += 1
    return total / max(used, 1)


def _shares(q: torch.Tensor, keys: torch.Tensor, scale: float, reps: int, rough: bool = False) -> torch.Tensor:
    """[groups] the largest attention share any row of ``q`` ([query heads, rows, dim]; the query heads sharing a
    KV head go together) gives each group, the softmax taken over the groups' best of ``reps`` keys (``keys``:
    [KV heads, reps * groups, dim], representative r of group g at row r * groups + g). ``rough``: the softmax's
    output in the keys' dtype where that is bf16 (the coarse pass, which only ranks: 18-31% faster there)."""
    heads = keys.shape[0]
    qh = q.reshape(heads, -1, keys.shape[-1]) * scale
    if keys.dtype == torch.bfloat16:  # where the CPU multiplies bf16 natively
        s = torch.bmm(qh.to(keys.dtype), keys.transpose(1, 2))
    else:
        s = torch.bmm(qh, keys.float().transpose(1, 2))
    if reps > 1:
        s = s.view(heads, qh.shape[1], reps, -1).amax(2)
    if rough and s.dtype == torch.bfloat16:
        return s.softmax(-1).amax((0, 1)).float().cpu()
    return s.float().softmax(-1).amax((0, 1)).cpu()


def scaffolding(model) -> torch.Tensor:
    """Token ids the chat template wraps every message in (role headers, end markers): a group made of these alone
    carries nothing to recall."""
    chat, encode = model.chat, lambda text: model.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = set(model.tokenizer.all_special_ids)
    for role in ("user", "assistant"):
        marker = "xq"
        seg = chat.segment([{"role": "user", "content": "hi"}] if role == "assistant" else [],
                           {"role": role, "content": marker})
        head, _, tail = seg.partition(marker)
        ids |= set(encode(head)) | set(encode(tail))
    return torch.tensor(sorted(ids), dtype=torch.long)


def choose(relevance: torch.Tensor, spans: torch.Tensor, mean_held: torch.Tensor, has_content: torch.Tensor,
           groups: int, tokens: int, threshold: float, message: torch.Tensor | None = None) -> list[list[int]]:
    """The groups to bring back, best first: at most ``groups`` of them and ``tokens`` positions in all, each
    scoring at least ``threshold``, holding more than template scaffolding (``has_content``, per group) and mostly
    evicted now (``mean_held``: the share of its (layer, head, position) slots held, per group, below one half).
    Each comes as a unit with the evicted groups right around it that are scaffolding, and with the next sentence
    of the same message (``message``: the message of each group) where that is evicted too; units are consecutive
    group indices, in conversation order."""
    a, b = spans[:, 0], spans[:, 1]
    # Only what the message wants more than most of what the cache already holds comes back.
    present = relevance[(mean_held >= 0.5) & has_content & (relevance > 0)]
    if present.numel() and HELD_QUANTILE > 0:
        threshold = max(threshold, float(torch.quantile(present, HELD_QUANTILE)))
    evicted = mean_held < 0.5
    wanted = (evicted & has_content & (relevance > 0) & (relevance >= threshold)).nonzero().flatten()
    order = wanted[relevance[wanted].argsort(descending=True)].tolist()
    free = (evicted & ~has_content).tolist()  # evicted scaffolding groups, which come along with their neighbour
    follows = [False] * len(free)  # the next group is the same message's next sentence, evicted
    if message is not None and len(free) > 1:
        follows = torch.cat([(message[1:] == message[:-1]) & evicted[1:], torch.tensor([False])]).tolist()
    size = (b - a).tolist()
    chosen, used, picked = [], 0, set()
    for g in order:
        if len(chosen) >= groups or used >= tokens:
            break
        if g in picked:
            continue
        # the template scaffolding right around it (the message's header, its end marker) comes with it, so the
        # model reads it as the message it was; and the sentence after it in the same message, which often
        # completes it (a name after "Dr.", the value a sentence introduces)
        unit = [g]
        if g > 0 and free[g - 1] and g - 1 not in picked:
            unit.insert(0, g - 1)
        if g + 1 < len(size) and (free[g + 1] or follows[g]) and g + 1 not in picked:
            unit.append(g + 1)
            if g + 2 < len(size) and free[g + 2] and not free[g + 1] and g + 2 not in picked:
                unit.append(g + 2)
        cost = sum(size[n] for n in unit)
        if used + cost > tokens:
            unit = [n for n in unit if n <= g]  # without the next sentence, if that is what does not fit
            cost = sum(size[n] for n in unit)
            if used + cost > tokens:
                continue
        chosen.append(unit)
        picked.update(unit)
        used += cost
    return sorted(chosen)


def held_share(cache, spans: torch.Tensor) -> torch.Tensor:
    """[groups] the share of each group's (layer, KV head, position) slots the cache holds: its slots are counted
    per group, so the cost follows the cache's size, not the conversation's."""
    held = torch.cat([layer.positions().flatten().cpu() for layer in cache.layers if layer.is_initialized])
    held = held[held >= 0]
    pairs = sum(layer.heads for layer in cache.layers if layer.is_initialized)
    group = torch.searchsorted(spans[:, 1].contiguous(), held, right=True)
    inside = group < spans.shape[0]
    group, held = group[inside], held[inside]
    counts = torch.bincount(group[held >= spans[group, 0]], minlength=spans.shape[0]).float()
    return counts / (max(pairs, 1) * (spans[:, 1] - spans[:, 0]).clamp(min=1))


def plan(session, tap: QueryTap) -> dict:
    """Score the archived groups against the queries ``tap`` kept and choose what comes back: {"recalled_tokens",
    "recalled_groups", "recalled": [[start, end]] (a chosen group with the scaffolding around it), "bring": the
    positions, "recall_ms"}."""
    t0 = time.perf_counter()
    s, archive = session.settings, session.archive
    spans, digests, coarse = archive.digests.read()
    out = {"recalled_tokens": 0, "recalled_groups": 0, "recalled": [], "bring": torch.zeros(0, dtype=torch.long)}
    if spans.shape[0] and tap.queries:
        rel = relevance(digests, coarse, archive.digests.layers, tap.unrotated(session.model.rotary), tap.scaling)
        units = choose(rel, spans, held_share(session.cache, spans),
                       archive.digests.has_content(spans, session.log, session.model.scaffolding_ids()),
                       s.recall_groups, s.recall_limit, s.recall_threshold, session.log.at("message", spans[:, 0]))
        if units:
            found = [[int(spans[u[0], 0]), int(spans[u[-1], 1])] for u in units]
            out.update(recalled=found, recalled_groups=len(units),
                       bring=torch.cat([torch.arange(a, b) for a, b in found]))
            out["recalled_tokens"] = int(out["bring"].numel())
    out["recall_ms"] = 1000 * (time.perf_counter() - t0)
    return out


def bring_back(session, bring: torch.Tensor) -> None:
    """Put the positions ``bring`` back into every layer and head, within the budget, and keep them there while the
    message is read again and through the reply's first compression (so the reply's first ``slack`` tokens at
    least see them); from there on the running policy keeps them as long as it scores them high enough."""
    from . import compress

    compress.compress(session, session.settings.budget, "recall", bring=bring)
    session.recall_guard = torch.cat([session.recall_guard, bring])


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0
