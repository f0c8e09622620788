"""Undo / retry of the last turn: the cache returns exactly to its state before it, in memory and in SQLite;
settings changes and views from another thread while a reply streams."""

import gc
import threading
import weakref

import pytest
import torch

from kvchat.core.engine.checkpoint import Checkpoint
from kvchat.core.engine.feeding import STOPPABLE
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.storage.db import Store

GREEDY = Sampling(max_new_tokens=8, temperature=0.0)
SETTINGS = Settings(policy="h2o", budget=48, window=8, slack=6, groups="sentence")


def _fill(session):
    for i in range(4):
        session.exchange(f"Fact {i}: the box holds {i * 7} marbles. Keep that in mind.", f"Noted, {i * 7} marbles.")


def _state(session):
    return {k: t.clone() for k, t in session.cache.state_tensors().items()}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "headaware", "streaming"])
def test_undo_restores_the_cache_exactly_and_retry_repeats_the_reply(tiny, policy):
    session = Session(tiny("llama"), SETTINGS.changed(policy=policy), sampling=GREEDY, undo=True)
    _fill(session)
    before, n, messages, turn = _state(session), session.log.n, list(session.messages), session.turn
    first = session.chat("How many marbles were in box 2? Answer briefly.")
    assert session.evicted_total > 0
    removed = session.undo()
    assert [m["role"] for m in removed] == ["user", "assistant"]
    _same(before, _state(session))
    assert (session.log.n, session.messages, session.turn) == (n, messages, turn)
    again = session.chat("How many marbles were in box 2? Answer briefly.")
    assert again.answer == first.answer
    # and equal to a session that never undid anything
    plain = Session(tiny("llama"), SETTINGS.changed(policy=policy), sampling=GREEDY)
    _fill(plain)
    assert plain.chat("How many marbles were in box 2? Answer briefly.").answer == first.answer


def test_undo_is_one_level_and_needs_the_option(tiny):
    session = Session(tiny("llama"), SETTINGS, sampling=GREEDY, undo=True)
    session.chat("Hello!")
    session.undo()
    with pytest.raises(ValueError, match="nothing to undo"):
        session.undo()
    plain = Session(tiny("llama"), SETTINGS, sampling=GREEDY)
    plain.chat("Hello!")
    with pytest.raises(ValueError, match="nothing to undo"):
        plain.undo()


def test_undo_keeps_settings_changed_after_the_turn(tiny):
    session = Session(tiny("llama"), SETTINGS, sampling=GREEDY, undo=True)
    _fill(session)
    session.chat("Say something.")
    session.configure(policy="streaming", budget=32, window=8)
    session.undo()
    assert session.settings.policy == "streaming" and session.settings.budget == 32
    assert session.cache.length <= 32
    session.chat("Say something else.")
    assert session.cache.length <= 32 + session.settings.slack_tokens


def test_undo_rewrites_the_stored_conversation(tiny, tmp_path):
    store = Store(tmp_path / "kv.db")
    session = Session(tiny("llama"), SETTINGS.changed(policy="streaming"), store=store, sampling=GREEDY, undo=True)
    _fill(session)
    cid = session.conversation_id
    n_messages, n_stats = len(store.messages(cid)), len(store.turn_stats(cid))
    session.chat("What now?")
    session.configure(budget=40)
    session.undo()
    assert len(store.messages(cid)) == n_messages and len(store.turn_stats(cid)) == n_stats
    assert all(e["turn"] < session.turn for e in store.eviction_events(cid))
    assert [c["turn"] for c in store.settings_changes(cid)] == [session.turn]
    conv = store.conversation(cid)
    assert conv["next_turn"] == session.turn and conv["total_tokens"] == session.log.n
    resumed = Session.resume(tiny("llama"), store, cid)
    assert resumed.restored_from == "archive" and resumed.settings.budget == 40
    assert torch.equal(resumed.kept_positions(), session.kept_positions())


def test_undoing_the_first_exchange_removes_the_conversation(tiny, tmp_path):
    store = Store(tmp_path / "kv.db")
    session = Session(tiny("llama"), SETTINGS, store=store, sampling=GREEDY, undo=True)
    session.chat("Hello!")
    assert len(store.conversations()) == 1
    session.undo()
    assert store.conversations() == [] and session.conversation_id is None
    session.chat("Hello again!")
    (conv,) = store.conversations()
    assert [m["role"] for m in store.messages(conv["id"])] == ["system", "user", "assistant"]


def test_settings_change_from_another_thread_while_a_reply_streams(tiny):
    session = Session(tiny("llama"), Settings(policy="h2o", budget=64, window=8, slack=8),
                      sampling=Sampling(max_new_tokens=120, temperature=0.0))
    _fill(session)
    errors, budgets = [], [32, 64, 40, 48]

    def fiddle():
        try:
            for i in range(40):
                session.configure(budget=budgets[i % 4], policy=("h2o", "streaming")[i % 2])
                session.stats()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    gen = session.reply("Count to one hundred, please.")
    next(gen, None)
    worker = threading.Thread(target=fiddle)
    worker.start()
    for _ in gen:
        pass
    worker.join()
    assert errors == []
    assert session.history[-1].new_tokens > 0
    assert session.cache.length <= session.settings.capacity


@pytest.mark.parametrize("fault", ["truncate", "disk"])
def test_an_undo_the_storage_refuses_changes_nothing(tiny, tmp_path, monkeypatch, fault):
    """Undo while the database (or the disk) refuses the write: one error, and the session and the stored
    conversation both stay at the turn that was to be undone; once the fault is gone the undo goes through and
    reopens exactly."""
    import errno

    from kvchat.core.engine import persist
    from kvchat.storage.db import StoreError

    store = Store(tmp_path / "kv.db")
    session = Session(tiny("llama"), SETTINGS, sampling=GREEDY, undo=True, store=store)
    _fill(session)
    session.chat("How many marbles were in box 2? Answer briefly.")
    before, n, messages, turn = _state(session), session.log.n, list(session.messages), session.turn
    history = list(session.history)
    stored = (store.messages(session.conversation_id), store.turn_stats(session.conversation_id))

    def refuse(*args, **kwargs):
        if fault == "truncate":
            raise StoreError(f"database {store.path}: database is locked")
        raise OSError(errno.ENOSPC, "No space left on device")

    if fault == "truncate":
        monkeypatch.setattr(Store, "truncate", refuse)
    else:
        monkeypatch.setattr(persist, "write_rows", refuse)
        monkeypatch.setattr(persist.statefile, "write", refuse)
    with pytest.raises((StoreError, OSError)):
        session.undo()
    _same(before, _state(session))
    assert (session.log.n, session.messages, session.turn, session.history) == (n, messages, turn, history)
    assert (store.messages(session.conversation_id), store.turn_stats(session.conversation_id)) == stored
    assert session.can_undo
    monkeypatch.undo()
    session.undo()
    assert session.turn == turn - 1 and len(store.messages(session.conversation_id)) == len(messages) - 2
    reopened = Session.resume(tiny("llama"), Store(tmp_path / "kv.db"), session.conversation_id, sampling=GREEDY)
    assert reopened.restored_from == "archive"
    _same({k: t for k, t in _state(session).items() if not k.endswith(".rows")},
          {k: t for k, t in _state(reopened).items() if not k.endswith(".rows")})


@pytest.mark.parametrize("long", [False, True])
def test_a_reply_holds_the_cache_and_one_undo_copy(tiny, monkeypatch, long):
    """With undo on, a reply holds the cache and the copy of the state before it, not also the copy of the turn
    before (the web UI's --max-cache-mb reserves twice the cache a session): that copy goes before the new one is
    taken, or, for a message long enough to be stopped while it is read (its stop keeps it again), once it is read."""
    session = Session(tiny("llama"), SETTINGS, sampling=GREEDY, undo=True)
    _fill(session)
    old = weakref.ref(session.undo_copy)
    alive_at_capture, capture = [], Checkpoint.capture.__func__

    def watched(cls, s, whole=False):
        gc.collect()
        alive_at_capture.append(old() is not None)
        return capture(cls, s, whole)

    monkeypatch.setattr(Checkpoint, "capture", classmethod(watched))
    text = " ".join(f"Fact {i}: the red box holds {i * 7} stones." for i in range(60)) if long else "And box 3?"
    assert (len(session.model.tokenizer(text)["input_ids"]) > STOPPABLE) == long
    gen = session.reply(text)
    next(gen)  # the message read, the reply's first text out
    gc.collect()
    assert alive_at_capture[0] == long  # the turn's undo copy taken once the copy before is let go (or kept: long)
    assert old() is None, "the copy of the turn before is held through the reply"
    for _ in gen:
        pass
    assert session.undo_copy is not None and session.undo()
