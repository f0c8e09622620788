"""Policies that read attention: equivalence, hand-made attention patterns, memory really freed, ragged heads."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvchat.core.cache import observe
from kvchat.core.cache.attention import causal_mask, kvchat_attention
from kvchat.core.cache.kvcache import KVCache, RaggedKV
from kvchat.core.cache.groups import select_keep
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.policies import LayerView, make_policy
from kvchat.policies.base import split_budget
from kvchat.storage.db import Store

ATTENTION_POLICIES = ["h2o", "tova", "snapkv", "cake", "headaware"]
GREEDY = Sampling(max_new_tokens=6, temperature=0.0)
CHAT = ["Hello there, who are you?", "Tell me about the sea. It is big!", "And the mountains?"]


def _view(window=None, acc=None, n=None, heads=1, layer=0, fed=None):
    n = n or (window.shape[-1] if window is not None else acc.shape[-1])
    positions = torch.arange(n).expand(heads, n)
    return LayerView(layer, positions, torch.ones(heads, n, dtype=torch.bool), torch.zeros(1, heads, n, 4),
                     acc=acc, window=window, fed=fed if fed is not None else n)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt-neox", "gpt2"])
@pytest.mark.parametrize("positions", ["rerotate", "original"])
def test_budget_larger_than_chat_equals_full(tiny, arch, positions):
    model = tiny(arch)
    full = Session(model, Settings(policy="full", positions=positions), sampling=GREEDY)
    want = [full.chat(t).answer for t in CHAT]
    for policy in ATTENTION_POLICIES:
        session = Session(model, Settings(policy=policy, budget=256, window=16, positions=positions), sampling=GREEDY)
        assert [session.chat(t).answer for t in CHAT] == want, policy
        assert session.evicted_total == 0


@pytest.mark.parametrize("policy", ["cake", "headaware"])
def test_a_settings_change_that_keeps_the_policy_keeps_what_it_learned(tiny, policy):
    """A change of budget, groups, slack or recall keeps the running policy and what it learned: headaware's head
    budgets (a running mean over every compression) and CAKE's layer budgets (the web UI's chart, /stats), which an
    undo keeps too. Every change made a new policy before: headaware's mean started again, CAKE's budgets were gone
    until the next compression. Other parameters are another policy, which starts afresh."""
    session = Session(tiny("llama"), Settings(policy=policy, budget=40, window=8, slack=6), sampling=GREEDY, undo=True)
    for i in range(3):
        session.exchange(f"Question {i}: " + "word " * 30 + "?", f"Answer {i}. " + "reply " * 12)
    learned, running = session.policy.get_state(), session.policy
    assert learned["budgets"] and session.policy.report() != make_policy(policy).report()
    session.configure(groups="sentence", slack=10, recall="off", budget=60)  # a larger budget compresses nothing
    assert session.policy is running and session.policy.get_state() == learned
    evicted = session.evicted_total
    session.chat("Hello?")
    assert session.evicted_total == evicted  # nothing compressed: what the policy holds is still what it learned
    session.undo()
    assert session.policy.get_state() == learned
    session.configure(params={"obs_window": 16})
    assert session.policy.get_state() == make_policy(policy, obs_window=16).get_state()


@pytest.mark.parametrize("policy", ["snapkv", "tova", "cake", "headaware"])
@pytest.mark.parametrize("positions", ["rerotate", "original"])
def test_a_switch_that_compresses_at_once_chooses_by_attention(tiny, tmp_path, policy, positions):
    """Switched in from ``full`` over a cache past the new budget, a policy that reads its observation window first
    reads the cache's newest tokens again to observe them, then compresses: its window holds what it would have held
    had it run all along (the same chat under it at a budget larger than the chat, then the same budget), and it
    chooses by that, where an empty window kept the newest tokens alone. The read leaves the cache as it was, bit for
    bit (rows on disk included: reopening restores that cache exactly)."""
    model = tiny("llama")
    chat = [(f"Question {i}: " + "word " * (20 + 5 * i) + "?", f"Answer {i}. " + "reply " * (8 + i)) for i in range(4)]
    ran, switched = (Session(model, Settings(policy=p, budget=400, window=8, slack=6, positions=positions),
                             store=Store(tmp_path / f"{p}.db"), sampling=GREEDY) for p in (policy, "full"))
    for session in (ran, switched):
        for message, answer in chat:
            session.exchange(message, answer)
    assert not switched.observer and ran.observer.observed
    window = ran.observer.mark()

    ran.configure(budget=40)
    switched.configure(policy=policy, budget=40)
    assert switched.evicted_total == ran.evicted_total > 0
    read = switched.observer.mark()  # the newest tokens' queries, as the policy would have observed them
    assert read[0].keys() == window[0].keys() and read[2] == window[2]
    for li in window[0]:
        assert torch.equal(read[1][li], window[1][li]) and torch.allclose(read[0][li], window[0][li], atol=1e-4)
    # so it chooses as it would have (the read's queries differ from the observed ones in the last bits, which can
    # turn a near tie between two slots the other way), not the newest tokens past the system prompt alone
    assert [a.lens for a in ran.cache.layers] == [b.lens for b in switched.cache.layers]
    n, system = switched.log.n, switched.system_tokens
    chosen = [[p for p in head.tolist() if p >= system]
              for layer in switched.cache.layers for head in layer.positions()]
    assert any(c != list(range(n - len(c), n)) for c in chosen)
    report = switched.policy.report()
    if policy in ("cake", "headaware"):
        key = "layer_budgets" if policy == "cake" else "head_classes"
        assert report[key] == ran.policy.report()[key] and report[key]

    # The read alone: every per-slot tensor (rows on disk, statistics) and length as before it
    twin = Session(model, Settings(policy="full", positions=positions), store=Store(tmp_path / "twin.db"),
                   sampling=GREEDY)
    for message, answer in chat:
        twin.exchange(message, answer)
    before = [({name: t.clone() for name, t in layer.per_slot().items()}, list(layer.lens))
              for layer in twin.cache.layers]
    twin.settings, twin.policy = twin.settings.changed(policy=policy, budget=40), make_policy(policy)
    twin.observer = twin.make_observer(twin.policy)
    twin.observe_newest()
    assert twin.observer.observed
    for layer, (tensors, lens) in zip(twin.cache.layers, before):
        assert layer.lens == lens
        for name, t in tensors.items():
            assert torch.equal(layer.per_slot()[name], t), name
    assert any((tensors["rows"] >= 0).any() for tensors, _ in before)  # rows on disk to put back


@pytest.mark.parametrize("policy", ["h2o", "headaware"])
def test_a_policy_that_counts_attention_switched_in_counts_it_from_the_newest_tokens(tiny, policy):
    """Switched in over a policy that counted no attention, h2o (and headaware's retrieval heads) count it afresh: the
    cache's newest ``ACC_SEED`` tokens are read again, and every slot holds the attention their queries gave it, as a
    session that ran the policy all along gained from them, counted from there (``since``): an average divides by the
    queries counted, not by the slot's age. What an earlier run of it counted is dropped; a change of its parameters
    keeps what it counted. At a smaller budget it then chooses by that, not the newest tokens alone."""
    from kvchat.core.cache.compress import layer_view
    from kvchat.core.engine.feeding import ACC_SEED

    model, ids = tiny("llama"), list(range(20, 220))
    cut = len(ids) - ACC_SEED
    ran = Session(model, Settings(policy=policy, budget=400), system=None)
    ran.feed_raw(ids[:cut], score=False)
    counted = [layer.padded(layer.stats["acc"]).clone() for layer in ran.cache.layers]
    ran.feed_raw(ids[cut:], score=False)
    again = Session(model, Settings(policy=policy, budget=400), system=None)  # counted before, then a pause
    again.feed_raw(ids, score=False)
    again.configure(policy="streaming")
    again.configure(policy=policy)
    switched = Session(model, Settings(policy="full"), system=None)
    switched.feed_raw(ids, score=False)
    switched.configure(policy=policy, budget=400)
    assert switched.evicted_total == 0
    for a, b, c, before in zip(ran.cache.layers, switched.cache.layers, again.cache.layers, counted):
        gained = a.padded(a.stats["acc"]) - F.pad(before, (0, ACC_SEED))
        assert torch.allclose(b.padded(b.stats["acc"]), gained, atol=1e-5)
        assert torch.equal(c.padded(c.stats["acc"]), b.padded(b.stats["acc"]))
        assert (b.padded(b.stats["since"]) == cut).all() and not a.stats["since"].any()  # ran: from each position
    view = layer_view(switched, 0, switched.cache.layers[0], switched.cache.layers[0].valid(), None, len(ids))
    assert torch.equal(view.seen, (len(ids) - view.positions).clamp(max=ACC_SEED))
    acc = [layer.stats["acc"].clone() for layer in ran.cache.layers]
    ran.configure(params={"heavy": 8} if policy == "h2o" else {"alpha_r": 2.0})
    assert all(torch.equal(layer.stats["acc"], a) for layer, a in zip(ran.cache.layers, acc))

    small = Session(model, Settings(policy="full"), system=None)
    small.feed_raw(ids, score=False)
    small.configure(policy=policy, budget=60, window=8, slack=6)
    chosen = [[p for p in head.tolist() if p >= small.settings.sink] for layer in small.cache.layers
              for head in layer.positions()]
    assert small.evicted_total > 0 and any(c != list(range(len(ids) - len(c), len(ids))) for c in chosen)


def test_a_policy_switched_in_goes_on_from_the_window_observed(tiny):
    """A switch to a policy that reads its window, even one that compresses nothing at once, fills the window then:
    its first compression (often before the next message is read, to make room for it) chooses by attention. From
    a policy that observed a window, the window goes over as it was (its newest rows, as many as the new one holds);
    from one that did not, the cache's newest tokens are read again, as they were observed under the policy."""
    model, settings = tiny("llama"), Settings(policy="cake", budget=60, window=8, slack=6)
    sessions = {p: Session(model, settings.changed(policy=p), sampling=GREEDY) for p in ("cake", "streaming")}
    for session in sessions.values():
        for i in range(4):
            session.exchange(f"Question {i}: " + "word " * 30 + "?", f"Answer {i}. " + "reply " * 12)
    cake, evicted = sessions["cake"].observer.mark(), sessions["cake"].evicted_total
    sessions["cake"].configure(policy="snapkv", params={"obs_window": 16})
    assert sessions["cake"].evicted_total == evicted  # nothing compressed at the switch
    taken = sessions["cake"].observer.mark()
    for li in cake[0]:
        assert torch.equal(taken[0][li], cake[0][li][-16:]) and torch.equal(taken[1][li], cake[1][li][-16:])
    streaming = sessions["streaming"]
    streaming.configure(policy="snapkv")  # every head holds the newest tokens alike: the window's 32 are read again
    queries, qpos, count, _ = streaming.observer.mark()
    n = streaming.cache.length
    assert count == {li: 32 for li in range(len(streaming.cache.layers))}
    assert all(torch.equal(q, torch.arange(n - 32, n, dtype=torch.float32)) for q in qpos.values())


@pytest.mark.parametrize("policy", ["tova", "snapkv"])
def test_a_switch_while_a_reply_streams_leaves_the_reply_as_it_was(tiny, policy):
    """The window filled mid-reply by reading the newest tokens again (tova's one through the decode step, snapkv's
    32 in one forward) changes nothing the reply reads: at a budget above the chat, its greedy tokens and the cache
    are those of the same reply without the switch."""
    model, sampling = tiny("llama"), Sampling(max_new_tokens=24, temperature=0.0)
    sessions = [Session(model, Settings(policy="streaming", budget=400), sampling=sampling) for _ in range(2)]
    for session in sessions:
        session.exchange("Question: " + "word " * 30 + "?", "Answer. " + "reply " * 12)
    plain = sessions[0].chat("And then?")
    stream = sessions[1].reply("And then?")
    next(stream)
    next(stream)
    assert sessions[1]._streaming is not None
    sessions[1].configure(policy=policy)
    assert sessions[1].observer.observed
    for _ in stream:
        pass
    switched = sessions[1].history[-1]
    assert switched.answer == plain.answer and switched.new_tokens == plain.new_tokens == 24
    for a, b in zip(sessions[0].cache.layers, sessions[1].cache.layers):
        assert torch.equal(a.padded(a.keys), b.padded(b.keys)) and torch.equal(a.padded(a.values), b.padded(b.values))


@pytest.mark.parametrize("policy", ATTENTION_POLICIES)
@pytest.mark.parametrize("groups", ["token", "sentence"])
def test_bounded_and_compressing(tiny, policy, groups):
    settings = Settings(policy=policy, budget=40, window=8, slack=6, groups=groups)
    session = Session(tiny("llama"), settings, sampling=Sampling(max_new_tokens=8, temperature=0.0))
    for i in range(6):
        session.exchange(f"Question {i}: " + "word " * 30 + "?", f"Answer {i}. " + "reply " * 12)
        res = session.chat("And?")
        assert res.peak_cache_tokens <= 46
    assert session.evicted_total > 0
    layers = session.cache.layers
    # cake moves budget between layers (a layer may hold more than the uniform 40 + 6 per head, another less), so
    # each layer is held to its own allocation and the layers together to the uniform total; the others per layer.
    budgets = session.policy.report()["layer_budgets"] if policy == "cake" else [40] * len(layers)
    assert len(budgets) == len(layers) and sum(budgets) == 40 * len(layers)
    for layer, budget in zip(layers, budgets):
        assert sum(layer.lens) <= layer.heads * (budget + 6)
        assert all(n <= c for n, c in zip(layer.lens, layer.caps))
    assert sum(sum(layer.lens) for layer in layers) <= sum(layer.heads for layer in layers) * 46
    stats = session.stats()  # /stats and the web UI's info line: the average, as the turns and charts say
    assert stats["cache_tokens"] == session.cache_tokens <= stats["capacity"] == 46
    assert stats["fullest_head_tokens"] == session.cache.length >= stats["cache_tokens"]


def test_h2o_keeps_an_old_token_every_query_attends_to():
    acc = torch.ones(1, 20)
    acc[0, 2] = 50.0  # old, but every query attended to it
    view = _view(acc=acc, fed=20)
    policy = make_policy("h2o")
    keep = select_keep(policy.score(view), 6, torch.zeros(1, 20, dtype=torch.bool))
    assert 2 in keep[0].tolist()
    heavy = make_policy("h2o", heavy=1)
    keep = select_keep(heavy.score(view), 6, torch.zeros(1, 20, dtype=torch.bool))
    assert keep[0].tolist() == [2, 15, 16, 17, 18, 19]  # the heavy hitter, then the most recent


@pytest.mark.parametrize("average", [True, False])
def test_h2o_judges_a_slot_counted_only_lately_by_the_attention_counted(average):
    """A slot whose attention began to count after its position (recall read it again, or h2o was switched in):
    averaged over the queries counted, or summed at that rate over its whole time, never ranked low for the time
    nothing counted it. Slot 2 drew 0.5 a query over the last 5 queries; slot 10, 0.2 over its 10."""
    acc, since = torch.full((1, 20), 0.1), torch.zeros(1, 20, dtype=torch.long)
    acc[0, 2], since[0, 2], acc[0, 10] = 2.5, 15, 2.0
    view = _view(acc=acc, fed=20)
    view.since = since
    policy = make_policy("h2o", average=average)
    scores = policy.score(view)
    assert math.isclose(float(scores[0, 2]), 0.5 if average else 0.5 * 18, rel_tol=1e-6)
    assert math.isclose(float(scores[0, 10]), 0.2 if average else 2.0, rel_tol=1e-6)
    if average:  # counted from its position instead: slot 2's 2.5 over 18 queries, below slot 10's 0.2 a query
        view.since = None
        assert float(policy.score(view)[0, 2]) < float(policy.score(view)[0, 10])


@pytest.mark.parametrize("policy", ["h2o", "headaware"])
def test_a_long_text_fed_at_once_keeps_what_it_keeps_fed_a_chunk_at_a_time(tiny, policy):
    """A compression part way through a long message scores what has been read so far: H2O's average divides a
    token's attention by the queries read since it, not counting the rest of the message still to come (which made
    a pasted text's heavy hitters differ from the same text typed in pieces; its average became nearly the sum)."""
    model, ids = tiny("llama"), list(range(300, 700))
    settings = Settings(policy=policy, budget=48, window=8, slack=6)
    whole, pieces = Session(model, settings, system=None), Session(model, settings, system=None)
    whole.feed_raw(ids, score=False)
    for i in range(0, len(ids), settings.slack):  # the chunks the long text is read in: one of ``slack`` at a time
        pieces.feed_raw(ids[i: i + settings.slack], score=False)
    for a, b in zip(whole.cache.layers, pieces.cache.layers):
        assert torch.equal(a.positions(), b.positions()) and torch.equal(a.padded(a.stats["acc"]),
                                                                         b.padded(b.stats["acc"]))


def test_tova_keeps_what_the_newest_query_attends_to():
    window = torch.zeros(2, 1, 10)
    window[:, 0, 3] = 0.6
    window[0, 0, 7] = 0.4
    window[1, 0, 1] = 0.4
    scores = make_policy("tova").score(_view(window=window, heads=2))
    assert torch.equal(scores, window[:, 0].mean(0).expand(2, -1))  # averaged over heads: both keep the same tokens
    assert torch.topk(scores[0], 1).indices.item() == 3


def test_snapkv_pools_votes_over_neighbours():
    window = torch.zeros(1, 4, 30)
    window[0, :, 12] = 1.0
    scores = make_policy("snapkv", kernel=5).score(_view(window=window))
    keep = select_keep(scores, 5, torch.zeros(1, 30, dtype=torch.bool))
    assert keep[0].tolist() == [10, 11, 12, 13, 14]


def _rows(pattern, rows=8, n=64):
    """Attention rows [1, rows, n] of queries at the last `rows` positions, each from pattern(query_slot, n)."""
    out = torch.zeros(1, rows, n)
    for r in range(rows):
        q = n - rows + r
        p = pattern(q, n)
        p[q + 1:] = 0
        out[0, r] = p / p.sum()
    return out


def test_head_classes_from_hand_made_patterns():
    policy = make_policy("headaware")

    def local(q, n):
        p = torch.full((n,), 1e-4)
        p[max(0, q - 4): q + 1] = 1.0
        return p

    def periodic(q, n):
        p = torch.full((n,), 0.02)
        p[torch.arange(q % 8, q + 1, 8)] = 1.0
        return p

    def flat(q, n):
        return torch.ones(n) + 0.01 * torch.rand(n)

    window = torch.cat([_rows(local), _rows(periodic), _rows(flat)])  # three heads
    features = policy.head_features(window, torch.ones(3, 64, dtype=torch.bool))
    assert policy.classify(features) == ["local", "induction", "retrieval"]


def test_headaware_budgets_follow_classes_and_sum_to_the_layer_total():
    policy = make_policy("headaware", new_tokens=4)
    local = _rows(lambda q, n: torch.cat([torch.full((q - 3,), 1e-5), torch.ones(n - q + 3)]))
    flat = _rows(lambda q, n: torch.ones(n))
    window = torch.cat([local, flat, flat])
    view = _view(window=window, heads=3)
    (budgets,) = policy.allocate([view], budget=20, minimum=9)
    assert sum(budgets) == 60 and budgets[0] < budgets[1] == budgets[2]
    assert min(budgets) >= 12  # sink + window + newest group always fit
    assert policy.report()["head_classes"] == [["local", "retrieval", "retrieval"]]
    # Online refresh: the budgets move toward a new target with a decreasing step, not at once.
    (again,) = policy.allocate([_view(window=torch.cat([flat, flat, flat]), heads=3)], budget=20, minimum=9)
    assert budgets[0] < again[0] < 20


def test_headaware_classifies_layers_of_different_lengths_together_as_each_alone():
    """Several layers' heads are classified at once (their windows zero-padded to the longest, one read back):
    every layer gets the classes it gets alone, and each head is scored by its class's rule whether its layer mixes
    classes or not."""
    policy = make_policy("headaware")
    local = lambda q, n: torch.cat([torch.full((max(q - 4, 0),), 1e-4), torch.ones(n - max(q - 4, 0))])  # noqa: E731
    periodic = lambda q, n: torch.full((n,), 0.02).index_fill(0, torch.arange(q % 8, q + 1, 8), 1.0)  # noqa: E731
    flat = lambda q, n: torch.ones(n)  # noqa: E731
    layers = [(local, periodic, flat, 64), (flat, flat, local, 48), (periodic, local, local, 57)]
    views = [_view(window=torch.cat([_rows(p, n=n) for p in pats]), heads=3, layer=i, acc=torch.rand(3, n))
             for i, (*pats, n) in enumerate(layers)]
    alone = [policy.classify(policy.head_features(v.window, v.valid)) for v in views]
    assert policy.layer_classes(views) == alone == [["local", "induction", "retrieval"],
                                                    ["retrieval", "retrieval", "local"],
                                                    ["induction", "local", "local"]]
    policy.allocate(views, budget=20, minimum=9)
    mixed = policy.score(views[0])
    for head, cls in enumerate(policy.classes[0]):  # the same head in a layer of its class alone
        policy.classes[0] = [cls] * 3
        assert torch.equal(policy.score(views[0])[head], mixed[head]), cls


def test_cake_weighs_layers_of_different_lengths_together_as_each_alone():
    policy = make_policy("cake")
    views = [_view(window=_rows(p, n=n), layer=i) for i, (p, n) in
             enumerate([(lambda q, n: torch.ones(n), 64), (lambda q, n: torch.rand(n) ** 4, 40),
                        (lambda q, n: torch.rand(n), 64)])]
    policy.allocate(views, budget=30, minimum=5)
    alone = [policy.preference(*(float(t) for t in policy.preference_terms(v.window, v.valid))) for v in views]
    assert policy.preferences == pytest.approx(alone, rel=1e-5)


def _sink_rows():
    """Every query looks at position 0 (low entropy, no shift over queries)."""
    return _rows(lambda q, n: torch.cat([torch.ones(1), torch.full((n - 1,), 1e-4)]))


def test_cake_gives_a_high_entropy_layer_a_larger_budget():
    policy = make_policy("cake", tau2=1e6)  # the variance term neutralized: entropy alone decides
    spread = _rows(lambda q, n: torch.ones(n))  # looks everywhere
    views = [_view(window=_sink_rows(), layer=0), _view(window=spread, layer=1)]
    budgets = policy.allocate(views, budget=30, minimum=5)
    assert budgets[1][0] > budgets[0][0] and budgets[0][0] + budgets[1][0] == 60
    assert policy.report()["layer_budgets"] == [budgets[0][0], budgets[1][0]]


def test_cake_gives_a_shifting_layer_a_larger_budget():
    policy = make_policy("cake", tau1=1e6)  # the entropy term neutralized: temporal shift alone decides
    shifting = _rows(lambda q, n: torch.cat([torch.full((q,), 1e-4), torch.ones(1), torch.full((n - q - 1,), 1e-4)]))
    views = [_view(window=_sink_rows(), layer=0), _view(window=shifting, layer=1)]
    budgets = policy.allocate(views, budget=30, minimum=5)
    assert budgets[1][0] > budgets[0][0]


def test_cake_indicator_keeps_tokens_with_high_mean_or_variance():
    window = torch.full((1, 4, 10), 0.05)
    window[0, :, 2] = 0.3  # steadily attended
    window[0, 0, 6] = 0.9  # attended by one query only: high variance
    scores = make_policy("cake").score(_view(window=window))
    keep = select_keep(scores, 2, torch.zeros(1, 10, dtype=torch.bool))
    assert keep[0].tolist() == [2, 6]


def test_split_budget():
    assert split_budget([1, 1, 2], 40, 5) == [11, 11, 18]  # 5 each, then 25 as 6.25 : 6.25 : 12.5
    assert sum(split_budget([0.3, 5.0, 0.1], 99, 10)) == 99 and min(split_budget([0.3, 5.0, 0.1], 99, 10)) >= 10


@pytest.mark.parametrize("policy", ["cake", "headaware"])
def test_per_layer_and_per_head_budgets_never_allocate_more_than_uniform_h2o(tiny, policy):
    model = tiny("llama")
    sizes = {}
    for name in ("h2o", policy):
        session = Session(model, Settings(policy=name, budget=48, window=8, slack=6),
                          sampling=Sampling(max_new_tokens=4, temperature=0.0))
        peak = 0
        for i in range(5):
            session.exchange(f"Q{i} " + "tok " * 40, f"A{i} " + "ans " * 10)
            peak = max(peak, session.cache_bytes, sum(layer.kv_bytes for layer in session.cache.layers))
        sizes[name] = peak
        kv_slots = sum(sum(layer.caps) for layer in session.cache.layers)
        assert kv_slots <= model.num_layers * session.cache.layers[0].heads * (48 + 6)
    assert sizes[policy] <= sizes["h2o"]


def test_ragged_attention_equals_per_head_reference():
    torch.manual_seed(0)
    heads, groups, d, q = 2, 3, 8, 4
    query = torch.randn(1, heads * groups, q, d)
    lens = [9, 6]
    keys = [torch.randn(1, 1, n, d) for n in lens]
    values = [torch.randn(1, 1, n, d) for n in lens]

    class Module:
        is_causal = True
        num_key_value_groups = groups
        layer_idx = 0

    out, _ = kvchat_attention(Module(), query, RaggedKV(keys), RaggedKV(values), None, scaling=d ** -0.5)
    assert out.shape == (1, q, heads * groups, d)
    for h, n in enumerate(lens):
        for g in range(groups):
            qh = query[0, h * groups + g]  # [q, d]
            logits = qh @ keys[h][0, 0].T / math.sqrt(d)
            logits = logits.masked_fill(~causal_mask(q, n, "cpu")[0, 0], float("-inf"))
            want = F.softmax(logits, -1) @ values[h][0, 0]
            torch.testing.assert_close(out[0, :, h * groups + g], want, atol=1e-5, rtol=1e-5)


def test_ragged_layer_round_trip_through_the_cache():
    cache = KVCache(num_layers=1, capacity=12, max_capacity=64)
    layer = cache.layers[0]
    keys, values = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
    cache.incoming_abs = torch.arange(10, dtype=torch.int32)
    layer.update(keys, values)
    layer.keep([torch.tensor([0, 5, 9]), torch.tensor([1, 2, 3, 4, 9])], caps=[5, 9])
    assert layer.caps == [5, 9] and not layer.uniform
    cache.incoming_abs = torch.tensor([10], dtype=torch.int32)
    k, v = layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert isinstance(k, RaggedKV) and [t.shape[2] for t in k.heads] == [4, 6]
    assert layer.positions().tolist() == [[0, 5, 9, 10, -1, -1], [1, 2, 3, 4, 9, 10]]
    assert torch.equal(k.heads[1][0, 0, :5], keys[0, 1, [1, 2, 3, 4, 9]])


def test_switching_live_through_every_policy(tiny):
    session = Session(tiny("qwen2"), Settings(policy="headaware", budget=40, window=8, slack=6,
                                               params={"tau_local": 0.0}),
                      sampling=Sampling(max_new_tokens=6, temperature=0.0))
    order = ["headaware", "streaming", "h2o", "cake", "full", "snapkv", "tova", "window", "headaware"]
    for i, policy in enumerate(order):
        session.configure(policy=policy)
        session.exchange(f"Q{i} " + "word " * 30, f"A{i} " + "reply " * 8)
        res = session.chat("Go on.")
        assert res.new_tokens > 0
        if policy != "full":
            assert session.cache_tokens <= 46
            for layer in session.cache.layers:
                assert all(n <= c for n, c in zip(layer.lens, layer.caps))
    assert session.stats()["policy"] == "headaware"


@pytest.mark.parametrize("held", ["model", "operators"])
def test_observer_window_holds_the_latest_queries_exactly(held, tiny, tokenizer, monkeypatch):
    """Decode steps' queries join the window lazily (core/cache/observe.py): what a compression, a saved state or a mark
    reads is exactly the last ``obs_window`` query rows seen, and a mark's restore forgets the rows after it; with the
    weights as loaded and on kvchat's operators (one call per layer, core/decode)."""
    from kvchat.core.decode import weights
    from kvchat.core.model.loading import ChatModel
    from kvchat.core.cache.observe import Observer
    from tinymodels import build_tiny

    model = tiny("llama")
    if held == "operators":
        built = build_tiny("llama", tokenizer)
        weights.apply(built, "half")
        model = ChatModel.from_pretrained_model(built, tokenizer, name="tiny-llama-ops")
        assert model.step.without_ops is None

    seen: dict[int, list] = {}
    call = Observer.__call__

    def spy(self, module, query, key, scaling, probs=None, **kwargs):
        seen.setdefault(module.layer_idx, []).append((query[0].transpose(0, 1).clone(), self.positions.clone()))
        return call(self, module, query, key, scaling, probs, **kwargs)

    monkeypatch.setattr(Observer, "__call__", spy)
    session = Session(model, Settings(policy="snapkv", budget=400, params={"obs_window": 8}),
                      sampling=Sampling(max_new_tokens=12, temperature=0.0))
    session.chat("Tell me about the sea and its ships.")  # a prefill, then decode steps

    def expected(layer):
        rows = torch.cat([q for q, _ in seen[layer]])[-8:]
        pos = torch.cat([p for _, p in seen[layer]])[-8:].float()
        return rows, pos

    state = session.observer.state_tensors()
    for layer in seen:
        rows, pos = expected(layer)
        assert torch.equal(state[f"obs.{layer}.queries"], rows) and torch.equal(state[f"obs.{layer}.qpos"], pos)
    mark = session.observer.mark()
    before = {k: t.clone() for k, t in session.observer.state_tensors().items()}
    for token in (5, 6, 7):  # decode steps whose queries are still pending when the mark is restored
        session._feed([([token], len(session.messages) - 1)], continue_message=True)
    assert session.observer._pending
    session.observer.restore(mark)
    after = session.observer.state_tensors()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("shape", ["alike", "ragged", "lengths", "lengths, a product a layer"])
def test_window_attention_of_every_layer_at_once_is_each_layers(shape, tiny, monkeypatch):
    """A compression reads the window's attention of every layer in one batched product where the layers' heads
    hold equally many (``Observer.window_attentions``): the same probabilities as each layer's own, its queries
    rotated to the cache as it is now, after compressions and decode steps; layers of different lengths
    (``lengths``, as ``cake``'s) padded to the longest, each row seeing its own layer's slots up to its own; a layer
    whose heads hold different numbers (``ragged``) read by itself beside the others; asked wider, each the same
    with zeros past it; in products of fewer layers where the keys would take more than ``WINDOW_KEYS``."""
    if shape.endswith("a layer"):
        monkeypatch.setattr(observe, "WINDOW_KEYS", 1)
    session = Session(tiny("llama"), Settings(policy="snapkv", budget=40, window=8, slack=8, recall="off",
                                              params={"obs_window": 6}), sampling=GREEDY)
    for message in CHAT:
        session.chat(message)
    assert session.evicted_total > 0
    last = session.cache.layers[-1]
    if shape == "ragged":
        last.keep([torch.arange(1, last.lens[0])] + [torch.arange(n) for n in last.lens[1:]])
    if shape.startswith("lengths"):  # the last layer three slots shorter than the others, its heads still alike
        last.keep([torch.arange(3, n) for n in last.lens])
    assert last.uniform != (shape == "ragged")
    layers = list(range(len(session.cache.layers)))
    assert len({session.cache.layers[li].length for li in layers}) == (2 if shape.startswith("lengths") else 1)
    rotary, at = session.model.rotary, session.cache.length
    together = session.observer.window_attentions(layers, rotary, at)
    own = [session.observer.window_attention(li, rotary, at) for li in layers]
    wide = session.observer.window_attentions(layers, rotary, at, width=session.cache.length + 4)
    for li, got, alone, padded in zip(layers, together, own, wide):
        n = session.cache.layers[li].length
        assert got.shape == alone.shape and alone.shape[-1] == n and padded.shape[-1] == session.cache.length + 4
        torch.testing.assert_close(got, alone, rtol=0, atol=1e-6)
        torch.testing.assert_close(padded[..., :n], alone, rtol=0, atol=1e-6)
        assert not padded[..., n:].any()


@pytest.mark.parametrize("policy", ["streaming", "window", *ATTENTION_POLICIES])
def test_a_layer_scored_wider_than_it_holds_scores_and_keeps_as_alone(policy, tiny):
    """A compression whose layers hold different lengths (``cake``'s) gives every layer's view the width of the
    longest (``compress.layer_view``), so that one selection serves all: padding must read as slots no head holds.
    Each policy's allocation, its scores of the held slots and the slots it keeps are the same at each layer's own
    width and 5 slots wider than the longest, the last layer three slots shorter than the others."""
    from kvchat.core.cache.compress import group_ids, layer_view, protected, valid_masks
    from kvchat.core.cache.groups import select_keep_padded

    session = Session(tiny("llama"), Settings(policy=policy, budget=40, window=8, slack=8, recall="off",
                                              groups="sentence"), sampling=GREEDY)
    for message in CHAT:
        session.chat(message)
    assert session.evicted_total > 0
    layers = [(li, layer) for li, layer in enumerate(session.cache.layers)]
    rotary, at = session.model.rotary, session.cache.length

    def views(width):  # None: each layer's own
        windows = session.observer.window_attentions([li for li, _ in layers], rotary, at, width) \
            if session.observer is not None else [None] * len(layers)
        assert all(w is None or w.shape[-1] == (width or layer.length) for w, (_, layer) in zip(windows, layers))
        widths = [width or layer.length for _, layer in layers]
        masks = [valid_masks([layer], w)[0] for (_, layer), w in zip(layers, widths)]
        out = [layer_view(session, li, layer, m, w, n) for (li, layer), m, w, n in zip(layers, masks, windows, widths)]
        for view, ids in zip(out, group_ids(session, [view.positions for view in out])):
            view.groups = ids
        return out

    last = layers[-1][1]  # three slots shorter than the others, as cake's layers are after their own budgets
    last.keep([torch.arange(3, n) for n in last.lens])
    n = max(layer.length for _, layer in layers)
    assert last.length == n - 3
    own, wide = views(None), views(n + 5)
    assert all(v.positions.shape[1] == n + 5 and v.keys.shape[2] == n + 5 for v in wide)
    for (_, layer), a, b in zip(layers, own, wide):
        m = layer.length
        assert a.positions.shape[1] == m and torch.equal(b.groups[:, :m], a.groups) and (b.groups[:, m:] == -1).all()
    alloc = [session.policy.allocate(v, 30, 10) for v in (own, wide)]
    assert alloc[0] == alloc[1]
    for (li, layer), a, b in zip(layers, own, wide):
        sa, sb = session.policy.score(a), session.policy.score(b)
        sa, sb = sa.expand(layer.heads, -1), sb.expand(layer.heads, -1)
        torch.testing.assert_close(sb[:, :layer.length][a.valid], sa[a.valid], rtol=1e-6, atol=0)
        keep = alloc[0][li] if alloc[0] is not None else [30] * layer.heads
        kept = [select_keep_padded(s, keep, protected(session, v.positions, list(layer.lens), keep), v.groups,
                                   "mean", v.valid, list(layer.lens)) for s, v in ((sa, a), (sb, b))]
        assert kept[0][1] == kept[1][1] and torch.equal(kept[0][0], kept[1][0]), li
