"""Generating a reply: sample, stream the text, feed the token back, and close the assistant turn the way the
chat template renders it. Mixed into ``Session`` (``reply`` opens the turn and returns this generator)."""

from __future__ import annotations

import time
from collections.abc import Generator

from .sampling import Sampler
from .tokens import Detokenizer
from .turns import TurnResult

CLOSING_RESERVE = 8  # positions kept free at a hard position limit for the tokens that close a reply


class Generation:
    """The lock is held for each model step, never across a yield: settings changes, views and ``cancel()`` from
    other threads land between steps."""

    def _generate(self, res, u, user_ids, header, header_ids, sampling) -> Generator[str, None, TurnResult]:
        history = self.messages + [u]
        with self._lock:
            user_idx, reply_idx = self.new_message("user", u["content"]), self.new_message("assistant", "")
            self._cancel.clear()
            logits = self._prefill(res, [(user_ids, user_idx), (header_ids, reply_idx)])[0]
        with self._lock:
            sample = Sampler(sampling, self.generator, self.log.column("token")[self.kept_positions()])
        generated: list[int] = []
        detok = Detokenizer(self.model.tokenizer)
        decode_s, steps, stopped = 0.0, 0, None
        self._streaming = reply_idx
        try:
            while True:
                with self._lock:
                    token = sample(logits)
                    generated.append(token)
                    if token in self.model.stop_ids:
                        stopped = "eos"
                        break
                    delta = detok.push(token)
                if delta:
                    yield delta
                with self._lock:
                    if self._cancel.is_set():
                        stopped = "cancelled"
                    elif len(generated) >= sampling.max_new_tokens:
                        stopped = "max_tokens"
                    elif self._hard_limit_reached(1 + CLOSING_RESERVE):
                        stopped = "context_full"
                    if stopped:
                        break
                    t = time.perf_counter()
                    logits = self._feed([([token], reply_idx)], continue_message=True)[0]
                    decode_s += time.perf_counter() - t
                    steps += 1
        except GeneratorExit:  # the consumer closed the generator: the partial reply is kept and the turn closed
            with self._lock:
                self._finish_reply(res, history, header, header_ids, user_ids, user_idx, reply_idx, generated, "cancelled",
                                   decode_s, steps)
            raise
        with self._lock:
            return self._finish_reply(res, history, header, header_ids, user_ids, user_idx, reply_idx, generated, stopped,
                                      decode_s, steps)

    def _finish_reply(self, res, history, header, header_ids, user_ids, user_idx, reply_idx, generated, stopped, decode_s,
                      steps) -> TurnResult:
        tok = self.model.tokenizer
        eos_last = stopped == "eos"
        content = tok.decode(generated[:-1] if eos_last else generated, skip_special_tokens=True)
        self.messages[reply_idx]["content"] = content
        # Close the assistant turn the way the template renders it; the last sampled token is not cached yet.
        seg = self.model.chat.segment(history, {"role": "assistant", "content": content})
        raw = header + tok.decode(generated, skip_special_tokens=False)
        if seg.startswith(raw):
            closing = seg[len(raw):]
        else:
            closing, eos_text = self.model.chat.closing, tok.decode(generated[-1:]) if eos_last else ""
            closing = closing[len(eos_text):] if eos_last and closing.startswith(eos_text) else closing
        tail = generated[-1:] + self._encode(closing)
        if tail:
            self._feed([(tail, reply_idx)], continue_message=True)
        self._streaming = None
        res.new_tokens = len(generated)
        res.answer, res.stopped = content, stopped
        res.decode_ms_per_token = 1000 * decode_s / steps if steps else None
        return self._close_turn(res, [(user_idx, user_ids), (reply_idx, header_ids + generated[:-1] + tail)])
