"""The web UI in a real browser: `kvchat serve` with the default model, driven by Debian's chromium (playwright).

Screenshots of the main screens go to $KVCHAT_TEST_OUTPUT (default: test-output/ in the repository).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import REPO

CHROMIUM = "/usr/bin/chromium"
OUT = Path(os.environ.get("KVCHAT_TEST_OUTPUT", REPO / "test-output")) / "screenshots"
pytestmark = pytest.mark.model


def _need_chromium():
    if not Path(CHROMIUM).exists() and not os.environ.get("CI"):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); CI installs it")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path, *flags: str, env: dict | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.db = tmp / "web.db"
        self.log = tmp / "serve.log"
        cmd = [sys.executable, "-m", "kvchat.app.cli", "serve", "--port", str(self.port), "--db", str(self.db),
               "--temperature", "0", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvchat serve exited: {self.log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.url, timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("kvchat serve did not start in 180 s")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def browser():
    _need_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(default_dir, tmp_path_factory):
    _need_chromium()
    srv = Server(tmp_path_factory.mktemp("web"), "--policy", "streaming", "--budget", "96", "--max-new-tokens",
                 "24", "--max-sessions", "4")
    yield srv
    srv.stop()


def test_a_stop_by_sigterm_shuts_the_server_down_and_leaves_nothing_behind(default_dir, tmp_path):
    """``kill`` (SIGTERM: systemd, a container's stop) stops ``kvchat serve`` as Ctrl-C does: the server closes, the
    process exits (0; 130, as Ctrl-C's, where the stop came while Gradio was still starting), and its temporary
    folders are gone (it died on the spot, leaving them in /tmp)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    srv = Server(tmp_path, "--max-new-tokens", "8", env={**os.environ, "TMPDIR": str(scratch)})
    assert list(scratch.glob("kvchat-export-*"))  # the exports' folder, made when the app starts
    srv.proc.terminate()
    try:
        code = srv.proc.wait(60)
    finally:
        srv.stop()
    log = srv.log.read_text()
    assert code in (0, 130) and "Traceback" not in log, log[-2000:]
    assert not list(scratch.glob("kvchat-export-*"))


def _open(browser, url):
    context = browser.new_context(viewport={"width": 1500, "height": 1100}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(120000)
    page.goto(url)
    page.wait_for_function(f"() => {INFO_JS}.includes('session')")
    return context, page


# The markdown's own text (the element also holds Gradio's progress tracker while an event runs).
INFO_JS = "(document.querySelector('#kv-info .prose')?.innerText || '')"
STATUS_JS = "(document.querySelector('#kv-status .prose')?.innerText || '')"


def _info(page) -> str:
    return page.evaluate(f"() => {INFO_JS}")


def _status(page) -> str:
    return page.evaluate(f"() => {STATUS_JS}")


def _state(page) -> str:
    return _info(page) + _status(page)


def _wait_done(page, before: str):
    """Wait until an event has updated the info or status line (replies end with their timings)."""
    page.wait_for_function(f"b => {INFO_JS} + {STATUS_JS} !== b && {INFO_JS}.includes('tokens in the conversation')",
                           arg=before)


def _send(page, text: str):
    before = _state(page)
    page.fill("#kv-input textarea", text)
    page.click("#kv-send")
    _wait_done(page, before)


def _bot_messages(page) -> list[str]:
    return page.locator("#kv-chat .bot.message").all_inner_texts()


# Records, on every change inside the chat, the length of an assistant message still being generated (it ends in
# the cursor "▌").
STREAM_RECORDER_JS = """() => {
  window.kvLengths = [];
  const chat = document.querySelector('#kv-chat');
  new MutationObserver(() => {
    const m = [...chat.querySelectorAll('.bot.message')];
    const t = m.length ? m[m.length - 1].innerText.trim() : '';
    if (t.endsWith('▌')) window.kvLengths.push(t.length);
  }).observe(chat, {childList: true, subtree: true, characterData: true});
}"""


def _wait_bot_count(page, n: int):
    """Wait until the chat shows n finished assistant messages (each ends with its token count)."""
    page.wait_for_function("n => { const m = [...document.querySelectorAll('#kv-chat .bot.message')];"
                           " return m.length === n && m.every(e => / tokens$/.test(e.innerText.trim())); }", arg=n)


def _set_number(page, elem: str, value: str):
    before = _state(page)
    box = page.locator(f"#{elem} input")
    box.fill(value)
    box.press("Enter")
    _wait_done(page, before)


def _shot(page, name: str):
    OUT.mkdir(parents=True, exist_ok=True)
    page.wait_for_function("() => !document.body.innerText.includes('processing |')")
    page.screenshot(path=str(OUT / f"{name}.png"), full_page=True)


def _session_id(page) -> str:
    return re.search(r"session (\S+)", _info(page)).group(1)


def test_chat_streams_and_live_settings_change_charts_and_cache_view(browser, server):
    context, page = _open(browser, server.url)
    try:
        # A reply streams: the bot message grows over several renders before the turn ends. The page records the
        # length of the reply in progress on every change of the chat (polling from here could miss a fast reply).
        page.evaluate(STREAM_RECORDER_JS)
        page.fill("#kv-input textarea", "Hello! Tell me a short story about a lighthouse keeper.")
        page.click("#kv-send")
        _wait_bot_count(page, 1)
        lengths = page.evaluate("() => window.kvLengths")
        assert len({n for n in lengths if n > 1}) >= 3, f"no streaming seen: {lengths}"
        page.wait_for_function(f"() => {INFO_JS}.includes('conversation #')")
        reply = _bot_messages(page)[-1]
        assert re.search(r"\d+ tokens", reply) and len(reply) > 20
        assert "conversation #" in _info(page)
        _shot(page, "01-chat")

        # Fill the cache past its budget (recall is on by default: what is evicted leaves a digest), then switch
        # policy and budget on the live conversation.
        for text in ("My locker code is 4417 and my sister is called Beatrice. Please remember both.",
                     "Now describe the sea at night in three sentences, with waves and stars."):
            _send(page, text)
        assert "streaming budget 96" in _info(page)
        page.click("#kv-policy input")
        page.click("[role=option]:has-text('h2o')")
        page.wait_for_function(f"() => {INFO_JS}.includes('h2o budget 96')")
        _set_number(page, "kv-budget", "48")
        assert "budget 96 → 48" in _status(page)
        assert "h2o budget 48" in _info(page)
        cache_now = int(re.search(r"cache (\d+) /", _info(page)).group(1))
        assert cache_now <= 48
        charts = page.inner_text("#kv-charts")
        assert "cache (positions per layer)" in charts and "budget 48" in charts  # the settings marker
        _shot(page, "02-charts-after-settings-change")

        page.click("role=tab[name='What the cache holds']")
        view = page.locator("#kv-cache-view")
        view.locator(".kv-evicted").first.wait_for()
        assert view.locator(".kv-kept").count() > 0
        assert re.search(r"still sees [\d,]+ of [\d,]+ tokens", view.inner_text())
        _shot(page, "03-cache-view")

        # A bad combination shows a visible message and changes nothing.
        _set_number(page, "kv-window", "100")
        assert "must be at least sink + window" in _status(page)
        assert "h2o budget 48" in _info(page)
        _set_number(page, "kv-window", "")

        # Recall switched off and on again live, the budget back to 96 and room for 64 recalled positions: the next
        # reply runs under the new policy with what the question needs brought back (read again from its tokens),
        # within budget + slack; the status says what came back, and the cache view marks it.
        before = _state(page)
        page.click("#kv-recall label:has-text('off')")
        _wait_done(page, before)
        assert "recall on → off" in _status(page)
        before = _state(page)
        page.click("#kv-recall label:has-text('on')")
        _wait_done(page, before)
        assert "recall off → on" in _status(page)
        _set_number(page, "kv-budget", "96")
        _set_number(page, "kv-recall-tokens", "64")
        _send(page, "Thanks. What was my locker code?")
        cache_now, cap = map(int, re.search(r"cache (\d+) / (\d+)", _info(page)).groups())
        assert cap == 96 + 64 and cache_now <= cap
        assert re.search(r"\d+ recalled in \d+ ms, the message [\d.]+ nats/token more predictable", _status(page)), \
            _status(page)
        view.locator(".kv-recalled").first.wait_for()
        assert re.search(r"[\d,]+ of them recalled", view.inner_text())
        page.click("role=tab[name='Charts']")
        assert "evicted / recalled tokens per turn" in page.inner_text("#kv-charts")
        _shot(page, "03b-recalled-text")

        # Undo takes the last turn back (its question returns to the input); retry regenerates the same reply.
        answer = _bot_messages(page)[-1]
        n_bot = len(_bot_messages(page))
        before = _state(page)
        page.click("#kv-undo")
        _wait_done(page, before)
        _wait_bot_count(page, n_bot - 1)
        assert page.input_value("#kv-input textarea") == "Thanks. What was my locker code?"
        before = _state(page)
        page.click("#kv-send")
        _wait_done(page, before)
        _wait_bot_count(page, n_bot)
        before = _state(page)
        page.click("#kv-retry")
        _wait_done(page, before)
        _wait_bot_count(page, n_bot)
        assert _bot_messages(page)[-1] == answer  # greedy: the cache before the turn was restored exactly
        _shot(page, "04-after-retry")
    finally:
        context.close()


def test_reload_reopens_a_conversation_from_the_list_and_exports_it(browser, server, tmp_path):
    context, page = _open(browser, server.url)
    try:
        _send(page, "Remember this: the meeting is in Lisbon on Tuesday.")
        cid = int(re.search(r"conversation #(\d+)", _info(page)).group(1))
        first_session = _session_id(page)
        page.reload()
        page.wait_for_function(f"() => {INFO_JS}.includes('session')")
        assert _session_id(page) != first_session and "new conversation" in _info(page)
        assert _bot_messages(page) == []
        item = page.locator("#kv-conversations label", has_text=f"#{cid} Remember this")
        assert "tokens" in item.inner_text() and "streaming" in item.inner_text()
        _shot(page, "05-conversation-list")
        # The search narrows the list to the conversations with a word in their title or any message.
        search = page.locator("#kv-search textarea, #kv-search input")
        saved = "document.querySelector('#kv-conversations').innerText"
        search.fill("LISBON")
        page.wait_for_function(f"() => {saved}.includes('Saved: 1 with “LISBON”')")
        assert page.locator("#kv-conversations input[type=radio]").count() == 1 and item.is_visible()
        search.fill("a word no message has")
        page.wait_for_function(f"() => {saved}.includes('Saved: 0 with')")
        assert page.locator("#kv-conversations input[type=radio]").count() == 0
        search.fill("")
        page.wait_for_function(f"() => !{saved}.includes(' with ') && {saved}.includes('Remember this')")
        item.click()
        before = _state(page)
        page.click("#kv-open")
        _wait_done(page, before)
        assert f"conversation #{cid}" in _info(page)
        assert "opened conversation" in _status(page)
        assert "Lisbon" in page.inner_text("#kv-chat")
        _send(page, "Where is the meeting?")
        _wait_bot_count(page, 2)

        # Rename, then export as a replay script that `kvchat replay` runs headless.
        page.fill("#kv-title textarea", "Lisbon meeting")
        page.click("#kv-rename")
        page.locator("#kv-conversations label", has_text=f"#{cid} Lisbon meeting").wait_for()
        page.click("#kv-export")
        link = page.locator("#kv-export-file a").first
        link.wait_for()
        with page.expect_download() as dl:
            link.click()
        script = tmp_path / "replay.jsonl"
        dl.value.save_as(script)
        lines = [json.loads(line) for line in script.read_text().splitlines()]
        assert [next(iter(line)) for line in lines] == ["system", "user", "assistant", "user", "assistant"]
        assert lines[1]["user"] == "Remember this: the meeting is in Lisbon on Tuesday."
        done = subprocess.run([sys.executable, "-m", "kvchat.app.cli", "replay", str(script), "--no-save",
                               "--json", "--max-new-tokens", "4", "--budget", "64"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    finally:
        context.close()


def test_each_browser_context_gets_its_own_session(browser, server):
    ctx_a, a = _open(browser, server.url)
    ctx_b, b = _open(browser, server.url)
    try:
        assert _session_id(a) != _session_id(b)
        _send(a, "Only tab A says this: pineapples.")
        assert "pineapples" in a.inner_text("#kv-chat")
        assert b.locator("#kv-chat .message").count() == 0
        # B's settings change does not touch A's session.
        page_b_policy = b.locator("#kv-policy input")
        page_b_policy.click()
        b.click("[role=option]:has-text('tova')")
        b.wait_for_function(f"() => {INFO_JS}.includes('tova budget')")
        assert "streaming budget" in _info(a)
        # Markdown is rendered, HTML in a message is not run.
        _send(b, 'Tab B talks about **kiwis** <img src=x onerror="window.__pwned=1">')
        assert "pineapples" not in b.inner_text("#kv-chat")
        assert b.locator("#kv-chat strong", has_text="kiwis").count() >= 1
        assert b.evaluate("() => window.__pwned") is None
        _shot(b, "06-second-session")

        # Stop ends a long reply early and keeps what was generated.
        _set_number(b, "kv-max-new", "400")
        assert "up to 400 new tokens" in _status(b)
        before = _state(b)
        b.fill("#kv-input textarea", "Write a very long essay about the history of tea, with many details.")
        b.click("#kv-send")
        b.wait_for_function("() => [...document.querySelectorAll('#kv-chat .bot.message')].some("
                            "e => e.innerText.trim().endsWith('▌') && e.innerText.length > 20)")
        b.click("#kv-stop")
        _wait_done(b, before)
        assert "stopped by cancelled" in _status(b)
        tokens = int(re.search(r"reply: (\d+) tokens", _status(b)).group(1))
        assert 0 < tokens < 400
    finally:
        ctx_a.close()
        ctx_b.close()


def test_a_full_server_says_so(browser, default_dir, tmp_path):
    srv = Server(tmp_path, "--max-sessions", "1", "--budget", "64")
    try:
        ctx_a, a = _open(browser, srv.url)
        ctx_b = browser.new_context()
        b = ctx_b.new_page()
        b.goto(srv.url)
        b.wait_for_function(f"() => {STATUS_JS}.includes('full')", timeout=60000)
        assert "1" in _status(b) and "chat sessions are open" in _status(b)
        _shot(b, "07-server-full")
        # Closing the first tab frees its session: a new tab then gets one.
        ctx_a.close()
        deadline = time.time() + 60
        while True:
            c = ctx_b.new_page()
            c.goto(srv.url)
            c.wait_for_function(f"() => {INFO_JS}.includes('session') || {STATUS_JS}.includes('full')")
            if "session" in _info(c):
                break
            assert time.time() < deadline, "the closed tab's session was not released"
            c.close()
            time.sleep(2)
        ctx_b.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("flags, message", [
    (["--host", "0.0.0.0"], "give --auth"),
    (["--share"], "--share opens a public link"),
    (["--auth", "nopassword"], "expected USER:PASSWORD"),
    (["--auth-file", "/nonexistent/logins"], "cannot read auth file"),
    (["--port", "0"], "--port must be between"),
    (["--budget", "8", "--window", "20"], "must be at least sink + window"),
    (["--port", "PORT IN USE"], "(Address already in use; another kvchat serve?): pick another --port"),
    (["--host", "no.such.host.invalid", "--auth", "a:b"], "--host no.such.host.invalid:"),
])
def test_serve_refuses_bad_flags_in_one_line(flags, message):
    with socket.socket() as taken:  # a port in use said so before the model loaded, naming kvchat's flag
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        flags = [str(taken.getsockname()[1]) if f == "PORT IN USE" else f for f in flags]
        done = subprocess.run([sys.executable, "-m", "kvchat.app.cli", "serve", *flags], capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("kvchat: error:") and message in done.stderr
    assert done.stderr.count("\n") == 1



def test_enter_sends_and_shift_enter_starts_a_new_line(browser, server):
    from kvchat.storage.db import Store

    context, page = _open(browser, server.url)
    try:
        before = _state(page)
        page.click("#kv-input textarea")
        page.keyboard.type("First line of my note.")
        page.keyboard.press("Shift+Enter")
        page.keyboard.type("Second line.")
        assert page.input_value("#kv-input textarea") == "First line of my note.\nSecond line."
        page.keyboard.press("Enter")
        _wait_done(page, before)
        _wait_bot_count(page, 1)
        assert page.input_value("#kv-input textarea") == ""
        user = page.locator("#kv-chat .user.message").first.inner_text()
        assert "First line of my note.\nSecond line." in user
        page.wait_for_function(f"() => {INFO_JS}.includes('conversation #')")
        cid = int(re.search(r"conversation #(\d+)", _info(page)).group(1))
        stored = [m["text"] for m in Store(server.db).messages(cid) if m["role"] == "user"]
        assert stored == ["First line of my note.\nSecond line."]
    finally:
        context.close()


def test_while_a_reply_streams_only_stop_is_offered(browser, server):
    """While a reply streams Send, Retry and Undo are greyed and Enter sends nothing: the next message waits in the
    input (before, a click on Send was dropped unseen while Enter queued the message behind the reply). Stop ends the
    reply and gives the buttons back; nothing queued is sent after it."""
    context, page = _open(browser, server.url)
    try:
        _set_number(page, "kv-max-new", "2000")
        page.fill("#kv-input textarea", "Tell me a very long story about a cat who keeps a lighthouse.")
        page.click("#kv-send")
        page.wait_for_function("() => { const m = [...document.querySelectorAll('#kv-chat .bot.message')];"
                               " return m.length === 1 && m[0].innerText.trim().length > 20; }")
        assert [page.is_disabled(f"#kv-{b}") for b in ("send", "retry", "undo", "stop")] == [True] * 3 + [False]
        page.fill("#kv-input textarea", "My budget is 1200 euros.")
        page.press("#kv-input textarea", "Enter")
        before = _state(page)
        page.click("#kv-stop")
        _wait_done(page, before)
        page.wait_for_function("() => !document.querySelector('#kv-send').disabled")
        assert "stopped by" in _status(page)
        time.sleep(1.5)  # a message queued behind the reply would be on its way by now
        assert page.input_value("#kv-input textarea") == "My budget is 1200 euros."
        assert page.locator("#kv-chat .user.message").count() == 1
        assert not any(page.is_disabled(f"#kv-{b}") for b in ("send", "retry", "undo"))
    finally:
        context.close()


def _last_stop(db: Path, words: str) -> tuple[int, str]:
    """The conversation whose message holds ``words``, and how its last reply ended."""
    import sqlite3

    with sqlite3.connect(db) as con:
        cid = con.execute("SELECT conversation_id FROM messages WHERE text LIKE ? ORDER BY id DESC LIMIT 1",
                          (f"%{words}%",)).fetchone()[0]
        return cid, con.execute("SELECT stopped FROM turn_stats WHERE conversation_id = ? ORDER BY id DESC LIMIT 1",
                                (cid,)).fetchone()[0]


def _start_long_reply(page, text: str):
    """Send ``text`` and wait until its reply streams."""
    page.fill("#kv-input textarea", text)
    page.click("#kv-send")
    page.wait_for_function("() => { const m = [...document.querySelectorAll('#kv-chat .bot.message')];"
                           " return m.length && m[m.length - 1].innerText.trim().length > 20; }")


def test_new_and_open_stop_the_streaming_reply_first(browser, server):
    """New, or Open, while a reply streams stops it (kept as far as it got, as Stop keeps it) and then runs, at once:
    before, they waited in the model's queue until the reply ended by itself. Open opens the conversation chosen at
    its click and it stays shown, however late a slow page draws the stopped reply's last updates. A conversation
    chosen in the list while a reply streams stays chosen after it."""
    context, page = _open(browser, server.url)
    try:
        _set_number(page, "kv-max-new", "2000")
        _start_long_reply(page, "Tell me a very long story about a cat who keeps a lighthouse.")
        page.click("#kv-new")
        page.wait_for_function(f"() => {STATUS_JS}.includes('new conversation')", timeout=30000)
        # The chat is read once Send is back, the stopped reply's event ended in the page: its last updates can be
        # drawn after New's (a suite run saw the old reply under "new conversation"), and are drawn over by then
        page.wait_for_function("() => !document.querySelector('#kv-send').disabled", timeout=60000)
        first, how = _last_stop(server.db, "cat who keeps a lighthouse")
        assert how == "cancelled" and _bot_messages(page) == [] and f"#{first}" not in _info(page)

        _start_long_reply(page, "Write a long poem about the sea, the wind and the stars.")
        choice = page.locator("#kv-conversations label", has_text=f"#{first} ")
        choice.click()
        page.wait_for_function("l => l.querySelector('input').checked", arg=choice.element_handle(), timeout=10000)
        time.sleep(1)  # the choice reaches the page's state
        # A page under load draws each event's updates late: the stopped reply's last ones, which choose its own
        # conversation in the list and draw its chat, could reach Open before it read the choice (it opened the
        # conversation already open) or land over the opened chat. With the page's CPU slowed 8x while Open is
        # clicked (at once: playwright's click waits for a still page) both were the usual case.
        cdp = context.new_cdp_session(page)
        cdp.send("Emulation.setCPUThrottlingRate", {"rate": 8})
        page.evaluate("() => document.querySelector('#kv-open').click()")
        time.sleep(4)
        cdp.send("Emulation.setCPUThrottlingRate", {"rate": 1})
        # Send is back once the reply's event has ended in the page, its last update drawn
        page.wait_for_function("() => !document.querySelector('#kv-send').disabled", timeout=60000)
        try:
            page.wait_for_function(f"c => {STATUS_JS}.includes('opened conversation #' + c) && (() => {{"
                                   " const t = document.querySelector('#kv-chat').innerText;"
                                   " return t.includes('lighthouse') && !t.includes('Loading'); })()",
                                   arg=first, timeout=60000)
        except Exception as exc:  # what the page showed instead
            shown = page.evaluate("() => document.querySelector('#kv-chat').innerText")
            raise AssertionError(f"conversation #{first} not shown as opened; status "
                                 f"{page.inner_text('#kv-status')!r}, the chat shows {shown[-300:]!r}, the poem's "
                                 f"reply {_last_stop(server.db, 'the wind and the stars')}") from exc
        assert _last_stop(server.db, "the wind and the stars")[1] == "cancelled"
        assert page.locator("#kv-conversations input:checked").evaluate("i => i.value") == str(first)
        assert "lighthouse" in page.inner_text("#kv-chat") and len(_bot_messages(page)) == 1

        # A conversation chosen in the list while a reply streams stays chosen once it has ended, for Open after it
        # (the reply's end chose its own conversation again).
        poem = _last_stop(server.db, "the wind and the stars")[0]
        _start_long_reply(page, "Tell me more about the cat, at length.")
        other = page.locator("#kv-conversations label", has_text=f"#{poem} ")
        other.click()
        page.wait_for_function("l => l.querySelector('input').checked", arg=other.element_handle(), timeout=10000)
        page.click("#kv-stop")
        page.wait_for_function("() => !document.querySelector('#kv-send').disabled", timeout=60000)
        assert _last_stop(server.db, "about the cat, at length")[1] == "cancelled"  # it streamed until the Stop
        assert page.locator("#kv-conversations input:checked").evaluate("i => i.value") == str(poem)
    finally:
        context.close()


# Four tabs, each with its own word, policy and budget (none of them the server's default policy).
FOUR = [("alpha", "streaming", 64), ("bravo", "h2o", 80), ("charlie", "snapkv", 96), ("delta", "window", 112)]
WORDS = [word for word, _, _ in FOUR] + ["echo", "foxtrot"]


def _pick_policy(page, policy: str):
    page.click("#kv-policy input")
    page.get_by_role("option", name=policy, exact=True).click()
    page.wait_for_function(f"p => {INFO_JS}.includes(p + ' budget')", arg=policy)


def _cache_view_text(page) -> str:
    page.click("role=tab[name='What the cache holds']")
    view = page.locator("#kv-cache-view")
    view.locator(".kv-msg").first.wait_for()
    return view.inner_text()


def _open_when_free(browser, url, timeout: float = 90):
    """A new context on ``url``, retried while the server says it is full (a closed tab is released when Gradio
    notices the disconnection). Returns (context, page, seconds waited)."""
    t0 = time.time()
    while True:
        context = browser.new_context(viewport={"width": 1500, "height": 1100})
        page = context.new_page()
        page.set_default_timeout(120000)
        page.goto(url)
        page.wait_for_function(f"() => {INFO_JS}.includes('session') || {STATUS_JS}.includes('full')")
        if "session" in _info(page):
            return context, page, time.time() - t0
        context.close()
        assert time.time() - t0 < timeout, "the server stayed full: a closed tab's session was not released"
        time.sleep(2)


def test_four_people_at_once_stay_apart_within_the_caps(browser, default_dir, tmp_path):
    from kvchat.storage.db import Store

    srv = Server(tmp_path, "--policy", "tova", "--budget", "200", "--max-new-tokens", "24", "--max-sessions", "4")
    contexts = []
    try:
        tabs = []
        for word, policy, budget in FOUR:
            context, page = _open(browser, srv.url)
            contexts.append(context)
            _pick_policy(page, policy)
            _set_number(page, "kv-budget", str(budget))
            assert f"{policy} budget {budget}" in _info(page)
            _set_number(page, "kv-max-new", "8")
            assert "up to 8 new tokens" in _status(page)
            tabs.append((page, word, policy, budget))
        assert len({_session_id(page) for page, *_ in tabs}) == 4

        # Three turns each, the four sends in flight together (replies queue on the one model).
        said = {word: [] for word, _, _ in FOUR}
        for turn in range(1, 4):
            for page, word, _, _ in tabs:
                text = f"Turn {turn}. My codeword is {word}. Repeat my codeword."
                said[word].append(text)
                page.fill("#kv-input textarea", text)
                page.click("#kv-send")
            for page, _, _, _ in tabs:
                _wait_bot_count(page, turn)

        for page, word, policy, budget in tabs:
            users = page.locator("#kv-chat .user.message").all_inner_texts()
            assert len(users) == 3 and all(u.startswith(s) for u, s in zip(users, said[word])), users
            chat = page.inner_text("#kv-chat").lower()
            view = _cache_view_text(page).lower()
            assert word in chat and word in view
            for other in WORDS:
                if other != word:
                    assert other not in chat, f"{other!r} shows in {word}'s chat"
                    assert other not in view, f"{other!r} shows in {word}'s cache view"
            info = _info(page)
            assert f"{policy} budget {budget}" in info and "tova" not in info
            assert int(re.search(r"cache (\d+) /", info).group(1)) <= budget + 64
            assert page.input_value("#kv-budget input") == str(budget)
            assert int(re.search(r"reply: (\d+) tokens", _status(page)).group(1)) <= 8
        _shot(tabs[0][0], "08-four-sessions")

        # A fifth person finds the server full, with a visible message.
        fifth = browser.new_context(viewport={"width": 1500, "height": 1100})
        contexts.append(fifth)
        p5 = fifth.new_page()
        p5.set_default_timeout(120000)
        p5.goto(srv.url)
        p5.wait_for_function(f"() => {STATUS_JS}.includes('full')", timeout=60000)
        assert "kvchat is full: 4 chat sessions are open" in _status(p5)
        assert p5.locator("#kv-status .kv-error").is_visible()

        # The fourth tab closes while a long reply streams.
        closing, word, _, _ = tabs.pop()
        cid = int(re.search(r"conversation #(\d+)", _info(closing)).group(1))
        _set_number(closing, "kv-max-new", "400")
        closing.fill("#kv-input textarea", f"Now, {word}, write a very long essay about the history of tea.")
        closing.click("#kv-send")
        closing.wait_for_function("() => [...document.querySelectorAll('#kv-chat .bot.message')].some("
                                  "e => e.innerText.trim().endsWith('▌') && e.innerText.length > 20)")
        closing.context.close()
        contexts.remove(closing.context)
        t_closed = time.time()

        # The other tabs keep being served, meanwhile.
        for page, word, _, _ in tabs:
            page.fill("#kv-input textarea", f"Turn 4. My codeword is still {word}.")
            page.click("#kv-send")
        for page, _, _, _ in tabs:
            _wait_bot_count(page, 4)
            assert int(re.search(r"reply: (\d+) tokens", _status(page)).group(1)) <= 8  # not the closed tab's 400

        # Its session was released: the fifth person, reloading, gets one and chats.
        fifth.close()
        contexts.remove(fifth)
        fifth, p5, waited = _open_when_free(browser, srv.url)
        contexts.append(fifth)
        print(f"closed tab released within {time.time() - t_closed:.1f} s (fifth tab retried {waited:.1f} s)")
        _send(p5, "My codeword is echo. Repeat my codeword.")
        _wait_bot_count(p5, 1)
        assert "echo" in p5.inner_text("#kv-chat").lower()
        assert "tova budget 200" in _info(p5)  # a new session starts with the server's settings, not a closed tab's

        # The closed tab's reply was cut short when it went away, and stored as a completed turn.
        stats = Store(srv.db).turn_stats(cid)
        assert [t["turn"] for t in stats] == [0, 1, 2, 3, 4] and stats[-1]["role"] == "assistant", stats
        print(f"closed tab's last turn: {stats[-1]['new_tokens']} tokens, stopped by {stats[-1]['stopped']}")
        assert stats[-1]["new_tokens"] < 400 and stats[-1]["stopped"] != "max_new_tokens", stats[-1]

        # Still healthy after: everyone leaves, a new person loads the page and chats.
        for context in contexts:
            context.close()
        contexts.clear()
        context, page, _ = _open_when_free(browser, srv.url)
        contexts.append(context)
        _send(page, "My codeword is foxtrot. Repeat my codeword.")
        _wait_bot_count(page, 1)
        assert srv.proc.poll() is None
        assert "Traceback" not in srv.log.read_text()
    finally:
        for context in contexts:
            context.close()
        srv.stop()


@pytest.fixture
def auth_server(default_dir, tmp_path):
    _need_chromium()
    srv = Server(tmp_path, "--auth", "user:secret", "--budget", "64", "--max-new-tokens", "8")
    yield srv
    srv.stop()


def test_login_refuses_a_wrong_password_and_admits_the_right_one(browser, auth_server):
    context = browser.new_context(viewport={"width": 1500, "height": 1100})
    page = context.new_page()
    page.set_default_timeout(120000)
    try:
        page.goto(auth_server.url)
        page.get_by_label("username").fill("user")
        page.get_by_label("password").fill("wrong")
        page.get_by_role("button", name="Login").click()
        page.get_by_text("Incorrect Credentials").wait_for()
        assert page.locator("#kv-chat").count() == 0
        _shot(page, "09-login-refused")

        page.get_by_label("username").fill("user")
        page.get_by_label("password").fill("secret")
        page.get_by_role("button", name="Login").click()
        page.wait_for_function(f"() => {INFO_JS}.includes('session')")
        assert page.locator("#kv-chat").is_visible()
        _send(page, "Hello there.")
        _wait_bot_count(page, 1)
    finally:
        context.close()
