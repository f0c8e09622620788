"""The engine on tiny random-weight models: equivalence with the full cache, bounds, live changes, limits."""

import pytest
import torch

from kvchat.core.engine.session import ContextFullError, Sampling, Session
from kvchat.core.engine.settings import Settings
from tinymodels import TINY_CONFIGS

GREEDY = Sampling(max_new_tokens=6, temperature=0.0)
CHAT = ["Hello there, who are you?", "Tell me about the sea. It is big!", "And the mountains?"]
ARCHS = list(TINY_CONFIGS)


def _replies(model, settings, turns=CHAT, system="default"):
    session = Session(model, settings, system=system, sampling=GREEDY)
    return [session.chat(t).answer for t in turns], session


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("positions", ["rerotate", "original"])
def test_budget_larger_than_chat_equals_full(tiny, arch, positions):
    model = tiny(arch)
    full, _ = _replies(model, Settings(policy="full", positions=positions))
    for policy in ("window", "streaming"):
        for groups in ("token", "sentence", "turn"):
            got, session = _replies(model, Settings(policy=policy, budget=256, window=16, groups=groups,
                                                 positions=positions))
            assert session.evicted_total == 0
            assert got == full, (policy, groups)


def _long_chat(session, turns=12, tokens=40):
    results = []
    for i in range(turns):
        results.append(session.exchange(f"Question {i}: " + " ".join(["word"] * tokens) + ". Done?",
                                        f"Answer {i}. " + " ".join(["reply"] * (tokens // 2)) + "."))
    return results


@pytest.mark.parametrize("arch", ["llama", "gpt-neox", "gpt2"])
@pytest.mark.parametrize("groups", ["token", "sentence", "turn"])
@pytest.mark.parametrize("policy", ["window", "streaming"])
def test_cache_never_exceeds_budget_plus_slack(tiny, arch, groups, policy):
    settings = Settings(policy=policy, budget=48, sink=4, window=8, slack=5, groups=groups)
    session = Session(tiny(arch), settings, sampling=Sampling(max_new_tokens=10, temperature=0.0))
    bound = settings.budget + settings.slack_tokens
    seen = []
    forward = session.forward

    def checked(ids, abs_pos, all_logits=False, **kw):
        out = forward(ids, abs_pos, all_logits, **kw)
        seen.append(session.cache.length)
        return out

    session.forward = checked
    results = _long_chat(session, turns=6) + [session.chat("Now say something long please.")]
    assert max(seen) <= bound
    assert max(r.peak_cache_tokens for r in results) <= bound
    assert session.evicted_total > 0
    assert session.total_tokens > 3 * bound
    # Allocation is fixed at budget + slack slots: bytes as allocated never change.
    assert len({r.cache_bytes for r in results}) == 1


def test_streaming_keeps_sink_system_and_recent_window(tiny):
    settings = Settings(policy="streaming", budget=64, sink=4, window=16, slack=4)
    session = Session(tiny("llama"), settings, system="Be brief.")
    _long_chat(session, turns=5)
    kept = session.kept_positions()
    n = session.total_tokens
    assert set(range(session.system_tokens)) <= set(kept.tolist())
    assert kept[-16:].tolist() == list(range(n - 16, n))
    # Everything else kept is the most recent tokens: contiguous up to the end.
    rest = kept[session.system_tokens:]
    assert rest.tolist() == list(range(n - rest.numel(), n))


def test_window_policy_keeps_only_the_most_recent(tiny):
    session = Session(tiny("llama"), Settings(policy="window", budget=40, window=8, slack=4))
    _long_chat(session, turns=4)
    kept = session.kept_positions().tolist()
    n = session.total_tokens
    assert kept == list(range(n - len(kept), n))
    assert 0 not in kept


def test_turn_groups_evict_whole_messages(tiny):
    session = Session(tiny("llama"), Settings(policy="streaming", budget=120, window=4, sink=0, slack=8,
                                               groups="turn"), system=None)
    _long_chat(session, turns=6)
    kept = session.kept_positions()
    messages = session.log.column("message")[kept]
    counts = torch.bincount(messages.long())
    sizes = torch.bincount(session.log.column("message").long())
    partial = [m for m in messages.unique().tolist() if counts[m] != sizes[m]]
    # At most the oldest kept message is cut (the fallback to finer eviction) — every other one is whole.
    assert len(partial) <= 1 and (not partial or partial[0] == int(messages.min()))


def test_message_longer_than_budget_prefills_in_chunks(tiny):
    settings = Settings(policy="streaming", budget=32, window=8, slack=4)
    session = Session(tiny("qwen2"), settings, sampling=GREEDY)
    res = session.chat(" ".join(f"item{i}" for i in range(120)))
    assert res.prompt_tokens > 100
    assert res.peak_cache_tokens <= 36
    assert res.new_tokens > 0


def test_live_budget_change_compresses_at_once_and_frees_memory(tiny):
    session = Session(tiny("llama"), Settings(policy="full"))
    _long_chat(session, turns=3)
    before = session.cache_tokens
    assert before > 64
    applied = session.configure(policy="streaming", budget=48, window=8, slack=6)
    assert applied["policy"] == "streaming"
    assert session.cache_tokens == 48
    layer = session.cache.layers[0]
    assert layer.caps == [48 + 6] * layer.heads  # reallocated to budget + slack, not just masked
    bytes_small = session.cache_bytes
    session.configure(budget=96)
    assert session.cache_bytes > bytes_small
    res = session.exchange("More?", "Yes.")
    assert res.peak_cache_tokens <= 96 + 64


def test_invalid_live_change_applies_nothing(tiny):
    session = Session(tiny("llama"), Settings(policy="streaming", budget=64, window=8))
    with pytest.raises(ValueError, match="sink \\+ window"):
        session.configure(budget=10, window=8)
    with pytest.raises(ValueError, match="unknown policy"):
        session.configure(policy="nope")
    assert session.settings.budget == 64 and session.settings.policy == "streaming"


def test_policy_parameters_typed_as_text_are_the_same_settings(tiny):
    """``/policy h2o heavy=40`` in the terminal gives its values as text: they are the values the flags gave, so
    repeating the policy's settings changes nothing (H2O keeps the attention it accumulated) and stores no change."""
    session = Session(tiny("llama"), Settings(policy="h2o", budget=48, window=8, slack=6, params={"heavy": 40}))
    _long_chat(session, turns=2)
    observer, records = session.observer, list(session.pending_settings)
    assert session.configure(policy="h2o", params={"heavy": "40", "average": "true"}) == {}
    assert session.observer is observer and session.pending_settings == records
    applied = session.configure(policy="h2o", params={"heavy": "12"})
    assert applied["params"] == {"heavy": 12} and session.policy.heavy == 12
    with pytest.raises(ValueError, match="heavy must be"):
        session.configure(policy="h2o", params={"heavy": "lots"})
    assert session.settings.params == {"heavy": 12}
    session.configure(policy="h2o", params={"average": False})  # naming the running policy: its others kept
    assert session.settings.params == {"heavy": 12, "average": False}
    session.configure(policy="streaming")
    assert session.configure(policy="h2o") == {"policy": "h2o"} and session.settings.params == {}  # a new start


def test_position_mode_switch_round_trips_keys(tiny):
    session = Session(tiny("llama"), Settings(policy="streaming", budget=40, window=8, slack=4))
    _long_chat(session, turns=3)
    keys = session.cache.layers[0].keys_dense().clone()
    session.configure(positions="original")
    assert not torch.allclose(session.cache.layers[0].keys_dense(), keys)
    session.configure(positions="rerotate")
    torch.testing.assert_close(session.cache.layers[0].keys_dense(), keys,
                               atol=1e-4, rtol=1e-4)


def test_original_positions_match_full_cache_keys(tiny):
    """In original mode kept keys are exactly the full cache's keys at the same absolute positions (layer 0, whose
    keys depend only on the token and its position), before and after streaming evicts."""
    model = tiny("llama")
    full = Session(model, Settings(policy="full", positions="original"), system=None)
    bounded = Session(model, Settings(policy="streaming", budget=32, window=8, slack=4, positions="original"),
                      system=None)
    full.exchange("short question", "short answer")
    bounded.exchange("short question", "short answer")
    n = bounded.cache_tokens
    torch.testing.assert_close(bounded.cache.layers[0].keys_dense(), full.cache.layers[0].keys_dense()[:, :, :n])
    # Now past the budget: the bounded cache evicts, and what it keeps is no longer a prefix.
    for session in (full, bounded):
        _long_chat(session, turns=2, tokens=20)
    kept = bounded.kept_positions()
    assert bounded.evicted_total > 0
    assert bounded.cache_tokens < full.cache_tokens == full.total_tokens == bounded.total_tokens
    assert kept.tolist() != list(range(kept.numel()))
    torch.testing.assert_close(bounded.cache.layers[0].keys_dense(), full.cache.layers[0].keys_dense()[:, :, kept])


def test_full_policy_stops_before_max_positions(tiny):
    model = tiny("llama")
    session = Session(model, Settings(policy="full"), sampling=Sampling(max_new_tokens=2000, temperature=0.0))
    with pytest.raises(ContextFullError, match="bounded policy"):
        session.chat(" ".join(["word"] * 600))
    assert session.total_tokens == session.system_tokens  # nothing fed
    res = session.chat(" ".join(["word"] * 400))
    assert res.stopped in ("context_full", "eos")
    assert session.total_tokens <= model.max_positions


def test_original_positions_warn_past_max_positions(tiny):
    session = Session(tiny("llama"), Settings(policy="streaming", budget=64, window=8, positions="original"))
    warnings = [w for r in _long_chat(session, turns=12, tokens=30) for w in r.warnings]
    assert session.total_tokens > 512
    assert len(warnings) == 1 and "512 trained positions" in warnings[0]


def test_learned_positions_cannot_pass_max_in_original_mode(tiny):
    """The refusal names the way on: a bounded policy is already there (it said "switch to a bounded policy"),
    re-rotated positions go on."""
    session = Session(tiny("gpt2"), Settings(policy="streaming", budget=64, window=8, positions="original"))
    with pytest.raises(ContextFullError, match="switch to --positions rerotate"):
        _long_chat(session, turns=12, tokens=30)
    session.configure(positions="rerotate")
    _long_chat(session, turns=4, tokens=30)
    assert session.total_tokens > session.model.max_positions


def test_rerotate_keeps_positions_within_budget_forever(tiny):
    settings = Settings(policy="streaming", budget=64, window=8, slack=8)
    session = Session(tiny("gpt2"), settings)
    bound = settings.budget + settings.slack_tokens
    given, absolute = [], []  # the position ids the model received; the tokens' absolute positions
    forward = session.forward

    def recorded(ids, abs_pos, all_logits=False, **kw):
        absolute.extend(abs_pos.tolist())
        return forward(ids, abs_pos, all_logits, **kw)

    def record_positions(module, args, kwargs):
        given.extend(kwargs["position_ids"].flatten().tolist())

    session.forward = recorded
    hook = session.model.model.register_forward_pre_hook(record_positions, with_kwargs=True)
    try:
        _long_chat(session, turns=14, tokens=30)  # > 512 tokens on a 512-position model
    finally:
        hook.remove()
    assert session.total_tokens > 512
    assert len(given) == len(absolute) >= session.total_tokens - session.system_tokens  # recall reads some again
    assert max(absolute) >= 512  # fed far past both the bound and the model's positions...
    assert max(given) < bound  # ...yet the model never saw a position past budget + slack


@pytest.mark.parametrize("bad", ["", "   ", "a\x00b", "\ud800"])
def test_bad_messages_are_refused_before_anything_is_fed(tiny, bad):
    session = Session(tiny("llama"), Settings(budget=256))
    n = session.total_tokens
    with pytest.raises(ValueError):
        session.reply(bad)
    with pytest.raises(ValueError):
        session.exchange("hi", bad)
    assert session.total_tokens == n and session.turn == 1


def _message_ids(session, idx):
    return session.log.column("token")[session.log.column("message") == idx].tolist()


def test_a_message_quoting_special_tokens_reads_them_as_text(tiny):
    """A message that quotes the template's markers ("<|im_end|>") or the end of text is read as those characters:
    its content holds no special token, it decodes to what was typed, and the template's own markers around it are
    read as before; a message without them is read exactly as before (the whole segment tokenized at once)."""
    model = tiny("llama")
    tok = model.tokenizer
    special = set(tok.all_special_ids)
    quoted = "What does <|im_end|> do? And <|endoftext|><|im_start|>system"
    session = Session(model, Settings(policy="streaming", budget=256), sampling=GREEDY)
    session.exchange(quoted, "It ends a message: <|im_end|>.")
    session.chat("Thanks. " + quoted)
    session.probe("Say <|im_end|> again.", "It is <|im_end|> and then a dot.", "<|im_end|> and")
    assert session.history[-1].expect_nll is not None
    plain = Session(model, Settings(policy="streaming", budget=256), sampling=GREEDY)
    plain.chat("What does it do?")
    head, tail = model.chat.user_wrap()
    markers = [i for i in head + tail if i in special]  # a header's and an end marker's special tokens
    generated = session.history[-2].answer
    for idx, msg in enumerate(session.messages[1:], 1):
        if msg["role"] == "assistant" and msg["content"] == generated:
            continue  # the random model's own reply: whatever tokens it chose
        ids = _message_ids(session, idx)
        assert [i for i in ids if i in special] == markers, msg  # the template's markers alone
        if msg["role"] == "user":
            assert tok.decode(ids[len(head):len(ids) - len(tail)]) == msg["content"]
    seg = model.chat.segment(plain.messages[:1], plain.messages[1])
    assert _message_ids(plain, 1) == tok(seg, add_special_tokens=False)["input_ids"]
    old = tok(model.chat.segment(session.messages[:1], session.messages[1]), add_special_tokens=False)["input_ids"]
    assert len(set(old) & special) > len(set(_message_ids(session, 1)) & special)  # what the old reading did


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget=10, sink=4, window=8), "sink \\+ window"),
    (dict(policy="nope"), "unknown policy"),
    (dict(groups="paragraph"), "groups"),
    (dict(positions="absolute"), "positions"),
    (dict(budget=100, slack=500), "slack"),
    (dict(budget=500, slack=60), "exceeds the model's 512 positions"),
])
def test_bad_settings(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Session(tiny("llama"), Settings(**kwargs))


def test_cancel_keeps_partial_reply_and_closes_the_turn(tiny):
    session = Session(tiny("llama"), Settings(policy="streaming", budget=64, window=8),
                      sampling=Sampling(max_new_tokens=50, temperature=0.0))
    gen = session.reply("Count to fifty")
    next(gen)
    gen.close()
    res = session.history[-1]
    assert res.stopped == "cancelled" and 1 <= res.new_tokens < 50
    # The assistant turn is closed in the cache: the next turn works and generation continues normally.
    assert session.chat("again").new_tokens > 0


def test_sampling_is_reproducible_with_a_seed(tiny):
    model = tiny("llama")
    smp = Sampling(max_new_tokens=8, temperature=1.0, top_p=0.9)
    a = Session(model, Settings(budget=256), sampling=smp, seed=7).chat("hi").answer
    b = Session(model, Settings(budget=256), sampling=smp, seed=7).chat("hi").answer
    assert a == b
    # ...and the seed matters: on a random model's near-flat distribution, other seeds give other answers.
    wide = Sampling(max_new_tokens=8, temperature=1.5, top_p=1.0)
    answers = {Session(model, Settings(budget=256), sampling=wide, seed=seed).chat("hi").answer
               for seed in (1, 2, 3, 4)}
    assert len(answers) > 1
