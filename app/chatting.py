"""The web UI's chat handlers, mixed into ``WebApp`` (app/web.py): a message sent and its reply streamed into the
chat pane with the charts kept live, Stop (of the reply, or of the reading of a long message: then nothing of it is
kept and it goes back to the input), Undo and Retry."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref

import gradio as gr

from ..core.engine.session import ReadStopped, memory_mb
from .sessions import USER_ERRORS
from .views import Live, cache_view, chat_messages, error_html as _error, stored_turns

#: The charts' refresh while a reply streams: each one held the page's drawing of the reply 0.3-0.47 s on this
#: machine (every second, a 300-token reply froze 7 times; docs/usage.md).
CHART_EVERY_S = 3.0
SHOW_EVERY_S = 0.05  # the streamed reply is shown at most this often (the tokens between come with the next)
READING_EVERY_S = 0.5  # how often the status says how far a long message's read got
#: Longer messages are refused: the browser's text box and the chat pane, which shows each message whole, slow down
#: past it (docs/usage.md); ``kvchat chat`` and ``kvchat replay`` take any length.
MAX_MESSAGE_CHARS = 100_000


class Chatting:
    """The chat's handlers (``WebApp`` supplies ``_entry``, ``_idle`` and the views they refresh)."""

    def reply(self, text: str, event: gr.EventData, request: gr.Request):
        """Send, Enter or Retry (one event, wired in app/layout.py): ``retry`` or ``send``'s outputs, with Send, Retry
        and Undo greyed while the reply streams (``after_reply`` gives them back when the event ends)."""
        key = request.session_hash
        if (entry := self.manager.get(key)) is not None:
            self.replying[key] = weakref.ref(entry)
        run = self.retry(request) if event.target is self.retry_button else self.send(text, request)
        for out in run:
            yield [*out, *[gr.update(interactive=False)] * 3]

    def after_reply(self, chosen, request: gr.Request):
        """When a reply's event has ended, in the page too: Send, Retry and Undo back, and, where New or Open replaced
        the tab's conversation meanwhile, the views drawn again from it. The page draws each event's updates in its
        own loop, so the stopped reply's last ones, still queued there under load, could land after New's or Open's
        and leave the old chat on screen (seen: the chat and status of the stopped reply over the opened
        conversation); this handler runs only once they are all drawn. A reply leaves the saved list's choice
        (``chosen``, as the page has it now) to the person; where nothing is chosen, the tab's conversation is (the
        first reply of a new one saves it). Returns the views, then the three buttons."""
        key = request.session_hash
        started, now = self.replying.pop(key, None), self.manager.get(key)
        buttons = [gr.update(interactive=True)] * 3
        if started is None or now is None or started() is now or now.said is None:  # None: its views still to come
            listed = gr.skip()
            if chosen is None and now is not None and now.session.conversation_id is not None:
                listed = self._conversations(key, now)
            return [gr.skip()] * 4 + [listed] + [gr.skip()] * 2 + buttons
        return self._all(key, now, now.said) + buttons

    def send(self, text: str, request: gr.Request):
        key = request.session_hash
        yield from self._stream(key, text)

    def _stream(self, key: str, text: str):
        """Yields chat, input, charts, head map, cache view, conversations, status, info."""
        keep = [gr.skip()] * 6
        try:
            entry = self._idle(self._entry(key))  # a second submit while a reply streams is refused
            if isinstance(text, str) and len(text) > MAX_MESSAGE_CHARS:
                raise ValueError(f"the message is too long ({len(text):,} characters; the web UI takes up to "
                                 f"{MAX_MESSAGE_CHARS:,}): feed longer texts with kvchat replay")
            gen = entry.session.reply(text)
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            yield [gr.skip(), gr.skip()] + [gr.skip()] * 3 + [gr.skip(), _error(str(exc)), gr.skip()]
            return
        s = entry.session
        entry.busy, entry.during_reply = True, []
        shown = chat_messages(s) + [{"role": "user", "content": text}, {"role": "assistant", "content": "▌"}]
        yield [shown, ""] + keep
        answer, last_shown, t0, n, before = "", 0.0, time.perf_counter(), 0, None
        # The first chart CHART_EVERY_S into the reply, not with its first token: the browser draws the plot before
        # the chat, which showed that token 160-310 ms later (docs/usage.md).
        last_chart = t0
        stored = stored_turns(s, self.manager.store, entry.stored)  # unchanged until the reply commits
        failed = broken = unread = None
        try:
            first = yield from self._read_first(gen, s)
            for delta in itertools.chain([] if first is None else [first], gen):
                answer += delta
                n += 1
                if before is None:  # the finished messages (and the user's count) are drawn once per reply
                    before = chat_messages(s, in_progress=False)
                now = time.perf_counter()
                if now - last_shown < SHOW_EVERY_S:
                    continue  # the browser draws the whole pane again for each update: these tokens go with the next
                last_shown, chart = now, gr.skip()
                if now - last_chart >= CHART_EVERY_S:
                    last_chart = now
                    cache = s.cache_now()
                    live = Live(cache["turn"], cache["cache_tokens"], cache["cache_bytes"], n / max(now - t0, 1e-6),
                                memory_mb(s.model.device)[1])
                    chart = self._charts(entry, live, stored)
                yield [before + [{"role": "assistant", "content": answer + " ▌"}], gr.skip(), chart] + [gr.skip()] * 5
        except ReadStopped as exc:  # Stop while a long message was still read: as if it had not been sent
            unread = exc
        except (*USER_ERRORS, OSError) as exc:  # the turn could not be written (database locked, disk full)
            failed = exc
        except Exception as exc:  # noqa: BLE001 — a model step raised (out of GPU memory, say): the turn is lost
            logging.getLogger(__name__).exception("a reply failed")
            broken = exc
        finally:
            gen.close()  # if the browser went away mid-reply: the partial reply is kept and the turn closed
            entry.busy = False
        if unread is not None:
            yield [chat_messages(s), text] + [gr.skip()] * 4 + [f"{unread}; your message is back in the input",
                                                                self._info(key, entry)]
            return
        if broken is not None:  # the session reopened at its last saved turn; the message back in the input
            entry = self.manager.recover(key)
            s = entry.session
            note = (f"the reply failed ({type(broken).__name__}: {str(broken)[:200]}); the conversation was "
                    f"reopened at its last saved turn, and your message is back in the input")
            gr.Warning(note)
            yield [chat_messages(s), text, self._charts(entry), self._head_map(entry), cache_view(s),
                   self._conversations(key, entry), _error(note), self._info(key, entry)]
            return
        if failed is not None:
            text = (f"the reply was not saved: {failed}. It stays in this tab and is saved with the next turn that "
                    "can be")
            gr.Warning(text)
            yield [chat_messages(s), gr.skip(), self._charts(entry), self._head_map(entry), cache_view(s),
                   gr.skip(), _error(text), self._info(key, entry)]
            return
        res = s.history[-1]
        entry.rss_mb[res.turn] = memory_mb(s.model.device)[1]
        speed = f", {1000 / res.decode_ms_per_token:.1f} tokens/s" if res.decode_ms_per_token else ""
        status = (f"reply: {res.new_tokens} tokens{speed}, prompt {res.prompt_tokens} tokens in {res.prefill_ms:.0f} ms"
                  f"; {res.evicted_tokens} evicted"
                  + (f"; {note}" if (note := res.recall_note()) else "")
                  + f"; stopped by {res.stopped}")
        status = "; ".join([status] + res.warnings + [f"during it, {said}" for said in entry.during_reply])
        yield [chat_messages(s), gr.skip(), self._charts(entry), self._head_map(entry), cache_view(s),
               self._conversations(key, entry, keep=True), status, self._info(key, entry)]

    @staticmethod
    def _read_first(gen, session):
        """The reply's first delta (None if it ends without one): its message is read first, in a worker thread
        while the handler shows how far a long message's read got (yielded as the status line, every
        ``READING_EVERY_S``). Whatever the generator raises is raised here."""
        out = {}

        def first():
            try:
                out["delta"] = next(gen, None)
            except BaseException as exc:  # noqa: BLE001 — handed to the handler's thread
                out["raised"] = exc

        worker = threading.Thread(target=first, name="kvchat-read", daemon=True)
        worker.start()
        try:
            while worker.is_alive():
                worker.join(READING_EVERY_S)
                if worker.is_alive() and (reading := session.reading) is not None:
                    yield [gr.skip()] * 6 + [f"reading your message: {reading[0]:,} of {reading[1]:,} tokens (Stop "
                                             "stops it and gives the message back)", gr.skip()]
        finally:  # the browser went away while the message was read: stopped (a long one), then closed as a reply
            if worker.is_alive():
                session.cancel()
                worker.join()
        if "raised" in out:
            raise out["raised"]
        return out["delta"]

    def stop(self, request: gr.Request):
        """Stop, and New or the chat pane's clear: this tab's reply or message read, if any, stops at its next step
        (a reply is kept as far as it got)."""
        entry = self.manager.get(request.session_hash)
        if entry is not None and entry.busy:
            entry.session.cancel()

    def stop_for_open(self, conversation_id, request: gr.Request):
        """Open stops this tab's reply only where a conversation is chosen (without one it only says so)."""
        if conversation_id is not None:
            self.stop(request)

    def undo(self, request: gr.Request):
        """chat, input, charts, head map, cache view, conversations, status, info."""
        key = request.session_hash
        try:
            entry = self._idle(self._entry(key))
            removed = entry.session.undo()
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return [gr.skip()] * 6 + [_error(str(exc)), gr.skip()]
        entry.rss_mb = {t: v for t, v in entry.rss_mb.items() if t < entry.session.turn}
        user = next((m["content"] for m in removed if m["role"] == "user"), "")
        views = self._all(key, entry, "the last turn was taken back; the cache is as it was before it")
        return [views[0], user] + views[1:]

    def retry(self, request: gr.Request):
        key = request.session_hash
        try:
            entry = self._idle(self._entry(key))
            user = entry.session.undo_reply("retry")
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            yield [gr.skip()] * 6 + [_error(str(exc)), gr.skip()]
            return
        yield from self._stream(key, user)
