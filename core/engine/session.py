"""A chat session: one conversation, one KV cache that stays bounded however long the chat runs.

Each new message is rendered by the chat template as the text it adds, tokenized, and prefilled on top of the
existing cache (never the history). Before a forward would take the cache past budget + slack, the cache is
compressed to the budget (``core/cache/compress.py``). The engine never knows which policy it runs.

This module orchestrates a turn: the five entry points (``add``, ``exchange``, ``probe``, ``reply``, ``feed_raw``)
share one prologue (``_open_turn``) and one epilogue (``_close_turn``). Generation is ``core/engine/generate.py``, undo
``core/engine/checkpoint.py``, what is stored ``core/engine/persist.py`` (reopening: ``core/engine/reopen.py``), reads
from other threads (the web UI) ``core/engine/reading.py``."""

from __future__ import annotations

import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch

from ...policies import make_policy
from ..cache import compress
from . import persist, reopen
from ..cache.kvcache import KVCache
from .checkpoint import Checkpoint
from .feeding import Feeding, stoppable
from .generate import CLOSING_RESERVE, Generation, Reply
from .locking import locked
from ..model.loading import ChatModel
from ..cache.positions import convert_positions
from .procinfo import memory_mb, peak_rss_mb, rss_mb  # noqa: F401  (part of the engine's public surface)
from .reading import SessionReads
from .settings import Sampling, Settings
from .tokens import ROLES, TokenLog, check_text, encode_parts
from .turns import ContextFullError, ReadStopped, TurnResult, stage

__all__ = ["CLOSING_RESERVE", "ROLES", "ContextFullError", "ReadStopped", "Sampling", "Session", "Settings",
           "TurnResult", "check_text", "memory_mb", "peak_rss_mb", "rss_mb"]


class Session(Feeding, Generation, SessionReads):
    def __init__(self, model: ChatModel, settings: Settings | None = None, system: str | None = "default",
                 store=None, sampling: Sampling | None = None, seed: int = 0, title: str | None = None,
                 undo: bool = False, folder: Path | None = None):
        """``system``: the system prompt; "default" uses the template's own default (if it has one), None none.
        ``undo``: keep a copy of the state before each turn so ``undo()`` can take the last one back. ``folder``:
        the stored conversation's files (``resume``); a new conversation with a store gets a new one."""
        settings = settings or Settings()
        settings.validate(model.max_positions, model.rotary_error)
        self.model, self.settings = model, settings
        self.policy = make_policy(settings.policy, **settings.params)
        self.sampling = (sampling or Sampling()).validate()
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        #: The conversation's files (core/engine/persist.py): with a store, or a temporary folder for recall's digests
        #: without one; None without either.
        self.files = persist.Files(folder) if folder is not None else \
            persist.Files.new(store) if store is not None or settings.recall == "on" else None
        self.digests = None  # recall's digests (core/recall/digest.py), opened by ``persist.open_digests``
        self.cache = self.new_cache(settings.capacity if self.policy.bounded else None)
        self.log = TokenLog()
        self.messages: list[dict] = []  # {"role", "content"} as the template sees them
        self.turn = 0
        self.store = store
        self.conversation_id: int | None = None
        self.title = title
        self.history: list[TurnResult] = []
        self.system_tokens = 0
        self.evictions = compress.Evictions()
        # just recalled: kept while the message is read again and through the reply's first compression
        self.recall_guard = torch.zeros(0, dtype=torch.long)
        self.recall_release = False  # the message has been read again: the next compression is the guard's last
        self.observer = self.make_observer(self.policy)
        self.undo_enabled = undo
        self.pending: list[dict] = []  # turn records not yet written (the system turn waits for the first exchange)
        self.pending_settings: list[dict] = []  # live settings changes not yet written (``persist.record_settings``)
        self.turn_open = False  # a turn is read or generated: the cache holds more than the committed turn
        self.warned: set[str] = set()
        self.last_logits: torch.Tensor | None = None
        self.restored_from: str | None = None
        self._cancel = threading.Event()
        self._lock = threading.RLock()  # a reply streams in one thread; settings / undo / views come from others
        self._undo: Checkpoint | None = None
        persist.open_digests(self)
        self._streaming: int | None = None  # the index of the reply being generated, while it is
        self._warnings: list[str] = []  # the open turn's
        if system == "default":
            system = model.chat.default_system
        if system is not None:
            self.add("system", system)

    @property
    def cache_tokens(self) -> int:
        """Cached positions per layer (averaged over layers and heads when budgets differ)."""
        return self.cache.mean_length

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes

    @property
    def total_tokens(self) -> int:
        return self.log.n

    @property
    def evicted_total(self) -> int:
        return self.evictions.total

    def cancel(self) -> None:
        """Stop the reply being generated (from another thread); the partial reply is kept."""
        self._cancel.set()

    def new_cache(self, capacity: int | None) -> KVCache:
        """An empty cache for this session's model (its computed keys kept where keys are re-rotated), watched by
        recall's digests when there are any."""
        cache = KVCache(self.model.num_layers, capacity, self.model.max_positions, self.model.rotary is not None)
        if getattr(self, "digests", None) is not None:
            cache.on_compress.append(self.digests.capture)
        return cache

    @property
    def undo_copy(self) -> Checkpoint | None:
        """The copy of the state before the last turn (``undo``), if one is kept."""
        return self._undo

    @property
    def disk_bytes(self) -> int:
        """Bytes the conversation keeps on disk beside the database: its rows, state file and recall digests."""
        return self.files.nbytes() if self.files is not None else 0

    @property
    def archive_bytes(self) -> int:
        """Bytes of recall's archive (the digests of every sentence group, capped by ``archive_mb``)."""
        return self.digests.nbytes if self.digests is not None else 0

    def close(self) -> None:
        """Stop any reply and release the conversation's files (deleted if no conversation was ever stored with
        them, or if they were a temporary folder)."""
        self.cancel()
        with self._lock:
            if self.files is not None:
                self.files.close(stored=self.conversation_id is not None)

    def reopened(self) -> "Session":
        """After a turn failed midway (a model step that raised, out of GPU memory say, leaves the cache's layers
        apart and the turn open): this conversation reopened at its last saved turn, as after a crash, with the
        live settings; a new conversation with its settings where none was saved. This session is closed."""
        return reopen.after_failure(self)

    # -- live settings and undo -------------------------------------------------------------------------------------
    @locked
    def configure(self, **changes: Any) -> dict:
        """Change cache settings on the live session; they apply at the next step, without re-prefilling.

        A smaller budget compresses at once. Returns the changes applied (ValueError and nothing applied if the
        new combination is invalid). Safe to call from another thread while a reply streams.
        """
        new = self.settings.changed(**changes)
        new.validate(self.model.max_positions, self.model.rotary_error)
        record = persist.settings_record(self.turn, self.settings, new)
        if record["changes"]:
            self._apply_settings(new)
            if new.recall == "on" and self.files is None:  # recall switched on without a store: a temporary folder
                self.files = persist.Files.new(None)
            persist.open_digests(self)
            persist.record_settings(self, record)
        return record["changes"]

    def _apply_settings(self, new: Settings) -> None:
        """Another policy, or other parameters, get a new policy and observer; the same keep what it learned."""
        old, was_bounded, self.settings, before = self.settings, self.policy.bounded, new, self.observer
        if (old.policy, old.params) != (new.policy, new.params):
            self.policy = make_policy(new.policy, **new.params)
            self.observer = self.make_observer(self.policy)
        if old.positions != new.positions:
            convert_positions(self.cache, self.model.rotary, new.positions)
        self.observe_newest(before)  # what a policy switched in reads (or a window left empty) is filled first
        if self.policy.bounded:
            shrunk = not was_bounded or new.budget < old.budget
            if shrunk and self.cache.mean_length > new.budget:
                compress.compress(self, new.budget, "settings")
            self.cache.set_capacity(new.capacity)
        else:
            self.cache.set_capacity(None)

    @property
    def can_undo(self) -> bool:
        return self._undo is not None

    @locked
    def undo(self) -> list[dict]:
        """Take back the last turn: the cache, token log and stored conversation return to their state before it
        (the current settings stay). Needs ``undo=True`` at construction; one level. Returns the messages removed."""
        checkpoint, self._undo = self._undo, None
        if checkpoint is None:
            raise ValueError("nothing to undo (only the last turn made in this session can be taken back)")
        redo = Checkpoint.capture(self, whole=True)  # the session as it is, should the stored conversation not follow
        current = self.settings
        removed = checkpoint.restore(self)
        if current != self.settings:
            self._apply_settings(current)
        try:
            persist.undo(self, created_conversation=checkpoint.conversation_id is None)
        except BaseException:
            # The database or the disk refused (full, locked, read-only): the session goes back to where the
            # stored conversation still is, and the turn can be undone again.
            redo.restore(self)
            if current != self.settings:
                self._apply_settings(current)
            self._undo = checkpoint
            raise
        return removed

    # -- the five kinds of turn -------------------------------------------------------------------------------------
    @locked
    def add(self, role: str, text: str) -> TurnResult:
        """Append one message without generating (teacher forcing)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        text = check_text(text, f"{role} message")
        if role == "system" and self.messages:
            raise ValueError("a system message can only open a conversation")
        ids = self._segment_ids(self.messages, {"role": role, "content": text})
        res = self._open_turn(role, len(ids))
        idx = self.new_message(role, text)
        self._prefill(res, [(ids, idx)])
        if role == "system":
            self.system_tokens = len(ids)
        if role == "assistant":
            res.answer = text
        return self._close_turn(res, [(idx, ids)])

    @locked
    def exchange(self, user: str, assistant: str) -> TurnResult:
        """Append a user message and its assistant reply as given (importing or replaying a transcript)."""
        user, assistant = check_text(user, "user message"), check_text(assistant, "assistant message")
        u = {"role": "user", "content": user}
        user_ids = self._segment_ids(self.messages, u)
        reply_ids = self._segment_ids(self.messages + [u], {"role": "assistant", "content": assistant})
        res = self._open_turn("assistant", len(user_ids) + len(reply_ids))
        user_idx, reply_idx = self.new_message("user", user), self.new_message("assistant", assistant)
        self._prefill(res, [(user_ids, user_idx), (reply_ids, reply_idx)])
        res.answer = assistant
        return self._close_turn(res, [(user_idx, user_ids), (reply_idx, reply_ids)])

    @locked
    def probe(self, user: str, reference: str, expect: str) -> TurnResult:
        """Ask ``user``, teacher-force ``reference`` as the answer, and measure how well the cache predicts the
        tokens covering ``expect`` inside it: mean NLL, and hit = each of them was the model's top choice."""
        user = check_text(user, "user message")
        reference = check_text(reference, "reference")
        expect = check_text(expect, "expect")
        at = reference.lower().find(expect.lower())
        if at < 0:
            raise ValueError(f"expect text {expect!r} does not occur in the reference answer")
        chat = self.model.chat
        u = {"role": "user", "content": user}
        user_ids = self._segment_ids(self.messages, u)
        header = chat.generation_header(self.messages + [u])
        parts = chat.segment_parts(self.messages + [u], {"role": "assistant", "content": reference})
        seg = "".join(text for text, _ in parts)
        ref_start = seg.find(reference, len(header) if seg.startswith(header) else 0)
        if ref_start < 0:
            raise ValueError("the chat template altered the reference answer; cannot locate the expected text")
        reply_ids, offsets = encode_parts(self.model.tokenizer, parts, offsets=True)
        lo, hi = ref_start + at, ref_start + at + len(expect)
        cover = [j for j, (a, b) in enumerate(offsets) if b > lo and a < hi]
        res = self._open_turn("assistant", len(user_ids) + len(reply_ids))
        user_idx, reply_idx = self.new_message("user", user), self.new_message("assistant", reference)
        _, logprobs, top1 = self._prefill(res, [(user_ids, user_idx), (reply_ids, reply_idx)], want_logprobs=True)
        rows = [len(user_ids) + j - 1 for j in cover]  # the logits that predict each covering token
        res.expect_nll = float(-logprobs[rows].mean())
        res.hit = bool(top1[rows].all())
        res.answer, res.expect = reference, expect
        return self._close_turn(res, [(user_idx, user_ids), (reply_idx, reply_ids)])

    @locked
    def reply(self, user: str, **sampling: Any) -> Generator[str, None, TurnResult]:
        """Add a user message and generate the reply; returns a generator yielding text as it is decoded.

        ``sampling``: settings of ``Sampling`` that apply to this reply only (None values ignored). Bad input raises
        here, before anything is fed. The generator's return value (``StopIteration.value``; also
        ``self.history[-1]``) is the TurnResult. ``cancel()`` or closing the generator stops the reply; what was
        generated is kept and committed. A ``cancel()`` while a long message is read raises ``ReadStopped`` from it,
        the session as before the message."""
        sampling = self.sampling.changed(**sampling)
        user = check_text(user, "user message")
        u = {"role": "user", "content": user}
        user_ids = self._segment_ids(self.messages, u)
        header = self.model.chat.generation_header(self.messages + [u])
        # undone: the undo copy of the turn before, kept again if a stop takes a long message's read back
        header_ids, undone = self._encode(header), self._undo if stoppable(user_ids) else None
        res = self._open_turn("assistant", len(user_ids) + len(header_ids) + CLOSING_RESERVE)
        return self._generate(Reply(res, self.messages + [u], header, header_ids, user_ids, undone), sampling)

    @locked
    def feed_raw(self, ids: list[int], score: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Feed tokens as plain text, without the chat template (long-text measurements such as perplexity).

        With ``score``, returns the log-probability the model gave each fed token and whether it was the top
        choice; the first token is scored by the logits that ended the previous feed (NaN / False when there were
        none). Without, only the last position's logits are computed."""
        if not ids:
            raise ValueError("nothing to feed")
        res = self._open_turn("user", len(ids))
        idx = self.new_message("user", self.model.tokenizer.decode(ids))
        previous = self.last_logits
        _, logprobs, top1 = self._prefill(res, [(list(ids), idx)], want_logprobs=score)
        self._close_turn(res, [(idx, list(ids))])
        if not score:
            return None
        first = torch.log_softmax(previous.float().cpu(), -1)[ids[0]] if previous is not None else torch.tensor(
            float("nan"))
        first_top = bool(previous is not None and int(previous.argmax()) == ids[0])
        return torch.cat([first[None], logprobs]), torch.cat([torch.tensor([first_top]), top1])

    def chat(self, user: str, **sampling) -> TurnResult:
        """``reply`` run to the end; returns the TurnResult (its ``answer`` holds the reply)."""
        gen = self.reply(user, **sampling)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value

    # -- a turn's prologue and epilogue -----------------------------------------------------------------------------
    def _open_turn(self, role: str, needed: int) -> TurnResult:
        """What every turn does first: check that ``needed`` more positions fit, and remember the state for undo.
        Eviction events are kept: those of a live settings change are committed with this turn."""
        self._warnings = []
        self.evictions.peak = self.cache.mean_length
        self._check_fits(needed)
        if role != "system" and self.undo_enabled:
            self._undo = None  # the copy of the turn before goes first (unless a long read keeps it for a stop)
            self._undo = Checkpoint.capture(self)
        self.turn_open = True
        return TurnResult(turn=self.turn, role=role)

    def _close_turn(self, res: TurnResult, messages: list[tuple[int, list[int]]]) -> TurnResult:
        res.cache_tokens, res.cache_bytes = self.cache.mean_length, self.cache.nbytes
        res.peak_cache_tokens = max(self.evictions.peak, res.cache_tokens)
        res.evicted_tokens = sum(e["evicted_tokens"] for e in self.evictions.events)
        res.evicted_groups = sum(e["evicted_groups"] for e in self.evictions.settle())
        res.warnings = list(self._warnings)
        self.recall_guard, self.recall_release = self.recall_guard[:0], False
        if self.digests is not None and self.digests.active:
            with stage("kvchat.digests"):  # the stages of a profiled turn (turns.STAGES)
                self.digests.add(self.cache, self.log, self.model.scaffolding_ids())
        res.archive_bytes = self.archive_bytes
        self.history.append(res)
        record = persist.turn_record(self, res, messages)
        self.turn, self.turn_open = self.turn + 1, False
        with stage("kvchat.commit"):
            persist.commit(self, record)
        res.disk_bytes = record["stats"].get("disk_bytes")
        return res

    def new_message(self, role: str, text: str) -> int:
        self.messages.append({"role": role, "content": text})
        return len(self.messages) - 1

    def warn(self, key: str, text: str) -> None:
        """A warning for the turn in progress, given once per session for each ``key``."""
        if key not in self.warned:
            if text not in self._warnings:  # a message read twice (recall) warns once
                self._warnings.append(text)
            self.warned.add(key)

    # -- position limits --------------------------------------------------------------------------------------------
    def _next_position(self) -> int:
        return self.log.n if self.settings.positions == "original" else self.cache.length

    def _hard_limit(self) -> bool:
        """Whether the model cannot go past its max positions at all (rather than degrade)."""
        return not self.policy.bounded or (self.settings.positions == "original" and not self.model.uses_rope)

    def _hard_limit_reached(self, more: int) -> bool:
        return self._hard_limit() and self._next_position() + more > self.model.max_positions

    def _check_fits(self, m: int) -> None:
        limit, nxt = self.model.max_positions, self._next_position()
        if self._hard_limit() and nxt + m > limit:
            way = ("switch to a bounded policy (e.g. streaming)" if not self.policy.bounded else
                   "switch to --positions rerotate (this model's positions are learned: original ones end there)")
            raise ContextFullError(
                f"this message needs {m} more positions but only {max(limit - nxt, 0)} of the model's {limit} are "
                f"left; {way} to go on"
            )
        if self.settings.positions == "original" and nxt + m > limit:
            self.warn("positions", f"original positions now pass the model's {limit} trained positions; "
                                   "quality will degrade (use --positions rerotate to stay within them)")

    # -- persistence ------------------------------------------------------------------------------------------------
    @classmethod
    def resume(cls, model: ChatModel, store, conversation_id: int, exact: bool = True,
               sampling: Sampling | None = None, undo: bool = False) -> "Session":
        """Reopen a stored conversation with the cache its last completed turn left, exactly (from the archive);
        conversations stored without one, or with ``exact=False``, rebuild it by prefilling the tokens it kept
        (``restored_from`` says which)."""
        return reopen.resume(cls, model, store, conversation_id, exact, sampling, undo)
