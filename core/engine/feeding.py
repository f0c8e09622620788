"""Feeding tokens through the model on top of the cache: a turn's prefill (with recall between a user message and
what answers it), chunked forwards that compress first when the cache has no room, the forward itself, and the
reads of tokens the cache holds or held again (recall's, and a switched-in policy's window). Mixed into ``Session``."""

from __future__ import annotations

import copy
import time

import torch

from ..cache import compress
from ..recall import choose as recall
from ..recall import gate
from .checkpoint import Checkpoint, ReadMark, TailMark
from ..cache.observe import Observer
from ..recall.score import QueryTap
from .tokens import encode, encode_parts
from .turns import ReadStopped, TurnResult, stage

#: The newest tokens read again for a policy that accumulates attention switched in with no window of its own (h2o):
#: the attention of their queries is what it first chooses by.
ACC_SEED = 32
STOPPABLE = compress.MAX_CHUNK  # a user message longer than one forward can be stopped while it is read


def stoppable(ids: list[int]) -> bool:
    """Whether a user message of ``ids`` is read in more than one forward, so that a stop can take its read back."""
    return len(ids) > STOPPABLE


class Feeding:
    #: Tokens at the token log's end not read into the cache yet while a compression runs (the policy sees the
    #: tokens read: ``compress.layer_view``): a long message's later chunks (set by ``compress.make_room``), or
    #: its part after its read mark while recall puts text back.
    unread = 0
    read_mark = None  # the mark a user message's first read left for recall (``_read``'s ``mark``)
    stop_reads = False  # a reply's long message is read: ``cancel()`` stops the read between chunks (``ReadStopped``)
    reading = None  # meanwhile, (tokens read, tokens to read) of the read in progress: what a UI shows of it

    def _encode(self, text: str) -> list[int]:
        return encode(self.model.tokenizer, text)

    def _segment_ids(self, history: list[dict], message: dict) -> list[int]:
        """The token ids appending ``message`` to ``history`` adds, its content read as plain text."""
        return encode_parts(self.model.tokenizer, self.model.chat.segment_parts(history, message))

    @property
    def recalling(self) -> bool:
        """Whether a user message followed by an answer recalls evicted text (recall on, a bounded policy, and
        digests to recall from)."""
        return (self.settings.recall == "on" and self.policy.bounded and self.digests is not None
                and self.digests.count > 0)

    def _prefill(self, res: TurnResult, segments, want_logprobs: bool = False):
        """Feed a turn's segments. When the first is a user message and something answers it, recall runs between
        the two: the message's queries choose what comes back before the answer is fed or generated."""
        t0 = time.perf_counter()
        first_role = self.messages[segments[0][1]]["role"]
        if len(segments) > 1 and first_role == "user" and self.recalling:
            # The message's queries choose what comes back. When something does, the session goes back to before
            # the message was read (a long one: to before its last ``budget`` tokens) and it is fed again after the
            # recall, so its own KV is computed with the recalled text before it, as it was when that text was still
            # cached; the recalled text stays only if it makes the message more predictable (``_read_with``,
            # core/recall/gate.py).
            tap = QueryTap(self.digests.layers)
            # Room for the message's first chunk, as feeding the message and its answer at once would make (the
            # message and the answer are read in the chunks and with the compressions of that: recall on or off,
            # the same cache when nothing comes back). The read is marked where the message's last ``budget``
            # tokens start (core/engine/checkpoint.py): only those are read again, the part of it the cache can hold
            # at its end.
            rest = sum(len(ids) for ids, _ in segments[1:])
            compress.make_room(self, len(segments[0][0]) + rest)
            try:
                with stage("kvchat.message"):  # the stages of a profiled turn (turns.STAGES)
                    head = self._feed(segments[:1], want_logprobs=want_logprobs, tap=tap, tail=gate.TAIL, more=rest,
                                      mark=self.settings.budget)
            finally:
                before, self.read_mark = self.read_mark, None
            with stage("kvchat.recall.plan"):
                found = recall.plan(self, tap, torch.as_tensor(segments[0][0]))
            found["recall_ms"] += before.ms  # what recall adds to every message: the mark, the scoring, the put-back
            if found["recalled"]:
                with stage("kvchat.recall.back"):
                    head = self._read_with(segments[0][0], want_logprobs, before, found, head, rest)
            del before  # a ``TailMark`` holds a copy of the cache
            for key in ("recalled_tokens", "recalled_groups", "recalled", "recall_ms"):
                setattr(res, key, found[key])
            res.recall_declined, res.recall_gain = found.get("declined", []), found.get("recall_gain")
            with stage("kvchat.prefill"):
                out = self._feed(segments[1:], want_logprobs=want_logprobs, first=self.carry)
            if want_logprobs:  # one sequence of scores, as if fed at once: the boundary token scored by head's logits
                nxt = segments[1][0][0]
                lp = torch.log_softmax(head[0].float().cpu(), -1)[nxt]
                out = (out[0], torch.cat([head[1], lp[None], out[1]]),
                       torch.cat([head[2], torch.tensor([int(head[0].argmax()) == nxt]), out[2]]))
        else:
            with stage("kvchat.prefill"):
                out = self._feed(segments, want_logprobs=want_logprobs)
        res.prefill_ms = 1000 * (time.perf_counter() - t0)
        res.prompt_tokens = sum(len(ids) for ids, _ in segments)
        return out

    def _read_with(self, message: list[int], want_logprobs: bool, before, found: dict, first, rest: int):
        """Read ``message`` (the token log's last tokens) again from its mark ``before`` with the text ``found``
        recalled before that; keep that read if the recalled text makes the message more predictable
        (core/recall/gate.py), else go back to the first read (``first``: its ``_feed`` result). Returns the read
        kept; ``found`` says what stayed."""
        t = time.perf_counter()
        scaffolding = self.model.scaffolding_ids()
        without = gate.content_nll(self.tail_logprobs, scaffolding)
        after_first = Checkpoint.capture(self)  # the message read without recall: kept if recall does not help
        stage, guard, carry = copy.deepcopy(self.digests.stage), self.recall_guard, self.carry
        before.restore(self)  # the read from the mark is forgotten (the message stays in the token log)
        ids, at = torch.tensor(message, dtype=torch.long), before.at
        positions = torch.arange(self.log.n - ids.numel(), self.log.n)
        self.unread = ids.numel() - at
        try:
            recall.bring_back(self, found["bring"], end=int(positions[at]))
        finally:
            self.unread = 0
        found["recall_ms"] += 1000 * (time.perf_counter() - t)
        head = self._read(ids, positions, want_logprobs=want_logprobs, tail=gate.TAIL, more=rest, start=at)
        if want_logprobs:  # the first read's scores of the tokens before the mark: the same state computed them
            head = (head[0], *(torch.cat([a[:at], b]) for a, b in zip(first[1:], head[1:])))
        with_recall = gate.content_nll(self.tail_logprobs, scaffolding)
        found["recall_gain"] = None if without is None or with_recall is None else without - with_recall
        if gate.keeps(without, with_recall):
            self.recall_release = True  # kept through the reply's first compression, then the policy decides
            return head
        t = time.perf_counter()
        after_first.restore(self)
        self.digests.stage, self.recall_guard, self.carry = stage, guard, carry
        found["recall_ms"] += 1000 * (time.perf_counter() - t)
        found["declined"] = found["recalled"]
        found.update(recalled=[], recalled_tokens=0, recalled_groups=0, bring=found["bring"][:0])
        return first

    def _feed(self, segments: list[tuple[list[int], int]], want_logprobs: bool = False,
              continue_message: bool = False, tap: QueryTap | None = None, tail: int = 0, more: int = 0,
              first: int = 0, mark: int = 0):
        """Feed tokens ([(ids, message index)]) through the model on top of the cache, compressing as needed.

        Returns (last logits, next-token log-probs, top-1 flags); the latter two only with ``want_logprobs``
        (entry j scores token j+1 of the fed sequence). ``tap`` keeps the queries of the tokens that are not the
        template's scaffolding (role headers, end markers), for recall. ``tail``: the log-probabilities of the last
        ``tail`` tokens (the first token fed has none) are left in ``tail_logprobs`` as (token ids, their
        log-probabilities), for recall's gate (core/recall/gate.py). ``more``: tokens that follow in the same
        turn (recall reads a user message before what answers it): the chunks and compressions are those of
        feeding both at once, the part of the last chunk past these tokens left in ``carry`` for the next call's
        ``first`` chunk, whose room was made. ``mark``: a mark left in ``read_mark`` at the start of the first chunk
        that leaves at most ``mark`` tokens to read (recall reads the message again from there): a ``ReadMark`` where
        the rest is read without a compression, else a ``TailMark``.
        """
        positions = self.log.append_messages(self.model.tokenizer,
                                             [(ids, m, self.messages[m]["role"]) for ids, m in segments],
                                             self.turn, continue_message)
        ids = torch.tensor([i for seg, _ in segments for i in seg], dtype=torch.long)
        return self._read(ids, positions, want_logprobs, tap, tail, more, first, mark)

    def _read(self, ids: torch.Tensor, positions: torch.Tensor, want_logprobs: bool = False,
              tap: QueryTap | None = None, tail: int = 0, more: int = 0, first: int = 0, mark: int = 0,
              start: int = 0):
        """``_feed``'s chunked forwards of tokens already in the token log, from ``ids[start]`` on."""
        if mark:
            self.read_mark = None
        if tap is not None:
            special = self.model.scaffolding_ids()
        total = ids.numel()
        logprobs, top1, i, logits = [], [], start, None
        tails = []  # (token ids, log-probabilities) of the last ``tail`` tokens, chunk by chunk
        planned = 0
        short = self.model.step.short_feed if self.model.step is not None else 0  # core/decode: where it pays
        while i < total:
            if self.stop_reads:
                if i > start and self._cancel.is_set():
                    raise ReadStopped(i, total)
                if total > STOPPABLE:  # the message's read (not the reply's header after it, read apart by recall)
                    self.reading = (i, total)
            if mark and (total - i <= mark or i + compress.chunk(self, total - i + more) >= total):
                t = time.perf_counter()
                self.read_mark = ReadMark.capture(self, total - i, more) or TailMark.capture(self)
                self.read_mark.at, self.read_mark.ms, mark = i, 1000 * (time.perf_counter() - t), 0
            planned = min(first, total) if i == 0 and first else \
                compress.make_room(self, total - i + more, logged=total - i)
            c = min(planned, total - i)
            if tap is not None:  # the rows to keep as indices made here: a mask would be read back from a GPU
                rows = torch.nonzero(~torch.isin(ids[i: i + c], special))[:, 0]
                tap.keep = None if rows.numel() == c else rows
            keep = min(c, max(0, i + c - (total - tail - 1))) if tail else 0  # this chunk's logits in the tail
            if c <= short and tap is None and not want_logprobs and not keep:  # a few tokens: a step each is cheaper
                for j in range(i, i + c):
                    logits = self.forward(ids[j: j + 1], positions[j: j + 1])
            else:
                logits = self.forward(ids[i: i + c], positions[i: i + c], all_logits=want_logprobs, tap=tap,
                                      keep=max(keep, 1))
            if want_logprobs:
                targets = ids[i + 1: i + c + 1]
                lp = torch.log_softmax(logits[: targets.numel()].float(), dim=-1).cpu()
                logprobs.append(lp.gather(1, targets[:, None])[:, 0])
                top1.append(lp.argmax(-1) == targets)
            if keep:  # row j of the last ``keep`` logits scores the token after position i + c - keep + j
                targets = ids[i + c - keep + 1: i + c + 1]
                lp = torch.log_softmax(logits[-keep:][: targets.numel()].float(), dim=-1).cpu()
                tails.append((targets, lp.gather(1, targets[:, None])[:, 0]))
            i += c
        if tail:
            self.tail_logprobs = (torch.cat([t for t, _ in tails]), torch.cat([lp for _, lp in tails]))
        self.carry = max(planned - c, 0) if more else 0
        self.last_logits = logits[-1]
        if want_logprobs:
            return self.last_logits, torch.cat(logprobs), torch.cat(top1)
        return self.last_logits, None, None

    def forward(self, ids: torch.Tensor, abs_pos: torch.Tensor, all_logits: bool = False,
                tap: QueryTap | None = None, at: torch.Tensor | None = None, keep: int = 1) -> torch.Tensor:
        """One model forward of ``ids`` (absolute positions ``abs_pos``) on top of the cache; the logits of every
        position (``all_logits``) or of the last ``keep``. ``at``: the positions to compute them at instead of the
        next ones (recall reads old text again at the end of the cache, unobserved)."""
        if at is not None:
            pos = at
        elif self.settings.positions == "original":
            pos = abs_pos
        else:
            pos = torch.arange(self.cache.length, self.cache.length + ids.numel())
        observer, step = self.observer if at is None else None, self.model.step
        if ids.numel() == 1 and tap is None and step is not None:  # a decode step (core/decode)
            with torch.no_grad():
                return step.decode(ids, pos, abs_pos, self.cache, observer)
        device = self.model.device
        self.cache.incoming_abs = abs_pos.to(device=device, dtype=torch.int32)
        self.cache.incoming_pos = pos.to(device=device, dtype=torch.int32)
        extra = {}
        if observer is not None:
            observer.positions = pos.to(device)
            extra["kvchat_observer"] = observer
        if tap is not None:
            tap.positions = pos.to(device)
            tap.keep = tap.keep.to(device) if tap.keep is not None else None
            extra["kvchat_tap"] = tap
        reader = self.model.reader  # the model's forward without its dispatch (core/decode/eager.py), or None
        with torch.no_grad():
            if reader is not None:
                return reader.read(ids.to(device), pos.to(device), self.cache, 0 if all_logits else keep, **extra)
            return self.model.model(input_ids=ids[None].to(device), position_ids=pos[None].to(device),
                                    **{self.model.cache_arg: self.cache}, use_cache=True,
                                    logits_to_keep=0 if all_logits else keep, **extra).logits[0]

    def read_again(self, positions: torch.Tensor, end: int | None = None) -> None:
        """Read the tokens at ``positions`` (absolute, ascending: evicted text recall brings back) again, computed
        at the positions after the cache's last ones with the cache as it is before them and unobserved; the
        caller made room for them and puts them back in conversation order (``compress.reorder``). ``end``: the
        absolute position after the cache's last one (the token log's end unless the log runs ahead of the cache)."""
        tokens, after = self.log.column("token")[positions].long(), self.log.n if end is None else end
        start = after if self.settings.positions == "original" else self.cache.length
        for i in range(0, positions.numel(), compress.MAX_CHUNK):
            ids = tokens[i: i + compress.MAX_CHUNK]
            self.forward(ids, positions[i: i + ids.numel()], at=torch.arange(start + i, start + i + ids.numel()))
        if self.observer is not None:
            self.observer.unobserved(positions.numel(), after)  # their attention counts from the next query on

    def observe_newest(self, before: Observer | None = None) -> None:
        """What a policy switched in over the observer ``before`` (or a window left empty) reads first, from what the
        cache holds now. An empty query window is filled with the queries ``before`` remembers, else by reading the
        cache's newest tokens again (``obs_window`` of them, or as many as every head holds last). Attention received
        (``acc``), where ``before`` kept none, counts afresh from the newest ``ACC_SEED`` tokens read again
        (``Observer.restart``). A policy that reads attention (snapkv, tova, cake, headaware, h2o), switched in
        mid-chat, then chooses by it at its first compression, not by recency alone. The cache is left as it was,
        bit for bit: the read's keys, values, positions and rows on disk are put back; only the observer learns
        (and, where it accumulates afresh, each slot the attention those queries gave it)."""
        observer = self.observer
        if observer is None:
            return
        switched = before is not observer
        restart = switched and observer.accumulate and not (before is not None and before.accumulate)
        if not restart:
            if not observer.window or observer.observed:
                return
            if switched and before is not None and before.window:
                observer.take_window(before)
                if observer.observed:
                    return
        positions = self.cache.newest_shared(observer.window or ACC_SEED)
        if restart:
            observer.restart(self.log.n - self.unread - positions.numel())
        if positions.numel():
            accumulate, observer.accumulate = observer.accumulate, restart  # attention counted once
            try:
                with self.cache.rewound(positions.numel()):
                    self.forward(self.log.column("token")[positions].long(), positions)
            finally:
                observer.accumulate = accumulate

    def make_observer(self, policy) -> Observer | None:
        accumulate, window = "acc" in policy.observes, policy.obs_window
        return Observer(self.cache, accumulate, window) if accumulate or window else None
