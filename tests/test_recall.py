"""Recall: evicted text comes back into the cache when a new message needs it, within the budget, at its place in
conversation order, with keys exactly the archived ones moved to their new positions; live, durable, and gone with
its conversation."""

import json

import numpy as np
import pytest
import torch

from helpers import data_file
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.storage.db import Store
from test_durability import TURNS, assert_same_cache

GREEDY = Sampling(max_new_tokens=10, temperature=0.0)
BOUNDED = ["streaming", "window", "h2o", "tova", "snapkv", "cake", "headaware"]


def _settings(**kw):
    return Settings(**{"policy": "streaming", "budget": 48, "window": 8, "slack": 6, "recall": "on",
                       "groups": "sentence", **kw})


def _chat(session, rounds=2):
    results = []
    for _ in range(rounds):
        for user, reply in TURNS:
            results.append(session.exchange(user, reply))
    return results


def _assert_archived_keys(session):
    """Every held key is the archived key rotated once from where it was computed to its slot's position."""
    original = session.settings.positions == "original"
    for li, layer in enumerate(session.cache.layers):
        for h in range(layer.heads):
            held = layer.head_view(layer.abs_pos, h).long()[None]
            assert torch.all(held[0, 1:] > held[0, :-1]), "slots are in conversation order"
            target = held if original else layer.pos_off[h] + torch.arange(held.shape[1])[None]
            keys, values, computed = session.archive.keys_values(li, held, [h])
            expected = session.model.rotary.rotate(keys, target - computed.long())
            assert torch.equal(layer.head_view(layer.keys, h), expected[0].to(layer.dtype))
            assert torch.equal(layer.head_view(layer.values, h), values[0])


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

    def recorded(sess, keep, reason, bring=None):
        guard, releasing = sess.recall_guard.clone(), sess.recall_release
        real(sess, keep, reason, bring)
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
def test_recalled_keys_are_the_archived_keys_at_their_new_positions(tiny, tmp_path, positions):
    session = Session(tiny("llama"), _settings(policy="h2o", positions=positions), store=Store(tmp_path / "k.db"),
                      sampling=GREEDY)
    _chat(session)
    res = session.chat("Tell me again about the mountains.")
    assert res.recalled_tokens > 0
    _assert_archived_keys(session)
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


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_forgetting_a_read_message_by_its_mark_equals_the_whole_checkpoint(tiny, tmp_path, monkeypatch, policy):
    """Recall reads a user message for its queries, then forgets the read before the put-back: by a ``ReadMark``
    when the message fits the free slots, else by a ``Checkpoint`` of the whole cache. Both leave the same
    session: the same cache, statistics, observer window and replies."""
    from kvchat.core.engine.checkpoint import ReadMark

    restored = []
    restore = ReadMark.restore

    def run(folder, marks):
        if marks:
            monkeypatch.setattr(ReadMark, "restore", lambda self, session: restored.append(1) or restore(self, session))
        else:
            monkeypatch.setattr(ReadMark, "capture", classmethod(lambda cls, session, tokens: None))
        # slack for a short message to fit the free slots after a compression
        session = Session(tiny("llama"), _settings(policy=policy, slack=24), store=Store(tmp_path / folder / "m.db"),
                          sampling=GREEDY)
        results = _chat(session) + [session.chat("And what did I say about the sea?")]
        monkeypatch.undo()
        return session, results

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    marked, with_marks = run("a", True)
    whole, with_checkpoints = run("b", False)
    assert restored, "some reads were forgotten by their mark"
    assert sum(r.recalled_tokens for r in with_marks) > 0
    assert [(r.recalled, r.answer) for r in with_marks] == [(r.recalled, r.answer) for r in with_checkpoints]
    assert_same_cache(marked, whole)


def test_recall_switches_live_and_undo_takes_it_back(tiny, tmp_path):
    session = Session(tiny("llama"), _settings(recall="off"), store=Store(tmp_path / "s.db"), sampling=GREEDY,
                      undo=True)
    off = _chat(session)
    assert all(r.recalled_tokens == 0 and r.recall_ms is None for r in off)
    session.configure(recall="on")
    before = session.kept_positions()
    on = session.chat("What about the sea, again?")
    assert on.recalled_tokens > 0  # the digests of turns fed with recall off are there
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


def test_deleting_a_conversation_deletes_its_recall_digests(tiny, tmp_path):
    store = Store(tmp_path / "x.db")
    session = Session(tiny("llama"), _settings(), store=store, sampling=GREEDY)
    _chat(session, rounds=1)
    folder = session.archive.folder
    assert (folder / "digest.bin").stat().st_size > 0 and session.archive.digests.covered == session.total_tokens
    session.close()
    store.delete(session.conversation_id)
    assert not folder.exists()


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


def test_digests_stand_for_a_group_by_its_content_tokens(tiny, tmp_path):
    """A group's representative keys are its largest-norm keys among its tokens that are not template scaffolding
    (role headers and end markers draw attention from any message); a group of scaffolding alone is represented by
    its own."""
    from kvchat.core.recall import digest

    session = Session(tiny("llama"), _settings(recall="off"), store=Store(tmp_path / "d.db"), sampling=GREEDY)
    _chat(session, rounds=1)
    digests, archive, rotary = session.archive.digests, session.archive, session.model.rotary
    spans, stored, _ = digests.read()
    content = ~torch.isin(session.log.column("token").long(), session.model.scaffolding_ids())
    mixed = 0
    for g, (a, b) in enumerate(spans.tolist()):
        inside = torch.arange(a, b)
        own = inside[content[a:b]] if content[a:b].any() else inside
        mixed += bool(content[a:b].any() and not content[a:b].all())
        for si, li in enumerate(digests.layers):
            for h in range(digests.layout[0]):
                keys, _, computed = archive.keys_values(li, own[None], [h])
                keys = rotary.rotate(keys.float(), -computed.long())[0]
                best = keys[keys.norm(dim=-1).topk(min(digest.REPS, own.numel())).indices].half()
                reps = torch.from_numpy(np.array(stored[g, si, h]))
                assert torch.equal(reps[: best.shape[0]], best)
    assert mixed > 0, "some groups hold a role header and content"


def test_digests_written_a_block_at_a_time_equal_those_written_at_once(tiny, tmp_path, monkeypatch):
    """A long stretch (a conversation reopened from before digests) is digested a block of whole groups at a time;
    the digests are the same."""
    files = {}
    for block in (100_000, 20):  # 20: longer than any group here, shorter than a turn
        monkeypatch.setattr("kvchat.core.recall.digest.BLOCK", block)
        session = Session(tiny("llama"), _settings(recall="off"), store=Store(tmp_path / f"{block}.db"),
                          sampling=GREEDY)
        _chat(session, rounds=1)
        folder = session.archive.folder
        files[block] = [(folder / name).read_bytes() for name in ("digest.bin", "coarse.bin", "groups.bin")]
    assert files[20] == files[100_000] and len(files[20][2]) > 8 * 4


def test_coarse_keys_kept_in_memory_follow_the_file_through_adds_and_undo(tiny, tmp_path):
    """Once recall has read the coarse keys they stay in memory (in ``COARSE_DTYPE``) and are extended as turns
    close; after an undo (the digests truncated) and more turns they still equal what coarse.bin holds."""
    from kvchat.core.recall.score import COARSE_DTYPE

    session = Session(tiny("llama"), _settings(recall="off"), store=Store(tmp_path / "c.db"), sampling=GREEDY,
                      undo=True)
    _chat(session, rounds=1)
    digests = session.archive.digests

    def on_disk():
        heads, dim = digests.layout
        raw = torch.from_numpy(np.fromfile(digests.folder / "coarse.bin", dtype=np.float16))
        return raw.view(digests.count, -1, heads, dim).permute(1, 2, 0, 3).to(COARSE_DTYPE)

    assert torch.equal(digests.read()[2], on_disk())  # loaded from the file
    session.chat("One more thing to remember: the boat is blue.")
    assert torch.equal(digests.read()[2], on_disk())  # extended in memory
    session.undo()
    session.chat("A different turn: the lake was calm and grey.")
    assert torch.equal(digests.read()[2], on_disk()) and digests.read()[2].shape[2] == digests.count


def test_group_shares_and_content_follow_the_chat_through_undo(tiny, tmp_path):
    """What ``choose`` reads per group: the share of its slots the cache holds (counted from the cache's slots)
    equals the mean over its positions of the held fraction, and whether it holds more than scaffolding (kept in
    memory between messages) equals a fresh reading of the token log, also after an undo rewrote the last turn."""
    from kvchat.core.model.template import scaffolding
    from kvchat.core.recall import choose

    session = Session(tiny("llama"), _settings(policy="h2o"), store=Store(tmp_path / "g.db"), sampling=GREEDY,
                      undo=True)
    digests = session.archive.digests
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


@pytest.mark.parametrize("policy", ["h2o", "headaware"])  # h2o: a statistic per slot; headaware: heads' own lengths
def test_put_back_slots_of_all_layers_at_once(policy, tiny):
    """``slots_of`` (every layer's heads as rows of one computation) gives each head its kept positions and the
    brought ones it lacks, in order, with its kept slots' statistics and, for a brought slot, the lower median of
    them (0 when it keeps none) — as a plain loop over heads computes them; the same per layer as alone."""
    from kvchat.core.cache.rebuild import slots_of

    session = Session(tiny("llama"), _settings(policy=policy, budget=40), system=None)
    session.feed_raw(list(range(20, 120)), score=False)
    layers = [layer for layer in session.cache.layers if layer.is_initialized]
    gen = torch.Generator().manual_seed(0)
    for case in range(4):
        pairs = []
        for li, layer in enumerate(layers):
            index = []
            for h in range(layer.heads):
                n = layer.lens[h]
                size = n // 2 if case == 0 else int(torch.randint(n // 3, n + 1, (1,), generator=gen))
                if case == 3 and h == 0 and li == 1:
                    size = 0  # a head that keeps nothing of its own
                index.append(torch.randperm(n, generator=gen)[:size].sort().values)
            pairs.append((layer, index))
        held = layers[0].positions()[0]
        bring = None if case == 1 else torch.cat([held[held >= 0][::5], torch.arange(200, 206)]).unique()
        batched = slots_of(pairs, bring)
        for (layer, index), got in zip(pairs, batched):
            alone = slots_of([(layer, index)], bring)[0]
            assert got.lens == alone.lens and torch.equal(got.held, alone.held)
            for h, idx in enumerate(index):
                pos = layer.head_view(layer.abs_pos, h)[idx].long().tolist()
                stat = {name: layer.head_view(t, h)[idx].tolist() for name, t in layer.stats.items()}
                want = sorted(set(pos) | set(bring.tolist() if bring is not None else []))
                n = got.lens[h]
                assert n == len(want) and got.held[h, :n].tolist() == want
                for name, values in stat.items():
                    fill = sorted(values)[(len(values) - 1) // 2] if values else 0.0
                    expect = [values[pos.index(p)] if p in pos else fill for p in want]
                    assert got.stats[name][h, :n].tolist() == pytest.approx(expect, abs=0, rel=0)
                    assert torch.equal(got.stats[name][h, :n], alone.stats[name][h, :n])
            assert policy != "h2o" or "acc" in got.stats
