"""Every completed turn is durable, cache included: a conversation reopened after any turn has exactly the cache
the live session had after it (tensors equal), whatever the policy, and nothing a crash leaves half-written is
read back."""

import pytest
import torch

from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.storage.db import Store

GREEDY = Sampling(max_new_tokens=12, temperature=0.0)
TURNS = [("Hello there. Tell me about the sea!", "The sea is wide. It is deep and blue."),
         ("And the mountains? Are they tall?", "Mountains are tall. Some have snow on top."),
         ("What about rivers in the north?", "Rivers run to the sea. They carve valleys."),
         ("Which do you like best, and why?", "I like the sea best. It never stays the same.")]


def assert_same_cache(a: Session, b: Session) -> None:
    assert a.total_tokens == b.total_tokens and a.turn == b.turn
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert la.is_initialized == lb.is_initialized
        if not la.is_initialized:
            continue
        assert la.lens == lb.lens and la.caps == lb.caps and la.pos_off == lb.pos_off
        assert torch.equal(la.positions(), lb.positions())
        assert torch.equal(la.keys_dense(), lb.keys_dense())
        assert torch.equal(la.padded(la.values), lb.padded(lb.values))
        assert la.stats.keys() == lb.stats.keys()
        for name in la.stats:
            assert torch.equal(la.padded(la.stats[name]), lb.padded(lb.stats[name]))
    if a.observer is not None:
        for key, t in a.observer.state_tensors().items():
            assert torch.equal(t, b.observer.state_tensors()[key]), key
    assert a.policy.get_state() == b.policy.get_state()
    assert a.evicted_total == b.evicted_total


@pytest.mark.parametrize("policy, positions", [("streaming", "rerotate"), ("h2o", "rerotate"), ("snapkv", "rerotate"),
                                               ("cake", "rerotate"), ("headaware", "rerotate"),
                                               ("tova", "original"), ("streaming", "original")])
def test_every_turn_reopens_with_the_exact_cache(tiny, tmp_path, policy, positions):
    model = tiny("llama")
    settings = Settings(policy=policy, budget=48, window=8, slack=6, positions=positions, groups="sentence")
    live = Session(model, settings, store=Store(tmp_path / "kv.db"), sampling=GREEDY)
    for i, (user, reply) in enumerate(TURNS):
        if i == 2:
            live.chat("Say something about the weather, please.")
        else:
            live.exchange(user, reply)
        reopened = Session.resume(model, Store(tmp_path / "kv.db"), live.conversation_id, sampling=GREEDY)
        assert reopened.restored_from == "archive"
        assert_same_cache(reopened, live)
    assert live.evicted_total > 0
    assert reopened.chat("One last question?").answer == live.chat("One last question?").answer


@pytest.mark.parametrize("recall", ["off", "on"])
def test_a_crash_mid_turn_reopens_the_last_committed_turn(tiny, tmp_path, recall, monkeypatch):
    monkeypatch.setattr("kvchat.core.recall.choose.HELD_QUANTILE", 0.0)  # random weights: recall whatever scores best
    model = tiny("qwen2")
    settings = Settings(policy="h2o", budget=40, window=8, slack=6, recall=recall, recall_tokens=24)
    live = Session(model, settings, store=Store(tmp_path / "kv.db"), sampling=GREEDY)
    for user, reply in TURNS[:3]:
        live.exchange(user, reply)
    twin = Session.resume(model, Store(tmp_path / "kv.db"), live.conversation_id, sampling=GREEDY)
    # The live process goes on into a turn that never commits: tokens fed (and archived), then the crash.
    gen = live.reply("This turn will never finish because the process dies now")
    next(gen)
    assert live.archive.n > twin.total_tokens
    digests = live.archive.digests
    if recall == "on":  # the crash comes after the closing turn's digests were written, before its commit
        digests.add(live.archive, live.log, model.scaffolding_ids(), model.rotary)
        assert digests.covered > twin.total_tokens
    live.archive.sync()
    for name, junk in (("kv.bin", b"\x01" * 7), ("pos.bin", b"\x02" * 3), ("digest.bin", b"\x03" * 5),
                       ("coarse.bin", b"\x04" * 9)):  # writes the crash cut short
        with open(live.archive.folder / name, "ab") as f:
            f.write(junk)
    reopened = Session.resume(model, Store(tmp_path / "kv.db"), live.conversation_id, sampling=GREEDY)
    assert reopened.restored_from == "archive" and reopened.archive.n == reopened.total_tokens
    assert reopened.archive.digests.covered == reopened.total_tokens
    assert_same_cache(reopened, twin)
    a, b = reopened.chat("Still there?"), twin.chat("Still there?")
    assert a.answer == b.answer and a.recalled == b.recalled
    assert bool(a.recalled) == (recall == "on")


def test_undo_then_reopen_is_exact(tiny, tmp_path):
    model = tiny("llama")
    store = Store(tmp_path / "kv.db")
    live = Session(model, Settings(policy="snapkv", budget=40, window=8, slack=6), store=store, sampling=GREEDY,
                   undo=True)
    for user, reply in TURNS:
        live.exchange(user, reply)
    live.undo()
    reopened = Session.resume(model, Store(tmp_path / "kv.db"), live.conversation_id, sampling=GREEDY)
    assert reopened.restored_from == "archive"
    assert_same_cache(reopened, live)
    assert [p.name for p in live.archive.folder.glob("state-*")] == [f"state-{live.turn}.safetensors"]


def test_archive_keeps_what_was_evicted_and_goes_with_its_conversation(tiny, tmp_path):
    model = tiny("llama")
    store = Store(tmp_path / "kv.db")
    live = Session(model, Settings(policy="streaming", budget=40, window=8, slack=6), store=store, sampling=GREEDY)
    for user, reply in TURNS:
        live.exchange(user, reply)
    archive = live.archive
    assert archive.n == live.total_tokens and live.kept_positions().numel() < live.total_tokens
    evicted = torch.tensor([[1, 2, 3]])
    keys, values, computed = archive.keys_values(0, evicted)
    assert keys.shape == (1, 3, archive.layout[1]) and torch.equal(computed, evicted)  # computed before any eviction
    folder = archive.folder
    assert folder.is_dir()
    store.delete(live.conversation_id)
    assert not folder.exists()


def test_a_kept_key_equals_the_archived_key_rotated_to_its_slot(tiny, tmp_path):
    model = tiny("llama")
    live = Session(model, Settings(policy="streaming", budget=40, window=8, slack=6), store=Store(tmp_path / "a.db"),
                   sampling=GREEDY)
    for user, reply in TURNS:
        live.exchange(user, reply)
    layer = live.cache.layers[1]
    held = layer.positions()[:1]
    slots = layer.pos_off[0] + torch.arange(held.shape[1])[None]
    keys, _, computed = live.archive.keys_values(1, held)
    expected = model.rotary.rotate(keys, slots - computed)
    assert torch.equal(layer.keys_dense()[0, :1], expected)


def test_a_live_settings_change_between_turns_reopens_exactly(tiny, tmp_path):
    model = tiny("llama")
    live = Session(model, Settings(policy="streaming", budget=64, window=8, slack=8), store=Store(tmp_path / "a.db"),
                   sampling=GREEDY)
    for user, reply in TURNS:
        live.exchange(user, reply)
    live.configure(budget=40)  # compresses at once
    live.configure(policy="h2o", groups="sentence")
    reopened = Session.resume(model, Store(tmp_path / "a.db"), live.conversation_id, sampling=GREEDY)
    assert reopened.restored_from == "archive" and reopened.settings == live.settings
    assert_same_cache(reopened, live)
    assert reopened.chat("Go on.").answer == live.chat("Go on.").answer


def test_a_session_that_stored_nothing_leaves_no_archive(tiny, tmp_path):
    store = Store(tmp_path / "kv.db")
    session = Session(tiny("llama"), Settings(budget=64, window=8), store=store, system="Be brief.")
    assert session.archive.n == session.total_tokens > 0  # the system prompt is fed (and archived) at once
    folder = session.archive.folder
    session.close()
    assert not folder.exists() and store.conversations() == []
