"""Generating a reply: sample, stream the text, feed the token back, and close the assistant turn the way the
chat template renders it. Mixed into ``Session`` (``reply`` opens the turn and returns this generator)."""

from __future__ import annotations

import sys
import time
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from . import persist
from .checkpoint import Checkpoint
from .feeding import stoppable
from .locking import locked
from .sampling import Sampler
from .tokens import Detokenizer
from .turns import ReadStopped, TurnResult, stage

CLOSING_RESERVE = 8  # positions kept free at a hard position limit for the tokens that close a reply


@dataclass
class Reply:
    """One reply in the making: the turn it belongs to, what was fed for it, and what was generated so far."""

    res: TurnResult
    history: list[dict]  # the messages before the reply, the user's included (as the template renders them)
    header: str  # the template's generation prompt
    header_ids: list[int]
    user_ids: list[int]
    undone: object = None  # the undo copy of the turn before (``Checkpoint``), kept again if a long read is stopped
    user_idx: int = -1
    reply_idx: int = -1
    generated: list[int] = field(default_factory=list)
    fed: int = 0  # how many of the generated tokens the loop fed to the model (its decode steps)
    decode_s: float = 0.0  # the engine's time in the decode loop (the consumer's between tokens left out)


class Generation:
    """The lock is held for each model step, never across a yield: settings changes, views and ``cancel()`` from
    other threads land between steps."""

    @locked
    def undo_reply(self, what: str = "undo") -> str:
        """``undo`` where the last turn is a reply: the exchange taken back and its user message returned, to be
        answered again (Retry, ``/retry``) or shown (``/undo``); ValueError ("nothing to ``what``") where the last
        turn is no reply this session can take back."""
        last = self.history[-1] if self.history else None
        if last is None or last.role != "assistant" or not self.can_undo:
            raise ValueError(f"nothing to {what}: only the last reply of this chat can be taken back, once")
        return next((m["content"] for m in self.undo() if m["role"] == "user"), "")

    def _generate(self, reply: Reply, sampling) -> Generator[str, None, TurnResult]:
        """The reply's generator. A ``cancel()`` from when it is made on stops it (one before is forgotten): a Stop
        pressed as a message is sent stops its read, or the reply at its first token."""
        self._cancel.clear()
        return self._replying(reply, sampling)

    def _replying(self, reply: Reply, sampling) -> Generator[str, None, TurnResult]:
        with self._lock:
            before = self._stop_copy(reply)
            reply.user_idx = self.new_message("user", reply.history[-1]["content"])
            reply.reply_idx = self.new_message("assistant", "")
            fed = [(reply.user_ids, reply.user_idx), (reply.header_ids, reply.reply_idx)]
            self.stop_reads = before is not None
            try:
                logits = self._prefill(reply.res, fed)[0]
            except ReadStopped:
                self._take_back(before, reply)
                raise
            finally:
                self.stop_reads, self.reading = False, None
            # Read: no stop can take it back now, so neither copy is needed through the reply (with undo, the cache
            # and its undo copy are what the session holds from here, what the web UI's --max-cache-mb reserves).
            before = reply.undone = None
            sample = Sampler(sampling, self.generator, self.log.column("token")[self.kept_positions()])
            self._streaming = reply.reply_idx
            picked = sample.pick(logits)
        detok = Detokenizer(self.model.tokenizer)
        stopped = None
        try:
            while True:
                with self._lock, stage("kvchat.token"):  # the stages of a profiled turn (turns.STAGES)
                    t = time.perf_counter()
                    # The token just picked is fed before the host reads it where the step takes it on the device:
                    # the device computes the next step while the host streams this token (every sampled token is
                    # fed next, by this loop or by _finish_reply, whatever stops the reply).
                    ahead = self._feed_ahead(picked)
                    token = sample.read()
                    reply.generated.append(token)
                    if ahead is not None:
                        self._log_reply_token(token, reply)
                    reply.decode_s += time.perf_counter() - t
                    if token in self.model.stop_ids:
                        stopped = "eos"
                        break
                    delta = detok.push(token)
                if delta:
                    yield delta
                with self._lock, stage("kvchat.token.next"):
                    t = time.perf_counter()
                    if self._cancel.is_set():
                        stopped = "cancelled"
                    elif len(reply.generated) >= sampling.max_new_tokens:
                        stopped = "max_tokens"
                    elif ahead is None and self._hard_limit_reached(1 + CLOSING_RESERVE):
                        stopped = "context_full"
                    if stopped:
                        break
                    if ahead is None:
                        logits = self._feed([([token], reply.reply_idx)], continue_message=True)[0]
                        reply.fed = len(reply.generated)
                    else:
                        logits = ahead
                    picked = sample.pick(logits)
                    reply.decode_s += time.perf_counter() - t
        except GeneratorExit:  # the consumer closed the generator: the partial reply is kept and the turn closed
            if sys.is_finalizing():  # a generator left open until the interpreter exits: no model runs then
                raise
            with self._lock:
                self._finish_reply(reply, "cancelled")
            raise
        with self._lock:
            return self._finish_reply(reply, stopped)

    def _stop_copy(self, reply: Reply) -> Checkpoint | None:
        """The session before a long user message is read (the turn's undo copy where one is kept), so that a stop
        while it is read can put it back (``_take_back``); None for a message read in one forward (it cannot be
        stopped part way, and a copy of the cache per turn would cost every short message)."""
        if not stoppable(reply.user_ids):
            return None
        return self._undo if self.undo_enabled else Checkpoint.capture(self)

    def _take_back(self, before: Checkpoint, reply: Reply) -> None:
        """A read stopped: the session as it was before the message (nothing was written: a turn is stored when it
        closes), the undo copy of the turn before kept again. A live settings change since the copy (the undo copy
        is taken as ``reply`` opens the turn; the change waits for the turn's commit) stays, as ``undo`` keeps it,
        and is written now."""
        current, deferred = self.settings, self.pending_settings[len(before.pending_settings):]
        before.restore(self)
        self.turn_open = False
        if current != self.settings:
            self._apply_settings(current)
        for record in deferred:  # held for the turn's commit, which will not come: written now
            persist.record_settings(self, record)
        self._undo = reply.undone if self.undo_enabled else None
        self.recall_guard, self.recall_release, self.carry = self.recall_guard[:0], False, 0

    def _feed_ahead(self, picked: torch.Tensor) -> torch.Tensor | None:
        """Feed the token ``picked`` ([1], where the sampler left it) before the host knows it, through a decode step
        that takes its token on the device (``runs_ahead``: the captured graph step on a GPU), and return the next
        logits; None where it must wait for the host (no such step, the cache needs a compression first, the
        model's last positions): the token is then fed by ``_feed`` once read. The token's log entry follows when
        it is read (``_log_reply_token``)."""
        step = self.model.step
        if step is None or not step.runs_ahead:
            return None
        if (self.policy.bounded and self.cache.room < 1) or self._hard_limit_reached(1 + CLOSING_RESERVE):
            return None
        logits = self.forward(picked, torch.tensor([self.log.n]))
        self.carry, self.last_logits = 0, logits[-1]
        return logits[-1]

    def _log_reply_token(self, token: int, reply: Reply) -> None:
        """The log entry of a reply's token fed by ``_feed_ahead``, at the position it was fed at."""
        self.log.append_messages(self.model.tokenizer, [([token], reply.reply_idx, "assistant")], self.turn,
                                 continue_message=True)
        reply.fed = len(reply.generated)

    def _finish_reply(self, reply: Reply, stopped: str) -> TurnResult:
        tok, generated, res = self.model.tokenizer, reply.generated, reply.res
        self._streaming = None
        eos_last = stopped == "eos"
        content = tok.decode(generated[:-1] if eos_last else generated, skip_special_tokens=True)
        self.messages[reply.reply_idx]["content"] = content
        # Close the assistant turn the way the template renders it.
        seg = self.model.chat.segment(reply.history, {"role": "assistant", "content": content})
        raw = reply.header + tok.decode(generated, skip_special_tokens=False)
        if seg.startswith(raw):
            closing = seg[len(raw):]
        else:
            closing, eos_text = self.model.chat.closing, tok.decode(generated[-1:]) if eos_last else ""
            closing = closing[len(eos_text):] if eos_last and closing.startswith(eos_text) else closing
        # The last sampled token is fed as a step of its own, as the loop feeds every token (or was, ahead of the
        # host: ``_feed_ahead``), then the closing: the same chunks, so the same compressions, either way.
        closing_ids = self._encode(closing)
        with stage("kvchat.closing"):
            if reply.fed < len(generated):
                self._feed([(generated[-1:], reply.reply_idx)], continue_message=True)
            if closing_ids:
                self._feed([(closing_ids, reply.reply_idx)], continue_message=True)
        res.new_tokens = len(generated)
        res.answer, res.stopped = content, stopped
        res.decode_ms_per_token = 1000 * reply.decode_s / reply.fed if reply.fed else None
        return self._close_turn(res, [(reply.user_idx, reply.user_ids),
                                      (reply.reply_idx, reply.header_ids + generated + closing_ids)])
