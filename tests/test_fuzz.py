"""Bad input, everywhere: replay scripts, the web UI's handlers and the database.

Every case must give a clear message (one ``kvchat: error:`` line and exit status 2 for the CLI; a visible error
status for the web handlers), leave the process working, and lose nothing already stored. Tiny random-weight
models keep this fast; a seeded generator (not hypothesis) mutates scripts so a failure replays exactly.
"""

import errno
import json
import os
import random
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from kvchat.app.cli import main
from kvchat.app.scripts import ScriptError, load_scripts
from kvchat.app.sessions import SessionManager
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import CACHE_SETTINGS, SAMPLING_SETTINGS, Settings
from kvchat.storage.db import Store, StoreError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:gradio.helpers")  # gr.Warning outside a request

FAST = ["--policy", "streaming", "--budget", "64", "--max-new-tokens", "2"]
GOOD = [{"system": "You are terse."}, {"user": "My name is Alice."}, {"assistant": "Hello Alice."},
        {"user": "What is my name?"}]
SETTINGS = Settings(policy="streaming", budget=48, window=8, slack=6)
GREEDY = Sampling(max_new_tokens=6, temperature=0.0)
WORDS = ["apple", "river", "stone", "cloud", "seven", "blue", "moves", "under", "quietly", "the"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a shared, busy machine the tiny model's matmuls are then ~50x faster than with two
    threads competing for the other processes' cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(code, err, alone: bool = False) -> str:
    """The command failed with exit status 2 and exactly one ``kvchat: error:`` line, the last on stderr (with
    ``alone``, the only one: the failure came before the model loaded)."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("kvchat: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err[-2000:]
    assert len(errors[0]) <= 600 and errors[0].isprintable(), errors[0][:600]
    if alone:
        assert lines == errors, err[-2000:]
    return errors[0]


def _write(path: Path, lines) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def _snapshot(db: Path) -> dict:
    """Everything stored, read without kvchat (so a bug in Store cannot hide a loss)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {t: con.execute(f"SELECT * FROM {t} ORDER BY id").fetchall()
                for t in ("conversations", "messages", "turn_stats")}
    finally:
        con.close()


@pytest.fixture(scope="module")
def stored_db(model_dir, tmp_path_factory):
    """A database holding one replayed conversation, copied for each test that wants one."""
    folder = tmp_path_factory.mktemp("stored")
    script = _write(folder / "good.jsonl", GOOD)
    assert main(["replay", str(script), "--model", str(model_dir), *FAST, "--db", str(folder / "kv.db"),
                 "--json"]) == 0
    con = sqlite3.connect(folder / "kv.db")
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    return folder / "kv.db"


def _copy_db(src: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, folder / "kv.db")
    if (src.parent / "archive").is_dir():
        shutil.copytree(src.parent / "archive", folder / "archive")
    return folder / "kv.db"


# ------------------------------------------------------------------------------------------------------------------
# 1. kvchat replay inputs
# ------------------------------------------------------------------------------------------------------------------
BAD_SCRIPTS = {
    # name: (file suffix, content (bytes, str, or a list of JSON values, one per line), what the error says)
    "random bytes": (".jsonl", bytes(random.Random(1).randrange(128, 256) for _ in range(4096)), "not UTF-8"),
    "random bytes, .json": (".json", b"\xff\xfe\x00garbage\x80\x81", "not UTF-8"),
    "10 MB line of junk": (".jsonl", "{\"user\": " + "x" * 10_000_000 + "}\n", ":1: invalid JSON"),
    "10 MB key": (".jsonl", "{\"" + "k" * 10_000_000 + "\": 1}\n", ":1: unknown key kkkk"),
    "10 MB list, not an object": (".jsonl", "[" + "1," * 5_000_000 + "1]\n", ":1: expected a JSON object"),
    "100,000 nested lists": (".jsonl", "[" * 100_000 + "]" * 100_000 + "\n", ":1: JSON nested too deeply"),
    "100,000 nested lists in a message": (".jsonl", "{\"user\": " + "[" * 100_000 + "]" * 100_000 + "}\n",
                                          ":1: JSON nested too deeply"),
    "100,000 nested lists, .json": (".json", "[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
    "NUL in a message": (".jsonl", [{"user": "a\u0000b"}], ":1: user holds a NUL character"),
    "lone surrogate": (".jsonl", "{\"user\": \"\\ud800\"}\n", ":1: user is not valid Unicode"),
    "lone surrogate in a key": (".jsonl", "{\"\\udfff\\n\": \"hi\"}\n", ":1: unknown key"),
    "control characters in a key": (".jsonl", [{"user": "hi", "\u001b[2J\r\n\u0007": 1}], ":1: unknown key"),
    "5,000-digit number": (".jsonl", "{\"user\": " + "9" * 5000 + "}\n", ":1: invalid JSON"),
    "empty file": (".jsonl", "", "the script is empty"),
    "only blank lines": (".jsonl", "\n  \n\t\n", "the script is empty"),
    "empty .json": (".json", "", "invalid JSON"),
    "a number, not an object": (".jsonl", [5], ":1: expected a JSON object"),
    "a string, not an object": (".jsonl", ["user"], ":1: expected a JSON object"),
    "null, not an object": (".jsonl", [None], ":1: expected a JSON object"),
    "a list, not an object": (".jsonl", [[{"user": "hi"}]], ":1: expected a JSON object"),
    ".json holding a number": (".json", "5", "expected an object with a \"conversations\" list"),
    "unknown key": (".jsonl", [{"user": "hi", "colour": "red"}], ":1: unknown key colour"),
    "empty object": (".jsonl", [{}], ":1: a line needs one of system, user, assistant"),
    "user: 5": (".jsonl", [{"user": 5}], ":1: user must be text, got int"),
    "user: null": (".jsonl", [{"user": None}], ":1: user must be text, got NoneType"),
    "user: a list": (".jsonl", [{"user": ["hi"]}], ":1: user must be text, got list"),
    "assistant: an object": (".jsonl", [{"user": "hi"}, {"assistant": {"a": 1}}], ":2: assistant must be text"),
    "expect: true": (".jsonl", [{"user": "hi", "expect": True}], ":1: expect must be text, got bool"),
    "system after a turn": (".jsonl", [{"user": "hi"}, {"system": "x"}], ":2: a system line stands alone"),
    "MT-Bench turns: a string": (".jsonl", [{"turns": "hello"}], ":1: expected a non-empty \"turns\" list"),
    "MT-Bench turn: a number": (".jsonl", [{"turns": ["hi", 3]}], ":1: turn must be text, got int"),
    "ShareGPT bad role": (".json", [{"conversations": [{"from": "wizard", "value": "hi"}]}],
                          ".conversations[0]: expected {\"from\": human|gpt|system"),
    "ShareGPT role: a list": (".json", [{"conversations": [{"from": ["human"], "value": "hi"}]}],
                              ".conversations[0]: expected"),
    "ShareGPT value: a number": (".json", [{"conversations": [{"from": "human", "value": 1.5}]}],
                                 "value must be text, got float"),
    "ShareGPT conversations: a string": (".json", [{"conversations": "human: hi"}], "expected an object with"),
    "ShareGPT no turns": (".json", [{"conversations": []}], "the conversation has no turns"),
}


def _script_file(folder: Path, suffix: str, content) -> Path:
    path = folder / f"script{suffix}"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content, encoding="utf-8", errors="surrogatepass")
    elif suffix == ".json":
        path.write_text(json.dumps(content), encoding="utf-8")
    else:
        _write(path, content)
    return path


@pytest.mark.parametrize("name", list(BAD_SCRIPTS))
def test_bad_replay_script_is_one_line_and_keeps_the_database(name, model_dir, stored_db, tmp_path, capsys):
    suffix, content, message = BAD_SCRIPTS[name]
    db = _copy_db(stored_db, tmp_path / "db")
    before = _snapshot(db)
    script = _script_file(tmp_path, suffix, content)
    code, out, err = _run(capsys, "replay", script, "--model", model_dir, *FAST, "--db", db, "--json")
    line = _one_error(code, err, alone=True)  # the script is parsed before the model loads
    assert message in line, line
    assert out == "" and _snapshot(db) == before


def test_control_characters_in_messages_are_kept_as_text(model_dir, tmp_path, capsys):
    """Control characters other than NUL are text like any other: replayed and stored exactly."""
    texts = ["bell\u0007 escape\u001b[31m red \u001b[0m", "tab\tcr\rback\bdel\u007f", "\u0001\u0002 zero\u200bwidth",
             "line\u2028sep\u2029para and \ufeffBOM"]
    lines = [{"user": texts[0]}, {"assistant": texts[1]}, {"user": texts[2]}, {"assistant": texts[3]}]
    db = tmp_path / "kv.db"
    code, _, err = _run(capsys, "replay", _write(tmp_path / "c.jsonl", lines), "--model", model_dir, *FAST,
                          "--db", db, "--json")
    assert code == 0, err
    (conv,) = Store(db).conversations()
    stored = [m["text"] for m in Store(db).messages(conv["id"]) if m["role"] != "system"]
    assert stored == texts


def test_seeded_mutations_of_a_script_parse_or_fail_cleanly(tmp_path):
    """Two thousand random mutations of valid scripts (bytes flipped, cut, spliced, values retyped): each either
    parses or raises ScriptError (a ValueError, one line) — never another exception."""
    rng = random.Random(20240601)
    seeds = ["".join(json.dumps(x) + "\n" for x in GOOD),
             json.dumps([{"id": 1, "conversations": [{"from": "human", "value": "hi"},
                                                     {"from": "gpt", "value": "yo"}]}]),
             "".join(json.dumps({"turns": ["q1", "q2"]}) + "\n" for _ in range(2))]
    junk = ["\u0000", "\ud800", "\\ud800", "\"", "{", "}", "[", "]", ",", ":", "null", "5", "1e999", "-0", "true",
            "\"from\"", "\"turns\"", "\"user\"", "\n", "\\", "\\u0000", "\u001b", "\uffff", "9" * 5000]
    outcomes = {"parsed": 0, "refused": 0}
    for i in range(2000):
        suffix = ".json" if i % 3 == 1 else ".jsonl"
        text = seeds[i % 3]
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(text) + 1)
            op = rng.randrange(4)
            if op == 0:
                text = text[:at] + rng.choice(junk) + text[at:]
            elif op == 1:
                text = text[:at] + text[at + rng.randint(1, 8):]
            elif op == 2:
                text = text[:at]
            else:
                text = text[:at] + chr(rng.randrange(0x20, 0x3000)) + text[at:]
        path = tmp_path / f"m{suffix}"
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
        try:
            scripts = load_scripts(path)
        except ScriptError as exc:
            assert "\n" not in str(exc)
            outcomes["refused"] += 1
        else:
            assert scripts and all(s.steps for s in scripts)
            outcomes["parsed"] += 1
    assert outcomes["parsed"] > 20 and outcomes["refused"] > 200, outcomes


def test_a_message_longer_than_the_budget_is_fed_in_chunks(model_dir, tmp_path, capsys):
    """A 50,000-token message is prefilled in chunks; the cache never holds more than budget + slack positions."""
    rng = random.Random(7)
    text = " ".join(rng.choice(WORDS) for _ in range(50_000))
    db = tmp_path / "kv.db"
    script = _write(tmp_path / "long.jsonl", [{"user": text}])
    code, out, err = _run(capsys, "replay", script, "--model", model_dir, *FAST, "--db", db, "--json")
    assert code == 0, err
    turn, summary = (json.loads(x) for x in out.splitlines())
    assert turn["prompt_tokens"] > 50_000 and turn["new_tokens"] == 2
    assert summary["summary"]["max_cache_tokens"] <= 64 + 64 and turn["evicted_tokens"] > 49_000
    (conv,) = Store(db).conversations()
    assert conv["total_tokens"] > 50_000


def test_a_message_past_the_models_positions_under_full_is_refused(model_dir, stored_db, tmp_path, capsys):
    """Under ``full`` (no eviction) a message that cannot fit the tiny model's 512 positions is refused before it
    is fed: one line, nothing stored, no archive left behind."""
    db = _copy_db(stored_db, tmp_path / "db")
    before = _snapshot(db)
    archives = sorted(p.name for p in (db.parent / "archive").iterdir())
    script = _write(tmp_path / "long.jsonl", [{"user": " ".join(["river"] * 2000)}])
    code, _, err = _run(capsys, "replay", script, "--model", model_dir, "--policy", "full", "--max-new-tokens", 2,
                        "--db", db, "--json")
    line = _one_error(code, err)
    assert "positions but only" in line and "switch to a bounded policy" in line
    assert _snapshot(db) == before
    assert sorted(p.name for p in (db.parent / "archive").iterdir()) == archives


# ------------------------------------------------------------------------------------------------------------------
# 2. The web UI's handlers (no browser)
# ------------------------------------------------------------------------------------------------------------------
class _Request:
    def __init__(self, key):
        self.session_hash = key


@pytest.fixture(scope="module")
def web(tiny, tmp_path_factory):
    from kvchat.app.web import WebApp

    db = tmp_path_factory.mktemp("web") / "kv.db"
    manager = SessionManager(tiny("llama"), Store(db), SETTINGS, GREEDY, max_sessions=64)
    app = WebApp(manager, "tiny")
    app.demo = app.build()
    yield app
    manager.close()


STATUS = 6  # the status in what send / undo yield


def _consistent(web, key):
    """The tab's session and SQLite hold the same conversation (when it has been stored at all)."""
    s = web.manager.get(key).session
    if s.conversation_id is None:
        return
    stored = [(m["role"], m["text"]) for m in web.manager.store.messages(s.conversation_id)]
    assert stored == [(m["role"], m["content"]) for m in s.messages]
    assert [r["turn"] for r in web.manager.store.turn_stats(s.conversation_id)] == list(range(s.turn))


def _usable(web, key):
    """A reply still streams to the end and is stored."""
    outs = list(web.send("Are you still there?", _Request(key)))
    assert "reply:" in outs[-1][STATUS], outs[-1][STATUS]
    _consistent(web, key)


def _settings_values(web, session, **changes):
    values = [changes.get(p.name, getattr(session.settings, p.name)) for p in CACHE_SETTINGS]
    params = session.stats()["params"]
    return values + [changes.get(n, params.get(n, p.default)) for n, (p, _) in web.params.items()]


JUNK = ["junk", "", "   ", None, -1, -1e30, 0, 1e30, 10**100, -(10**100), float("nan"), float("inf"),
        float("-inf"), "nan", "inf", "1e30", "12abc", 2.5, True, [], {}, "\u0000", "\ud800"]


def test_settings_panel_junk_is_a_visible_error_or_a_valid_change(web):
    key = "settings"
    request = _Request(key)
    session = web.manager.entry(key).session
    session.exchange("Hello there, this is a start.", "Hi.")
    names = [p.name for p in CACHE_SETTINGS] + list(web.params)
    accepted = []
    for i, name in enumerate(names):
        for junk in JUNK:
            session = web.manager.get(key).session
            before = session.settings
            values = _settings_values(web, session)
            values[i] = junk
            if i >= len(CACHE_SETTINGS):  # a policy parameter: under a policy that has it
                values[0] = web.params[name][1][0]
            out = web.apply_settings(request, *values)
            status = out[3]
            assert isinstance(status, str) and ("kv-error" in status or "applied" in status
                                                or "unchanged" in status), (name, junk, out)
            session = web.manager.get(key).session
            if "kv-error" in status:
                assert session.settings == before, (name, junk)
                continue
            session.settings.validate(session.model.max_positions)
            if session.settings == before:
                continue
            for j in range(2):  # the accepted value must hold through compressions
                session.exchange(f"Turn {j}: the red kite flies over the green hill again. " * 3, "Noted.")
            _consistent(web, key)
            web.manager.new(key, settings=SETTINGS)  # a short conversation for the next case
            accepted.append((name, junk))
    assert ("window", "") in accepted and ("heavy", 0) in accepted  # empty: derived; 0 heavy hitters: all recent
    ints = {p.name for p in CACHE_SETTINGS if p.type is int} | {n for n, (p, _) in web.params.items() if p.type is int}
    assert not [(n, j) for n, j in accepted if n in ints and not isinstance(j, bool) and j in (10**100, 1e30, -1)]
    assert not [j for n, j in accepted if n == "average" and j is not None and not isinstance(j, (bool, str))]
    _consistent(web, key)
    _usable(web, key)


def test_generation_panel_junk_is_a_visible_error_or_a_valid_change(web):
    key = "sampling"
    request = _Request(key)
    session = web.manager.entry(key).session
    defaults = [getattr(GREEDY, p.name) for p in SAMPLING_SETTINGS]
    for i, p in enumerate(SAMPLING_SETTINGS):
        for junk in JUNK:
            values = list(defaults)
            values[i] = junk
            if p.name != "temperature":
                values[1] = 0.8  # sample, so every other setting is in play
            before = session.sampling
            status = web.sampling(request, *values)
            assert isinstance(status, str), (p.name, junk)
            if "kv-error" in status:
                assert session.sampling == before, (p.name, junk)
                continue
            assert status.startswith("generation:"), status
            outs = []
            for k, out in enumerate(web.send("Tell me a story.", request)):  # stopped, whatever max_new_tokens is
                outs.append(out)
                if k == 4:
                    web.stop(request)
            assert "reply:" in outs[-1][STATUS], (p.name, junk, outs[-1][STATUS])
            web.sampling(request, *defaults)
    _consistent(web, key)
    _usable(web, key)


def test_empty_and_huge_messages(web):
    key = "messages"
    request = _Request(key)
    web.manager.entry(key)
    for text in ["", "   ", " \n\t \r\n", "\u0000", "a\u0000b", "\ud800"]:
        outs = list(web.send(text, request))
        assert len(outs) == 1 and "kv-error" in outs[0][STATUS], (text, outs)
    assert web.manager.get(key).session.turn <= 1  # only the system turn
    t = time.perf_counter()
    outs = list(web.send("word " * 200_000, request))  # 1 MB
    assert len(outs) == 1 and "kv-error" in outs[0][STATUS] and "too long" in outs[0][STATUS]
    assert time.perf_counter() - t < 5
    _usable(web, key)
    outs = list(web.send("x" * 8_000, request))  # 2,000 tokens, within the limit: fed in chunks
    assert "reply:" in outs[-1][STATUS]
    _consistent(web, key)


def test_double_submit_is_refused_while_a_reply_streams(web):
    key = "double"
    request = _Request(key)
    session = web.manager.entry(key).session
    session.sampling = Sampling(max_new_tokens=40, temperature=0.0)
    first = web.send("First question?", request)
    next(first)
    next(first)
    for _ in range(3):
        outs = list(web.send("Second question?", request))
        assert len(outs) == 1 and "a reply is streaming" in outs[0][STATUS], outs
    rest = list(first)
    assert "reply:" in rest[-1][STATUS]
    roles = [m["role"] for m in session.messages]
    assert roles.count("user") == 1 and roles.count("assistant") == 1
    assert session.messages[-2]["content"] == "First question?"
    _consistent(web, key)
    _usable(web, key)


def test_stop_and_undo_hammered_while_a_reply_streams(web):
    key = "hammer"
    request = _Request(key)
    session = web.manager.entry(key).session
    session.exchange("Keep this exchange.", "Kept.")
    session.sampling = Sampling(max_new_tokens=300, temperature=0.0)
    web.stop(_Request("no such tab"))  # a tab without a session: nothing to stop
    gen = web.send("Talk for a long time.", request)
    next(gen)  # the user's message is shown; the prefill has not started
    for _ in range(5):
        assert web.stop(request) is None
        out = web.undo(request)
        assert "kv-error" in out[STATUS] and "a reply is streaming" in out[STATUS]
    outs = list(gen)
    res = session.history[-1]
    assert res.stopped == "cancelled" and res.new_tokens < 300, res
    assert "stopped by cancelled" in outs[-1][STATUS]
    _consistent(web, key)
    out = web.undo(request)
    assert "taken back" in out[STATUS] and out[1] == "Talk for a long time."
    for _ in range(3):
        out = web.undo(request)
        assert "kv-error" in out[STATUS] and "nothing to undo" in out[STATUS]
        web.stop(request)
    assert [m["content"] for m in session.messages][-2:] == ["Keep this exchange.", "Kept."]
    _consistent(web, key)
    session.sampling = GREEDY
    gen = web.send("Once more.", request)
    for _ in gen:  # stop and undo between streamed pieces too
        if web.manager.get(key).busy:
            web.stop(request)
            assert "kv-error" in web.undo(request)[STATUS]
    assert session.history[-1].stopped == "cancelled"
    _consistent(web, key)
    _usable(web, key)


def test_a_failed_write_in_the_web_ui_is_shown_and_the_turn_kept_for_the_next(web, monkeypatch):
    key = "diskfull"
    request = _Request(key)
    web.manager.entry(key)
    _usable(web, key)
    store = web.manager.store

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "commit_turns", full)
    outs = list(web.send("This one cannot be written.", request))
    assert "kv-error" in outs[-1][STATUS] and "No space left on device" in outs[-1][STATUS]
    monkeypatch.undo()
    _usable(web, key)  # the next turn writes both


# ------------------------------------------------------------------------------------------------------------------
# 3. The database
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def engine_db(tiny, tmp_path):
    """A database with one conversation of three exchanges made by the engine (closed, WAL checkpointed)."""
    db = tmp_path / "kv.db"
    store = Store(db)
    s = Session(tiny("llama"), SETTINGS, store=store)
    for i in range(3):
        s.exchange(f"Item {i}: the red kite flies over the hill. " * 3, f"Kite {i} noted.")
    s.close()
    store.close()
    return db


def test_corrupt_database_files_give_one_line(engine_db, model_dir, tmp_path, capsys):
    good = engine_db.read_bytes()
    script = _write(tmp_path / "s.jsonl", GOOD)
    cases = {"truncated to half": good[: len(good) // 2],
             "random bytes": bytes(random.Random(3).randrange(256) for _ in range(len(good))),
             "a text file": b"these are my notes, not a database\n" * 100}
    for name, content in cases.items():
        db = tmp_path / name.replace(" ", "-") / "kv.db"
        db.parent.mkdir()
        db.write_bytes(content)
        for argv in (["conversations", "list", "--db", db], ["conversations", "show", 1, "--db", db],
                     ["replay", script, "--model", model_dir, *FAST, "--db", db]):
            code, _, err = _run(capsys, *argv)
            line = _one_error(code, err)
            assert str(db) in line and ("malformed" in line or "not a database" in line), (name, line)
            assert db.read_bytes() == content, name  # nothing was "repaired" away
        with pytest.raises(StoreError):
            Store(db).conversations()
    folder = tmp_path / "a-folder.db"
    folder.mkdir()
    code, _, err = _run(capsys, "conversations", "list", "--db", folder)
    assert "unable to open database file" in _one_error(code, err, alone=True)


def test_read_only_database(engine_db, model_dir, tmp_path, capsys, monkeypatch):
    """Reading works; the first write fails with one line and the file is unchanged. As root chmod does not stop
    writes, so the database is then also opened through SQLite's read-only URI."""
    folder = engine_db.parent
    before = _snapshot(engine_db)
    content = engine_db.read_bytes()
    os.chmod(engine_db, 0o444)
    os.chmod(folder, 0o555)
    try:
        if os.access(engine_db, os.W_OK):  # root
            connect = sqlite3.connect

            def read_only(path, *args, **kwargs):
                if Path(path) == engine_db:
                    return connect(f"file:{engine_db}?mode=ro", *args, uri=True, **kwargs)
                return connect(path, *args, **kwargs)

            monkeypatch.setattr(sqlite3, "connect", read_only)
        code, out, err = _run(capsys, "conversations", "list", "--db", engine_db)
        assert code == 0 and "Item 0" in out, err
        code, _, err = _run(capsys, "conversations", "rename", 1, "New title", "--db", engine_db)
        assert "readonly database" in _one_error(code, err, alone=True)
        script = _write(tmp_path / "s.jsonl", GOOD)
        code, _, err = _run(capsys, "replay", script, "--model", model_dir, *FAST, "--db", engine_db,
                            "--no-save")  # without storing, a read-only database is not in the way
        assert code == 0, err
        code, _, err = _run(capsys, "replay", script, "--model", model_dir, *FAST, "--db", engine_db)
        line = _one_error(code, err)
        assert "readonly database" in line or "Permission denied" in line or "Read-only" in line, line
    finally:
        monkeypatch.undo()
        os.chmod(folder, 0o755)
        os.chmod(engine_db, 0o644)
    assert engine_db.read_bytes() == content and _snapshot(engine_db) == before


def test_database_locked_by_another_writer(tiny, engine_db):
    """Another connection holds BEGIN EXCLUSIVE: a turn waits for it (SQLite's 5 s timeout); past that the turn
    fails with a clear error, nothing of it is written, the session stays usable and the next turn writes both."""
    store = Store(engine_db)
    cid = store.conversations()[0]["id"]
    session = Session.resume(tiny("llama"), store, cid)
    before = _snapshot(engine_db)
    other = sqlite3.connect(engine_db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(1.0, lambda: other.execute("ROLLBACK"))
    release.start()
    t = time.perf_counter()
    session.exchange("Written after the lock is released.", "Yes.")  # waits for the other writer
    release.join()
    assert 0.9 < time.perf_counter() - t < 5
    stored = store.messages(cid)
    assert stored[-1]["text"] == "Yes."

    before = _snapshot(engine_db)
    other = sqlite3.connect(engine_db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreError, match="database is locked"):
            session.exchange("Held back by the lock.", "Waiting.")
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert _snapshot(engine_db) == before  # nothing half-written
    session.exchange("After the lock.", "Both written now.")
    stored = [(m["role"], m["text"]) for m in store.messages(cid)]
    assert stored == [(m["role"], m["content"]) for m in session.messages]
    assert stored[-4:] == [("user", "Held back by the lock."), ("assistant", "Waiting."),
                           ("user", "After the lock."), ("assistant", "Both written now.")]
    session.close()
    reopened = Session.resume(tiny("llama"), Store(engine_db), cid)
    assert reopened.restored_from == "archive" and reopened.kept_positions().tolist() == \
        session.kept_positions().tolist()


@pytest.mark.parametrize("where", ["commit_turns", "rows sync"])
def test_disk_full(where, model_dir, tmp_path, capsys, monkeypatch):
    """The second turn's write fails with ENOSPC: one line, exit 2; the first turn is intact, reopens exactly, and
    --resume goes on from it."""
    from kvchat.storage.kvrows import RowFile

    db = tmp_path / "kv.db"
    script = _write(tmp_path / "s.jsonl", GOOD + [{"user": "And again?"}])
    calls = []
    target, name = (Store, "commit_turns") if where == "commit_turns" else (RowFile, "sync")
    original = getattr(target, name)

    def full(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(target, name, full)
    code, out, err = _run(capsys, "replay", script, "--model", model_dir, *FAST, "--db", db, "--json")
    assert "No space left on device" in _one_error(code, err)
    monkeypatch.undo()
    assert len(out.splitlines()) == 1  # the first turn was done and reported
    (conv,) = Store(db).conversations()
    assert [m["role"] for m in Store(db).messages(conv["id"])] == ["system", "user", "assistant"]
    code, out, err = _run(capsys, "replay", script, "--model", model_dir, *FAST, "--db", db, "--json",
                          "--resume", conv["id"])
    assert code == 0, err
    assert len(Store(db).messages(conv["id"])) == 7


def test_schema_from_an_older_kvchat_reopens(tiny, engine_db, model_dir, capsys):
    """Tables without the newer columns (no archive, seed, snapshot): Store adds them, the conversation reopens,
    its cache rebuilt from the tokens it kept, and goes on."""
    con = sqlite3.connect(engine_db)
    cid = con.execute("SELECT id FROM conversations").fetchone()[0]
    rows = con.execute("SELECT id, title, model, settings, next_turn, total_tokens, kept, created_at, updated_at "
                       "FROM conversations").fetchall()
    con.execute("DROP TABLE conversations")
    con.execute("CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT, model TEXT, settings TEXT, "
                "next_turn INTEGER, total_tokens INTEGER, kept TEXT, created_at TEXT, updated_at TEXT)")
    con.executemany("INSERT INTO conversations VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    con.commit()
    con.close()
    shutil.rmtree(engine_db.parent / "archive")
    code, out, err = _run(capsys, "conversations", "list", "--db", engine_db)
    assert code == 0 and "Item 0" in out, err
    store = Store(engine_db)
    assert "archive" in store.db.table("conversations").columns_dict
    session = Session.resume(tiny("llama"), store, cid)
    assert session.restored_from == "tokens" and 0 < session.cache_tokens <= SETTINGS.capacity
    session.exchange("One more after the upgrade.", "Fine.")
    stored = [(m["role"], m["text"]) for m in store.messages(cid)]
    assert stored == [(m["role"], m["content"]) for m in session.messages] and len(stored) == 9
