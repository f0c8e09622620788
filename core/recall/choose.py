"""Choosing what comes back, and putting it back.

The best groups the cache has (mostly) evicted are chosen (``choose``) and put back into every layer and head
(``bring_back``): a compression makes room for them (the running policy's lowest-scored tokens go), they are read
again from their token ids after the cache's last slots, and every head's slots go back into conversation order,
each key rotated once from where it was computed (so the cache stays a function of its slots' computed keys and
positions, and resumes exactly). They are protected while the message is read again and through the reply's first
compression; then the running policy keeps them as long as it scores them high enough. Whether they stay at all is
the gate's (core/recall/gate.py).
"""

from __future__ import annotations

import time

import torch

from ..cache import compress
from . import rerank
from .lexical import bm25, fuse, word_forms
from .score import QueryTap, relevance

HELD_QUANTILE = 0.9  # a recalled group must outscore this share of the groups the cache holds


def choose(relevance: torch.Tensor, spans: torch.Tensor, mean_held: torch.Tensor, has_content: torch.Tensor,
           groups: int, tokens: int, threshold: float, message: torch.Tensor | None = None,
           text=None) -> list[list[int]]:
    """The groups to bring back, best first: at most ``groups`` of them and ``tokens`` positions in all, each
    scoring at least ``threshold``, holding more than template scaffolding (``has_content``, per group) and mostly
    evicted now (``mean_held``: the share of its (layer, head, position) slots held, per group, below one half).
    Each comes as a unit with the evicted groups right around it that are scaffolding, and with the next sentence
    of the same message (``message``: the message of each group) where that is evicted too; units are consecutive
    group indices, in conversation order. ``text`` (group -> its token ids as a tuple), where given, skips a group
    whose very text the cache holds (a group mostly held) or an earlier pick brings: a chat repeats its pleasantries
    ("How can I help you today?"), which attention favours and a second copy of tells the model nothing."""
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
    seen = held_texts(mean_held, has_content, text) if text is not None else set()
    for g in order:
        if len(chosen) >= groups or used >= tokens:
            break
        if g in picked:
            continue
        if text is not None:
            if text(g) in seen:
                continue
            seen.add(text(g))
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


def plan(session, tap: QueryTap, message: torch.Tensor) -> dict:
    """Score the archived groups against the queries ``tap`` kept and the words of ``message`` (its token ids),
    and choose what comes back: {"recalled_tokens",
    "recalled_groups", "recalled": [[start, end]] (a chosen group with the scaffolding around it), "bring": the
    positions, "recall_ms"}."""
    t0 = time.perf_counter()
    s, digests_store = session.settings, session.digests
    spans, digests, coarse = digests_store.read()
    out = {"recalled_tokens": 0, "recalled_groups": 0, "recalled": [], "bring": torch.zeros(0, dtype=torch.long)}
    if spans.shape[0] and tap.queries:
        attention = relevance(digests, coarse, digests_store.layers, tap.unrotated(session.model.rotary),
                              tap.scaling)
        ids = session.log.column("token")
        words = bm25(message, ids, spans, word_forms(session.model))
        # the two rankings merged; recall_threshold still asks for that much attention
        wanted = fuse(attention, words) * (attention >= s.recall_threshold)
        held = held_share(session.cache, spans)
        content = digests_store.has_content(spans, session.log, session.model.scaffolding_ids())
        text = group_text(ids, spans)
        pool = rerank.pool_size(s.recall_rerank, session.model.device)
        if pool:
            wanted = reranked(session.model, wanted, held, content, text, message, pool)
        units = choose(wanted, spans, held, content, s.recall_groups, s.recall_limit, 0.0,
                       session.log.at("message", spans[:, 0]), text=text)
        if units:
            found = [[int(spans[u[0], 0]), int(spans[u[-1], 1])] for u in units]
            out.update(recalled=found, recalled_groups=len(units),
                       bring=torch.cat([torch.arange(a, b) for a, b in found]))
            out["recalled_tokens"] = int(out["bring"].numel())
    out["recall_ms"] = 1000 * (time.perf_counter() - t0)
    return out


def reranked(cm, wanted: torch.Tensor, held: torch.Tensor, content: torch.Tensor, text, message: torch.Tensor,
             pool: int) -> torch.Tensor:
    """``wanted`` with its ``pool`` best candidates (evicted, with content, their text neither held nor a copy of a
    better one's, as ``choose`` takes them) scored again by the message's likelihood gain after each
    (core/recall/rerank.py), and every other group 0: only a candidate that makes the message likelier can come
    back, the likeliest first. The held groups score 0 too, so ``choose``'s rule of outscoring most of them
    (``HELD_QUANTILE``) gives way to the gain's: the two scales do not compare."""
    scaffolding = cm.scaffolding_ids()
    seen = held_texts(held, content, text)
    eligible = ((held < 0.5) & content & (wanted > 0)).nonzero().flatten()
    picked = []
    for g in eligible[wanted[eligible].argsort(descending=True, stable=True)].tolist():
        if len(picked) >= pool:
            break
        if text(g) not in seen:
            seen.add(text(g))
            picked.append(g)
    out = torch.zeros_like(wanted)
    if picked:
        strip = lambda t: t[~torch.isin(t, scaffolding)]  # noqa: E731
        gain = rerank.gains(cm, strip(message.long()), [strip(torch.tensor(text(g))) for g in picked], pool)
        out[torch.tensor(picked)] = gain.clamp(min=0).to(out.dtype)
    return out


def group_text(ids: torch.Tensor, spans: torch.Tensor):
    """group -> its token ids as a tuple, read through numpy: called for every held group twice a message, where
    slicing the tensors took two operations and two scalar reads a group."""
    tokens, bounds = ids.numpy(), spans.numpy()
    return lambda g: tuple(tokens[bounds[g, 0]:bounds[g, 1]].tolist())


def held_texts(held: torch.Tensor, content: torch.Tensor, text) -> set:
    """The texts (token-id tuples) of the groups the cache mostly holds that have content: none comes back again."""
    return {text(g) for g in ((held >= 0.5) & content).nonzero().flatten().tolist()}


def bring_back(session, bring: torch.Tensor, end: int | None = None) -> None:
    """Put the positions ``bring`` back into every layer and head, within the budget: the running policy's
    lowest-scored slots make room, the tokens are read again from their ids with the cache before them as context
    (no evicted KV is kept: core/recall/digest.py), and every head's slots go back into conversation order, each key
    rotated once from where it was computed. They stay while the message is read again and through the reply's
    first compression (so the reply's first ``slack`` tokens at least see them); from there on the running policy
    keeps them as long as it scores them high enough. ``end``: the absolute position after the cache's last one
    (the token log's end unless a long message is read again from part way: ``core/engine/checkpoint.TailMark``)."""
    compress.compress(session, session.settings.budget, "recall", drop=bring, room=bring.numel())
    session.read_again(bring, end)
    compress.reorder(session)
    session.recall_guard = torch.cat([session.recall_guard, bring])
