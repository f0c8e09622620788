"""The web UI's parts without a browser: session caps, conversations moving between tabs, charts and the cache
view against the engine's own numbers."""

import re
import subprocess
import sys
import time

import pytest

from kvchat.app.sessions import CapacityError, SessionManager
from kvchat.app.views import cache_view, charts, chat_messages, head_map, layer_lengths, stored_turns
from kvchat.core.engine.session import Sampling
from kvchat.core.engine.settings import Settings
from kvchat.storage.db import Store, StoreError

GREEDY = Sampling(max_new_tokens=6, temperature=0.0)
SETTINGS = Settings(policy="streaming", budget=48, window=8, slack=6)


@pytest.fixture
def manager(tiny, tmp_path):
    return SessionManager(tiny("llama"), Store(tmp_path / "kv.db"), SETTINGS, GREEDY, max_sessions=2)


def _chat(session, turns=4):
    for i in range(turns):
        session.exchange(f"Item {i}: the red kite flies over the hill. " * 2, f"Kite {i} noted.")


def test_session_cap_gives_a_clear_message(manager):
    manager.entry("a")
    manager.entry("b")
    with pytest.raises(CapacityError, match="2 chat sessions are open"):
        manager.entry("c")
    manager.release("a")
    manager.entry("c")


def test_cache_memory_cap_counts_what_sessions_may_reserve(tiny, tmp_path):
    m = SessionManager(tiny("llama"), Store(tmp_path / "kv.db"), SETTINGS, GREEDY, max_sessions=8,
                       max_cache_bytes=1)
    with pytest.raises(CapacityError, match="not enough cache memory"):
        m.entry("a")
    per = m.per_position_bytes()
    assert per > 0
    m.max_cache_bytes = 2 * m.reserve(SETTINGS)
    m.entry("a")
    m.entry("b")
    with pytest.raises(CapacityError, match="not enough cache memory"):
        m.entry("c")
    with pytest.raises(CapacityError, match="choose a smaller budget"):
        m.check_room("a", SETTINGS.changed(budget=480), new=False)
    m.check_room("a", SETTINGS.changed(budget=24, window=4), new=False)


def test_a_conversation_moves_to_the_tab_that_opens_it(manager):
    a = manager.entry("a")
    _chat(a.session)
    cid = a.session.conversation_id
    b = manager.open("b", cid)
    assert manager.holder(cid) == "b" and "a" in manager.moved and manager.get("a") is None
    assert b.session.restored_from == "archive"  # exactly the cache a's last turn left
    assert b.session.kept_positions().tolist() == a.session.kept_positions().tolist()
    b.busy = True
    with pytest.raises(CapacityError, match="generating a reply in another tab"):
        manager.open("a", cid)


def test_charts_follow_the_stored_turns_and_mark_settings_changes(manager):
    entry = manager.entry("a")
    s = entry.session
    _chat(s)
    s.configure(policy="h2o", budget=32)
    fig = charts(s, stored_turns(s, manager.store, entry.stored), {1: 100.0}, manager.per_position_bytes())
    traces = {t.name: t for t in fig.data}
    stats = [r for r in manager.store.turn_stats(s.conversation_id) if r["role"] != "system"]
    assert list(traces["cache"].y) == [r["cache_tokens"] for r in stats]
    assert set(traces["budget"].y) == {48}
    assert list(traces["now"].y) == [s.cache.mean_length] and s.cache.mean_length <= 32
    labels = [a.text for a in fig.layout.annotations]
    assert any("policy h2o" in t and "budget 32" in t for t in labels)
    turns = [r["turn"] for r in stats]
    for axis in (fig.layout.xaxis, fig.layout.xaxis2, fig.layout.xaxis3, fig.layout.xaxis4, fig.layout.xaxis5):
        # the turns drawn, not widened to fit the change's label (which pushed the data into half the chart)
        assert axis.range[0] < min(turns) and max(turns) + 0.5 <= axis.range[1] <= s.turn + 0.5
    assert sum(traces["evicted"].y) == sum(r["evicted_tokens"] for r in stats) > 0


def test_the_charts_read_only_the_turns_stored_since_and_follow_an_undo(manager, monkeypatch):
    """The charts are drawn from the conversation's stored turns twice a reply; in a chat of days that is thousands
    of rows (5,000 took 77-158 ms to read here). A tab reads them whole once, then only the turns committed since;
    after an undo, or in another conversation, it reads them whole again: what it draws is always what is stored."""
    from kvchat.storage import db

    entry = manager.entry("a")
    s, store = entry.session, manager.store
    _chat(s, turns=3)
    loaded, plain = [], db._load
    monkeypatch.setattr(db, "_load", lambda row: loaded.append(row["id"]) or plain(row))

    def drawn():
        loaded.clear()
        rows, _ = stored_turns(s, store, entry.stored)
        assert rows == store.turn_stats(s.conversation_id)  # what is stored, in turn order
        n = len(loaded) - len(rows)  # the rows the tab read (the comparison above read them all)
        return rows, n

    rows, read = drawn()
    assert read == len(rows) and len(rows) >= 3  # whole, the first time
    _chat(s, turns=1)
    rows, read = drawn()
    assert read == 1  # the turn stored since, only
    assert drawn()[1] == 0
    s.undo()
    rows, read = drawn()
    assert read == len(rows)  # an undo took a turn back: whole again
    _chat(s, turns=1)
    assert drawn()[1] == 1
    other = manager.entry("b").session  # the same copy asked for another conversation, and back: whole each time
    _chat(other, turns=2)
    for conversation in (other.conversation_id, s.conversation_id):
        loaded.clear()
        rows = entry.stored.read(store, conversation)
        assert len(loaded) == len(rows) and rows == store.turn_stats(conversation)


def test_cache_view_greys_exactly_what_no_head_holds(manager):
    s = manager.entry("a").session
    _chat(s, turns=6)
    html = cache_view(s)
    seen = int(re.search(r"still sees <b>([\d,]+)</b>", html).group(1).replace(",", ""))
    assert seen == s.kept_positions().numel() < s.total_tokens
    assert "kv-evicted" in html and "&lt;script&gt;" not in html
    s.exchange("<script>alert(1)</script>", "ok")
    assert "<script>alert" not in cache_view(s) and "&lt;script&gt;" in cache_view(s)
    s.exchange("What does <|im_end|> mean?", "It ends a message.")  # typed: text, not the template's marker
    last = cache_view(s).rsplit('<div class="kv-msg kv-user">', 1)[1].split("</div>")[0]
    marked = re.findall(r'<span class="[a-z-]+ kv-mark"[^>]*>([^<]*)</span>', last)
    assert marked == ["&lt;|im_start|&gt;", "&lt;|im_end|&gt;"], last  # the header's and the end's markers alone
    assert "What does &lt;|im_end|&gt; mean?" in re.sub(r"<[^>]+>", "", last)


def test_the_cache_view_of_a_long_chat_reads_what_it_shows(manager, monkeypatch):
    """Past ``VIEW_TOKENS`` the view shows the last ones; its per-token reading covers those alone (it covered the
    whole chat with every reply), and its counts, taken from what the cache holds, are those of every token."""
    from kvchat.app import views

    s = manager.entry("a").session
    _chat(s, turns=8)
    monkeypatch.setattr(views, "VIEW_TOKENS", 40)
    rows = s.token_rows(40)
    n, held = s.total_tokens, s.held_fraction()
    assert rows["start"] == n - 40 and len(rows["token"]) == len(rows["held"]) == 40
    assert rows["held"] == held[n - 40:].tolist() and rows["token"] == s.token_rows()["token"][n - 40:]
    text = re.sub(r"<[^>]+>", "", cache_view(s))
    seen, full = int((held > 0).sum()), int((held >= 0.9999).sum())
    assert f"still sees {seen:,} of {n:,} tokens" in text and f"{full:,} in every head" in text
    assert f"{n - seen:,} evicted" in text and "Showing the last 40." in text
    assert "Kite 7 noted." in text and "Item 0" not in text  # the last tokens, not the first


def test_chat_messages_carry_token_counts(manager):
    s = manager.entry("a").session
    s.exchange("Hello there.", "Hi!")
    msgs = chat_messages(s)
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    user_tokens = int(re.search(r"<sub>(\d+) tokens</sub>", msgs[0]["content"]).group(1))
    assert user_tokens == (s.log.column("message") == 1).sum().item()


def test_a_long_conversation_is_drawn_in_bounded_pieces(manager, monkeypatch):
    """The chat pane and the charts are sent and drawn again with every streamed token and every few seconds: a
    conversation of 6,001 messages took 13 s to open in the browser, and a reply in it did not finish in 2 minutes.
    The pane shows the last messages after a note of how many came before; the charts a point per k turns past
    CHART_POINTS, keeping each run's peak (the bound a person checks) and its mean speed and evictions."""
    from kvchat.app import views

    entry = manager.entry("a")
    s = entry.session
    _chat(s, turns=3)
    monkeypatch.setattr(views, "SHOWN_MESSAGES", 4)
    note, *shown = chat_messages(s)
    assert note["metadata"]["title"] == "2 earlier messages" and "Export saves them all" in note["content"]
    assert [m["content"].split("\n")[0] for m in shown] == [m["content"] for m in s.messages[-4:]]

    rows, _ = stored_turns(s, manager.store, entry.stored)
    template = [r for r in rows if r["role"] == "assistant"][-1]
    turns = 1000  # stored turns as a long chat leaves them: the cache at its bound, one peak, speeds and evictions
    rows = [{**template, "turn": t, "cache_tokens": 40 + t % 7 + 9 * (t == 611), "evicted_tokens": t % 5,
             "decode_ms_per_token": 10.0 + t % 3} for t in range(1, turns + 1)]
    fig = charts(s, (rows, []), {}, manager.per_position_bytes())
    traces = {t.name: t for t in fig.data}
    k = -(-turns // views.CHART_POINTS)
    assert len(traces["cache"].x) == -(-turns // k) <= views.CHART_POINTS and traces["cache"].x[-1] == turns
    assert list(traces["cache"].y) == [max(r["cache_tokens"] for r in rows[i: i + k]) for i in range(0, turns, k)]
    assert max(traces["cache"].y) == 51  # the peak kept
    assert sum(traces["evicted"].y) * k == pytest.approx(sum(r["evicted_tokens"] for r in rows), rel=0.01)
    assert set(traces["budget"].y) == {48} and f"a point per {k} turns" in fig.layout.xaxis4.title.text
    few = charts(s, (rows[:views.CHART_POINTS], []), {}, manager.per_position_bytes())
    assert list(few.data[0].y) == [r["cache_tokens"] for r in rows[:views.CHART_POINTS]]  # a point per turn


def test_head_map_and_layer_budgets_for_headaware(tiny, tmp_path):
    m = SessionManager(tiny("llama"), Store(tmp_path / "kv.db"),
                       Settings(policy="headaware", budget=32, window=8, slack=4), GREEDY)
    s = m.entry("a").session
    assert head_map(s) is None
    _chat(s, turns=6)
    fig = head_map(s)
    layers = s.policy.report()["head_classes"]
    assert fig is not None and len(fig.data[0].z) == len(layers)
    held, allocated = layer_lengths(s)
    assert allocated is not None and len(held) == len(allocated) == s.model.num_layers


class _Request:
    """What the handlers read of Gradio's request: the tab's session hash."""

    def __init__(self, key):
        self.session_hash = key


@pytest.fixture
def web(manager):
    from kvchat.app.web import WebApp

    app = WebApp(manager, "tiny")
    app.demo = app.build()
    return app


def test_exports_go_with_the_app(manager):
    """A conversation exported for download is written to a folder of the app's own, removed with the app (each app
    of an earlier version left one in /tmp, with the conversations in it)."""
    import gc

    from kvchat.app.web import WebApp

    app = WebApp(manager, "tiny")
    folder = app.export_dir
    (folder / "conversation-1.jsonl").write_text("{}\n", encoding="utf-8")
    del app
    gc.collect()
    assert not folder.exists()


def test_an_export_names_the_command_that_replays_it_as_it_began(web):
    s = web.manager.entry("a").session
    _chat(s, turns=1)
    web.apply_settings(_Request("a"), *_values(web, s, policy="h2o"))  # the replay's set line makes it
    _, status, _ = web.export(s.conversation_id, _Request("a"))
    assert status.endswith(f"replay it as it began with `kvchat replay conversation-{s.conversation_id}.jsonl "
                           "--model tiny-llama --budget 48 --window 8 --slack 6`")


def test_settings_panel_is_generated_from_the_declarations(web):
    import gradio as gr

    from kvchat.app.layout import elem_id
    from kvchat.core.engine.settings import CACHE_SETTINGS, SAMPLING_SETTINGS
    from kvchat.policies import declared_params

    ids = {c.elem_id: c for c in web.demo.blocks.values() if getattr(c, "elem_id", None)}
    for name in ("policy", "budget", "sink", "window", "slack", "groups", "positions", "aggregate", "max-new",
                 "temperature", "top-p", "top-k", "min-p", "repetition-penalty", "no-repeat-ngram-size"):
        assert f"kv-{name}" in ids, name
    assert {elem_id(p) for p in (*CACHE_SETTINGS, *SAMPLING_SETTINGS)} <= set(ids)
    assert all(f"kv-param-{name}" in ids for name in declared_params())
    assert isinstance(ids["kv-policy"], gr.Dropdown) and isinstance(ids["kv-groups"], gr.Radio)
    assert isinstance(ids["kv-budget"], gr.Number) and ids["kv-budget"].precision == 0
    assert ids["kv-budget"].minimum == 1
    assert ids["kv-window"].placeholder == "empty: budget/4"
    assert isinstance(ids["kv-top-p"], gr.Slider) and ids["kv-top-p"].maximum == 1
    assert isinstance(ids["kv-param-pool"], gr.Radio) and isinstance(ids["kv-param-average"], gr.Checkbox)
    inp = ids["kv-input"]
    assert inp.lines == 1 and inp.max_lines > 1  # a one-line box submits on Enter; Shift+Enter adds a line


def _values(web, session, **cache):
    from kvchat.core.engine.settings import CACHE_SETTINGS

    values = [cache.get(p.name, getattr(session.settings, p.name)) for p in CACHE_SETTINGS]
    return values + [p.default for p, _ in web.params.values()]


def test_sampling_and_settings_handlers_parse_by_declaration(web):
    from kvchat.core.engine.settings import SAMPLING_SETTINGS

    request = _Request("a")
    s = web.manager.entry("a").session
    values = [getattr(s.sampling, p.name) for p in SAMPLING_SETTINGS]
    values[[p.name for p in SAMPLING_SETTINGS].index("top_k")] = 40
    status = web.sampling(request, *values)
    assert s.sampling.top_k == 40 and "up to 6 new tokens" in status and "top-k 40" in status
    before = s.sampling
    values[0] = "lots"
    assert "kv-error" in web.sampling(request, *values) and s.sampling == before

    out = web.apply_settings(request, *_values(web, s, budget=32, window=None, groups="sentence"))
    assert "applied" in out[3] and s.settings.budget == 32 and s.settings.groups == "sentence"
    assert s.settings.window is None
    settings = s.settings
    for junk in ({"budget": None}, {"sink": 2.5}, {"groups": "word"}, {"budget": 8, "window": 20}):
        out = web.apply_settings(request, *_values(web, s, **junk))
        assert "kv-error" in out[3] and s.settings == settings, junk
    assert "budget 32" in web._info("a", web.manager.get("a"))
    assert len(web._settings_values(web.manager.get("a"))) == web.n_settings


def test_the_saved_list_follows_a_settings_change(web):
    """The saved conversations show each one's policy as stored; a change in the settings panel rewrites it, and
    the list now shows it at once (it showed the old policy until the next turn), leaving its choice as it is."""
    request = _Request("a")
    s = web.manager.entry("a").session
    _chat(s, turns=1)
    out = web.apply_settings(request, *_values(web, s, policy="h2o"))
    assert "applied" in out[3] and len(out) == 6
    (label,) = [label for label, cid in out[5]["choices"] if cid == s.conversation_id]
    assert " · h2o · " in label and "value" not in out[5]  # a conversation chosen in the list stays chosen
    assert "choices" not in web.apply_settings(request, *_values(web, s, budget=None))[5]  # an error: left as is


def test_the_saved_list_shows_the_last_used_and_a_search_finds_the_others(web, monkeypatch):
    """The saved list shows the ``LIST_LIMIT`` last used conversations and says how many there are; the tab's search
    narrows it (titles and messages) and holds for the lists its later replies draw; the tab's own conversation is
    chosen only where it is listed."""
    from kvchat.app import web as web_module

    monkeypatch.setattr(web_module, "LIST_LIMIT", 2)
    request = _Request("a")
    ids = []
    for text in ("Plan the trip to Lisbon.", "Buy tea and milk.", "How do kites fly?"):
        s = web.manager.new("a").session
        s.exchange(text, "Noted.")
        ids.append(s.conversation_id)
    out = web._conversations("a", web.manager.get("a"))
    assert [cid for _, cid in out["choices"]] == [ids[2], ids[1]] and out["value"] == ids[2]
    assert out["label"] == "Saved: the 2 last used of 3 (search for the others)"
    out = web.search_conversations("  LISBON ", request)
    assert [cid for _, cid in out["choices"]] == [ids[0]] and out["value"] is None  # the tab's own is not listed
    assert out["label"] == "Saved: 1 with “LISBON”"
    out = list(web.send("And the hotel?", request))[-1][5]  # a reply's list: still the search's
    assert [cid for _, cid in out["choices"]] == [ids[0]]
    assert web.search_conversations("zzz", request)["choices"] == []
    assert web.search_conversations("", request)["label"] == "Saved: the 2 last used of 3 (search for the others)"
    web.unload(request)
    assert "a" not in web.searches


def test_a_conversation_another_process_has_open_is_refused_in_the_page(web):
    """A terminal chat (another kvchat process) has the conversation open: opening or deleting it in the web UI is
    a visible error (two processes wrote turns on top of each other's state), and works once that process ends."""
    s = web.manager.entry("a").session
    _chat(s, turns=1)
    cid, folder = s.conversation_id, s.files.folder
    web.manager.release("a")  # the tab closed: this process gives it back
    other = subprocess.Popen([sys.executable, "-c", "import sys; from kvchat.storage import holding; "
                              f"holding.hold({str(folder)!r}, 'x'); print('held', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        refusal = f"conversation {cid} is open in another kvchat process (pid {other.pid})"
        assert refusal in web.open_conversation(cid, _Request("b"))[5]
        assert refusal in web.delete(cid, _Request("b"))[5]
        assert web.manager.holder(cid) is None and web.manager.store.conversation(cid)
    finally:
        other.communicate("", timeout=60)
    assert "opened conversation" in web.open_conversation(cid, _Request("b"))[5]


def test_a_choice_deleted_elsewhere_is_an_error_that_draws_the_list_again(web, monkeypatch):
    """A conversation deleted in another tab (or by ``kvchat conversations delete``) while this tab still shows it
    in its list: Open, Rename, Delete and Export say it is not there and draw the list again without it, the choice
    cleared; an error about a conversation still saved leaves the list as it is."""
    gone, kept = web.manager.entry("a").session, web.manager.entry("b").session
    _chat(gone, turns=1)
    _chat(kept, turns=1)
    cid = gone.conversation_id
    web.manager.release("a")
    web.manager.store.delete(cid)
    missing = f"no conversation {cid} in "
    results = {"open": web.open_conversation(cid, _Request("c")), "delete": web.delete(cid, _Request("c")),
               "rename": web.rename(cid, "New title", _Request("c")), "export": web.export(cid, _Request("c"))}
    for name, out in results.items():
        at_list, at_status = {"rename": (0, 1), "export": (2, 1)}.get(name, (4, 5))  # where each handler puts them
        listed, status = out[at_list], out[at_status]
        assert missing in status, (name, status)
        assert listed.get("value") is None and [c[1] for c in listed["choices"]] == [kept.conversation_id], name
    out = web.rename(kept.conversation_id, "  ", _Request("c"))  # refused, the conversation still there
    assert "title is empty" in out[1] and "choices" not in out[0]
    out = web.open_conversation(None, _Request("c"))
    assert "choose a conversation" in out[5] and "choices" not in out[4]

    def unreadable(conversation_id):
        raise StoreError(f"database {web.manager.store.path}: database is locked")

    monkeypatch.setattr(web.manager.store, "has", unreadable)  # the database unreadable at that moment: list left
    out = web.open_conversation(cid, _Request("c"))
    assert missing in out[5] and "choices" not in out[4]


def test_full_policy_reserves_the_models_positions(manager):
    full = SETTINGS.changed(policy="full")
    assert manager.reserve(full) == 2 * manager.model.max_positions * manager.per_position_bytes()
    assert manager.reserve(SETTINGS) == 2 * SETTINGS.capacity * manager.per_position_bytes()


def test_undo_and_retry_the_database_refuses_show_an_error_and_change_nothing(web, monkeypatch):
    """The web UI's Undo and Retry while the database refuses the write: a visible error, and the chat, the cache
    and the stored conversation stay as they were."""
    request = _Request("a")
    session = web.manager.entry("a").session
    _chat(session, turns=2)
    session.chat("And the kite?")
    shown = chat_messages(session)
    stored = web.manager.store.messages(session.conversation_id)

    def refuse(*args, **kwargs):
        raise StoreError("database kv.db: database is locked (another program holds a write lock on it)")

    monkeypatch.setattr(Store, "truncate", refuse)
    out = web.undo(request)
    assert "kv-error" in out[6] and "database is locked" in out[6]
    out = list(web.retry(request))[-1]
    assert "kv-error" in out[6] and "database is locked" in out[6]
    assert chat_messages(session) == shown and web.manager.store.messages(session.conversation_id) == stored
    assert session.can_undo


def test_a_reply_that_fails_midway_reopens_the_conversation_and_says_so(web, monkeypatch):
    """A model step that raises while a reply streams (out of GPU memory, say): a visible error, the message back
    in the input, the tab's conversation reopened at its last saved turn, and the next message answered as if the
    failed one was never sent."""
    request = _Request("a")
    session = web.manager.entry("a").session
    _chat(session, turns=2)
    shown, stored = chat_messages(session), web.manager.store.messages(session.conversation_id)
    reads = []

    def failing(ids, *args, **kwargs):
        reads.append(1)
        if len(reads) == 3:
            raise RuntimeError("CUDA out of memory (simulated)")
        return type(session).forward(session, ids, *args, **kwargs)

    monkeypatch.setattr(session, "forward", failing)
    out = list(web.send("Tell me about the kite", request))[-1]
    assert "kv-error" in out[6] and "RuntimeError: CUDA out of memory (simulated)" in out[6]
    assert "last saved turn" in out[6] and out[1] == "Tell me about the kite"
    again = web.manager.get("a").session
    assert again is not session and again.restored_from == "archive"
    assert chat_messages(again) == shown and web.manager.store.messages(again.conversation_id) == stored
    assert out[0] == shown
    out = list(web.send("Tell me about the kite", request))[-1]
    assert "kv-error" not in (out[6] or "") and again.history[-1].new_tokens > 0
    assert len(web.manager.store.messages(again.conversation_id)) == len(stored) + 2


def test_the_first_token_goes_to_the_page_without_the_charts(web, monkeypatch):
    """The yield that carries a reply's first token carries no charts (the browser drew the plot before the chat,
    which showed the token 160-310 ms later); they come CHART_EVERY_S into the reply, and with its end."""
    from types import SimpleNamespace

    from kvchat.app import chatting

    clock = iter(range(40_000, 50_000))  # the handler's clock: 0.25 s a reading, from 10,000 s (as after a boot)
    monkeypatch.setattr(chatting, "time", SimpleNamespace(perf_counter=lambda: next(clock) / 4))
    session = web.manager.entry("a").session
    session.sampling = Sampling(max_new_tokens=24, temperature=0.0)
    outs = list(web.send("Tell me about the kite", _Request("a")))
    streamed = [o for o in outs if isinstance(o[0], list) and o[0][-1]["content"].endswith(" ▌")]
    assert len(streamed) >= 8 and session.history[-1].new_tokens == 24
    has_chart = [not (isinstance(o[2], dict) and o[2].get("__type__") == "update") for o in streamed]
    assert has_chart[0] is False and any(has_chart[1:]), has_chart
    assert not isinstance(outs[-1][2], dict)  # the end draws them


def test_settings_changed_while_a_reply_streams_are_said_again_at_its_end(web):
    """A settings or generation change made while a reply streams draws its status line, which the reply's later
    updates draw over: the reply's last status says it again (it was lost); the next reply's does not."""
    from kvchat.core.engine.settings import SAMPLING_SETTINGS

    request = _Request("a")
    session = web.manager.entry("a").session
    session.sampling = Sampling(max_new_tokens=12, temperature=0.0)
    stream = web.send("Tell me about the kite", request)
    while not (isinstance((out := next(stream))[0], list) and out[0][-1]["content"].endswith(" ▌")):
        pass  # until the reply's first token is on the page
    applied = web.apply_settings(request, *_values(web, session, budget=40))[3]
    sampling = [getattr(session.sampling, p.name) for p in SAMPLING_SETTINGS]
    sampling[[p.name for p in SAMPLING_SETTINGS].index("top_k")] = 7
    generation = web.sampling(request, *sampling)
    assert web.sampling(request, *sampling) == generation  # the field's blur after its Enter: said once
    assert "kv-error" in web.sampling(request, *["lots"] + sampling[1:])  # refused: not said again
    assert applied.startswith("applied: budget") and "top-k 7" in generation
    last = list(stream)[-1][6]
    assert last.startswith("reply: ") and last.endswith(f"; during it, {applied}; during it, {generation}"), last
    last = list(web.send("And the hill?", request))[-1][6]
    assert last.startswith("reply: ") and "during it" not in last, last
    assert web.apply_settings(request, *_values(web, session, budget=36))[3].startswith("applied: budget")
    assert web.manager.get("a").during_reply == []  # a change made between replies is not repeated


def test_stop_while_a_long_message_is_read_gives_the_message_back(web, monkeypatch):
    """Stop pressed while the model still reads a long message: the read stops between two chunks, the chat pane and
    the stored conversation are as before it, the message is back in the input, and the tab chats on."""
    request = _Request("a")
    session = web.manager.entry("a").session
    _chat(session, turns=2)
    shown, stored = chat_messages(session), web.manager.store.messages(session.conversation_id)
    reads = []

    def pressed(ids, *args, **kwargs):  # a slow model; Stop pressed in the page during the message's 8th forward
        reads.append(1)
        time.sleep(0.2)
        if len(reads) == 8:
            web.stop(request)
        return type(session).forward(session, ids, *args, **kwargs)

    monkeypatch.setattr(session, "forward", pressed)
    text = "The red kite flies over the hill and the river. " * 80  # ~800 tokens, read 6 at a time (the slack)
    outs = list(web.send(text, request))
    assert "stopped while reading the message" in outs[-1][6] and "back in the input" in outs[-1][6]
    assert outs[-1][1] == text and outs[-1][0] == shown and len(reads) == 8
    # Meanwhile the status said how far the read got.
    progress = [re.search(r"reading your message: ([\d,]+) of ([\d,]+) tokens", out[6]) for out in outs
                if isinstance(out[6], str)]
    read = [int(m[1].replace(",", "")) for m in progress if m]
    assert len(read) >= 2 and read == sorted(read) and read[-1] > read[0]
    assert web.manager.store.messages(session.conversation_id) == stored and not web.manager.get("a").busy
    monkeypatch.undo()
    out = list(web.send("And the kite?", request))[-1]
    assert "reply:" in out[6] and len(web.manager.store.messages(session.conversation_id)) == len(stored) + 2


def test_after_a_reply_the_conversation_new_or_open_put_in_its_place_is_drawn_again(web):
    """New or Open while a reply streams: the page draws each event's updates in its own loop, and under load the
    stopped reply's last ones landed after Open's (CI saw the opened chat replaced by the stopped reply's).
    ``after_reply``, which the page runs once the reply's updates are all drawn, draws the tab's views again where New
    or Open has replaced its conversation since the reply began, with what they said; otherwise (the same
    conversation, or New or Open still running: its own views come later) it gives back only the buttons."""
    from types import SimpleNamespace

    import gradio as gr

    send, request, buttons = SimpleNamespace(target=None), _Request("a"), [gr.update(interactive=True)] * 3
    other = web.manager.entry("b").session
    _chat(other, turns=1)
    web.manager.release("b")
    _chat(web.manager.entry("a").session, turns=1)
    list(web.reply("Tell me about the kite", send, request))
    chosen = web.manager.get("a").session.conversation_id  # the page's choice: the tab's conversation
    assert web.after_reply(chosen, request) == [gr.skip()] * 7 + buttons  # nothing replaced it

    reply = web.reply("And the hill?", send, request)
    next(reply)
    web.stop_for_open(other.conversation_id, request)
    list(reply)  # its last update says how it stopped
    web.open_conversation(other.conversation_id, request)
    out = web.after_reply(chosen, request)
    opened = web.manager.get("a").session
    assert opened.conversation_id == other.conversation_id and out[7:] == buttons
    assert out[0] == chat_messages(opened) and out[5].startswith(f"opened conversation #{other.conversation_id}")

    list(web.reply("And the river?", send, request))
    web.manager.new("a")  # New still running: what it says is not set yet, its own views are still to come
    assert web.after_reply(None, request) == [gr.skip()] * 7 + buttons
    assert web.after_reply(None, request) == [gr.skip()] * 7 + buttons  # once per reply
    list(web.reply("A kite?", send, request))
    assert web.new_conversation("", request)[5] == "new conversation"
    out = web.after_reply(None, request)
    assert out[0] == [] and out[5] == "new conversation"


def test_a_conversation_chosen_in_the_list_while_a_reply_streams_stays_chosen(web):
    """A reply's end redraws the saved list (its titles and sizes) without choosing in it: a conversation chosen
    there while the reply streamed stays chosen, for Open after it (the reply's end chose its own conversation again).
    Where nothing is chosen, as after the first reply of a new conversation, the tab's conversation is."""
    from types import SimpleNamespace

    import gradio as gr

    send, request = SimpleNamespace(target=None), _Request("a")
    other = web.manager.entry("b").session
    _chat(other, turns=1)
    web.manager.release("b")
    session = web.manager.entry("a").session
    outs = list(web.reply("Tell me about the kite", send, request))  # the first reply saves the new conversation
    listed = outs[-1][5]
    assert "value" not in listed and session.conversation_id in [c[1] for c in listed["choices"]]
    assert web.after_reply(None, request)[4]["value"] == session.conversation_id  # nothing chosen: the tab's one
    outs = list(web.reply("And the hill?", send, request))
    assert "value" not in outs[-1][5]
    assert web.after_reply(other.conversation_id, request)[4] == gr.skip()  # another one chosen: it stays


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "headaware"])
def test_what_a_session_holds_stays_within_what_the_cap_reserves_for_it(tiny, tmp_path, policy):
    """``--max-cache-mb`` admits a session by what it may come to hold (``reserve``), which must bound it: after
    turns past the budget, its cache with the policy's statistics per slot (H2O's attention received), its query
    window (SnapKV's, head-aware's) and the undo copy of both. Counting the plain cache's positions alone, it held up
    to 37% more here (tiny layers); 0.1-3.2% more for the default model at budget 1024."""
    settings = Settings(policy=policy, budget=48, window=8, slack=6)
    m = SessionManager(tiny("llama"), Store(tmp_path / "kv.db"), settings, GREEDY, max_sessions=2)
    session = m.entry("a").session
    _chat(session, turns=6)
    assert session.evicted_total > 0
    window = _nbytes(session.observer.state_tensors().values()) if session.observer is not None else 0
    copy = session.undo_copy
    undo = _nbytes(t for part in copy.cache.parts for t in part.saved.values()) + _nbytes(copy.observer.values())
    assert session.cache.nbytes + window + undo <= m.reserve(settings)
    assert m.reserve(settings) <= 1.05 * 2 * (session.cache.nbytes + window)  # and no more than it holds, near enough


def test_the_saved_list_says_which_conversations_another_model_holds(web):
    """A conversation held by another model than the server's says so in the saved list, with how to open it; Open
    refuses it in the page (it reopens only under the model that held it)."""
    s = web.manager.entry("a").session
    _chat(s, turns=1)
    mine = s.conversation_id
    other = web.manager.new("a").session
    _chat(other, turns=1)
    web.manager.release("a")
    web.manager.store.db.execute("UPDATE conversations SET model = 'org/other-model' WHERE id = ?",
                                 [other.conversation_id])
    labels = dict((cid, label) for label, cid in web._conversations("b")["choices"])
    assert labels[other.conversation_id].endswith(" · model org/other-model (kvchat serve --model opens it)")
    assert " · model " not in labels[mine]
    refusal = f"conversation {other.conversation_id} was held by model org/other-model, not tiny-llama"
    assert refusal in web.open_conversation(other.conversation_id, _Request("b"))[5]
