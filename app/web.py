"""``kvchat serve``: the Gradio web UI.

Chat (streamed, stop, undo/retry; Enter sends, Shift+Enter starts a new line: its handlers in app/chatting.py), a
settings panel generated from the declared settings (``core/engine/settings.py``) and the policies' declared
parameters that changes the live conversation, charts of the cache updated while a reply streams, the conversation
as the cache holds it, and the saved conversations. Each browser tab has its own engine session
(``SessionManager``); replies and conversation loads queue on the one model.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import weakref
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # a local tool: no calls home

import gradio as gr  # noqa: E402

from ..core.engine.settings import CACHE_SETTINGS, SAMPLING_SETTINGS  # noqa: E402
from ..core.model.names import check_held_by  # noqa: E402
from ..policies import POLICIES, declared_params, policy_class  # noqa: E402
from .args import parse_setting  # noqa: E402
from .chatting import Chatting  # noqa: E402
from .sessions import USER_ERRORS, CapacityError, Entry, SessionManager  # noqa: E402
from .layout import CSS, Layout, theme  # noqa: E402
from .scripts import export_script, replay_command  # noqa: E402
from .views import Live, cache_view, charts, chat_messages, error_html as _error, head_map, stored_turns  # noqa: E402


#: Conversations the saved list shows at once, the last used first; its search reaches the others. The page draws
#: the whole list again after every reply: with 1,000 listed its status line came 535 ms after the last token, with
#: 100 191-209 ms (docs/usage.md).
LIST_LIMIT = 100
MAX_SEARCH_CHARS = 200


class WebApp(Layout, Chatting):
    """The UI's event handlers over a SessionManager; ``build()`` lays out the Blocks and wires the events."""

    def __init__(self, manager: SessionManager, model_name: str):
        self.manager = manager
        self.model_name = model_name
        self.params = declared_params()
        # the conversations exported for download; removed with the app (at exit at the latest), not left in /tmp
        self._exports = tempfile.TemporaryDirectory(prefix="kvchat-export-")
        self.export_dir = Path(self._exports.name)
        self.searches: dict[str, str] = {}  # each tab's search of its saved list (by Gradio session), "" for none
        self.replying: dict[str, weakref.ref] = {}  # each tab's entry its last reply started on (``after_reply``)

    # -- the views one handler refreshes ----------------------------------------------------------------------------
    def _info(self, key: str, entry: Entry) -> str:
        s = entry.session
        st = s.stats()
        cfg = st["settings"]
        conv = f"conversation #{s.conversation_id}" if s.conversation_id is not None else "new conversation"
        limit = f"{st['capacity']:,}" if st["capacity"] is not None else "—"
        return (f"session `{key[:8]}` · {conv} · model {self.model_name} · **{st['policy']}** budget "
                f"{cfg['budget']:,} ({cfg['groups']} groups, {cfg['positions']} positions) · cache "
                f"{st['cache_tokens']:,} / {limit} positions, {st['cache_bytes'] / 2**20:.1f} MB · "
                f"{st['total_tokens']:,} tokens in the conversation")

    def _conversations(self, key: str, entry: Entry | None = None, value: int | None = None, keep: bool = False):
        """The saved list of the tab ``key``: the ``LIST_LIMIT`` last used of the conversations its search finds,
        its label saying how many there are; ``value`` (else the tab's conversation) chosen where listed, or with
        ``keep`` the page's choice left as it is (a reply's end, a settings change: a conversation chosen stays)."""
        store, search = self.manager.store, self.searches.get(key, "")
        choices = []
        for c in store.conversations(search, limit=LIST_LIMIT):
            when = (c["updated_at"] or "")[:16].replace("T", " ")
            label = (f"#{c['id']} {c['title']} · {c['total_tokens']:,} tokens, {c['disk_bytes'] / 2**20:.1f} MB on "
                     f"disk · {c['settings'].get('policy', '?')} · {when}{self._other_model(c)}")
            choices.append((label, c["id"]))
        total = store.conversation_count(search) if len(choices) == LIST_LIMIT else len(choices)
        shown = f"the {len(choices)} last used of {total:,}" if total > len(choices) else f"{total:,}"
        label = (f"Saved: {shown} with “{search}”" if search else
                 f"Saved: {shown} (search for the others)" if total > len(choices) else "Saved")
        if keep:
            return gr.update(choices=choices, label=label)
        if value is None and entry is not None:
            value = entry.session.conversation_id
        return gr.update(choices=choices, label=label, value=value if value in {c[1] for c in choices} else None)

    def _other_model(self, row: dict) -> str:
        """What the saved list says of conversation ``row`` held by another model than the server's (Open refuses
        it: it reopens under the model that held it), else nothing."""
        try:
            check_held_by(row["id"], row["model"], self.manager.model.name)
        except ValueError:
            return f" · model {row['model']} (kvchat serve --model opens it)"
        return ""

    def search_conversations(self, text: str, request: gr.Request):
        """The search box: the tab's saved list narrowed to the conversations whose title or any message contains
        the text (all of them again when it is emptied)."""
        key = request.session_hash
        self.searches[key] = (text or "").strip()[:MAX_SEARCH_CHARS]
        return self._conversations(key, self.manager.get(key))

    def _charts(self, entry: Entry, live: Live | None = None, stored=None):
        stored = stored or stored_turns(entry.session, self.manager.store, entry.stored)
        return charts(entry.session, stored, entry.rss_mb, self.manager.per_position_bytes(entry.session.settings),
                      live)

    def _head_map(self, entry: Entry):
        fig = head_map(entry.session)
        return gr.update(value=fig, visible=fig is not None)

    def _settings_values(self, entry: Entry) -> list:
        """The settings panel's values for the tab's session: cache settings, policy parameters (the running
        policy's shown), sampling settings, the policy's summary."""
        s = entry.session.settings
        values = [getattr(s, p.name) for p in CACHE_SETTINGS]
        declared = {p.name for p in POLICIES[s.policy].params}
        policy_values = entry.session.stats()["params"]
        for name, (p, _) in self.params.items():
            values.append(gr.update(value=policy_values.get(name, p.default) if name in declared else p.default,
                                    visible=name in declared))
        sampling = entry.session.sampling
        return values + [getattr(sampling, p.name) for p in SAMPLING_SETTINGS] + [POLICIES[s.policy].summary]

    def _all(self, key: str, entry: Entry, status: str = "") -> list:
        """chat, charts, head map, cache view, conversations, status, info."""
        return [chat_messages(entry.session), self._charts(entry), self._head_map(entry), cache_view(entry.session),
                self._conversations(key, entry), status, self._info(key, entry)]

    def _blank(self, status: str, conversations=None) -> list:
        return [gr.skip(), gr.skip(), gr.skip(), gr.skip(), conversations or gr.skip(), _error(status), gr.skip()]

    def _list_after_error(self, key: str, conversation_id):
        """After an error about the chosen conversation: the tab's list drawn again, its choice cleared, where that
        conversation is no longer saved (deleted in another tab or by ``kvchat conversations delete``); else, or
        where the database cannot be read now (the error says so), left as it is."""
        try:
            if conversation_id is not None and not self.manager.store.has(int(conversation_id)):
                return self._conversations(key)
        except USER_ERRORS:
            pass
        return gr.skip()

    # -- handlers ---------------------------------------------------------------------------------------------------
    def load(self, request: gr.Request):
        key = request.session_hash
        try:
            entry = self.manager.entry(key)
        except CapacityError as exc:
            return self._blank(str(exc)) + [gr.skip()] * self.n_settings
        return self._all(key, entry, "") + self._settings_values(entry)

    def unload(self, request: gr.Request):
        self.searches.pop(request.session_hash, None)
        self.replying.pop(request.session_hash, None)
        self.manager.release(request.session_hash)

    def _entry(self, key: str) -> Entry:
        note = key in self.manager.moved
        entry = self.manager.entry(key)
        if note:
            gr.Info("This tab's conversation was opened in another tab; a new conversation started here.")
        return entry

    @staticmethod
    def _idle(entry: Entry | None) -> Entry | None:
        if entry is not None and entry.busy:
            raise ValueError("a reply is streaming; stop it first")
        return entry

    def apply_settings(self, request: gr.Request, *values, quiet: bool = False):
        """Settings widgets (cache settings, then policy parameters) -> the live session. Every value is parsed by
        its declaration first; a bad one is a visible error and nothing is applied. Returns charts, head map, cache
        view, status, info and the saved conversations (their policy as stored, which a change rewrites; the list's
        choice left as the page has it)."""
        key = request.session_hash
        cache_values, param_values = values[:len(CACHE_SETTINGS)], dict(zip(self.params, values[len(CACHE_SETTINGS):]))
        try:
            entry = self._entry(key)
            changes = {p.name: parse_setting(p, v) for p, v in zip(CACHE_SETTINGS, cache_values)}
            params = {}
            for p in policy_class(changes["policy"]).params:
                value = param_values.get(p.name)
                if value is None or value == "":
                    continue
                params[p.name] = parse_setting(p, value)
            new = entry.session.settings.changed(params=params, **changes)
            new.validate(self.manager.model.max_positions, self.manager.model.rotary_error)
            self.manager.check_room(key, new, new=False)
            before = entry.session.settings.as_dict()
            applied = entry.session.configure(params=params, **changes)
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return [gr.skip()] * 3 + [_error(str(exc)), gr.skip(), gr.skip()]
        if applied:
            what = ", ".join(f"{k} {before.get(k)} → {v}" for k, v in applied.items() if k != "params")
            if "params" in applied:
                what = ", ".join(filter(None, [what, f"params {applied['params'] or 'defaults'}"]))
            status = f"applied: {what}"
        elif quiet:
            return [gr.skip()] * 6  # the blur after an Enter that already applied the value
        else:
            status = "settings unchanged"
        if applied and entry.busy:
            entry.during_reply.append(status)
        s = entry.session
        return [self._charts(entry), self._head_map(entry), cache_view(s), status, self._info(key, entry),
                self._conversations(key, entry, keep=True) if applied else gr.skip()]

    def apply_settings_on_blur(self, request: gr.Request, *values):
        """Leaving a field applies it too, silently when nothing changed."""
        return self.apply_settings(request, *values, quiet=True)

    def policy_changed(self, policy: str):
        """Show the new policy's parameters at their defaults."""
        declared = {p.name for p in POLICIES[policy].params}
        return [gr.update(value=p.default, visible=name in declared) for name, (p, _) in self.params.items()] + [
            POLICIES[policy].summary]

    def sampling(self, request: gr.Request, *values):
        """Sampling widgets (in ``SAMPLING_SETTINGS`` order) -> the session's sampling settings, each value parsed
        by its declaration; a bad one is a visible error and nothing is applied. Returns the status."""
        try:
            entry = self._entry(request.session_hash)
            given = {p.name: parse_setting(p, v) for p, v in zip(SAMPLING_SETTINGS, values)}
            new = entry.session.sampling.changed(**given)
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return _error(str(exc))
        changed, entry.session.sampling = new != entry.session.sampling, new
        rest = ", ".join(f"{p.name.replace('_', '-')} {getattr(new, p.name)}" for p in SAMPLING_SETTINGS
                         if p.name != "max_new_tokens")
        status = f"generation: up to {new.max_new_tokens} new tokens, {rest}"
        if changed and entry.busy:  # not the blur after an Enter, nor a field left unchanged
            entry.during_reply.append(status)
        return status

    def new_conversation(self, system: str, request: gr.Request):
        key = request.session_hash
        try:
            self._idle(self.manager.get(key))
            entry = self.manager.new(key, system=system if system and system.strip() else None)
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return self._blank(str(exc)) + [gr.skip()] * self.n_settings
        entry.said = "new conversation"
        return self._all(key, entry, entry.said) + self._settings_values(entry)

    def open_conversation(self, conversation_id, request: gr.Request):
        key = request.session_hash
        try:
            if conversation_id is None:
                raise ValueError("choose a conversation in the list first")
            self._idle(self.manager.get(key))
            entry = self.manager.open(key, int(conversation_id))
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return self._blank(str(exc), self._list_after_error(key, conversation_id)) + [gr.skip()] * self.n_settings
        how = {"archive": "restored exactly as its last turn left it",
               "tokens": "rebuilt from the tokens it kept"}.get(entry.session.restored_from, "")
        entry.said = f"opened conversation #{conversation_id}; its cache was {how}" if how else ""
        return self._all(key, entry, entry.said) + self._settings_values(entry)

    def rename(self, conversation_id, title: str, request: gr.Request):
        try:
            if conversation_id is None:
                raise ValueError("choose a conversation in the list first")
            self.manager.store.rename(int(conversation_id), title or "")
            holder = self.manager.holder(int(conversation_id))
            if holder is not None:
                self.manager.get(holder).session.title = title.strip()
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return self._list_after_error(request.session_hash, conversation_id), _error(str(exc)), gr.skip()
        return (self._conversations(request.session_hash, value=int(conversation_id)),
                f"renamed conversation #{conversation_id}", "")

    def delete(self, conversation_id, request: gr.Request):
        key = request.session_hash
        try:
            if conversation_id is None:
                raise ValueError("choose a conversation in the list first")
            holder = self.manager.holder(int(conversation_id))
            if holder is not None and holder != key:
                raise ValueError(f"conversation #{conversation_id} is open in another tab")
            if holder == key:
                self._idle(self.manager.get(key))
                self.manager.store.delete(int(conversation_id))
                entry = self.manager.new(key)
            else:
                self.manager.store.delete(int(conversation_id))
                entry = self._entry(key)
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return self._blank(str(exc), self._list_after_error(key, conversation_id))
        return self._all(key, entry, f"deleted conversation #{conversation_id}")

    def export(self, conversation_id, request: gr.Request):
        try:
            if conversation_id is None:
                raise ValueError("choose a conversation in the list first")
            lines = export_script(self.manager.store, int(conversation_id))
            path = self.export_dir / f"conversation-{int(conversation_id)}.jsonl"
            command = replay_command(self.manager.store, int(conversation_id), path.name)
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return (gr.update(visible=False), _error(str(exc)),
                    self._list_after_error(request.session_hash, conversation_id))
        path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
        return (gr.update(value=str(path), visible=True),
                f"exported conversation #{conversation_id}: replay it as it began with `{command}`", gr.skip())


def serve(manager: SessionManager, model_name: str, host: str = "127.0.0.1", port: int = 7860,
          auth: list[tuple[str, str]] | None = None, share: bool = False) -> None:
    app = WebApp(manager, model_name)
    demo = app.build()
    # SIGTERM (kill, systemd, a container's stop) shuts the server down as Ctrl-C does (Gradio closes it on a
    # KeyboardInterrupt): then the sessions close, their temporary files and the exports go; the caller's handler
    # comes back after
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        demo.launch(server_name=host, server_port=port, auth=auth or None, share=share, show_error=True,
                    theme=theme(), css=CSS, footer_links=[], allowed_paths=[str(app.export_dir)],
                    ssr_mode=False, quiet=False)
    finally:
        manager.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
