"""Generating a reply: sample, stream the text, feed the token back, and close the assistant turn the way the
chat template renders it. Mixed into ``Session`` (``reply`` opens the turn and returns this generator)."""

from __future__ import annotations

import sys
import time
from collections.abc import Generator
from dataclasses import dataclass, field

from .sampling import Sampler
from .tokens import Detokenizer
from .turns import TurnResult

CLOSING_RESERVE = 8  # positions kept free at a hard position limit for the tokens that close a reply


@dataclass
class Reply:
    """One reply in the making: the turn it belongs to, what was fed for it, and what was generated so far."""

    res: TurnResult
    history: list[dict]  # the messages before the reply, the user's included (as the template renders them)
    header: str  # the template's generation prompt
    header_ids: list[int]
    user_ids: list[int]
    user_idx: int = -1
    reply_idx: int = -1
    generated: list[int] = field(default_factory=list)
    decode_s: float = 0.0
    steps: int = 0


class Generation:
    """The lock is held for each model step, never across a yield: settings changes, views and ``cancel()`` from
    other threads land between steps."""

    def _generate(self, reply: Reply, sampling) -> Generator[str, None, TurnResult]:
        with self._lock:
            reply.user_idx = self.new_message("user", reply.history[-1]["content"])
            reply.reply_idx = self.new_message("assistant", "")
            self._cancel.clear()
            fed = [(reply.user_ids, reply.user_idx), (reply.header_ids, reply.reply_idx)]
            logits = self._prefill(reply.res, fed)[0]
            sample = Sampler(sampling, self.generator, self.log.column("token")[self.kept_positions()])
            self._streaming = reply.reply_idx
        detok = Detokenizer(self.model.tokenizer)
        stopped = None
        try:
            while True:
                with self._lock:
                    token = sample(logits)
                    reply.generated.append(token)
                    if token in self.model.stop_ids:
                        stopped = "eos"
                        break
                    delta = detok.push(token)
                if delta:
                    yield delta
                with self._lock:
                    if self._cancel.is_set():
                        stopped = "cancelled"
                    elif len(reply.generated) >= sampling.max_new_tokens:
                        stopped = "max_tokens"
                    elif self._hard_limit_reached(1 + CLOSING_RESERVE):
                        stopped = "context_full"
                    if stopped:
                        break
                    t = time.perf_counter()
                    logits = self._feed([([token], reply.reply_idx)], continue_message=True)[0]
                    reply.decode_s += time.perf_counter() - t
                    reply.steps += 1
        except GeneratorExit:  # the consumer closed the generator: the partial reply is kept and the turn closed
            if sys.is_finalizing():  # a generator left open until the interpreter exits: no model runs then
                raise
            with self._lock:
                self._finish_reply(reply, "cancelled")
            raise
        with self._lock:
            return self._finish_reply(reply, stopped)

    def _finish_reply(self, reply: Reply, stopped: str) -> TurnResult:
        tok, generated, res = self.model.tokenizer, reply.generated, reply.res
        self._streaming = None
        eos_last = stopped == "eos"
        content = tok.decode(generated[:-1] if eos_last else generated, skip_special_tokens=True)
        self.messages[reply.reply_idx]["content"] = content
        # Close the assistant turn the way the template renders it; the last sampled token is not cached yet.
        seg = self.model.chat.segment(reply.history, {"role": "assistant", "content": content})
        raw = reply.header + tok.decode(generated, skip_special_tokens=False)
        if seg.startswith(raw):
            closing = seg[len(raw):]
        else:
            closing, eos_text = self.model.chat.closing, tok.decode(generated[-1:]) if eos_last else ""
            closing = closing[len(eos_text):] if eos_last and closing.startswith(eos_text) else closing
        tail = generated[-1:] + self._encode(closing)
        if tail:
            self._feed([(tail, reply.reply_idx)], continue_message=True)
        res.new_tokens = len(generated)
        res.answer, res.stopped = content, stopped
        res.decode_ms_per_token = 1000 * reply.decode_s / reply.steps if reply.steps else None
        return self._close_turn(res, [(reply.user_idx, reply.user_ids),
                                      (reply.reply_idx, reply.header_ids + generated[:-1] + tail)])
