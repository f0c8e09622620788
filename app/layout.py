"""The web UI's layout: the Blocks (sidebar, chat, charts, settings panel) and which handler each event runs.
``Layout`` is mixed into ``WebApp`` (app/web.py), whose methods are the handlers; the settings widgets are generated
from the declared settings (core/engine/settings.py) and the policies' declared parameters."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from ..core.engine.settings import CACHE_SETTINGS, SAMPLING_SETTINGS
from ..policies import POLICIES, Param

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
.kv-cacheview .kv-recalled { background: #c9f2d0; outline: 1px dashed #2ca02c; }
.kv-cacheview .kv-mark { color: #7b52ab; font-size: 0.85em; }
.kv-cacheview .kv-summary { font-family: ui-sans-serif, sans-serif; font-size: 13px; }
"""



def theme():
    # System fonts only: the page must not reach for web fonts (a local tool, often offline).
    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "Consolas", "monospace"])


def elem_id(p: Param) -> str:
    """The settings widget's element id: kv-<name with dashes> (kv-max-new for max_new_tokens)."""
    return "kv-max-new" if p.name == "max_new_tokens" else "kv-" + p.name.replace("_", "-")


def _step(p: Param) -> float:
    return 0.01 if p.max - p.min <= 1 else 0.05


def widget(p: Param, value, **common):
    """The input for one declared setting: its choices as a radio (up to three) or a dropdown, a checkbox for a
    bool, a slider for a float declared with both bounds, else a number (whole for an int; empty means the derived
    default where the setting has one) or a text box."""
    if p.choices is not None:
        choices = list(POLICIES) if p.name == "policy" else list(p.choices)  # registered ones, also later ones
        return (gr.Radio if len(choices) <= 3 else gr.Dropdown)(choices, value=value, **common)
    if p.type is bool:
        return gr.Checkbox(value=bool(value), **common)
    if p.type is float and p.min is not None and p.max is not None and p.derived is None:
        step = _step(p)
        low = 0 if p.min < step else p.min  # a slider from 1e-6 would offer 0.010001, 0.020001, ...
        return gr.Slider(low, p.max, value=value, step=step, **common)
    if p.type in (int, float):
        placeholder = f"empty: {p.derived}" if p.derived is not None else None
        return gr.Number(value, precision=0 if p.type is int else None, minimum=p.min, maximum=p.max,
                         placeholder=placeholder, **common)
    return gr.Textbox(value=value, **common)


def _label(p: Param) -> str:
    return p.name.replace("_", " ").capitalize()


def on_change(box, fn, inputs, outputs, on_blur=None) -> None:
    """Run ``fn`` when the user has finished changing ``box``: Enter or leaving a number or text field
    (``on_blur`` then, if given), releasing a slider, picking a choice."""
    if isinstance(box, (gr.Number, gr.Textbox)):
        box.submit(fn, inputs, outputs)
        box.blur(on_blur or fn, inputs, outputs)
    elif isinstance(box, gr.Slider):
        box.release(fn, inputs, outputs)
    else:
        box.input(fn, inputs, outputs)


class Layout:
    """``build()`` lays out the Blocks and wires the events to the handlers of the class it is mixed into."""

    # -- layout -----------------------------------------------------------------------------------------------------
    def _sidebar(self) -> SimpleNamespace:
        """The saved conversations: new, open, delete, rename, export."""
        ui = SimpleNamespace()
        with gr.Sidebar(label="Conversations", open=True, elem_id="kv-sidebar"):
            gr.Markdown("### Conversations")
            ui.new = gr.Button("New conversation", variant="primary", elem_id="kv-new")
            ui.system = gr.Textbox(label="System prompt for new conversations", lines=2,
                                   placeholder="empty: the model's default", elem_id="kv-system")
            ui.search = gr.Textbox(label="Search saved conversations", max_lines=1, elem_id="kv-search",
                                   placeholder="a word of a title or of any message")
            ui.conversations = gr.Radio(label="Saved", choices=[], elem_id="kv-conversations")
            with gr.Row():
                ui.open = gr.Button("Open", size="sm", elem_id="kv-open")
                ui.delete = gr.Button("Delete", size="sm", variant="stop", elem_id="kv-delete")
            ui.title = gr.Textbox(label="New title", elem_id="kv-title")
            with gr.Row():
                ui.rename = gr.Button("Rename", size="sm", elem_id="kv-rename")
                ui.export = gr.Button("Export replay JSONL", size="sm", elem_id="kv-export")
            ui.export_file = gr.File(label="Replay script", visible=False, elem_id="kv-export-file")
        return ui

    def _chat(self) -> SimpleNamespace:
        """The chat, its message box and buttons, and the tabs of charts and of what the cache holds."""
        ui = SimpleNamespace()
        ui.chatbot = gr.Chatbot(label="Chat", height=460, elem_id="kv-chat", sanitize_html=True, render_markdown=True,
                                buttons=["copy"])
        # One line that grows to twelve: Gradio submits a one-line box on Enter, and Shift+Enter adds a line.
        ui.text = gr.Textbox(show_label=False, lines=1, max_lines=12, elem_id="kv-input",
                             placeholder="Message (Shift+Enter for a new line)")
        with gr.Row():
            ui.send = gr.Button("Send", variant="primary", elem_id="kv-send")
            ui.stop = gr.Button("Stop", variant="stop", elem_id="kv-stop")
            ui.retry = gr.Button("Retry", elem_id="kv-retry")
            ui.undo = gr.Button("Undo", elem_id="kv-undo")
        with gr.Tabs():
            with gr.Tab("Charts", elem_id="kv-tab-charts"):
                ui.plot = gr.Plot(show_label=False, elem_id="kv-charts")
                ui.heads = gr.Plot(show_label=False, visible=False, elem_id="kv-heads")
            with gr.Tab("What the cache holds", elem_id="kv-tab-cache"):
                ui.cache_html = gr.HTML(elem_id="kv-cache-view")
        return ui

    def _settings(self) -> SimpleNamespace:
        """The settings panel, one widget per declared setting: the cache settings with the policy's summary, every
        policy parameter (only the running policy's visible), the sampling settings."""
        d, sampling = self.manager.settings, self.manager.sampling
        ui = SimpleNamespace()
        with gr.Accordion("Cache settings", open=True, elem_id="kv-settings"):
            ui.cache = []
            for p in CACHE_SETTINGS:
                ui.cache.append(widget(p, getattr(d, p.name), label=_label(p), info=p.help, elem_id=elem_id(p)))
                if p.name == "policy":
                    ui.summary = gr.Markdown(POLICIES[d.policy].summary, elem_id="kv-policy-summary")
            ui.policy = ui.cache[0]
            ui.params = []
            declared = {p.name for p in POLICIES[d.policy].params}
            for name, (p, users) in self.params.items():
                ui.params.append(widget(p, d.params.get(name, p.default), label=f"{name} ({', '.join(users)})",
                                        info=p.help, visible=name in declared, elem_id=f"kv-param-{name}"))
        with gr.Accordion("Generation", open=True, elem_id="kv-generation"):
            ui.sampling = [widget(p, getattr(sampling, p.name), label=_label(p), info=p.help, elem_id=elem_id(p))
                           for p in SAMPLING_SETTINGS]
        return ui

    def build(self) -> gr.Blocks:
        with gr.Blocks(title="kvchat", fill_width=True) as demo:
            side = self._sidebar()
            status = gr.Markdown("", elem_id="kv-status")
            info = gr.Markdown("", elem_id="kv-info")
            with gr.Row():
                with gr.Column(scale=3):
                    chat = self._chat()
                with gr.Column(scale=1, min_width=280):
                    panel = self._settings()
            self._wire(demo, side, chat, panel, status, info)
        demo.queue(default_concurrency_limit=4)
        return demo

    def _wire(self, demo, side, chat, panel, status, info) -> None:
        """The events: page load and unload, the chat, the settings, the conversations."""
        settings_inputs = [*panel.cache, *panel.params]
        settings_outputs = [*settings_inputs, *panel.sampling, panel.summary]
        self.n_settings = len(settings_outputs)
        views = [chat.chatbot, chat.plot, chat.heads, chat.cache_html, side.conversations, status, info]
        stream_outputs = [chat.chatbot, chat.text, chat.plot, chat.heads, chat.cache_html, side.conversations, status,
                          info]
        model_queue = dict(concurrency_id="model", concurrency_limit=1)

        demo.load(self.load, None, views + settings_outputs, **model_queue)
        demo.unload(self.unload)
        # Send, Enter and Retry are one event: while its reply streams the browser drops another trigger of it (the
        # default trigger mode), and Send, Retry and Undo are greyed until the event ends, however it ends; Stop
        # stays. (Two events let Enter queue a message behind a reply that a click on Send dropped unseen.)
        self.retry_button = chat.retry
        buttons = [chat.send, chat.retry, chat.undo]
        gr.on([chat.send.click, chat.text.submit, chat.retry.click], self.reply, [chat.text], stream_outputs + buttons,
              trigger_mode="once", **model_queue).then(self.after_reply, [side.conversations], views + buttons,
                                                         queue=False, show_progress="hidden")
        chat.stop.click(self.stop, None, None, queue=False)
        chat.undo.click(self.undo, None, stream_outputs, **model_queue)

        settings_out = [chat.plot, chat.heads, chat.cache_html, status, info, side.conversations]
        panel.policy.input(self.policy_changed, [panel.policy], [*panel.params, panel.summary]).then(
            self.apply_settings, settings_inputs, settings_out)
        for box in settings_inputs:
            if box is not panel.policy:
                on_change(box, self.apply_settings, settings_inputs, settings_out, on_blur=self.apply_settings_on_blur)
        for box in panel.sampling:
            on_change(box, self.sampling, panel.sampling, [status])

        opened = views + settings_outputs
        # New, the chat pane's clear and Open first stop this tab's reply, if one streams (kept as far as it got, as
        # Stop keeps it), so that they run at its next token rather than when it would have ended. The page sends a
        # click's second event only once the first has answered; where a conversation is chosen, nothing changes the
        # choice between them (a reply's end and a settings change draw the list without choosing in it, and
        # ``after_reply`` chooses the tab's conversation only where none is chosen).
        gr.on([side.new.click, chat.chatbot.clear], self.stop, None, None, queue=False)
        side.open.click(self.stop_for_open, [side.conversations], None, queue=False)
        side.new.click(self.new_conversation, [side.system], opened, **model_queue)
        chat.chatbot.clear(self.new_conversation, [side.system], opened, **model_queue)
        side.open.click(self.open_conversation, [side.conversations], opened, **model_queue)
        side.search.change(self.search_conversations, [side.search], [side.conversations], trigger_mode="always_last",
                          show_progress="hidden")
        side.rename.click(self.rename, [side.conversations, side.title], [side.conversations, status, side.title])
        side.delete.click(self.delete, [side.conversations], views)
        side.export.click(self.export, [side.conversations], [side.export_file, status, side.conversations])
