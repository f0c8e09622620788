"""Recall: evicted text comes back into the cache when a new message needs it, within the budget, at its place in
conversation order, read again from its tokens and every key rotated once from where it was computed; live, durable,
and gone with its conversation."""

import json
from pathlib import Path

import pytest
import torch

from helpers import data_file
from kvchat.core.engine.feeding import Feeding
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.storage.db import Store
from kvchat.core.cache import compress
from kvchat.core.recall import choose as recall_choose, gate
from test_durability import TURNS, assert_same_cache

GREEDY = Sampling(max_new_tokens=10, temperature=0.0)
BOUNDED = ["streaming", "window", "h2o", "tova", "snapkv", "cake", "headaware"]


@pytest.fixture(autouse=True)
def open_gate(request, monkeypatch):
    """Recall's gate (core/recall/gate.py) keeps what makes a message more predictable: on tiny random models that
    is chance, so the tests of recall's mechanics keep whatever recall chooses; tests marked ``gate`` keep the gate."""
    if request.node.get_closest_marker("gate") is None:
        monkeypatch.setattr(gate, "keeps", lambda without, with_recall: True)


def _settings(**kw):
    return Settings(**{"policy": "streaming", "budget": 48, "window": 8, "slack": 6, "recall": "on",
                       "groups": "sentence", **kw})


def _chat(session, rounds=2):
    results = []
    for _ in range(rounds):
        for user, reply in TURNS:
            results.append(session.exchange(user, reply))
    return results


def _assert_keys_rotated_once(session):
    """Every held key is its computed key rotated once from where it was computed to its slot's position, and the
    slots are in conversation order."""
    original = session.settings.positions == "original"
    for layer in session.cache.layers:
        for h in range(layer.heads):
            held = layer.head_view(layer.abs_pos, h).long()
            assert torch.all(held[1:] > held[:-1]), "slots are in conversation order"
            target = held if original else layer.pos_off[h] + torch.arange(held.numel())
            computed = layer.head_view(layer.computed, h).long()
            expected = session.model.rotary.rotate(layer.head_view(layer.k0, h), target - computed)
            assert torch.equal(layer.head_view(layer.keys, h), expected)


@pytest.mark.parametrize("policy", BOUNDED)
def test_recall_brings_evicted_groups_back_within_the_bound(tiny, tmp_path, policy):
    session = Session(tiny("llama"), _settings(policy=policy), store=Store(tmp_path / "r.db"), sampling=GREEDY)
    bound = session.settings.capacity
    seen, guarded = [], []
    forward = session.forward

    def checked(*a, **kw):
        out = forward(*a, **kw)
        # cake and headaware split budget x layers among layers (and heads): their bound is on the mean
        seen.append(session.cache.mean_length if policy in ("cake", "headaware") else session.cache.length)
        if session.recall_guard.numel():  # the message read again after what it recalled: all of it held
            guarded.append(bool(torch.all(session.held_fraction()[session.recall_guard] == 1.0)))
        return out

    session.forward = checked
    results = _chat(session) + [session.chat("And what did I say about the sea?")]
    recalled = [r for r in results if r.recalled_tokens]
    assert recalled, "something evicted came back"
    assert max(seen) <= bound
    for r in results:
        assert r.recall_ms is not None and r.recalled_groups == len(r.recalled) <= session.settings.recall_groups
        assert r.recalled_tokens == sum(b - a for a, b in r.recalled) <= session.settings.recall_limit
    assert guarded and all(guarded), "recalled groups are held in every layer and head while the message is read"


def test_recalled_tokens_are_kept_through_the_replys_first_compression_then_the_policy_decides(tiny, tmp_path,
                                                                                               monkeypatch):
    """After the message is read again, the reply's first compression still keeps every recalled position in every
    layer and head and ends their protection; ``streaming`` then evicts them (old positions) at a later one."""
    from kvchat.core.cache import compress

    session = Session(tiny("llama"), _settings(), store=Store(tmp_path / "g.db"),
                      sampling=Sampling(max_new_tokens=40, temperature=0.0))
    calls, real = [], compress.compress

    def recorded(sess, keep, reason, drop=None, room=0):
        guard, releasing = sess.recall_guard.clone(), sess.recall_release
        real(sess, keep, reason, drop, room)
        held = sess.held_fraction()[guard] if guard.numel() else torch.ones(0)
        calls.append((reason, releasing, guard.numel(), sess.recall_guard.numel(), bool(torch.all(held == 1.0)),
                      guard))

    monkeypatch.setattr(compress, "compress", recorded)
    _chat(session)
    res = session.chat("And what did I say about the sea?")
    assert res.recalled_tokens > 0 and res.new_tokens == 40
    turn = calls[max(i for i, c in enumerate(calls) if c[0] == "recall"):]
    released = [i for i, c in enumerate(turn) if c[1]]
    assert len(released) == 1, "one compression ends the protection"
    reason, _, before, after, kept, guard = turn[released[0]]
    assert before > 0 and after == 0 and kept, "that compression kept every recalled position"
    assert all(c[2] > 0 and c[4] for c in turn[1: released[0]]), "kept while the message was read again"
    assert released[0] + 1 < len(turn), "the reply went on compressing"
    assert session.held_fraction()[guard].min() < 1.0, "streaming let the old recalled positions go"


@pytest.mark.parametrize("positions", ["rerotate", "original"])
def test_recalled_keys_are_rotated_once_to_their_place_in_conversation_order(tiny, tmp_path, positions):
    """Recalled text is read again at the end of the cache, then every head's slots go back into conversation order:
    the recalled keys too are their computed keys rotated once (from the end of the cache) to their slots."""
    session = Session(tiny("llama"), _settings(policy="h2o", positions=positions), store=Store(tmp_path / "k.db"),
                      sampling=GREEDY)
    _chat(session)
    checked, read = [], []
    real, read_again = compress.reorder, session.read_again
    session.read_again = lambda positions, end=None: (read.append(positions), read_again(positions, end))

    def reorder(sess):
        real(sess)
        _assert_keys_rotated_once(sess)
        brought, layer = read[-1], sess.cache.layers[0]
        mine = torch.isin(layer.head_view(layer.abs_pos, 0), brought)
        moved = layer.head_view(layer.computed, 0)[mine] != layer.head_view(layer.abs_pos, 0)[mine]
        checked.append(bool(mine.sum() == brought.numel()) and bool(moved.all()))

    compress.reorder = reorder
    try:
        res = session.chat("Tell me again about the mountains.")
    finally:
        compress.reorder = real
    assert res.recalled_tokens > 0 and checked and all(checked), "held everywhere, computed at the cache's end"
    _assert_keys_rotated_once(session)
    if positions == "rerotate":  # contiguous positions 0..n-1 in every layer: the next token continues at n
        for layer in session.cache.layers:
            assert set(p + n for p, n in zip(layer.pos_off, layer.lens)) == {session.cache.length}


def test_a_recall_turn_reopens_exactly(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr("kvchat.core.recall.choose.HELD_QUANTILE", 0.0)  # random weights: recall whatever scores best
    model = tiny("qwen2")
    live = Session(model, _settings(policy="snapkv"), store=Store(tmp_path / "d.db"), sampling=GREEDY)
    for user, reply in TURNS * 2:
        res = live.exchange(user, reply)
        reopened = Session.resume(model, Store(tmp_path / "d.db"), live.conversation_id, sampling=GREEDY)
        assert reopened.restored_from == "archive"
        assert_same_cache(reopened, live)
    assert res.recalled_tokens > 0
    rows = Store(tmp_path / "d.db").turn_stats(live.conversation_id)
    assert [r["recalled"] for r in rows[-2:]] == [h.recalled for h in live.history[-2:]]
    assert rows[-1]["recalled_tokens"] == res.recalled_tokens and rows[-1]["recall_ms"] > 0
    assert reopened.chat("And the rivers?").answer == live.chat("And the rivers?").answer


LONG = " ".join(f"Note {i}: the harbour wall was mended in spring." for i in range(30)) + " Which wall was mended?"


@pytest.mark.parametrize("policy", BOUNDED)
def test_a_long_message_is_read_again_only_from_where_its_last_budget_tokens_start(tiny, monkeypatch, policy):
    """Recall reads a message longer than the budget again only from a mark where its last ``budget`` tokens start
    (``TailMark``): what came before is evicted or already scored by then. With nothing put back, reading it again
    from the mark gives exactly the first read: the probe's score of every token, the cache and its statistics."""
    read, reads, forward = [0], [], Session.forward

    def counted(self, ids, abs_pos, *args, at=None, **kw):
        read[0] += ids.numel() if at is None else 0
        return forward(self, ids, abs_pos, *args, at=at, **kw)

    monkeypatch.setattr(Session, "forward", counted)
    monkeypatch.setattr(recall_choose, "bring_back", lambda session, bring, end=None: None)
    plan, sessions, results = recall_choose.plan, [], []
    for chooses in (True, False):  # recall chose text (the message read again), or nothing (read once)
        monkeypatch.setattr(recall_choose, "plan", lambda *a, **k: {**plan(*a, **k), **({} if chooses else
                                                                                       {"recalled": []})})
        session = Session(tiny("llama"), _settings(policy=policy), sampling=GREEDY)
        _chat(session, rounds=1)
        read[0] = 0
        results.append(session.probe(LONG, "The harbour wall was mended.", "harbour wall"))
        reads.append(read[0])
        sessions.append(session)
    (on, off), budget = results, sessions[0].settings.budget
    assert on.recalled and not off.recalled
    assert on.prompt_tokens > 4 * budget
    assert 0 < reads[0] - reads[1] <= budget
    assert (on.expect_nll, on.hit) == (off.expect_nll, off.hit)
    assert_same_cache(*sessions)


@pytest.mark.parametrize("positions", ["rerotate", "original"])
def test_a_long_message_that_recalls_stays_within_the_bound_and_reopens_exactly(tiny, tmp_path, monkeypatch,
                                                                                positions):
    """Text recalled before a long message's last ``budget`` tokens: the cache stays within budget + slack, the
    recalled keys are read again right after the cache's last position there and rotated once to their place, an
    undo takes the turn back exactly, and the turn reopens exactly."""
    monkeypatch.setattr("kvchat.core.recall.choose.HELD_QUANTILE", 0.0)  # random weights: recall whatever scores best
    model = tiny("llama")
    live = Session(model, _settings(policy="h2o", positions=positions), store=Store(tmp_path / "l.db"),
                   sampling=GREEDY, undo=True)
    _chat(live, rounds=1)
    before = Session.resume(model, Store(tmp_path / "l.db"), live.conversation_id, sampling=GREEDY)
    live.exchange(LONG, "The harbour wall.")
    live.undo()
    assert_same_cache(live, before)
    seen, forward = [], live.forward
    live.forward = lambda *a, **kw: (forward(*a, **kw), seen.append(live.cache.length))[0]
    start = live.total_tokens
    res = live.exchange(LONG, "The harbour wall.")
    assert res.recalled_tokens > 0 and max(seen) <= live.settings.capacity
    _assert_keys_rotated_once(live)
    layer = live.cache.layers[0]
    recalled = torch.isin(layer.head_view(layer.abs_pos, 0), torch.tensor([p for a, b in res.recalled
                                                                          for p in range(a, b)]))
    computed = layer.head_view(layer.computed, 0)[recalled]
    message_end = start + int((live.log.column("message") == len(live.messages) - 2).sum())
    assert recalled.any()
    if positions == "original":  # read again after the cache's last position at the mark, inside the message
        assert bool(((computed >= start) & (computed < message_end)).all())
    reopened = Session.resume(model, Store(tmp_path / "l.db"), live.conversation_id, sampling=GREEDY)
    assert_same_cache(reopened, live)
    assert reopened.chat("And the sea?").answer == live.chat("And the sea?").answer


def test_a_mark_that_only_appends_is_never_taken_over_a_read_that_compresses(tiny, monkeypatch):
    """A ``ReadMark`` puts back only heads' lengths and statistics, so no compression may run in the read after it.
    A message that fits the free slots can still compress while it is read: its chunks are planned over the answer
    that follows (here 17 tokens with 19 free slots, read 8 at a time, compressed before the last); such a read is
    marked by a copy of the whole session instead."""
    from kvchat.core.engine.checkpoint import ReadMark

    marked, broken, capture, real = [False], [], ReadMark.capture, compress.compress

    def mark(cls, session, *args):
        out = capture.__func__(cls, session, *args)
        marked[0] = out is not None
        return out

    def compressing(session, keep, reason, *args, **kw):
        broken.append(marked[0] and reason != "recall")
        return real(session, keep, reason, *args, **kw)

    feed = Session._feed

    def first_read(self, *args, **kw):  # the message read for its queries (with a tap) ends the marked read
        out = feed(self, *args, **kw)
        marked[0] = marked[0] and kw.get("tap") is None
        return out

    monkeypatch.setattr(ReadMark, "capture", classmethod(mark))
    monkeypatch.setattr(compress, "compress", compressing)
    monkeypatch.setattr(Session, "_feed", first_read)
    session = Session(tiny("llama"), _settings(policy="h2o", budget=64, slack=8), sampling=GREEDY)
    for _ in range(2):
        session.exchange("Hi.", "Hello there.")
    broken.clear()
    session.exchange("word " * 11, "And a longer answer follows here, on and on." * 8)
    assert broken and not any(broken), "the message's read compressed; no mark that only appends was over it"


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_forgetting_a_read_message_by_its_mark_equals_the_whole_checkpoint(tiny, tmp_path, monkeypatch, policy):
    """Recall reads a user message for its queries, then forgets the read before the put-back: by a ``ReadMark``
    when the message fits the free slots, else by a ``Checkpoint`` of the whole cache. Both leave the same
    session: the same cache, statistics, observer window and replies."""
    from kvchat.core.engine.checkpoint import ReadMark

    restored = []
    restore = ReadMark.restore

    def run(folder, marks):
        with pytest.MonkeyPatch.context() as patch:
            if marks:
                patch.setattr(ReadMark, "restore", lambda self, session: restored.append(1) or restore(self, session))
            else:
                patch.setattr(ReadMark, "capture", classmethod(lambda cls, session, tokens, more=0: None))
            # slack for a short message to fit the free slots after a compression
            session = Session(tiny("llama"), _settings(policy=policy, slack=24),
                              store=Store(tmp_path / folder / "m.db"), sampling=GREEDY)
            results = _chat(session) + [session.chat("And what did I say about the sea?")]
        return session, results

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    marked, with_marks = run("a", True)
    whole, with_checkpoints = run("b", False)
    assert restored, "some reads were forgotten by their mark"
    assert sum(r.recalled_tokens for r in with_marks) > 0
    assert [(r.recalled, r.answer) for r in with_marks] == [(r.recalled, r.answer) for r in with_checkpoints]
    assert_same_cache(marked, whole)


def test_recall_switches_live_and_undo_takes_it_back(tiny, tmp_path):
    """With recall off nothing is digested (the disk keeps only what resume needs); switched on live, the text fed
    from then on can come back; an undo takes a recall back; switched off, nothing comes back."""
    session = Session(tiny("llama"), _settings(recall="off"), store=Store(tmp_path / "s.db"), sampling=GREEDY,
                      undo=True)
    off = _chat(session, rounds=1)
    assert all(r.recalled_tokens == 0 and r.recall_ms is None for r in off)
    assert session.digests is None and not (session.files.folder / "digests").exists()
    session.configure(recall="on")
    switched = session.total_tokens
    _chat(session)
    before = session.kept_positions()
    on = session.chat("What about the sea, again?")
    assert on.recalled_tokens > 0 and all(a >= switched for a, _ in on.recalled)
    session.undo()
    assert torch.equal(session.kept_positions(), before)
    session.configure(recall="off")
    assert session.chat("What about the sea, again?").recalled_tokens == 0


def test_recall_needs_nothing_that_is_not_evicted(tiny, tmp_path):
    """A budget larger than the chat evicts nothing, so recall changes nothing: the full cache's greedy replies."""
    model = tiny("llama")
    answers = {}
    for recall in ("off", "on"):
        session = Session(model, _settings(budget=400, window=None, slack=None, recall=recall),
                          store=Store(tmp_path / f"{recall}.db"), sampling=GREEDY)
        answers[recall] = [session.chat(u).answer for u, _ in TURNS]
        assert session.evicted_total == 0 and all(r.recalled_tokens == 0 for r in session.history)
    assert answers["on"] == answers["off"]


def test_a_message_of_template_scaffolding_alone_recalls_nothing(tiny, tmp_path):
    """A user message that is all template scaffolding (the word "user", the one the template's header holds; a
    typed "<|im_start|>" was the special token until messages were read as plain text) leaves recall no query to
    score with: the turn goes on without recalling (it raised in the scoring's reshape), and a message with content
    after it recalls as before."""
    session = Session(tiny("llama"), _settings(), store=Store(tmp_path / "r.db"), sampling=GREEDY)
    _chat(session)
    assert session.digests.count > 0 and session.evicted_total > 0
    res = session.chat("user")
    assert res.recalled_tokens == 0 and res.new_tokens > 0
    assert session.chat(TURNS[0][0]).recalled_tokens > 0


def test_deleting_a_conversation_deletes_its_recall_digests(tiny, tmp_path):
    store = Store(tmp_path / "x.db")
    session = Session(tiny("llama"), _settings(), store=store, sampling=GREEDY)
    _chat(session, rounds=1)
    folder = session.files.folder
    assert session.archive_bytes > 0 and session.digests.covered == session.total_tokens
    session.close()
    store.delete(session.conversation_id)
    assert not folder.exists()


def test_an_unsaved_sessions_temporary_digests_never_outlive_it(tiny):
    """Without a store, recall's digests live in a temporary folder: gone when the session is closed, when it is
    dropped without closing, and when a process ends holding one (nothing piles up in the temporary directory)."""
    import gc
    import subprocess
    import sys

    session = Session(tiny("llama"), _settings(), sampling=GREEDY)
    _chat(session, rounds=1)
    folder = session.files.folder
    assert session.files.temporary and session.archive_bytes > 0
    session.close()
    assert not folder.exists()
    session = Session(tiny("llama"), _settings(), sampling=GREEDY)
    _chat(session, rounds=1)
    folder = session.files.folder
    del session
    gc.collect()
    assert not folder.exists()
    code = ("import sys, pathlib; from kvchat.core.engine.persist import Files; f = Files.new(None); "
            "(f.folder / 'digests').mkdir(); print(f.folder)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out and not Path(out).exists()


@pytest.mark.parametrize("bad", [{"recall": "maybe"}, {"recall_groups": 0}, {"recall_tokens": -3},
                                 {"recall_threshold": 2.0}, {"recall_threshold": "high"}])
def test_bad_recall_settings_are_refused(tiny, bad):
    session = Session(tiny("llama"), _settings())
    with pytest.raises(ValueError, match=next(iter(bad))):
        session.configure(**bad)
    assert session.settings.recall == "on"


def _filler(n):
    convs = json.loads(data_file("fastchat", "dummy_conversation.json").read_text())
    return [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in convs
            if len(c["conversations"]) >= 2 and c["conversations"][0]["from"] == "human"][:n]


@pytest.mark.gate
def test_an_evicted_fact_comes_back_for_a_question_in_other_words(smol, tmp_path):
    """The default model: a fact planted at the start and evicted by 600+ tokens of chat at budget 128 comes back
    for a question sharing almost no words with it, and the probe predicts it (recall off: it does not)."""
    fact = "I parked the car on level 4 of the garage, spot K12."
    results = {}
    for recall in ("off", "on"):
        session = Session(smol, Settings(policy="streaming", budget=128, window=32, slack=16, recall=recall),
                          store=Store(tmp_path / f"{recall}.db"), sampling=GREEDY)
        session.exchange(fact, "Noted, I will remember that.")
        planted = session.log.column("message") == len(session.messages) - 2
        for pair in _filler(40):
            if session.total_tokens >= 700:
                break
            session.exchange(*pair)
        assert session.held_fraction()[: planted.numel()][planted].max() == 0.0, "the fact was evicted"
        results[recall] = session.probe("Where did I leave the car?", "You left it on level 4, spot K12.", "4")
        text = [smol.tokenizer.decode(session.log.column("token")[a:b].tolist()) for a, b in
                results[recall].recalled]
        assert any(fact in t for t in text) == (recall == "on")
    assert results["on"].hit and not results["off"].hit
    assert results["on"].expect_nll < results["off"].expect_nll - 1.0


@pytest.mark.parametrize("candidates", [10_000, 64])
def test_relevance_finds_the_group_the_queries_point_at(monkeypatch, candidates):
    """Scored in full, or through the coarse pass that picks candidates past ``CANDIDATES`` groups, the group whose
    keys the queries point at ranks first; groups the coarse pass leaves out score 0."""
    from kvchat.core.recall import digest, score

    monkeypatch.setattr(score, "CANDIDATES", candidates)
    monkeypatch.setattr(score, "BLOCK", 512)  # the coarse pass's 2000 groups in four blocks
    gen = torch.Generator().manual_seed(0)
    layers, groups, heads, dim = [2, 4, 6, 8], 2000, 2, 16
    digests = torch.randn(groups, len(layers), heads, digest.REPS, dim, generator=gen)
    queries = {li: torch.randn(2 * heads, 5, dim, generator=gen) for li in layers}
    target = 1234
    for si, li in enumerate(layers):  # the target's largest key points where the queries of its KV head point
        direction = queries[li].view(heads, -1, dim).mean(1)
        digests[target, si, :, 0] = 4 * direction / direction.norm(dim=-1, keepdim=True) * dim ** 0.5
    digests = digests.half()
    coarse = digests[:, score.coarse_index(layers), :, 0].permute(1, 2, 0, 3).contiguous()
    rel = score.relevance(digests.numpy(), coarse, layers, queries, {})
    assert rel.argmax() == target
    assert (rel == 0).sum() == (groups - candidates if candidates < groups else 0)


@pytest.mark.parametrize("kept_blocks, products", [(None, 11), (0, 2 * 11), (5, 11 + 6)])
def test_the_coarse_pass_multiplies_a_block_of_groups_at_a_time(monkeypatch, kept_blocks, products):
    """Past ``BLOCK`` groups the coarse pass's shares are those of one softmax over all the groups (to float
    precision), from products of at most ``BLOCK`` groups each: its memory, on a GPU too, stays bounded however long
    the chat (the groups grow with it until the archive's cap). The products of its first pass (the normaliser) are
    kept for the second up to ``KEPT_LOGITS_MB`` and made again past it, with the same shares."""
    from kvchat.core.recall import score

    gen = torch.Generator().manual_seed(2)
    q, keys = torch.randn(8, 5, 16, generator=gen), torch.randn(2, 1000, 16, generator=gen).to(score.COARSE_DTYPE)
    whole = score._shares(q, keys, 0.25, 1)
    monkeypatch.setattr(score, "BLOCK", 96)
    if kept_blocks is not None:  # room for that many blocks' products (None: the default, all of them)
        block_bytes = score._logits(q, keys[:, :96], 0.25).nbytes
        monkeypatch.setattr(score, "KEPT_LOGITS_MB", kept_blocks * block_bytes / 2**20)
    widths, plain = [], score._logits
    monkeypatch.setattr(score, "_logits", lambda q, k, *a: widths.append(k.shape[1]) or plain(q, k, *a))
    blocked = score._blocked_shares(q, keys, 0.25)
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-8)
    assert max(widths) == 96 and len(widths) == products


def test_scores_equal_the_attention_shares_they_stand_for():
    """``score``: per layer the softmax over groups of each query row's best representative logit, its largest
    value over rows and query heads, the mean over layers; computed here the plain way (fp32, loops), it agrees
    (to bf16's precision where the CPU multiplies in bf16)."""
    from kvchat.core.recall import digest, score

    gen = torch.Generator().manual_seed(1)
    layers, groups, heads, qheads, dim = [1, 3, 5], 40, 2, 4, 16
    digests = torch.randn(groups, len(layers), heads, digest.REPS, dim, generator=gen).half()
    queries = {li: torch.randn(qheads, 7, dim, generator=gen) for li in layers}
    expected = torch.zeros(groups)
    for si, li in enumerate(layers):
        best = torch.zeros(groups)
        for qh in range(qheads):
            kv = qh // (qheads // heads)
            logits = torch.einsum("rd,gkd->rgk", queries[li][qh], digests[:, si, kv].float()).amax(-1) * dim ** -0.5
            best = torch.maximum(best, logits.softmax(-1).amax(0))
        expected += best / len(layers)
    got = score.score(digests, layers, queries, {})
    assert torch.allclose(got, expected, atol=3e-3 if score.FULL_DTYPE == torch.bfloat16 else 1e-6)
    assert got.argmax() == expected.argmax()


def _reference_digests(keys: dict, sentence, content, start: int, n: int, layers, heads: int):
    """Digests computed the plain way from every key as computed, un-rotated ({(layer, head, position): key}),
    quantized as the store keeps them."""
    from kvchat.core.recall import digest

    out = []
    ids = sentence[start:n].tolist()
    bounds = [start] + [start + i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [n]
    for a, b in zip(bounds, bounds[1:]):
        own = [p for p in range(a, b) if content[p]] or list(range(a, b))
        group = torch.empty(len(layers), heads, digest.REPS, next(iter(keys.values())).shape[-1])
        for si, li in enumerate(layers):
            for h in range(heads):
                k = torch.stack([keys[(li, h, p)] for p in own])
                top = k.norm(dim=-1).topk(min(digest.REPS, len(own))).indices
                top = torch.cat([top, top[:1].expand(digest.REPS - top.numel())])
                group[si, h] = k[top]
        out.append(group)
    return digest.dequantize(*digest.quantize(torch.stack(out)))


@pytest.mark.parametrize("budget", [400, 24])
def test_digests_stand_for_a_group_by_its_content_keys_as_computed(tiny, tmp_path, budget):
    """A group's digest is its largest-norm keys (as computed, un-rotated) among its tokens that are not template
    scaffolding (role headers and end markers draw attention from any message), in int8; a group of scaffolding
    alone is represented by its own. At budget 24 a long message is read in pieces with compressions between:
    the keys they drop are taken before (``Digests.capture``), so the digests are still those of every key."""
    from kvchat.core.recall import digest

    session = Session(tiny("llama"), _settings(budget=budget, window=4, slack=4), store=Store(tmp_path / "d.db"),
                      sampling=GREEDY, system=None)
    seen = {}
    forward = session.forward

    def remember(ids, abs_pos, all_logits=False, tap=None, at=None, **kw):  # every key as the forward computed it
        out = forward(ids, abs_pos, all_logits, tap, at, **kw)
        if at is None:
            for li in session.digests.layers:
                layer = session.cache.layers[li]
                for h in range(layer.heads):
                    slots = layer.head_view(layer.abs_pos, h)
                    for p in abs_pos.tolist():
                        i = int(torch.nonzero(slots == p)[0])
                        seen[(li, h, p)] = session.model.rotary.rotate(
                            layer.head_view(layer.k0, h)[i].float(), -layer.head_view(layer.computed, h)[i].long())
        return out

    session.forward = remember
    session.exchange("A long message. " + "It goes on and on, sentence after sentence. " * 6, "Short reply.")
    assert budget == 400 or session.evicted_total > 0
    content = ~torch.isin(session.log.column("token").long(), session.model.scaffolding_ids())
    heads = session.cache.layers[0].heads
    expected = _reference_digests(seen, session.log.column("sentence"), content, 0, session.total_tokens,
                                  session.digests.layers, heads)
    spans, rows, _ = session.digests.read()
    assert int(spans[-1, 1]) == session.total_tokens and spans.shape[0] == expected.shape[0]
    got = rows.take(None).float()
    assert torch.allclose(got, expected.to(got.dtype).float(), rtol=1e-2, atol=1e-2)
    assert digest.REPS == got.shape[3]


def test_every_groups_representatives_at_once_equal_the_group_by_group_choice():
    """``representatives`` picks all groups' keys in a few operations (no loop over groups, nothing read back from
    a GPU); the keys are exactly those chosen group by group: the largest norms among the group's content tokens
    (its scaffolding only where it has nothing else), largest first, a group of fewer repeating its first."""
    from kvchat.core.recall import digest

    torch.manual_seed(0)
    counts = torch.tensor([1, 3, 2, 9, 4, 1, 40, 5])
    n = int(counts.sum())
    keys = torch.randn(3, 2, n, 16)
    content = torch.rand(n) > 0.3
    content[1:4] = False  # a group of scaffolding alone
    content[4:6] = torch.tensor([True, False])  # one content token among two
    got = digest.representatives(keys, counts, content)
    expected = []
    for a, c in zip((torch.cumsum(counts, 0) - counts).tolist(), counts.tolist()):
        own = torch.arange(a, a + c)
        if content[a: a + c].any():
            own = own[content[a: a + c]]
        top = own[keys.norm(dim=-1)[..., own].topk(min(digest.REPS, own.numel()), -1).indices]
        top = torch.cat([top, top[..., :1].expand(-1, -1, digest.REPS - top.shape[-1])], -1)
        expected.append(torch.gather(keys, 2, top[..., None].expand(-1, -1, -1, keys.shape[-1])))
    assert torch.equal(got, torch.stack(expected))


def test_int8_digests_score_as_the_fp16_ones(monkeypatch):
    """Quantized to int8 with one scale per key, the digests rank groups as the float ones do."""
    from kvchat.core.recall import digest, score

    gen = torch.Generator().manual_seed(3)
    layers, groups, heads, dim = [1, 3, 5], 300, 2, 16
    reps = torch.randn(groups, len(layers), heads, digest.REPS, dim, generator=gen)
    queries = {li: torch.randn(2 * heads, 9, dim, generator=gen) for li in layers}
    exact = score.score(reps, layers, queries, {})
    packed = digest.dequantize(*digest.quantize(reps))
    assert (packed - reps).abs().max() <= reps.abs().amax() / 127
    approx = score.score(packed, layers, queries, {})
    assert approx.argmax() == exact.argmax()
    assert torch.allclose(approx, exact, atol=2e-3)


def test_bf16_scoring_multiplies_a_few_shapes_and_gives_the_plain_products(monkeypatch):
    """The CPU's bf16 products keep a kernel for every shape they see (never freed: a long chat grew ~20 KB a turn):
    scoring pads the query rows and the groups to a few sizes. Over 300 messages of random sizes the products take
    at most a few dozen shapes, each padded by at most half, and give what the plain product gives: bit for bit
    where the CPU's kernels sum alike for both shapes, within a bf16 rounding where not (a CPU with AMX: one product
    in 300 apart, by 1.9e-6)."""
    from kvchat.core.recall import score

    gen = torch.Generator().manual_seed(5)
    plain, shapes, exact = torch.bmm, set(), 0

    def bmm(a, b, *args, **kwargs):
        shapes.add((a.shape[1], b.shape[2]))
        return plain(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "bmm", bmm)
    for _ in range(300):
        m, n = int(torch.randint(1, 193, (1,), generator=gen)), int(torch.randint(1, 3001, (1,), generator=gen))
        q, k = torch.randn(2, m, 8, generator=gen).bfloat16(), torch.randn(2, n, 8, generator=gen).bfloat16()
        out, ref = score._bf16_scores(q, k), plain(q, k.transpose(1, 2))
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-5)  # rows or groups dropped are far apart
        exact += torch.equal(out, ref)
    assert len(shapes) <= 3 * 20 and exact >= 290
    assert all(mp <= 192 and np_ <= 3000 * 3 // 2 + 64 for mp, np_ in shapes)


def test_coarse_keys_kept_in_memory_follow_the_store_through_adds_and_undo(tiny, tmp_path):
    """Once recall has read the coarse keys they stay in memory (in ``COARSE_DTYPE``) and are extended as turns
    close; after an undo and more turns they still equal what the store holds."""
    from kvchat.core.recall import digest
    from kvchat.core.recall.score import COARSE_DTYPE

    session = Session(tiny("llama"), _settings(), store=Store(tmp_path / "c.db"), sampling=GREEDY, undo=True)
    _chat(session, rounds=1)
    digests = session.digests

    def stored():
        packed = digest.dequantize(digests.store.field("coarse"), digests.store.field("coarse_scale"))
        return packed.permute(1, 2, 0, 3).to(COARSE_DTYPE)

    assert torch.equal(digests.read()[2], stored())  # loaded from the store
    session.chat("One more thing to remember: the boat is blue.")
    assert torch.equal(digests.read()[2], stored())  # extended in memory
    session.undo()
    session.chat("A different turn: the lake was calm and grey.")
    assert torch.equal(digests.read()[2], stored()) and digests.read()[2].shape[2] == digests.count


def test_a_read_taken_back_keeps_the_coarse_keys_in_memory(tiny, tmp_path, monkeypatch):
    """Recall takes a read back (a ``Checkpoint`` restore: the digests' window rewound to where it was) whenever it
    declines what it brought: the coarse keys are not read from the store again, every one of them, each time; a
    window whose start moved (segments forgotten since) is read again."""
    from kvchat.core.engine.checkpoint import Checkpoint
    from kvchat.storage.digests import DigestStore

    session = Session(tiny("llama"), _settings(), store=Store(tmp_path / "r.db"), sampling=GREEDY)
    _chat(session, rounds=1)
    digests = session.digests
    loaded = digests.read()[2].clone()
    reads = []
    plain = DigestStore.field
    monkeypatch.setattr(DigestStore, "field", lambda self, name, *a: reads.append(name) or plain(self, name, *a))
    Checkpoint.capture(session).restore(session)
    assert torch.equal(digests.read()[2], loaded) and "coarse" not in reads
    before = Checkpoint.capture(session)
    digests.store.first += 1  # the window's start moved after the copy (as when a turn forgets a segment)
    before.restore(session)
    assert torch.equal(digests.read()[2], loaded)
    assert "coarse" in reads
    # a turn taken back and another in its place, with other groups: what memory holds of the first is not reused
    before = Checkpoint.capture(session)
    session.exchange("One. Two. Three. Four.", "Five. Six.")
    digests.has_content(digests.read()[0], session.log, session.model.scaffolding_ids())
    before.restore(session)
    session.add("user", "Alpha and beta. Gamma and delta.")  # no recall (no answer): memory's flags not renewed
    spans = digests.read()[0]
    content = ~torch.isin(session.log.column("token").long(), session.model.scaffolding_ids())
    fresh = torch.tensor([bool(content[a:b].any()) for a, b in spans.tolist()])
    assert torch.equal(digests.has_content(spans, session.log, session.model.scaffolding_ids()), fresh)


def test_group_shares_and_content_follow_the_chat_through_undo(tiny, tmp_path):
    """What ``choose`` reads per group: the share of its slots the cache holds (counted from the cache's slots)
    equals the mean over its positions of the held fraction, and whether it holds more than scaffolding (kept in
    memory between messages) equals a fresh reading of the token log, also after an undo rewrote the last turn."""
    from kvchat.core.model.template import scaffolding
    from kvchat.core.recall import choose

    session = Session(tiny("llama"), _settings(policy="h2o"), store=Store(tmp_path / "g.db"), sampling=GREEDY,
                      undo=True)
    digests = session.digests
    session.model.scaffolding = scaffolding(session.model.chat, session.model.tokenizer)
    for step, (user, reply) in enumerate(TURNS * 2):
        if step == 5:
            session.undo()
        session.exchange(user, reply)
        spans = digests.read()[0]
        held = session.held_fraction()
        expected = torch.stack([held[a:b].mean() for a, b in spans.tolist()])
        assert torch.allclose(choose.held_share(session.cache, spans), expected, atol=1e-6)
        assert 0 < int((expected < 0.5).sum()) < spans.shape[0] or step < 2
        content = ~torch.isin(session.log.column("token").long(), session.model.scaffolding)
        fresh = torch.tensor([bool(content[a:b].any()) for a, b in spans.tolist()])
        assert torch.equal(digests.has_content(spans, session.log, session.model.scaffolding), fresh)
        assert not fresh.all(), "scaffolding-only groups exist (the template's markers)"


def test_a_recalled_sentence_comes_with_its_scaffolding_and_the_next_sentence_of_its_message():
    """``choose``: the best evicted group comes back with the scaffolding groups right around it and the next
    sentence of the same message (which completes "My dentist is called Dr." with the name); a held neighbour, a
    neighbour from another message, or one that does not fit the limit stays out."""
    from kvchat.core.recall.choose import choose

    # groups: 0 header | 1 "My dentist is called Dr." | 2 "Petrov." | 3 end marker | 4 next message | 5 held
    spans = torch.tensor([[0, 3], [3, 9], [9, 12], [12, 14], [14, 20], [20, 26]])
    content = torch.tensor([False, True, True, False, True, True])
    message = torch.tensor([0, 0, 0, 0, 1, 1])
    relevance = torch.tensor([0.0, 0.9, 0.1, 0.0, 0.2, 0.0])
    held = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    assert choose(relevance, spans, held, content, 6, 100, 0.5, message) == [[0, 1, 2, 3]]
    assert choose(relevance, spans, held, content, 6, 100, 0.5) == [[0, 1]]  # without messages: scaffolding only
    assert choose(relevance, spans, held, content, 6, 10, 0.5, message) == [[0, 1]]  # the next sentence won't fit
    kept = held.clone()
    kept[2] = 1.0  # the next sentence is held already
    assert choose(relevance, spans, kept, content, 6, 100, 0.5, message) == [[0, 1]]
    other = torch.tensor([0, 0, 1, 1, 1, 1])
    assert choose(relevance, spans, held, content, 6, 100, 0.5, other) == [[0, 1]]


def test_a_sentence_whose_text_the_cache_holds_or_a_pick_brings_is_not_recalled_again():
    """``choose`` with ``text``: a chat's repeated pleasantries come back at most once, and not at all while the
    cache holds a copy; the next best distinct group takes the place."""
    from kvchat.core.recall.choose import choose

    # groups: 0 "How can I help?" (held) | 1 same text | 2 "Goodbye" | 3 same text | 4 a fact | 5 a fact
    spans = torch.tensor([[0, 4], [4, 8], [8, 10], [10, 12], [12, 18], [18, 24]])
    texts = [(1, 2, 3, 4), (1, 2, 3, 4), (5, 6), (5, 6), (7, 8, 9, 10, 11, 12), (13, 14, 15, 16, 17, 18)]
    content = torch.ones(6, dtype=torch.bool)
    relevance = torch.tensor([0.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    held = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert choose(relevance, spans, held, content, 3, 100, 0.0) == [[1], [2], [3]]  # without text: copies come
    assert choose(relevance, spans, held, content, 3, 100, 0.0, text=lambda g: texts[g]) == [[2], [4], [5]]


def test_word_overlap_ranks_the_sentence_sharing_a_rare_word_first(tokenizer):
    """``bm25``: a group sharing a word that few groups hold outscores ones sharing only words every group holds,
    whatever their case or leading space; a group sharing no word scores 0. ``fuse`` brings a group high in either
    ranking above one high in neither, and counts a ranking only where it scores above 0."""
    from kvchat.core.recall.lexical import bm25, fuse, normal_forms

    tok = tokenizer
    forms = normal_forms(tok)
    sentences = ["The weather is nice today.", "My bike lock code is 5104.", "The train is late today.",
                 "Pizza sounds good.", "The cat is asleep today."]
    ids, spans = [], []
    for text in sentences:
        t = tok(" " + text, add_special_tokens=False)["input_ids"]
        spans.append([len(ids), len(ids) + len(t)])
        ids += t
    question = torch.tensor(tok("Is the Lock on my bicycle open today?", add_special_tokens=False)["input_ids"])
    scores = bm25(question, torch.tensor(ids), torch.tensor(spans), forms)
    assert int(scores.argmax()) == 1
    assert float(scores[3]) == 0.0 and all(float(scores[g]) > 0 for g in (0, 2, 4))
    punctuation = tok("?", add_special_tokens=False)["input_ids"]
    assert all(int(forms[i]) == -1 for i in punctuation)
    fused = fuse(torch.tensor([0.0, 0.0, 0.9, 0.0, 0.1]), scores)
    assert float(fused[3]) == 0.0
    assert float(fused[1]) > float(fused[0]) and float(fused[2]) > float(fused[0])


def test_recall_takes_ids_past_the_tokenizer_from_a_padded_vocabulary(tokenizer, tmp_path):
    """Models often have more output ids than their tokenizer has tokens (a padded embedding): a reply made of
    such ids (here one the model picks often) is kept, and recall's word overlap gives them no word where it
    indexed past its table (seen on an H100: ``IndexError`` at a chat's second message)."""
    from transformers import AutoModelForCausalLM

    from kvchat.core.model.loading import ChatModel
    from kvchat.core.recall.lexical import word_forms
    from tinymodels import TINY_CONFIGS

    torch.manual_seed(0)
    config = TINY_CONFIGS["llama"](len(tokenizer) + 64)
    net = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        net.lm_head.weight[len(tokenizer) + 5] = net.lm_head.weight.abs().max() * 50 * net.model.norm.weight.sign()
    model = ChatModel.from_pretrained_model(net, tokenizer, name="tiny-padded")
    session = Session(model, _settings(budget=40), store=Store(tmp_path / "p.db"), sampling=GREEDY)
    results = [session.chat(user) for user, _ in TURNS]
    ids = session.log.column("token")
    assert int((ids >= len(tokenizer)).sum()) >= len(TURNS)  # padding ids in the replies
    assert sum(r.recall_ms is not None for r in results) == len(TURNS) and session.evicted_total > 0
    assert session.cache.length <= session.settings.capacity
    assert word_forms(model).shape[0] == len(tokenizer) + 64 and int(word_forms(model)[-1]) == -1


@pytest.mark.parametrize("policy", ["h2o", "headaware"])  # h2o: a statistic per slot; headaware: heads' own lengths
def test_reorder_puts_recalled_slots_in_place_counting_their_attention_from_the_read(policy, tiny):
    """``compress.reorder`` after recall read text again at the end of the cache: every head's slots in conversation
    order, the others' statistics kept; a recalled slot has received no attention counted yet (``acc`` 0) and its
    attention counts from the read's end on (``since``: the token log's end), so an average over the queries counted
    (``LayerView.seen``) is not taken over the time it was evicted."""
    from kvchat.core.cache import compress

    session = Session(tiny("llama"), _settings(policy=policy, budget=40), system=None)
    session.feed_raw(list(range(20, 140)), score=False)
    held = session.kept_positions()
    bring = torch.tensor([p for p in range(0, 60, 7) if p not in set(held.tolist())])
    compress.compress(session, 40, "recall", drop=bring, room=bring.numel())
    before = []
    for layer in session.cache.layers:
        before.append([({int(p): {name: float(layer.head_view(t, h)[i]) for name, t in layer.stats.items()}
                         for i, p in enumerate(layer.head_view(layer.abs_pos, h).tolist())})
                       for h in range(layer.heads)])
    assert all(s["since"] == 0 for heads in before for stats in heads for s in stats.values())  # from its position
    session.read_again(bring)
    compress.reorder(session)
    _assert_keys_rotated_once(session)
    for layer, heads in zip(session.cache.layers, before):
        assert set(layer.stats) == {"acc", "since"}
        for h, stats in enumerate(heads):
            pos = layer.head_view(layer.abs_pos, h).tolist()
            assert pos == sorted(set(stats) | set(bring.tolist()))
            acc, since = (layer.head_view(layer.stats[name], h).tolist() for name in ("acc", "since"))
            assert acc == [stats[p]["acc"] if p in stats else 0.0 for p in pos]
            assert since == [stats[p]["since"] if p in stats else 120.0 for p in pos]
    view = compress.layer_view(session, 0, session.cache.layers[0], session.cache.layers[0].valid(), None,
                               session.cache.layers[0].length)
    seen = view.seen[view.valid].tolist()
    mine = torch.isin(view.positions, bring)[view.valid].tolist()
    assert all(n == (1 if m else 120 - p) for n, m, p in zip(seen, mine, view.positions[view.valid].tolist()))


@pytest.mark.gate
def test_a_declined_recall_leaves_the_turn_as_if_nothing_had_been_recalled(tiny, tmp_path, monkeypatch):
    """The gate declining what recall read back puts the session where the first read left it: the same answers,
    cache, statistics, token log and evictions as a session whose recall found nothing to bring back."""
    plan = recall_choose.plan
    sessions, results = [], []
    for declines in (True, False):
        if declines:
            monkeypatch.setattr(gate, "GAIN", float("inf"))
            monkeypatch.setattr(recall_choose, "plan", plan)
        else:
            monkeypatch.setattr(recall_choose, "plan", lambda *a, **k: {**plan(*a, **k), "recalled": []})
        session = Session(tiny("llama"), _settings(policy="h2o"), store=Store(tmp_path / f"{declines}.db"),
                          sampling=GREEDY)
        results.append(_chat(session) + [session.chat("And what did I say about the sea?")])
        sessions.append(session)
    declined = [r for r in results[0] if r.recall_declined]
    assert declined and all(not r.recalled for r in results[0])  # recall read text back, the gate took it back
    assert [r.answer for r in results[0]] == [r.answer for r in results[1]]
    assert_same_cache(*sessions)
    assert sessions[0].evicted_total == sessions[1].evicted_total
    assert torch.equal(sessions[0].log.column("token"), sessions[1].log.column("token"))


@pytest.mark.gate
@pytest.mark.parametrize("read", ["first", "back"])
@pytest.mark.parametrize("declines", [True, False])
def test_a_warning_goes_with_the_read_the_gate_keeps(tiny, monkeypatch, declines, read):
    """A warning raised by one of a message's two reads (a compression of that read: the system prompt no longer fits
    beside the window) belongs to it: the turn gives it, once, where the gate keeps that read, and not where the gate
    keeps the other. A read-back's warning was given where the gate took the read back (and again at each such read);
    the first read's was given where the read with recalled text was kept, while the session forgot it had warned."""
    if read == "first":  # ``_read_with`` is called with the first read's state, before the read-back
        owner, name = Feeding, "_read_with"
    else:
        owner, name = recall_choose, "bring_back"
    original = getattr(owner, name)

    def warning(session, *args, **kwargs):
        session.warn("probe", f"said by the {read} read")
        return original(session, *args, **kwargs)

    monkeypatch.setattr(owner, name, warning)
    monkeypatch.setattr(gate, "GAIN", float("inf") if declines else float("-inf"))
    session = Session(tiny("llama"), _settings(), sampling=GREEDY)
    results = _chat(session) + [session.chat("And what did I say about the sea?")]
    read_back = [r for r in results if r.recall_declined or r.recalled]
    assert read_back
    kept = declines == (read == "first")
    given = [r for r in results if f"said by the {read} read" in r.warnings]
    assert given == (read_back[:1] if kept else [])
    assert ("probe" in session.warned) is kept


@pytest.mark.gate
def test_the_gate_compares_the_messages_content_tokens():
    scaffolding = torch.tensor([1, 2])
    ids = torch.tensor([1, 5, 6, 2])
    assert gate.content_nll((ids, torch.tensor([-9.0, -1.0, -3.0, -9.0])), scaffolding) == pytest.approx(2.0)
    assert gate.content_nll((torch.tensor([1, 2]), torch.tensor([-1.0, -1.0])), scaffolding) is None
    assert gate.keeps(2.0, 2.0 - gate.GAIN) and not gate.keeps(2.0, 2.0 - gate.GAIN / 2)
    assert not gate.keeps(None, 1.0) and not gate.keeps(1.0, None)
