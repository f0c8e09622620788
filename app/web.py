"""``kvchat serve``: the Gradio web UI.

Chat (streamed, stop, undo/retry), a settings panel generated from the policies' declared parameters that
changes the live conversation, charts of the cache updated while a reply streams, the conversation as the cache
holds it, and the saved conversations. Each browser tab has its own engine session (``SessionManager``); replies
and conversation loads queue on the one model.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # a local tool: no calls home

import gradio as gr  # noqa: E402

from ..core.session import ContextFullError, Sampling, rss_mb  # noqa: E402
from ..policies import POLICIES, declared_params  # noqa: E402
from .sessions import CapacityError, Entry, SessionManager  # noqa: E402
from .views import Live, cache_view, charts, chat_messages, head_map  # noqa: E402

CHART_EVERY_S = 1.0  # chart refresh while a reply streams
USER_ERRORS = (ValueError, ContextFullError, CapacityError)

CSS = """
#kv-status p { margin: 0; }
#kv-status .kv-error { color: #b42318; font-weight: 600; }
#kv-info { font-size: 0.85em; opacity: 0.8; }
.kv-cacheview { max-height: 560px; overflow-y: auto; font-family: ui-monospace, monospace; font-size: 12px;
                white-space: pre-wrap; line-height: 1.45; }
.kv-cacheview .kv-msg { margin: 0 0 8px 0; padding: 4px 6px; border-left: 3px solid #ccc; }
.kv-cacheview .kv-user { border-color: #1f77b4; }
.kv-cacheview .kv-assistant { border-color: #2ca02c; }
.kv-cacheview .kv-system { border-color: #9467bd; }
.kv-cacheview .kv-role { display: block; font-weight: 600; font-family: ui-sans-serif, sans-serif; font-size: 11px;
                         text-transform: uppercase; opacity: 0.7; }
.kv-cacheview .kv-evicted { color: #a0a0a0; background: #f1f1f1; text-decoration: line-through; }
.kv-cacheview .kv-partial { background: #fff3c4; }
.kv-cacheview .kv-summary { font-family: ui-sans-serif, sans-serif; font-size: 13px; }
"""


def _theme():
    # System fonts only: the page must not reach for web fonts (a local tool, often offline).
    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "Consolas", "monospace"])


def _error(text: str) -> str:
    return f'<span class="kv-error">⚠ {text}</span>'


class WebApp:
    """The UI's event handlers over a SessionManager; ``build()`` lays out the Blocks."""

    def __init__(self, manager: SessionManager, model_name: str):
        self.m = manager
        self.model_name = model_name
        self.params = declared_params()
        self.export_dir = Path(tempfile.mkdtemp(prefix="kvchat-export-"))

    # -- the views one handler refreshes ----------------------------------------------------------------------------
    def _info(self, key: str, entry: Entry) -> str:
        s = entry.session
        st = s.settings
        conv = f"conversation #{s.conversation_id}" if s.conversation_id is not None else "new conversation"
        limit = f"{st.capacity:,}" if s.policy.bounded else "—"
        return (f"session `{key[:8]}` · {conv} · model {self.model_name} · **{st.policy}** budget {st.budget:,} "
                f"({st.groups} groups, {st.positions} positions) · cache {s.cache.length:,} / {limit} positions, "
                f"{s.cache_bytes / 2**20:.1f} MB · {s.total_tokens:,} tokens in the conversation")

    def _conversation_choices(self):
        out = []
        for c in self.m.store.conversations():
            when = (c["updated_at"] or "")[:16].replace("T", " ")
            label = (f"#{c['id']} {c['title']} · {c['total_tokens']:,} tokens · {c['settings'].get('policy', '?')} · "
                     f"{when}")
            out.append((label, c["id"]))
        return out

    def _conversations(self, entry: Entry | None):
        value = entry.session.conversation_id if entry is not None else None
        return gr.update(choices=self._conversation_choices(), value=value)

    def _charts(self, entry: Entry, live: Live | None = None):
        return charts(entry.session, self.m.store, entry.rss_mb, self.m.per_position_bytes(), live)

    def _head_map(self, entry: Entry):
        fig = head_map(entry.session)
        return gr.update(value=fig, visible=fig is not None)

    def _settings_values(self, entry: Entry) -> list:
        s = entry.session.settings
        values = [s.policy, s.budget, s.sink, s.window, s.slack, s.groups, s.positions, s.aggregate]
        declared = {p.name for p in POLICIES[s.policy].params}
        policy = entry.session.policy
        for name, (p, _) in self.params.items():
            values.append(gr.update(value=policy.values.get(name, p.default) if name in declared else p.default,
                                    visible=name in declared))
        smp = entry.session.sampling
        return values + [smp.max_new_tokens, smp.temperature, smp.top_p, POLICIES[s.policy].summary]

    def _all(self, key: str, entry: Entry, status: str = "") -> list:
        """chat, charts, head map, cache view, conversations, status, info."""
        return [chat_messages(entry.session), self._charts(entry), self._head_map(entry), cache_view(entry.session),
                self._conversations(entry), status, self._info(key, entry)]

    def _blank(self, status: str) -> list:
        return [gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), _error(status), gr.skip()]

    # -- handlers ---------------------------------------------------------------------------------------------------
    def load(self, request: gr.Request):
        key = request.session_hash
        try:
            entry = self.m.entry(key)
        except CapacityError as exc:
            return self._blank(str(exc)) + [gr.skip()] * self.n_settings
        return self._all(key, entry, "") + self._settings_values(entry)

    def unload(self, request: gr.Request):
        self.m.release(request.session_hash)

    def _entry(self, key: str) -> Entry:
        note = key in self.m.moved
        entry = self.m.entry(key)
        if note:
            gr.Info("This tab's conversation was opened in another tab; a new conversation started here.")
        return entry

    @staticmethod
    def _idle(entry: Entry | None) -> Entry | None:
        if entry is not None and entry.busy:
            raise ValueError("a reply is streaming; stop it first")
        return entry

    def send(self, text: str, request: gr.Request):
        key = request.session_hash
        yield from self._stream(key, text)

    def _stream(self, key: str, text: str):
        """Yields chat, input, charts, head map, cache view, conversations, status, info."""
        keep = [gr.skip()] * 6
        try:
            entry = self._entry(key)
            gen = entry.session.reply(text)
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            yield [gr.skip(), gr.skip()] + [gr.skip()] * 3 + [gr.skip(), _error(str(exc)), gr.skip()]
            return
        s = entry.session
        entry.busy = True
        shown = chat_messages(s) + [{"role": "user", "content": text}, {"role": "assistant", "content": "▌"}]
        yield [shown, ""] + keep
        answer, last_chart, t0, n, before = "", 0.0, time.perf_counter(), 0, None
        try:
            for delta in gen:
                answer += delta
                n += 1
                if before is None:  # the finished messages (and the user's count) are drawn once per reply
                    before = chat_messages(s, in_progress=True)
                now = time.perf_counter()
                chart = gr.skip()
                if now - last_chart >= CHART_EVERY_S:
                    last_chart = now
                    with s._lock:
                        live = Live(s.turn, s.cache.mean_length, s.cache_bytes, n / max(now - t0, 1e-6), rss_mb())
                    chart = self._charts(entry, live)
                yield [before + [{"role": "assistant", "content": answer + " ▌"}], gr.skip(), chart] + [gr.skip()] * 5
        finally:
            gen.close()  # if the browser went away mid-reply: the partial reply is kept and the turn closed
            entry.busy = False
        res = s.history[-1]
        entry.rss_mb[res.turn] = rss_mb()
        speed = f", {1000 / res.decode_ms_per_token:.1f} tokens/s" if res.decode_ms_per_token else ""
        status = (f"reply: {res.new_tokens} tokens{speed}, prompt {res.prompt_tokens} tokens in {res.prefill_ms:.0f} ms"
                  f"; {res.evicted_tokens} evicted; stopped by {res.stopped}")
        status = "; ".join([status] + res.warnings)
        yield [chat_messages(s), gr.skip(), self._charts(entry), self._head_map(entry), cache_view(s),
               self._conversations(entry), status, self._info(key, entry)]

    def stop(self, request: gr.Request):
        entry = self.m.get(request.session_hash)
        if entry is not None:
            entry.session.cancel()

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
            last = entry.session.history[-1] if entry.session.history else None
            if last is None or last.role != "assistant" or not entry.session.can_undo:
                raise ValueError("nothing to retry: the last turn of this tab is not a reply")
            removed = entry.session.undo()
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            yield [gr.skip()] * 6 + [_error(str(exc)), gr.skip()]
            return
        user = next((m["content"] for m in removed if m["role"] == "user"), None)
        yield from self._stream(key, user)

    def apply_settings(self, request: gr.Request, *values, quiet: bool = False):
        """Settings widgets -> the live session. Returns charts, head map, cache view, status, info."""
        key = request.session_hash
        policy, budget, sink, window, slack, groups, positions, aggregate = values[:8]
        raw = dict(zip(self.params, values[8:]))
        try:
            entry = self._entry(key)
            cls = POLICIES[policy]
            params = {}
            for p in cls.params:
                value = raw.get(p.name)
                if value is None or value == "":
                    continue
                value = p.parse(value)
                if value != p.default:
                    params[p.name] = value
            new = entry.session.settings.changed(
                policy=policy, params=params, budget=_int(budget, "budget"), sink=_int(sink, "sink"),
                window=_int(window, "window", optional=True), slack=_int(slack, "slack", optional=True),
                groups=groups, positions=positions, aggregate=aggregate)
            new.validate(self.m.model.max_positions, self.m.model.rotary_error)
            self.m.check_room(key, new, new=False)
            before = entry.session.settings.as_dict()
            applied = entry.session.configure(**{k: getattr(new, k) for k in
                                                 ("policy", "params", "budget", "sink", "window", "slack", "groups",
                                                  "positions", "aggregate")})
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return [gr.skip()] * 3 + [_error(str(exc)), gr.skip()]
        if applied:
            what = ", ".join(f"{k} {before.get(k)} → {v}" for k, v in applied.items() if k != "params")
            if "params" in applied:
                what = ", ".join(filter(None, [what, f"params {applied['params'] or 'defaults'}"]))
            status = f"applied: {what}"
        elif quiet:
            return [gr.skip()] * 5  # the blur after an Enter that already applied the value
        else:
            status = "settings unchanged"
        s = entry.session
        return [self._charts(entry), self._head_map(entry), cache_view(s), status, self._info(key, entry)]

    def apply_settings_on_blur(self, request: gr.Request, *values):
        """Leaving a field applies it too, silently when nothing changed."""
        return self.apply_settings(request, *values, quiet=True)

    def policy_changed(self, policy: str):
        """Show the new policy's parameters at their defaults."""
        declared = {p.name for p in POLICIES[policy].params}
        return [gr.update(value=p.default, visible=name in declared) for name, (p, _) in self.params.items()] + [
            POLICIES[policy].summary]

    def sampling(self, max_new_tokens, temperature, top_p, request: gr.Request):
        try:
            entry = self._entry(request.session_hash)
            smp = Sampling(max_new_tokens=_int(max_new_tokens, "max new tokens"),
                           temperature=float(temperature), top_p=float(top_p)).validate()
        except (USER_ERRORS + (TypeError,)) as exc:
            gr.Warning(str(exc))
            return _error(str(exc))
        entry.session.sampling = smp
        return f"generation: up to {smp.max_new_tokens} new tokens, temperature {smp.temperature}, top-p {smp.top_p}"

    def new_conversation(self, system: str, request: gr.Request):
        key = request.session_hash
        try:
            self._idle(self.m.get(key))
            entry = self.m.new(key, system=system if system and system.strip() else None)
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return self._blank(str(exc)) + [gr.skip()] * self.n_settings
        return self._all(key, entry, "new conversation") + self._settings_values(entry)

    def open_conversation(self, conversation_id, request: gr.Request):
        key = request.session_hash
        try:
            if conversation_id is None:
                raise ValueError("choose a conversation in the list first")
            self._idle(self.m.get(key))
            entry = self.m.open(key, int(conversation_id))
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return self._blank(str(exc)) + [gr.skip()] * self.n_settings
        how = {"snapshot": "restored exactly from its snapshot",
               "tokens": "rebuilt from the tokens it kept"}.get(entry.session.restored_from, "")
        status = f"opened conversation #{conversation_id}; its cache was {how}" if how else ""
        return self._all(key, entry, status) + self._settings_values(entry)

    def rename(self, conversation_id, title: str, request: gr.Request):
        try:
            if conversation_id is None:
                raise ValueError("choose a conversation in the list first")
            self.m.store.rename(int(conversation_id), title or "")
            holder = self.m.holder(int(conversation_id))
            if holder is not None:
                self.m.get(holder).session.title = title.strip()
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return gr.skip(), _error(str(exc)), gr.skip()
        return (gr.update(choices=self._conversation_choices(), value=conversation_id),
                f"renamed conversation #{conversation_id}", "")

    def delete(self, conversation_id, request: gr.Request):
        key = request.session_hash
        try:
            if conversation_id is None:
                raise ValueError("choose a conversation in the list first")
            holder = self.m.holder(int(conversation_id))
            if holder is not None and holder != key:
                raise ValueError(f"conversation #{conversation_id} is open in another tab")
            if holder == key:
                self._idle(self.m.get(key))
                self.m.store.delete(int(conversation_id))
                entry = self.m.new(key)
            else:
                self.m.store.delete(int(conversation_id))
                entry = self._entry(key)
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return self._blank(str(exc))
        return self._all(key, entry, f"deleted conversation #{conversation_id}")

    def export(self, conversation_id):
        try:
            if conversation_id is None:
                raise ValueError("choose a conversation in the list first")
            lines = self.m.store.export_replay(int(conversation_id))
        except USER_ERRORS as exc:
            gr.Warning(str(exc))
            return gr.update(visible=False), _error(str(exc))
        path = self.export_dir / f"conversation-{int(conversation_id)}.jsonl"
        path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
        return (gr.update(value=str(path), visible=True),
                f"exported conversation #{conversation_id}: replay it with `kvchat replay {path.name}`")

    # -- layout -----------------------------------------------------------------------------------------------------
    def build(self) -> gr.Blocks:
        d = self.m.settings
        with gr.Blocks(title="kvchat", fill_width=True) as demo:
            with gr.Sidebar(label="Conversations", open=True, elem_id="kv-sidebar"):
                gr.Markdown("### Conversations")
                new_btn = gr.Button("New conversation", variant="primary", elem_id="kv-new")
                system_box = gr.Textbox(label="System prompt for new conversations", lines=2,
                                        placeholder="empty: the model's default", elem_id="kv-system")
                conv_list = gr.Radio(label="Saved", choices=[], elem_id="kv-conversations")
                with gr.Row():
                    open_btn = gr.Button("Open", size="sm", elem_id="kv-open")
                    delete_btn = gr.Button("Delete", size="sm", variant="stop", elem_id="kv-delete")
                title_box = gr.Textbox(label="New title", elem_id="kv-title")
                with gr.Row():
                    rename_btn = gr.Button("Rename", size="sm", elem_id="kv-rename")
                    export_btn = gr.Button("Export replay JSONL", size="sm", elem_id="kv-export")
                export_file = gr.File(label="Replay script", visible=False, elem_id="kv-export-file")
            status = gr.Markdown("", elem_id="kv-status")
            info = gr.Markdown("", elem_id="kv-info")
            with gr.Row():
                with gr.Column(scale=3):
                    chatbot = gr.Chatbot(label="Chat", height=460, elem_id="kv-chat", sanitize_html=True,
                                         render_markdown=True, buttons=["copy"])
                    text = gr.Textbox(show_label=False, lines=3, max_lines=12, elem_id="kv-input",
                                      placeholder="Message (Shift+Enter for a new line)")
                    with gr.Row():
                        send_btn = gr.Button("Send", variant="primary", elem_id="kv-send")
                        stop_btn = gr.Button("Stop", variant="stop", elem_id="kv-stop")
                        retry_btn = gr.Button("Retry", elem_id="kv-retry")
                        undo_btn = gr.Button("Undo", elem_id="kv-undo")
                    with gr.Tabs():
                        with gr.Tab("Charts", elem_id="kv-tab-charts"):
                            plot = gr.Plot(show_label=False, elem_id="kv-charts")
                            heads = gr.Plot(show_label=False, visible=False, elem_id="kv-heads")
                        with gr.Tab("What the cache holds", elem_id="kv-tab-cache"):
                            cache_html = gr.HTML(elem_id="kv-cache-view")
                with gr.Column(scale=1, min_width=280):
                    with gr.Accordion("Cache settings", open=True, elem_id="kv-settings"):
                        policy = gr.Dropdown(list(POLICIES), value=d.policy, label="Policy", elem_id="kv-policy")
                        summary = gr.Markdown(POLICIES[d.policy].summary, elem_id="kv-policy-summary")
                        budget = gr.Number(d.budget, label="Budget (positions per layer)", precision=0,
                                           minimum=1, elem_id="kv-budget")
                        sink = gr.Number(d.sink, label="Sink (first tokens kept)", precision=0, minimum=0,
                                         elem_id="kv-sink")
                        window = gr.Number(d.window, label="Window (recent tokens kept)", precision=0,
                                           placeholder="empty: budget / 4", elem_id="kv-window")
                        slack = gr.Number(d.slack, label="Slack (compress at budget + slack)", precision=0,
                                          placeholder="empty: max(64, budget / 8)", elem_id="kv-slack")
                        groups = gr.Radio(["token", "sentence", "turn"], value=d.groups, label="Evict whole",
                                          elem_id="kv-groups")
                        positions = gr.Radio(["rerotate", "original"], value=d.positions, label="Positions",
                                             elem_id="kv-positions")
                        aggregate = gr.Radio(["mean", "max", "sum"], value=d.aggregate, label="Group score",
                                             elem_id="kv-aggregate")
                        param_boxes = []
                        declared = {p.name for p in POLICIES[d.policy].params}
                        for name, (p, users) in self.params.items():
                            value = d.params.get(name, p.default)
                            common = dict(label=f"{name} ({', '.join(users)})", info=p.help,
                                          visible=name in declared, elem_id=f"kv-param-{name}")
                            if p.choices is not None:
                                box = gr.Dropdown(list(p.choices), value=value, **common)
                            elif p.type is bool:
                                box = gr.Checkbox(value=bool(value), **common)
                            else:
                                box = gr.Number(value, precision=0 if p.type is int else None,
                                                minimum=p.min, maximum=p.max, **common)
                            param_boxes.append(box)
                    with gr.Accordion("Generation", open=True, elem_id="kv-generation"):
                        smp = self.m.sampling
                        max_new = gr.Number(smp.max_new_tokens, label="Max new tokens", precision=0, minimum=1,
                                            elem_id="kv-max-new")
                        temperature = gr.Slider(0, 2, value=smp.temperature, step=0.05,
                                                label="Temperature (0 = greedy)", elem_id="kv-temperature")
                        top_p = gr.Slider(0.05, 1, value=smp.top_p, step=0.05, label="Top-p", elem_id="kv-top-p")

            settings_inputs = [policy, budget, sink, window, slack, groups, positions, aggregate, *param_boxes]
            settings_outputs = [*settings_inputs, max_new, temperature, top_p, summary]
            self.n_settings = len(settings_outputs)
            views = [chatbot, plot, heads, cache_html, conv_list, status, info]
            stream_outputs = [chatbot, text, plot, heads, cache_html, conv_list, status, info]
            model_queue = dict(concurrency_id="model", concurrency_limit=1)

            demo.load(self.load, None, views + settings_outputs, **model_queue)
            demo.unload(self.unload)
            send_btn.click(self.send, [text], stream_outputs, **model_queue)
            text.submit(self.send, [text], stream_outputs, **model_queue)
            stop_btn.click(self.stop, None, None, queue=False)
            undo_btn.click(self.undo, None, stream_outputs, **model_queue)
            retry_btn.click(self.retry, None, stream_outputs, **model_queue)

            settings_out = [plot, heads, cache_html, status, info]
            policy.input(self.policy_changed, [policy], [*param_boxes, summary]).then(
                self.apply_settings, settings_inputs, settings_out)
            for box in (groups, positions, aggregate):
                box.input(self.apply_settings, settings_inputs, settings_out)
            for box in (budget, sink, window, slack, *param_boxes):
                if isinstance(box, gr.Number):
                    box.submit(self.apply_settings, settings_inputs, settings_out)
                    box.blur(self.apply_settings_on_blur, settings_inputs, settings_out)
                else:
                    box.input(self.apply_settings, settings_inputs, settings_out)
            max_new.submit(self.sampling, [max_new, temperature, top_p], [status])
            max_new.blur(self.sampling, [max_new, temperature, top_p], [status])
            for slider in (temperature, top_p):
                slider.release(self.sampling, [max_new, temperature, top_p], [status])

            new_btn.click(self.new_conversation, [system_box], views + settings_outputs, **model_queue)
            chatbot.clear(self.new_conversation, [system_box], views + settings_outputs, **model_queue)
            open_btn.click(self.open_conversation, [conv_list], views + settings_outputs, **model_queue)
            rename_btn.click(self.rename, [conv_list, title_box], [conv_list, status, title_box])
            delete_btn.click(self.delete, [conv_list], views)
            export_btn.click(self.export, [conv_list], [export_file, status])
        demo.queue(default_concurrency_limit=4)
        return demo


def _int(value, name: str, optional: bool = False) -> int | None:
    if value is None or value == "":
        if optional:
            return None
        raise ValueError(f"{name} is empty")
    if float(value) != int(float(value)):
        raise ValueError(f"{name} must be a whole number, got {value}")
    return int(float(value))


def serve(manager: SessionManager, model_name: str, host: str = "127.0.0.1", port: int = 7860,
          auth: list[tuple[str, str]] | None = None, share: bool = False) -> None:
    app = WebApp(manager, model_name)
    demo = app.build()
    try:
        demo.launch(server_name=host, server_port=port, auth=auth or None, share=share, show_error=True,
                    theme=_theme(), css=CSS, footer_links=[], allowed_paths=[str(app.export_dir)],
                    ssr_mode=False, quiet=False)
    finally:
        manager.close()
