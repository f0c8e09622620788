"""SQLite storage: one transaction per turn, nothing half-written, conversations resumed with their cache."""

import json
import os
import sqlite3
import subprocess
import sys

import pytest
import torch

from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.storage.db import Store

GREEDY = Sampling(max_new_tokens=5, temperature=0.0)
SETTINGS = Settings(policy="streaming", budget=48, window=8, slack=6, groups="sentence")


def _chat(session):
    session.exchange("My code word is mango. Remember it.", "I will remember mango.")
    session.chat("What else can you do?")
    session.exchange("Tell me a long story. " + "Blah " * 40, "Once upon a time. " * 6)


def test_turns_messages_stats_and_events_are_stored(tiny, tmp_path):
    store = Store(tmp_path / "kv.db")
    session = Session(tiny("llama"), SETTINGS, store=store, sampling=GREEDY)
    _chat(session)
    cid = session.conversation_id
    conv = store.conversation(cid)
    assert conv["title"].startswith("My code word is mango")
    msgs = store.messages(cid)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    # The stored tokens are exactly what the model was fed, in order.
    fed = session.log.column("token").tolist()
    assert [t for m in msgs for t in m["tokens"]] == fed
    stats = store.turn_stats(cid)
    assert [s["turn"] for s in stats] == [0, 1, 2, 3]
    assert stats[-1]["cache_tokens"] == session.cache_tokens and stats[-1]["policy"] == "streaming"
    events = store.eviction_events(cid)
    assert sum(e["evicted_tokens"] for e in events) == session.evicted_total > 0
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_the_saved_list_finds_a_conversation_by_its_title_or_any_message(tiny, tmp_path):
    """``conversations(search, limit)``: the last used first, those whose title or any message holds the text (ASCII
    case ignored; ``%`` and ``_`` are plain characters, not LIKE's wildcards), at most ``limit``, and
    ``conversation_count`` how many there are without the limit."""
    store = Store(tmp_path / "kv.db")
    chats = [("Trip to Lisbon: 100% booked", "Where do we stay?"), ("Groceries", "Buy KESTREL brand tea_bags."),
             ("Kites", "How do kites fly?"), ("Taxes", "What is due in April?")]
    ids = []
    for title, text in chats:  # each used after the one before
        s = Session(tiny("llama"), SETTINGS, store=store, sampling=GREEDY)
        s.exchange(text, "Noted.")
        store.rename(s.conversation_id, title)
        ids.append(s.conversation_id)
        s.close()
    last_first = ids[::-1]

    def found(search, limit=None):
        return [r["id"] for r in store.conversations(search, limit)]

    assert found("") == found("   ") == last_first and store.conversation_count("") == 4
    assert found("lisbon") == found("LISBON") == [ids[0]]  # the title
    assert found("kestrel") == found("tea_bags") == [ids[1]]  # a message
    assert found("100%") == [ids[0]] and found("%") == [ids[0]] and found("_") == [ids[1]]
    assert found("t_a") == found("1%0") == [] and store.conversation_count("1%0") == 0  # as wildcards: "tea", "100"
    assert found("kite") == [ids[2]] and found("noted.") == last_first  # every reply says it
    assert found("", limit=2) == last_first[:2] and found("noted", limit=3) == last_first[:3]
    assert store.conversation_count("noted") == 4


def test_a_system_prompt_alone_creates_no_conversation(tiny, tmp_path):
    store = Store(tmp_path / "kv.db")
    Session(tiny("llama"), SETTINGS, store=store)
    assert store.conversations() == []


def test_failed_turn_writes_nothing(tiny, tmp_path):
    store = Store(tmp_path / "kv.db")
    session = Session(tiny("llama"), SETTINGS, store=store, sampling=GREEDY)
    session.exchange("hello", "hi")
    cid = session.conversation_id
    n_msgs, n_stats = len(store.messages(cid)), len(store.turn_stats(cid))

    def boom(*a, **k):
        raise RuntimeError("killed mid-turn")

    session.forward = boom
    with pytest.raises(RuntimeError):
        session.exchange("this turn dies", "never stored")
    assert len(store.messages(cid)) == n_msgs and len(store.turn_stats(cid)) == n_stats


def test_a_broken_write_is_rolled_back_whole(tiny, tmp_path):
    store = Store(tmp_path / "kv.db")
    session = Session(tiny("llama"), SETTINGS, store=store, sampling=GREEDY)
    session.exchange("hello", "hi")
    cid = session.conversation_id
    n_msgs = len(store.messages(cid))
    record = {"turn": 9, "messages": [{"idx": 99, "role": "user", "text": "x", "tokens": [1], "turn": 9,
                                       "created_at": "t"}],
              "stats": {"turn": 9, "created_at": "t"}, "events": [{"bad column": 1}]}
    with pytest.raises(sqlite3.OperationalError):
        store.commit_turns(cid, {"updated_at": "t"}, [record])
    assert len(store.messages(cid)) == n_msgs


@pytest.mark.parametrize("exact", [True, False])
def test_resume_continues_with_the_same_cache(tiny, tmp_path, exact):
    model = tiny("llama")
    store = Store(tmp_path / "kv.db")
    live = Session(model, SETTINGS, store=store, sampling=GREEDY)
    _chat(live)
    resumed = Session.resume(model, Store(tmp_path / "kv.db"), live.conversation_id, exact=exact, sampling=GREEDY)
    assert resumed.restored_from == ("archive" if exact else "tokens")
    assert resumed.total_tokens == live.total_tokens and resumed.turn == live.turn
    assert torch.equal(resumed.kept_positions(), live.kept_positions())
    if exact:
        for a, b in zip(resumed.cache.layers, live.cache.layers):
            assert torch.equal(a.keys_dense(), b.keys_dense())
        # Restored exactly: the next greedy reply is the one the live session gives.
        assert resumed.chat("And now?").answer == live.chat("And now?").answer
    else:
        assert resumed.chat("And now?").new_tokens > 0
    assert resumed.conversation_id == live.conversation_id


def test_a_conversation_stored_without_an_archive_is_rebuilt_from_its_tokens(tiny, tmp_path):
    model = tiny("llama")
    store = Store(tmp_path / "kv.db")
    live = Session(model, SETTINGS, store=store, sampling=GREEDY)
    _chat(live)
    store.db.execute("UPDATE conversations SET archive = NULL")  # as an older kvchat stored it
    store.db.conn.commit()
    resumed = Session.resume(model, store, live.conversation_id)
    assert resumed.restored_from == "tokens"
    assert torch.equal(resumed.kept_positions(), live.kept_positions())
    assert resumed.chat("Still there?").new_tokens > 0


def test_settings_changes_are_recorded_and_resumed(tiny, tmp_path):
    model = tiny("llama")
    store = Store(tmp_path / "kv.db")
    session = Session(model, SETTINGS, store=store, sampling=GREEDY)
    session.exchange("hello", "hi")
    session.configure(budget=40, groups="turn")
    changes = store.settings_changes(session.conversation_id)
    assert changes[-1]["changes"] == {"budget": 40, "groups": "turn"}
    assert changes[-1]["turn"] == session.turn
    resumed = Session.resume(model, store, session.conversation_id)
    assert resumed.settings.budget == 40 and resumed.settings.groups == "turn"


def test_export_replays_as_a_script_with_the_chats_settings_changes_where_they_were_made(tiny, tmp_path):
    """A conversation whose policy and parameters were changed between turns (one set back to its default) exports
    as a script whose set lines make the same changes at the same turns: replayed from the chat's starting settings,
    as the command the export names gives them, it stores the chat's messages and settings changes and ends in its
    settings."""
    from kvchat.app.replay import run_step, switched
    from kvchat.app.scripts import export_script, load_scripts, replay_command

    store = Store(tmp_path / "kv.db")
    session = Session(tiny("llama"), SETTINGS, store=store, sampling=GREEDY)
    _chat(session)
    session.configure(policy="h2o", params={"heavy": 4})
    session.chat("And what was my code word?")
    session.configure(params={"heavy": 0}, budget=40)
    session.chat("Say it once more.")
    session.configure(policy="tova")  # after the last turn: the script's last line
    lines = export_script(store, session.conversation_id)
    assert [next(iter(x)) for x in lines] == ["system", "user", "assistant", "user", "assistant", "user", "assistant",
                                              "set", "user", "assistant", "set", "user", "assistant", "set"]
    assert lines[7] == {"set": {"policy": "h2o", "heavy": 4}}
    assert lines[10] == {"set": {"budget": 40, "policy": "h2o", "heavy": 0, "average": True}}
    assert lines[13] == {"set": {"policy": "tova"}}
    path = tmp_path / "export.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    (script,) = load_scripts(path)
    assert script.system == session.messages[0]["content"]
    command = replay_command(store, session.conversation_id, "my chat.jsonl")
    assert command == ("kvchat replay 'my chat.jsonl' --model tiny-llama --budget 48 --window 8 --slack 6 "
                       "--groups sentence")  # the chat's start, not its settings now (tova, budget 40)
    started = _command_settings(command)
    assert started == SETTINGS
    again = Store(tmp_path / "again.db")
    replay = Session(tiny("llama"), started, store=again, sampling=GREEDY)
    for step in script.steps:
        switched(replay, step) if step.kind == "set" else run_step(replay, step, {})
    assert replay.settings == session.settings
    assert [m["text"] for m in again.messages(replay.conversation_id)] == \
        [m["text"] for m in store.messages(session.conversation_id)]
    changes = [[{k: c[k] for k in ("turn", "changes", "settings")} for c in s.settings_changes(cid)]
               for s, cid in ((store, session.conversation_id), (again, replay.conversation_id))]
    assert changes[0] == changes[1] and len(changes[0]) == 3


def _command_settings(command: str) -> Settings:
    """The cache settings ``kvchat replay`` takes from ``command``'s flags."""
    import shlex

    from kvchat.app.args import build_parser, settings_from_args

    words = shlex.split(command)
    assert words[:2] == ["kvchat", "replay"]
    return settings_from_args(build_parser(words[1:]).parse_args(words[1:]))


@pytest.mark.parametrize("change", [None, "before", "budget", "explicit"])
def test_the_export_names_the_command_that_replays_the_chat_as_it_began(tiny, tmp_path, change):
    """The replay command the export names starts from the chat's first settings, and with the export's set lines
    resolves to the chat's settings at every change: as set where they never changed (the window left to the
    budget stays so); with a change before the first turn (no system prompt read before it), the settings it left
    (its set line then changes nothing); the window left to the budget where a budget change's set line gives the
    window it moved to, and given where the chat's was set to what the budget's default happened to be."""
    from kvchat.app.scripts import export_script, load_scripts, replay_command

    store = Store(tmp_path / "kv.db")
    settings = Settings(policy="h2o", budget=48, sink=2, window=12 if change == "explicit" else None,
                        params={"heavy": 8})
    session = Session(tiny("llama"), settings, store=store, sampling=GREEDY, system=None)
    seen = [session.settings]
    if change == "before":
        session.configure(policy="tova")
        seen = [session.settings]  # what the first turn ran under
    session.chat("Hello there.")
    if change in ("budget", "explicit"):
        session.configure(budget=64)  # the default window moves from 12 to 16
        seen.append(session.settings)
        session.chat("And again.")
    command = replay_command(store, session.conversation_id, "chat.jsonl")
    expected = {None: "--policy h2o --budget 48 --sink 2 --heavy 8", "before": "--policy tova --budget 48 --sink 2",
                "budget": "--policy h2o --budget 48 --sink 2 --heavy 8",
                "explicit": "--policy h2o --budget 48 --sink 2 --window 12 --heavy 8"}[change]
    assert command == f"kvchat replay chat.jsonl --model tiny-llama {expected}"
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in export_script(store, session.conversation_id)))
    (script,) = load_scripts(path)
    replayed = [_command_settings(command)]
    for step in script.steps:
        if step.kind == "set":
            replayed.append(replayed[-1].changed(**step.cache))
    assert [s.as_dict() for s in replayed][-len(seen):] == [s.as_dict() for s in seen]
    with pytest.raises(ValueError, match="no conversation 99"):
        replay_command(store, 99, "chat.jsonl")


def test_rename_and_delete(tiny, tmp_path):
    store = Store(tmp_path / "kv.db")
    session = Session(tiny("llama"), SETTINGS, store=store, sampling=GREEDY)
    session.exchange("hello", "hi")
    cid = session.conversation_id
    store.rename(cid, "Greetings")
    assert store.conversation(cid)["title"] == "Greetings"
    archive = session.files.folder
    assert archive.is_dir()
    store.delete(cid)
    assert store.conversations() == [] and store.messages(cid) == []
    assert not archive.exists()
    with pytest.raises(ValueError, match="no conversation"):
        store.conversation(cid)


def test_rebuild_of_a_per_head_policy_stays_within_its_budget(tiny, tmp_path):
    # h2o keeps different positions per head: their union can pass the budget, so the rebuild compresses again.
    store = Store(tmp_path / "kv.db")
    settings = Settings(policy="h2o", budget=40, window=8, slack=6)
    session = Session(tiny("llama"), settings, store=store, sampling=GREEDY)
    _chat(session)
    assert session.kept_positions().numel() > settings.capacity
    resumed = Session.resume(tiny("llama"), store, session.conversation_id, exact=False, sampling=GREEDY)
    assert resumed.restored_from == "tokens"
    assert resumed.cache.length <= settings.capacity
    assert resumed.evicted_total == session.evicted_total
    resumed.chat("Still there?")


def test_the_digest_store_reads_each_records_field_in_the_order_asked(tmp_path):
    """``DigestStore.field``: the live records' field, all of them or at the positions asked (any order, repeats),
    across segment files, with a window that starts past forgotten segments, read back as written."""
    import numpy as np

    from kvchat.storage.digests import DigestStore

    store = DigestStore(tmp_path)
    store.start([("span", "<i4", (2,)), ("keys", "i1", (3, 4))], segment=7)
    gen = np.random.default_rng(0)
    records = np.zeros(40, dtype=store.dtype)
    records["span"] = np.arange(80).reshape(40, 2)
    records["keys"] = gen.integers(-127, 127, size=(40, 3, 4))
    store.append(records[:25])
    store.append(records[25:])
    assert store.forget(30 * store.record_bytes) and store.first == 14  # two segments of 7 left the window
    live = records[14:]
    assert np.array_equal(store.field("span"), live["span"]) and np.array_equal(store.field("keys"), live["keys"])
    index = np.array([25, 0, 6, 7, 7, 13, 3, 20])  # live positions: unsorted, a repeat, both ends, a segment's edges
    assert np.array_equal(store.field("keys", index), live["keys"][index])
    assert store.field("span", np.array([], dtype=np.int64)).shape == (0, 2)
    store.rewind(14, 14)
    assert store.field("span").shape == (0, 2)


def _other_process_can_hold(folder) -> bool:
    code = f"from kvchat.storage import holding; holding.hold({str(folder)!r}, 'it')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0


def test_a_conversation_is_held_until_this_process_gives_back_its_last_hold(tmp_path, monkeypatch, caplog):
    """Holds are counted within a process (the web UI moves a conversation between tabs, the old tab's session
    closing after the new one opened it); another process may open it only once the last is given back. A file
    system without locks opens it unguarded, with a warning, instead of refusing every conversation."""
    import errno
    import fcntl

    from kvchat.storage import holding

    holding.hold(tmp_path, "conversation 1")
    holding.hold(tmp_path, "conversation 1")
    holding.release(tmp_path)
    assert not _other_process_can_hold(tmp_path)
    holding.release(tmp_path)
    assert _other_process_can_hold(tmp_path)

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with holding.held(tmp_path, "conversation 2"):
        pass
    assert "cannot lock" in caplog.text and "another kvchat process could open conversation 2" in caplog.text


def test_a_refusal_names_the_kvchat_command_that_holds_the_conversation(tmp_path):
    """The refusal says which kvchat command has the conversation open, and what to do there: a browser tab of
    ``kvchat serve`` gives it back by opening another conversation or closing."""
    from kvchat.storage import holding

    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.argv = ['kvchat', 'serve', '--port', '7861']; "
                               f"from kvchat.storage import holding; holding.hold({str(tmp_path)!r}, 'it'); "
                               "print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(holding.HeldElsewhere) as refused:
            holding.hold(tmp_path, "conversation 4")
        with pytest.raises(holding.HeldElsewhere) as checked:  # the check before a model loads
            holding.check(tmp_path, "conversation 4")
    finally:
        holder.communicate("", timeout=60)
    assert str(refused.value) == (f"conversation 4 is open in another kvchat process (pid {holder.pid}, `kvchat "
                                  "serve`); open another conversation in its browser tab or close the tab")
    assert str(checked.value) == str(refused.value)


def test_a_check_holds_nothing_and_a_hold_waits_out_a_checks_moment(tmp_path, monkeypatch):
    """``check`` (``kvchat chat --resume`` before the model loads) leaves the conversation unheld and its file as
    it was; a hold made while another process's check has the file locked for its moment waits it out."""
    import fcntl

    from kvchat.storage import holding

    holding.check(tmp_path, "conversation 5")  # never held: no file to check
    assert not (tmp_path / "held").exists()
    (tmp_path / "held").write_text("123\nkvchat chat\n")  # a holder that has ended
    holding.check(tmp_path, "conversation 5")
    assert (tmp_path / "held").read_text() == "123\nkvchat chat\n" and _other_process_can_hold(tmp_path)
    fd = os.open(tmp_path / "held", os.O_RDONLY)  # a check's moment, from another open file
    fcntl.flock(fd, fcntl.LOCK_SH)
    holding.check(tmp_path, "conversation 5")  # another check at the same moment passes
    waits = []

    def moment_ends(seconds):  # the check's moment ends while the hold waits (a timer thread ran late under load)
        waits.append(seconds)
        if len(waits) == 1:
            os.close(fd)

    monkeypatch.setattr(holding.time, "sleep", moment_ends)
    holding.hold(tmp_path, "conversation 5")
    holding.release(tmp_path)
    assert len(waits) == 1
