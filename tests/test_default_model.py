"""The real default model (SmolLM2-135M-Instruct): equivalence, recall through the cache, bounded endless chat."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings

from helpers import data_file

pytestmark = pytest.mark.model

GREEDY = Sampling(max_new_tokens=24, temperature=0.0)
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.", "Why is the sky blue?"]


def _replies(model, settings):
    session = Session(model, settings, sampling=GREEDY)
    return [session.chat(q).answer for q in QUESTIONS], session


@pytest.mark.parametrize("positions", ["rerotate", "original"])
def test_budget_larger_than_chat_gives_full_cache_replies(smol, positions):
    full, _ = _replies(smol, Settings(policy="full", positions=positions))
    assert "Paris" in full[0]
    for policy, groups in [("streaming", "token"), ("streaming", "sentence"), ("window", "turn")]:
        got, session = _replies(smol, Settings(policy=policy, budget=2048, groups=groups, positions=positions))
        assert session.evicted_total == 0
        assert got == full, (policy, groups)


def _filler(n):
    convs = json.loads(data_file("fastchat", "dummy_conversation.json").read_text())
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in convs
             if len(c["conversations"]) >= 2 and c["conversations"][0]["from"] == "human"]
    return pairs[:n]


def _fact_then_probe(model, settings):
    session = Session(model, settings, sampling=GREEDY)
    session.exchange("Please remember this: my locker code is 4417.", "Got it. Your locker code is 4417.")
    for pair in _filler(40):
        if session.total_tokens >= 400:
            break
        session.exchange(*pair)
    return session, session.probe("What is my locker code?", "Your locker code is 4417.", "4417")


def test_probe_measures_what_the_cache_still_holds(smol):
    """With the fact in the cache its tokens are predicted (NLL ~0.07, measured); once streaming has slid past
    it they are not (NLL ~2.8) with recall off, and with recall on (the default) the question brings the fact's
    sentence back and they are again."""
    full, with_fact = _fact_then_probe(smol, Settings(policy="full"))
    assert with_fact.hit and with_fact.expect_nll < 0.5
    small = Settings(policy="streaming", budget=128, window=32, slack=16, recall="off")
    session, without = _fact_then_probe(smol, small)
    assert session.total_tokens > 3 * small.capacity
    assert not without.hit and without.expect_nll > 1.5
    session, recalled = _fact_then_probe(smol, replace(small, recall="on"))
    ids = session.log.column("token")
    assert any("4417" in smol.tokenizer.decode(ids[a:b].tolist()) for a, b in recalled.recalled), recalled.recalled
    assert recalled.hit and recalled.expect_nll < 1.0


def test_endless_chat_stays_bounded_and_positions_stay_small(smol):
    settings = Settings(policy="streaming", budget=96, window=24, slack=12, groups="sentence")
    session = Session(smol, settings, sampling=Sampling(max_new_tokens=12, temperature=0.0))
    positions = []  # the largest position each read or step computed its keys at (what the model saw)
    forward = session.forward

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        positions.append(int(session.cache.incoming_pos.max()))
        return out

    session.forward = spy
    try:
        turns = [json.loads(line)["turns"][0] for line in data_file("streaming-llm", "mt_bench.jsonl")
                 .read_text().splitlines()[:12]]
        results = [session.chat(q) for q in turns]
    finally:
        del session.forward
    assert session.total_tokens > 4 * settings.capacity
    assert max(r.peak_cache_tokens for r in results) <= settings.capacity
    assert max(positions) < settings.capacity
    assert all(r.new_tokens > 0 for r in results)


def _chat_a_while(session):
    for q in ["My locker code is 4417. Remember it.", "Tell me a short story about a dragon.",
              "What is the capital of France?"]:
        session.chat(q)


def test_headaware_gives_heads_their_own_allocations(smol, tmp_path):
    from kvchat.storage.db import Store

    # With the seed's tau_local = 0.8 no head of this model is local (the largest local mass measured is ~0.75),
    # so every head would be "retrieval" and budgets uniform; 0.4 makes local heads appear.
    settings = Settings(policy="headaware", params={"tau_local": 0.4}, budget=96, window=16, slack=16)
    store = Store(tmp_path / "kv.db")
    session = Session(smol, settings, store=store, sampling=Sampling(max_new_tokens=24, temperature=0.0))
    _chat_a_while(session)
    layers = session.cache.layers
    assert any(not layer.uniform for layer in layers)  # heads of one layer hold different numbers of positions
    heads = layers[0].heads
    assert sum(sum(layer.caps) for layer in layers) <= smol.num_layers * heads * (96 + 16)
    stats = session.stats()
    classes = {c for layer in stats["head_classes"] for c in layer}
    assert len(classes) >= 2 and stats["memory_bound_bytes"] > 0
    # Ragged heads reopen exactly as the last turn left them.
    resumed = Session.resume(smol, store, session.conversation_id, sampling=session.sampling)
    assert resumed.restored_from == "archive"
    for a, b in zip(resumed.cache.layers, layers):
        assert a.caps == b.caps and a.lens == b.lens and torch.equal(a.keys_dense(), b.keys_dense())
    assert resumed.chat("And my locker code?").answer == session.chat("And my locker code?").answer


def test_two_commands_started_at_once_on_a_fresh_machine_both_convert_the_default_model(default_dir, tmp_path):
    """Two kvchat commands started together where the default model was never converted (a fresh $KVCHAT_HOME) both
    convert it; the one that finishes second uses the first's folder instead of failing on it (it exited 2 with
    "Directory not empty"), and neither leaves its half of the work behind."""
    env = dict(os.environ, KVCHAT_HOME=str(tmp_path))
    code = "from kvchat.core.model.loading import default_model_dir as d; print(d())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-500:] for _, err in outs]
    target = tmp_path / "models" / default_dir.name
    assert [out.strip() for out, _ in outs] == [str(target)] * 2
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no .convert-* folder left
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
