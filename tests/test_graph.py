"""The graph step (core/decode/graph.py): the whole decode step over the cache's fixed-capacity buffers, captured as a
CUDA graph on a GPU. On the CPU it runs uncaptured, and must give what kvchat's eager step gives for every policy,
through compressions, budget changes and undo; the tests marked ``cuda`` check the captured graph on a GPU."""

import gc

import pytest
import torch

from kvchat.core.decode import GraphStep, build, weights
from kvchat.core.decode.eager import DecodeStep
from kvchat.core.engine.sampling import Sampler, draw
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.core.model.loading import ChatModel
from kvchat.policies import POLICIES

from tinymodels import build_tiny

GREEDY = Sampling(max_new_tokens=24, temperature=0.0)
MESSAGES = ["Hello there. Tell me about the sea!", "And the mountains? Are they tall? Some are.",
            "What about rivers in the north, and lakes?"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _pair(arch, tokenizer, device="cpu", dtype=torch.float32):
    """The same tiny model twice on ``device``: with kvchat's eager step and with the graph step."""
    out = []
    for decode in ("auto", "graph"):
        model = build_tiny(arch, tokenizer).to(device=device, dtype=dtype)
        out.append(ChatModel.from_pretrained_model(model, tokenizer, name=f"tiny-{arch}", decode=decode))
    eager, graph = out
    assert type(eager.step) in (DecodeStep, GraphStep) and isinstance(graph.step, GraphStep)
    return eager, graph


def _settings(policy):
    return Settings(policy="full") if not POLICIES[policy].bounded else \
        Settings(policy=policy, budget=48, window=8, slack=8)


def _assert_same_cache(a: Session, b: Session, atol: float) -> None:
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert la.lens == lb.lens and la.caps == lb.caps
        assert torch.equal(la.positions(), lb.positions())
        torch.testing.assert_close(lb.keys_dense().float(), la.keys_dense().float(), atol=atol, rtol=0)
        torch.testing.assert_close(lb.padded(lb.values).float(), la.padded(la.values).float(), atol=atol, rtol=0)
        for name in la.stats:
            torch.testing.assert_close(lb.padded(lb.stats[name]), la.padded(la.stats[name]), atol=atol, rtol=0)
        assert torch.equal(la.padded(la.computed), lb.padded(lb.computed))
        assert torch.equal(la.padded(la.rows), lb.padded(lb.rows))
    if a.observer is not None:
        wa, wb = a.observer.state_tensors(), b.observer.state_tensors()
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wb[k].float(), wa[k].float(), atol=atol, rtol=0)


@pytest.mark.parametrize("arch, policy", [("llama", p) for p in POLICIES] + [("qwen2", "h2o"), ("qwen2", "snapkv")])
def test_graph_step_gives_the_eager_steps_replies_and_cache(arch, policy, tokenizer):
    """Three replies through compressions: the same greedy answers, and the same cache — positions, keys, values,
    the computed keys' positions, storage rows, the policy's statistics and the observer's query window."""
    eager, graph = _pair(arch, tokenizer)
    sessions = [Session(cm, _settings(policy), sampling=GREEDY) for cm in (eager, graph)]
    for text in MESSAGES:
        answers = [s.chat(text).answer for s in sessions]
        assert answers[0] == answers[1]
    _assert_same_cache(*sessions, atol=1e-5)
    step = graph.step
    assert step.replays >= 60 and step.eager_calls <= 2
    if POLICIES[policy].bounded:
        assert sessions[1].evicted_total > 0


def ragged_heads_step_alike(sessions: list[Session], n: int, caps: list[int], steps: int) -> None:
    """The sessions read the same ``n`` random tokens; then in every layer head 0 forgets its first 7 positions and
    gets fewer slots than head 1 (``caps``); then ``steps`` tokens, fed one at a time, give the first session's logits
    within 1e-5 in the second."""
    torch.manual_seed(2)
    prompt = torch.randint(10, 1000, (n,)).tolist()
    for s in sessions:
        s.feed_raw(prompt, score=False)
        for layer in s.cache.layers:
            layer.keep([torch.arange(7, n), torch.arange(n)], caps=caps)
        assert not s.cache.layers[0].uniform_caps
    idx = len(sessions[0].messages) - 1
    token = 5
    for _ in range(steps):
        logits = [s._feed([([token], idx)], continue_message=True)[0] for s in sessions]
        torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
        token = int(logits[0].argmax())


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_heads_of_different_capacities(policy, tokenizer):
    """Per-head budgets (``headaware``'s on a real model): heads of one layer with different capacities and lengths
    go through the graph's gathered attention and give the eager step's logits, sums and window."""
    eager, graph = _pair("llama", tokenizer)
    sessions = [Session(cm, Settings(policy=policy, budget=100), system=None, sampling=GREEDY) for cm in (eager, graph)]
    ragged_heads_step_alike(sessions, 30, [40, 56], 9)
    assert graph.step.replays == 9 and graph.step.eager_calls == 0
    assert sessions[1].cache.layers[1].lens == [32, 39]
    _assert_same_cache(*sessions, atol=1e-5)


def test_a_budget_larger_than_the_chat_gives_the_full_caches_tokens(tokenizer):
    """streaming at a budget the chat never reaches, on the graph step: the full cache's greedy replies (eager)."""
    eager, graph = _pair("llama", tokenizer)
    full = Session(eager, Settings(policy="full"), sampling=GREEDY)
    bounded = Session(graph, Settings(policy="streaming", budget=400), sampling=GREEDY)
    for text in MESSAGES:
        assert bounded.chat(text).answer == full.chat(text).answer
    assert bounded.evicted_total == 0 and graph.step.replays >= 60


def test_compression_keeps_the_plan_and_a_budget_change_makes_a_new_one(tokenizer):
    """A compression writes the kept slots back into the same buffers: the step's plan (its graph on a GPU) stays;
    a budget change allocates new buffers and the next step plans (captures) again."""
    _, graph = _pair("llama", tokenizer)
    session = Session(graph, Settings(policy="h2o", budget=48, window=8, slack=8), sampling=GREEDY)
    session.chat(MESSAGES[0])
    plan = graph.step._plans[session.cache]
    before = session.evicted_total
    session.chat(MESSAGES[1])
    assert session.evicted_total > before and graph.step._plans[session.cache] is plan
    session.configure(budget=64)
    session.chat(MESSAGES[2])
    assert graph.step._plans[session.cache] is not plan


def test_undo_after_graph_steps_gives_the_same_next_reply(tokenizer):
    eager, graph = _pair("llama", tokenizer)
    answers = []
    for cm in (eager, graph):
        session = Session(cm, Settings(policy="snapkv", budget=48, window=8, slack=8), sampling=GREEDY, undo=True)
        session.chat(MESSAGES[0])
        first = session.chat(MESSAGES[1]).answer
        session.undo()
        assert session.chat(MESSAGES[1]).answer == first
        answers.append(first)
    assert answers[0] == answers[1]


def test_graph_is_the_default_step_only_on_cuda(tokenizer):
    model = build_tiny("llama", tokenizer)
    assert not isinstance(build(model, "auto"), GraphStep)
    assert isinstance(build(model, "graph"), GraphStep)
    gpt2 = build_tiny("gpt2", tokenizer)
    assert build(gpt2, "graph") is None  # not a Llama-family decoder: the model's forward


@cuda
@pytest.mark.cuda
def test_auto_on_cuda_is_the_graph_step_in_tritons_kernels(tokenizer):
    """``--decode auto`` on CUDA: the fastest step measured (docs/gpu.md), the graph step's layers in Triton."""
    step = build(build_tiny("llama", tokenizer).to(device="cuda", dtype=torch.bfloat16), "auto")
    assert isinstance(step, GraphStep) and step.triton and step.asked == "triton" and step.compile_error is None


def test_draw_samples_each_token_with_its_probability():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[int(draw(probs, float(torch.rand((), generator=gen))))] += 1
    assert counts[1] == 0
    torch.testing.assert_close(counts / 4000, probs, atol=0.03, rtol=0)
    assert [int(draw(probs, u)) for u in (0.0, 0.0999, 0.1001, 0.9999)] == [0, 0, 2, 3]


# -- on a GPU -------------------------------------------------------------------------------------------------------
BF16 = 3e-2  # tiny models' logits and kept tensors in bf16: the graph's fp32 attention against SDPA's


def _bf16_errors(policy, tokenizer, device, compiled=False, triton=False):
    """40 decode steps through compressions of the same tiny model three times: kvchat's eager step and the graph
    step in bf16, and the eager step in fp32 over the same (bf16-rounded) weights. Each bf16 step's logits' relative
    error ‖x − fp32‖ / ‖fp32‖ per step, and the graph step's counters."""
    eager, graph = _pair("llama", tokenizer, device=device, dtype=torch.bfloat16)
    exact = ChatModel.from_pretrained_model(build_tiny("llama", tokenizer).to(device=device, dtype=torch.bfloat16)
                                            .float(), tokenizer, name="tiny-fp32", decode="auto")
    eager.step, exact.step = DecodeStep(eager.model), DecodeStep(exact.model)
    if compiled or triton:
        graph.step = GraphStep(graph.model, compiled=compiled, triton=triton)
    sessions = [Session(cm, _settings(policy), system=None, sampling=GREEDY) for cm in (eager, graph, exact)]
    torch.manual_seed(1)
    prompt = torch.randint(10, 1000, (40,)).tolist()
    for s in sessions:
        s.feed_raw(prompt, score=False)
    idx = len(sessions[0].messages) - 1
    token, errors = int(sessions[2].last_logits.argmax()), ([], [])
    for _ in range(40):
        *low, ref = [s._feed([([token], idx)], continue_message=True)[0].float() for s in sessions]
        for out, x in zip(errors, low):
            out.append(((x - ref).norm() / ref.norm()).item())
        token = int(ref.argmax())
    assert sessions[1].evicted_total > 0 or not POLICIES[policy].bounded
    return errors, graph.step


def _as_accurate(errors) -> None:
    """The graph step's bf16 error, averaged over the steps, at most 1.5× the eager step's (the two round
    differently: on the CPU the graph's is 0.87-1.06× the eager step's, each 2-5% on a tiny random model's
    near-flat logits; an error in the step itself is several times larger: a mask off by one slot gave 15-20%)."""
    eager, graph = (sum(e) / len(e) for e in errors)
    assert graph <= 1.5 * eager + 1e-3, (graph, eager)


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_graph_step_in_bf16_is_as_accurate_as_the_eager_step(policy, tokenizer):
    """bf16 on the CPU (uncaptured): what the test below checks on a GPU, for two policies."""
    errors, step = _bf16_errors(policy, tokenizer, "cpu")
    _as_accurate(errors)
    assert step.replays == 40 and step.eager_calls == 0


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("policy", list(POLICIES))
def test_captured_graph_is_as_accurate_as_the_eager_step(policy, tokenizer):
    """bf16 on the GPU, every policy, step by step through compressions: the captured step against kvchat's eager
    step, both against fp32; the graph replays every step, capturing again only for a new capacity."""
    errors, step = _bf16_errors(policy, tokenizer, "cuda")
    _as_accurate(errors)
    assert step.captures >= 1 and step.replays == 40 and step.eager_calls == 0
    assert step.captures <= (1 if policy not in ("cake", "headaware") else 20)


@cuda
@pytest.mark.cuda
def test_captured_graph_budget_larger_than_the_chat_gives_the_full_caches_tokens(tokenizer):
    """fp32 (no TF32 in matrix products by default): in bf16 the two steps' different roundings flip a tiny random
    model's near-ties, which says nothing about the cache."""
    eager, graph = _pair("llama", tokenizer, device="cuda", dtype=torch.float32)
    eager.step = DecodeStep(eager.model)
    full = Session(eager, Settings(policy="full"), sampling=GREEDY)
    bounded = Session(graph, Settings(policy="streaming", budget=400), sampling=GREEDY)
    for text in MESSAGES:
        assert bounded.chat(text).answer == full.chat(text).answer
    assert graph.step.captures == 1


@cuda
@pytest.mark.cuda
def test_captured_graph_survives_compressions_and_recaptures_on_a_budget_change(tokenizer):
    _, graph = _pair("llama", tokenizer, device="cuda", dtype=torch.bfloat16)
    session = Session(graph, Settings(policy="h2o", budget=48, window=8, slack=8), sampling=GREEDY)
    session.chat(MESSAGES[0])
    session.chat(MESSAGES[1])
    assert session.evicted_total > 0 and graph.step.captures == 1
    session.configure(budget=64)
    session.chat(MESSAGES[2])
    assert graph.step.captures == 2


@cuda
@pytest.mark.cuda
def test_captured_short_segments_give_the_forwards_chat(tokenizer):
    """On a GPU the closing tokens (and a reply's header where recall reads the message apart) go a replay a token
    (``short_feed``): in fp32, the same replies as reading them through the model's forward, and the same cache."""
    _, graph = _pair("llama", tokenizer, device="cuda", dtype=torch.float32)
    assert graph.step.short_feed >= 3
    sessions, replays = [], []
    for short in (graph.step.short_feed, 0):
        graph.step.short_feed, before = short, graph.step.replays
        session = Session(graph, Settings(policy="h2o", budget=48, window=8, slack=8, recall="on"), sampling=GREEDY)
        sessions.append((session, [session.chat(m).answer for m in MESSAGES]))
        replays.append(graph.step.replays - before)
    (a, replies_a), (b, replies_b) = sessions
    assert replies_a == replies_b and a.evicted_total > 0 and replays[0] >= replays[1] + 2 * len(MESSAGES)
    _assert_same_cache(a, b, atol=1e-4)


@cuda
@pytest.mark.cuda
def test_capturing_again_leaves_no_gpu_memory_behind(tokenizer):
    """A chat whose budget goes back and forth captures the step at each change; what the GPU holds after a turn at
    the same budget stays the same (a capture's warm-up on a new stream left cuBLAS's workspace for it behind:
    32 MiB a capture on an H100, for the life of the process)."""
    _, graph = _pair("llama", tokenizer, device="cuda", dtype=torch.bfloat16)
    session = Session(graph, Settings(policy="streaming", budget=48, window=8, slack=8), sampling=GREEDY)
    held = {}
    for turn, budget in enumerate((48, 64) * 4):
        session.configure(budget=budget)
        session.chat(MESSAGES[turn % len(MESSAGES)])
        gc.collect()
        torch.cuda.synchronize()
        held.setdefault(budget, []).append(torch.cuda.memory_allocated())
    assert graph.step.captures == 8 and session.evicted_total > 0
    for budget, after in held.items():  # from each budget's second turn: the first may allocate what stays
        assert max(after[1:]) - min(after[1:]) < 2**20, f"budget {budget}: {[b / 2**20 for b in after]} MiB"


@cuda
@pytest.mark.cuda
def test_captured_graph_stays_valid_through_an_undo(tokenizer):
    """Undo puts the copied slots back into the same buffers (core/cache/snapshot.py): the graph is not captured
    again, and the turn asked again gets the same reply."""
    _, graph = _pair("llama", tokenizer, device="cuda", dtype=torch.bfloat16)
    session = Session(graph, Settings(policy="h2o", budget=48, window=8, slack=8), sampling=GREEDY, undo=True)
    session.chat(MESSAGES[0])
    first = session.chat(MESSAGES[1]).answer
    assert session.evicted_total > 0
    session.undo()
    assert session.chat(MESSAGES[1]).answer == first and graph.step.captures == 1


@cuda
@pytest.mark.cuda
def test_sampler_on_the_gpu_reads_back_only_the_token(tokenizer):
    logits = torch.randn(1000, device="cuda")
    gen = torch.Generator().manual_seed(3)
    tokens = [Sampler(Sampling(temperature=0.7, top_p=0.9, top_k=50), gen)(logits) for _ in range(200)]
    assert all(0 <= t < 1000 for t in tokens) and len(set(tokens)) > 1
    assert Sampler(Sampling(temperature=0.0), gen)(logits) == int(logits.argmax())


@cuda
@pytest.mark.cuda
def test_prefill_on_top_of_the_cache_on_the_gpu_is_the_models(tokenizer):
    """A message read on top of the cache (SDPA's lower-right causal bias: flash where it applies) gives the logits
    of the model reading the whole text at once with transformers' SDPA."""
    _, graph = _pair("llama", tokenizer, device="cuda", dtype=torch.bfloat16)
    session = Session(graph, Settings(policy="full"), system=None, sampling=GREEDY)
    torch.manual_seed(4)
    ids = torch.randint(10, 1000, (70,)).tolist()
    session.feed_raw(ids[:40], score=False)
    session.feed_raw(ids[40:], score=False)
    graph.model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            whole = graph.model(input_ids=torch.tensor([ids], device="cuda"), logits_to_keep=1).logits[0, -1]
    finally:
        graph.model.set_attn_implementation("kvchat")
    torch.testing.assert_close(session.last_logits.float(), whole.float(), atol=BF16, rtol=BF16)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "headaware"])
def test_captured_compiled_step_is_as_accurate_as_the_eager_step(policy, tokenizer):
    """``--decode compiled`` on the GPU: each layer compiled by inductor, then captured; as accurate as the eager
    step, every step through the graph, nothing left uncompiled. The last of the cuda tests: compiling is the
    slowest part of a GPU run's tests (scripts/gpu_check.sh gives them ``TESTS_S``)."""
    errors, step = _bf16_errors(policy, tokenizer, "cuda", compiled=True)
    _as_accurate(errors)
    assert step.compiled and step.compile_error is None
    assert step.captures >= 1 and step.replays == 40 and step.eager_calls == 0


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "headaware"])
def test_compiled_graph_step_gives_the_graph_steps_replies_and_cache(policy, tokenizer):
    """``--decode compiled`` on CUDA: each layer of the graph step compiled by ``torch.compile`` (inductor fuses a
    layer's ~25 operations into about a dozen kernels) computes what the step as written does — here on the CPU in
    fp32, through compressions: the same greedy replies, the same cache within 1e-5."""
    out = []
    for compiled in (False, True):
        cm = ChatModel.from_pretrained_model(build_tiny("llama", tokenizer), tokenizer, name="tiny", decode="graph")
        cm.step = GraphStep(cm.model, compiled=compiled)
        session = Session(cm, _settings(policy), sampling=GREEDY)
        out.append(([session.chat(m).answer for m in MESSAGES], session))
        assert cm.step.eager_calls <= 1 and cm.step.compile_error is None and cm.step.compiled == compiled
    (plain, a), (fused, b) = out
    assert fused == plain and b.evicted_total == a.evicted_total > 0
    _assert_same_cache(a, b, atol=1e-5)


def test_graph_step_over_kvchats_fp16_copies(tokenizer):
    """``--decode graph`` on the CPU, where the weights default to kvchat's fp16 copies (``--weights half``): the
    graph step multiplies by them as the eager step does (it once multiplied q/k/v by the q weight alone)."""
    out = []
    for decode in ("auto", "graph"):
        model = build_tiny("llama", tokenizer)
        weights.apply(model, "half")
        cm = ChatModel.from_pretrained_model(model, tokenizer, name="tiny-half", decode=decode)
        session = Session(cm, _settings("h2o"), sampling=GREEDY)
        out.append(([session.chat(m).answer for m in MESSAGES], session))
    assert isinstance(out[1][1].model.step, GraphStep) and out[1][1].model.weights == "half"
    assert out[0][0] == out[1][0]
    # within fp16 rounding: the graph's products over the copies round their outputs to fp16, kvchat's operators
    # (the eager step's, where built) keep fp32 sums
    _assert_same_cache(out[0][1], out[1][1], atol=2e-2)


def test_a_second_graph_step_over_the_same_model_holds_no_second_copy_of_its_weights(tokenizer):
    """``--graph-variants`` builds a second step over a model the first already fused: it reuses the concatenated
    q/k/v and gate/up the model's layers are views of, and the model's weights stay what they were."""
    model = build_tiny("llama", tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    first = ChatModel.from_pretrained_model(model, tokenizer, name="tiny", decode="graph").step
    second = GraphStep(model, compiled=True)
    for a, b in zip(first.weights, second.weights):
        for i in (1, 4):  # q/k/v, gate/up
            assert a[i][0].data_ptr() == b[i][0].data_ptr() and a[i][0].shape == b[i][0].shape
    assert all(torch.equal(x, y) for x, y in zip(before, model.parameters()))


def test_rotary_table_gives_each_positions_bits_and_grows_with_the_positions(tokenizer):
    """The step reads its token's rotary cos and sin' from a table the model's rotary module made for the first
    4,096 positions at once: the bits it gives one position at a time; a later position doubles the table (the
    first positions' rows unchanged) and the plans made over the old one are made (captured) again."""
    _, graph = _pair("llama", tokenizer)
    step = graph.step
    session = Session(graph, Settings(policy="streaming", budget=48, window=8, slack=8), sampling=GREEDY)
    session.chat(MESSAGES[0])
    plan, first = step._plans[session.cache], step._table
    assert first.shape[1] == 4096 and plan.table is first
    for p in (0, 17, 4095):
        cos, sin = step._rope(torch.empty(1, 1, 1), torch.tensor([[p]]))
        assert torch.equal(first[0, p], cos[0, 0]) and torch.equal(first[1, p], sin[0, 0])
    grown = step._rope_table(5000)
    cos, sin = step._rope(torch.empty(1, 1, 1), torch.tensor([[5000]]))
    assert grown.shape[1] == 8192 and torch.equal(grown[:, :4096], first)
    assert torch.equal(grown[0, 5000], cos[0, 0]) and torch.equal(grown[1, 5000], sin[0, 0])
    session.chat(MESSAGES[1])
    assert step._plans[session.cache] is not plan and step._plans[session.cache].table is grown
