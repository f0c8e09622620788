"""Every completed turn is durable, cache included: a conversation reopened after any turn has exactly the cache
the live session had after it (tensors equal), whatever the policy, and nothing a crash leaves half-written is
read back."""

import pytest
import torch

from kvchat.core.engine import persist
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.core.engine.tokens import TokenLog
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
    for name in TokenLog.COLUMNS:  # every token's role, turn, message and sentence (the groups evicted whole)
        assert torch.equal(a.log.column(name), b.log.column(name)), name
    assert a.log.sentence == b.log.sentence


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.cuda
def test_a_conversation_on_the_gpu_reopens_with_the_exact_cache(tokenizer, tmp_path):
    """On CUDA, in bf16 with ``--decode auto``'s step (the graph step in Triton kernels) and recall on: every turn
    reopens with the cache tensor for tensor, and the reopened conversation's next greedy reply is the live one's
    (the GPU bench's long chat continues this way from one call to the next)."""
    from kvchat.core.model.loading import ChatModel
    from tinymodels import build_tiny

    model = ChatModel.from_pretrained_model(build_tiny("llama", tokenizer).to(device="cuda", dtype=torch.bfloat16),
                                            tokenizer, name="tiny-cuda", decode="auto")
    settings = Settings(policy="h2o", budget=48, window=8, slack=6, groups="sentence", recall="on")
    live = Session(model, settings, store=Store(tmp_path / "kv.db"), sampling=GREEDY)
    for user, reply in TURNS:
        live.chat(user)
        live.exchange(user, reply)
        reopened = Session.resume(model, Store(tmp_path / "kv.db"), live.conversation_id, sampling=GREEDY)
        assert reopened.restored_from == "archive" and reopened.cache.layers[0].keys.is_cuda
        assert_same_cache(reopened, live)
    assert live.evicted_total > 0 and model.step.replays > 0
    assert reopened.chat("One last question?").answer == live.chat("One last question?").answer


@pytest.mark.parametrize("recall", ["off", "on"])
def test_a_crash_mid_turn_reopens_the_last_committed_turn(tiny, tmp_path, recall, monkeypatch):
    """The worst moment: the next turn's rows, digests and state file are on disk (and a write was cut short), its
    SQLite commit is not. The conversation reopens exactly as the last committed turn left it."""
    monkeypatch.setattr("kvchat.core.recall.choose.HELD_QUANTILE", 0.0)  # random weights: recall whatever scores best
    monkeypatch.setattr("kvchat.core.recall.gate.keeps", lambda without, with_recall: True)  # and keep it
    model = tiny("qwen2")
    settings = Settings(policy="h2o", budget=40, window=8, slack=6, recall=recall, recall_tokens=24)
    live = Session(model, settings, store=Store(tmp_path / "kv.db"), sampling=GREEDY)
    for user, reply in TURNS[:3]:
        live.exchange(user, reply)
    twin = Session.resume(model, Store(tmp_path / "kv.db"), live.conversation_id, sampling=GREEDY)
    # The live process goes on into a turn that never commits: tokens fed, compressions, then everything written
    # but the commit point, then the crash.
    gen = live.reply("This turn will never finish because the process dies now, after writing all it could")
    for _ in range(6):
        next(gen)
    live.turn += 1
    if recall == "on":
        assert live.digests.add(live.cache, live.log, model.scaffolding_ids()) > 0
    persist.write_state(live)
    files = live.files
    assert (files.folder / f"state-{live.turn}.safetensors").is_file()
    digests = ((p, b"\x03" * 5) for p in (files.folder / "digests").glob("*.bin"))
    for path, junk in ((files.rows.path, b"\x01" * 7), *digests):
        with open(path, "ab") as f:  # writes the crash cut short
            f.write(junk)
    reopened = Session.resume(model, Store(tmp_path / "kv.db"), live.conversation_id, sampling=GREEDY)
    assert reopened.restored_from == "archive"
    assert_same_cache(reopened, twin)
    a, b = reopened.chat("Still there?"), twin.chat("Still there?")
    assert a.answer == b.answer and a.recalled == b.recalled
    assert bool(a.recalled) == (recall == "on")


@pytest.mark.parametrize("stored", [True, False])
def test_a_turn_failing_midway_reopens_at_the_last_saved_turn(tiny, tmp_path, stored):
    """A model step that raises midway (out of GPU memory, say) leaves the turn open and the cache apart from the
    log; ``reopened`` gives the conversation as its last saved turn left it, exactly, with the settings changed
    since, and the chat goes on as if the failed turn never happened. A first exchange that fails leaves a new
    conversation with its settings and system prompt."""
    model = tiny("llama")
    settings = Settings(policy="h2o", budget=40, window=8, slack=6, recall="on")
    live = Session(model, settings, system="You are terse.", store=Store(tmp_path / "kv.db"), sampling=GREEDY,
                   undo=True)
    turns = TURNS[:3] if stored else []
    for user, reply in turns:
        live.exchange(user, reply)
    twin = Session(model, settings, system="You are terse.", store=Store(tmp_path / "twin.db"), sampling=GREEDY)
    for user, reply in turns:
        twin.exchange(user, reply)
    live.configure(budget=36)
    twin.configure(budget=36)
    forward, steps = live.forward, []

    def failing(ids, *args, **kwargs):
        steps.extend([1] if ids.numel() == 1 else [])
        if len(steps) == 3:
            raise RuntimeError("CUDA out of memory (simulated)")
        return forward(ids, *args, **kwargs)

    live.forward = failing
    with pytest.raises(RuntimeError, match="simulated"):
        live.chat("This turn fails in its third decode step, after its message was read")
    assert live.total_tokens > twin.total_tokens  # the failed turn's tokens: the session is past its saved state
    again = live.reopened()
    assert again is not live and again.settings == twin.settings and again.undo_enabled
    assert again.messages == twin.messages and again.conversation_id == (live.conversation_id if stored else None)
    if stored:
        assert again.restored_from == "archive"
        assert_same_cache(again, twin)
    a, b = again.chat("Still there?"), twin.chat("Still there?")
    assert a.answer == b.answer and again.turn == twin.turn
    assert Store(tmp_path / "kv.db").messages(again.conversation_id)[-1]["text"] == a.answer


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
    assert [p.name for p in live.files.folder.glob("state-*")] == [f"state-{live.turn}.safetensors"]


def _chat_turns(n: int):
    words = ["sea", "hill", "river", "forest", "city", "desert", "island", "valley"]
    return [(f"Tell me about the {words[i % 8]} number {i}. Is it far?", f"The {words[i % 8]} {i} is near. It is "
             f"{'calm' if i % 2 else 'busy'} today.") for i in range(n)]


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_disk_stays_bounded_with_recall_off(tiny, tmp_path, policy):
    """With recall off a conversation keeps on disk what exact resume needs: one row per (layer, head, position)
    the cache holds, plus at most the rows of one turn; one state file; no digests. The rows file stops growing once
    the cache is full, whatever the chat's length."""
    model = tiny("llama")
    settings = Settings(policy=policy, budget=48, window=8, slack=6, recall="off")
    live = Session(model, settings, store=Store(tmp_path / "kv.db"), sampling=GREEDY, undo=True)
    heads, layers = 2, model.num_layers
    sizes, longest = [], 0
    for user, reply in _chat_turns(40):
        res = live.exchange(user, reply)
        longest = max(longest, res.prompt_tokens)
        sizes.append(live.files.rows.rows)
        assert res.disk_bytes is not None and res.archive_bytes == 0
    assert live.total_tokens > 8 * settings.capacity
    bound = layers * heads * (settings.capacity + longest)
    assert max(sizes) <= 2 * bound  # the held rows, one turn's new ones, and those the undo copy still names
    assert sizes[-1] == sizes[-10] or max(sizes[-10:]) <= bound  # flat once full
    assert sorted(p.name for p in live.files.folder.iterdir()) == ["held", "rows.bin", "rows.txt",
                                                                   f"state-{live.turn}.safetensors"]
    assert live.digests is None
    reopened = Session.resume(model, Store(tmp_path / "kv.db"), live.conversation_id, sampling=GREEDY)
    assert reopened.restored_from == "archive"
    assert_same_cache(reopened, live)


def _small_archive(live: Session):
    """Recall's cap set on ``live``'s digests to one a few tiny-model turns pass (the setting's least, 1 MB, takes
    hundreds), after checking that the setting reached them; before their first record (a system prompt would make
    one), as the segments' size follows the cap then. Returns the digests' store."""
    assert live.digests.cap_mb == live.settings.archive_mb and live.digests.store.dtype is None
    live.digests.cap_mb = 0.03
    return live.digests.store


@pytest.mark.parametrize("saved", [True, False])
def test_recall_archive_is_capped_forgetting_the_oldest_first(tiny, tmp_path, saved):
    """Recall's archive stays under --archive-mb (give or take one segment and one turn): past it the oldest sentence
    groups are forgotten first, their files deleted once the turn closes — an unsaved chat's temporary folder too —
    and a saved conversation still reopens exactly."""
    model = tiny("llama")
    settings = Settings(policy="streaming", budget=48, window=8, slack=6, recall="on", archive_mb=1.0)
    live = Session(model, settings, store=Store(tmp_path / "kv.db") if saved else None, sampling=GREEDY,
                   system=None)
    _small_archive(live)
    cap = int(live.digests.cap_mb * 2**20)
    forgotten = None
    for i, (user, reply) in enumerate(_chat_turns(100)):
        live.exchange(user, reply)
        store = live.digests.store
        assert live.archive_bytes <= cap + store.segment * store.record_bytes
        forgotten = forgotten or (i if store.first > 0 else None)
        if forgotten is not None and (i > forgotten + 40 or saved):
            break
    assert live.digests.store.first > 0, "the cap was reached and the oldest groups forgotten"
    assert live.digests.store.first > store.segment or saved  # forgotten again since: each time the files went
    spans = live.digests.read()[0]
    assert int(spans[0, 0]) > 0 and int(spans[-1, 1]) == live.total_tokens  # the newest stay, the oldest went
    if not saved:
        return
    for user, reply in _chat_turns(3):
        live.exchange(user, reply)
    reopened = Session.resume(model, Store(tmp_path / "kv.db"), live.conversation_id, sampling=GREEDY)
    assert reopened.restored_from == "archive"
    assert reopened.digests.window() == live.digests.window()
    assert torch.equal(reopened.digests.read()[0], live.digests.read()[0])
    assert_same_cache(reopened, live)


def test_undo_of_a_turn_that_forgot_archived_groups_brings_them_back(tiny, tmp_path):
    """A turn that passed the archive's cap and forgot its oldest sentence groups can be undone: the window before it
    comes back with its records (their files stay on disk while the turn can be undone), the conversation reopens
    there exactly, and what a later turn forgot goes from disk once no undo copy names it."""
    model = tiny("llama")
    live = Session(model, Settings(policy="streaming", budget=48, window=8, slack=6, recall="on"),
                   store=Store(tmp_path / "kv.db"), sampling=GREEDY, undo=True, system=None)
    store = _small_archive(live)
    turns = iter(_chat_turns(60))
    while True:
        before, spans = live.digests.window(), live.digests.read()[0]
        live.exchange(*next(turns))
        if store.first > before[0] >= store.segment:  # forgotten again: an earlier turn's forgotten files are gone
            break
    assert min(int(p.stem) for p in store.folder.glob("*.bin")) * store.segment == before[0]
    live.undo()
    assert live.digests.window() == before
    assert torch.equal(live.digests.read()[0], spans)
    reopened = Session.resume(model, Store(tmp_path / "kv.db"), live.conversation_id, sampling=GREEDY)
    assert reopened.digests.window() == before and torch.equal(reopened.digests.read()[0], spans)
    assert_same_cache(reopened, live)
    first = store.first
    while store.first < first + 2 * store.segment:
        live.exchange(*next(turns))
    assert min(int(p.stem) for p in store.folder.glob("*.bin")) * store.segment == live.undo_copy.digests[0] > first


def test_a_kept_key_is_its_computed_key_rotated_once_to_its_slot(tiny, tmp_path):
    """Through every compression a kept key is the key as computed rotated once, from where it was computed to its
    slot (not rotated again and again), and the rows on disk hold the computed key and value."""
    model = tiny("llama")
    live = Session(model, Settings(policy="streaming", budget=40, window=8, slack=6), store=Store(tmp_path / "a.db"),
                   sampling=GREEDY)
    for user, reply in TURNS:
        live.exchange(user, reply)
    assert live.evicted_total > 0
    layer = live.cache.layers[1]
    n = layer.lens[0]
    slots = layer.pos_off[0] + torch.arange(n)
    k0, computed = layer.k0[:n], layer.computed[:n].long()
    assert torch.equal(layer.keys[:n], model.rotary.rotate(k0, slots - computed))
    assert bool((computed != slots).any())  # some were computed elsewhere: they were moved
    stored = live.files.rows.read(layer.rows[:n].numpy())
    assert torch.equal(stored[:, : k0.shape[-1]], k0) and torch.equal(stored[:, k0.shape[-1]:], layer.values[:n])


@pytest.mark.parametrize("sized", [dict(window=8, slack=8), {}])  # {}: window and slack follow the budget
def test_a_live_settings_change_between_turns_reopens_exactly(tiny, tmp_path, sized):
    model = tiny("llama")
    live = Session(model, Settings(policy="streaming", budget=64, **sized), store=Store(tmp_path / "a.db"),
                   sampling=GREEDY)
    for user, reply in TURNS:
        live.exchange(user, reply)
    live.configure(budget=40)  # compresses at once
    live.configure(policy="h2o", groups="sentence")
    reopened = Session.resume(model, Store(tmp_path / "a.db"), live.conversation_id, sampling=GREEDY)
    # the settings as set, not as resolved: a window left to the budget was stored as the budget's then (10), and a
    # reopened chat kept it at any later budget where the live one's followed
    assert reopened.restored_from == "archive" and reopened.settings == live.settings
    assert_same_cache(reopened, live)
    assert reopened.chat("Go on.").answer == live.chat("Go on.").answer
    assert reopened.configure(budget=96) == live.configure(budget=96)


@pytest.mark.parametrize("change", [dict(budget=40), dict(positions="original")])
def test_a_crash_between_a_live_changes_state_file_and_its_row_reopens_exactly(tiny, tmp_path, change,
                                                                              monkeypatch):
    """A live change writes the cache it left (state file), then its row in SQLite; a crash between the two reopens
    the cache exactly under the settings the change made (the state file carries them; they reopened under the
    settings before it, and a change of positions from the tokens, approximately), and the next turn stores them."""
    model = tiny("llama")
    live = Session(model, Settings(policy="streaming", budget=64, window=8, slack=8), store=Store(tmp_path / "a.db"),
                   sampling=GREEDY)
    for user, reply in TURNS[:3]:
        live.exchange(user, reply)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("the process dies here")

    monkeypatch.setattr(Store, "record_settings", crash)
    with pytest.raises(KeyboardInterrupt):
        live.configure(**change)
    monkeypatch.undo()
    reopened = Session.resume(model, Store(tmp_path / "a.db"), live.conversation_id, sampling=GREEDY)
    assert reopened.restored_from == "archive" and reopened.settings == live.settings
    assert_same_cache(reopened, live)
    assert reopened.chat("Go on.").answer == live.chat("Go on.").answer
    store = Store(tmp_path / "a.db")
    assert Settings.from_dict(store.conversation(live.conversation_id)["settings"]) == live.settings
    assert [c["changes"] for c in store.settings_changes(live.conversation_id)] == [change]


@pytest.mark.parametrize("completed", [False, True])
def test_a_live_change_while_a_reply_streams_is_stored_with_its_turn(tiny, tmp_path, completed):
    """The settings panel changes the budget while a reply streams: the change is stored with the turn when it
    completes. A crash before that reopens the last completed turn exactly, and changes it again as the person left
    it (the change's settings wait on the conversation's row; before, the change wrote the committed turn's state
    file with the half turn's cache at once, and the conversation reopened from its tokens, approximately; then it
    reopened under the settings before the change)."""
    model = tiny("llama")
    settings = Settings(policy="streaming", budget=64, window=8, slack=8)
    live = Session(model, settings, store=Store(tmp_path / "a.db"), sampling=GREEDY)
    for user, reply in TURNS[:3]:
        live.exchange(user, reply)
    twin = Session.resume(model, Store(tmp_path / "a.db"), live.conversation_id, sampling=GREEDY)
    gen = live.reply("Tell me more about the rivers of the north, please.")
    next(gen)
    live.configure(budget=40)  # between two reply tokens, from the settings panel's thread
    waiting = Store(tmp_path / "a.db")
    assert waiting.conversation(live.conversation_id)["settings"]["budget"] == 64  # stored with the turn
    assert waiting.conversations()[0]["settings"]["budget"] == 40  # the saved lists show what a reopen takes
    if completed:
        for _ in gen:
            pass
    reopened = Session.resume(model, Store(tmp_path / "a.db"), live.conversation_id, sampling=GREEDY)
    assert reopened.restored_from == "archive"
    changes = Store(tmp_path / "a.db").settings_changes(live.conversation_id)
    if completed:
        assert reopened.settings == live.settings and [c["changes"] for c in changes] == [{"budget": 40}]
        assert_same_cache(reopened, live)
    else:  # the crash: the half turn is gone, the turn before is as it was, changed as the person left it
        assert reopened.settings == live.settings
        assert [(c["turn"], c["changes"]) for c in changes] == [(4, {"budget": 40})]
        reopened.close()
        again = Session.resume(model, Store(tmp_path / "a.db"), live.conversation_id, sampling=GREEDY)
        assert again.settings == live.settings  # written by the first reopen: nothing changes again
        assert len(Store(tmp_path / "a.db").settings_changes(live.conversation_id)) == 1
        twin.configure(budget=40)  # (it writes the conversation too: last)
        assert_same_cache(reopened, twin)
        assert_same_cache(again, twin)


def test_a_parameter_set_back_to_its_default_mid_reply_survives_a_crash(tiny, tmp_path):
    """A policy parameter set back to its default while a reply streams (stored as left out) comes back so after a
    crash: the reopened session does not keep the value the last saved turn had."""
    settings = Settings(policy="h2o", budget=64, window=8, slack=8, params={"heavy": 16})
    live = Session(tiny("llama"), settings, store=Store(tmp_path / "a.db"), sampling=GREEDY)
    live.exchange(*TURNS[0])
    gen = live.reply("Tell me more about the rivers of the north, please.")
    next(gen)
    live.configure(params={"heavy": 0})  # h2o's default
    assert live.settings.params == {}
    reopened = Session.resume(tiny("llama"), Store(tmp_path / "a.db"), live.conversation_id, sampling=GREEDY)
    assert reopened.settings == live.settings


def test_a_live_change_the_database_refuses_mid_reply_is_stored_with_its_turn(tiny, tmp_path, monkeypatch):
    """The database refuses to keep a change made while a reply streams (locked by another writer, say): the change
    applies all the same, the reply says why it waits, and the turn stores it as it closes."""
    from kvchat.storage.db import StoreError

    live = Session(tiny("llama"), Settings(policy="streaming", budget=64, window=8, slack=8),
                   store=Store(tmp_path / "a.db"), sampling=GREEDY)
    live.exchange(*TURNS[0])

    def locked(*args):
        raise StoreError("database a.db: database is locked")

    monkeypatch.setattr(live.store, "record_live_settings", locked)
    gen = live.reply("Tell me more about the rivers of the north, please.")
    next(gen)
    assert live.configure(budget=40) == {"budget": 40}
    for _ in gen:
        pass
    assert live.history[-1].warnings == ["a settings change made during the reply is stored only with it: "
                                         "database a.db: database is locked"]
    store = Store(tmp_path / "a.db")
    assert [c["changes"] for c in store.settings_changes(live.conversation_id)] == [{"budget": 40}]
    assert store.conversation(live.conversation_id)["settings"]["budget"] == 40


def test_a_session_that_stored_nothing_leaves_no_files(tiny, tmp_path):
    store = Store(tmp_path / "kv.db")
    session = Session(tiny("llama"), Settings(budget=64, window=8), store=store, system="Be brief.")
    assert session.total_tokens > 0  # the system prompt is fed at once
    folder = session.files.folder
    session.close()
    assert not folder.exists() and store.conversations() == []


def test_deleting_a_conversation_deletes_its_files(tiny, tmp_path):
    store = Store(tmp_path / "kv.db")
    live = Session(tiny("llama"), Settings(policy="h2o", budget=40, window=8, slack=6), store=store, sampling=GREEDY)
    for user, reply in TURNS:
        live.exchange(user, reply)
    folder = live.files.folder
    assert (folder / "rows.bin").is_file() and (folder / "digests").is_dir()
    store.delete(live.conversation_id)
    assert not folder.exists()


LEGACY_COMMIT = "db83950"  # the last version whose archive kept every token's KV


@pytest.fixture(scope="session")
def legacy_v1(tmp_path_factory):
    """A conversation stored, and reopened, by kvchat as of ``LEGACY_COMMIT``: that version's code is taken from
    the repository's history (``git archive``) and runs tests/data/legacy-v1/make.py with a tiny random model
    (about 6 s); the folder holds its kv.db, archive/ and expected.pt (the cache that version reopened)."""
    import os
    import subprocess
    import sys

    from helpers import REPO

    base = tmp_path_factory.mktemp("legacy-v1")
    src = base / "src"
    src.mkdir()
    tree = subprocess.run(["git", "-C", str(REPO), "archive", LEGACY_COMMIT], capture_output=True)
    if tree.returncode != 0:
        pytest.skip(f"needs the repository's history (commit {LEGACY_COMMIT}) to build the old version's "
                    f"conversation: {tree.stderr.decode().strip()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(src)], input=tree.stdout, check=True)
    (base / "kvchat").symlink_to(src)
    (src / "make.py").write_bytes((REPO / "tests" / "data" / "legacy-v1" / "make.py").read_bytes())
    env = dict(os.environ, PYTHONPATH=str(base), HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, str(src / "make.py"), str(base / "out")], env=env, capture_output=True,
                         text=True, cwd=base)
    assert run.returncode == 0, run.stderr[-2000:]
    return base / "out"


def test_a_conversation_of_the_old_archive_reopens_exactly_and_moves_to_the_new_form(tiny, tmp_path, legacy_v1):
    """A conversation stored by kvchat before the bounded storage (its archive kept every token's KV: made by that
    version, ``legacy_v1``) reopens with exactly the cache that version reopened it with; after the next turn its
    old files are gone and it reopens exactly from the new ones."""
    import shutil

    shutil.copytree(legacy_v1, tmp_path / "legacy")
    expected = torch.load(tmp_path / "legacy" / "expected.pt")
    store = Store(tmp_path / "legacy" / "kv.db")
    (conv,) = store.conversations()
    model = tiny("llama")
    old = Session.resume(model, store, conv["id"], sampling=GREEDY)
    assert old.restored_from == "archive"
    for i, layer in enumerate(old.cache.layers):
        assert torch.equal(layer.keys_dense(), expected[f"{i}.keys"])
        assert torch.equal(layer.padded(layer.values), expected[f"{i}.values"])
        assert torch.equal(layer.positions(), expected[f"{i}.positions"])
        for name, t in layer.stats.items():
            assert torch.equal(layer.padded(t), expected[f"{i}.stat.{name}"])
    assert old.digests is not None and old.digests.count > 0  # its digests carried over
    old.chat("What is my locker code?")
    folder = old.files.folder
    assert not (folder / "kv.bin").exists() and not (folder / "digest.bin").exists()
    assert (folder / "rows.bin").is_file()
    again = Session.resume(model, Store(tmp_path / "legacy" / "kv.db"), conv["id"], sampling=GREEDY)
    assert again.restored_from == "archive"
    assert_same_cache(again, old)
