"""The one-token decode step (core/decode) computes what the model's forward computes, on kvchat's cache."""

import copy
import re
import subprocess
import sys

import pytest
import torch

from kvchat.core.ops import kernels
from kvchat.core.model import loading as models
from kvchat.core.decode import weights
from kvchat.core.cache.layer import KVLayer
from kvchat.core.model.loading import ChatModel
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.core.decode import build as build_step
from kvchat.core.decode.compiled import CompiledStep
from kvchat.core.decode.eager import SHORT_FEED, DecodeStep
from kvchat.core.decode.parts import ROPE_BLOCK, Norm

from test_graph import _assert_same_cache
from tinymodels import build_tiny

FAMILIES = ["llama", "qwen2", "mistral", "llama3-scaled"]  # qwen2: q/k/v biases; llama3-scaled: another rope type
# kvchat's operators (core/ops/kernels.py) multiply by the fp16 copies with the input and each product unrounded where
# an fp16 GEMM (the model's ``HalfLinear``, the step without them) rounds both to fp16: logits (up to ~7 on these tiny
# models) differ by up to ~2e-2, the size of the fp16 copies' own error against the fp32 weights
# (``test_operators_are_as_close_to_the_fp32_model_as_the_fp16_products``).
COMPILED = {"atol": 3e-2, "rtol": 0}
COMPILED_KV = {"atol": 1e-2, "rtol": 0}  # keys, values, H2O's sums (~1e-3 apart here): the same differences, smaller


def _models(arch, tokenizer, held):
    """kvchat's step and the model's forward on one tiny model, its weights ``held`` as loaded ("model") or as fp16
    copies, the step on kvchat's operators ("operators") or without them ("half")."""
    model = build_tiny(arch, tokenizer)
    weights.apply(model, "model" if held == "model" else "half")
    fast = ChatModel.from_pretrained_model(model, tokenizer, name="fast")
    slow = ChatModel.from_pretrained_model(copy.deepcopy(model), tokenizer, name="slow", decode="model")
    assert fast.step is not None and slow.step is None
    if held == "half":
        fast.step.without_ops = "turned off by the test"
    assert (fast.step.without_ops is None) == (held == "operators")
    return fast, slow


def _prefilled(models_, seed: int = 1, **settings) -> list[Session]:
    """A session per model, each fed the same 30 random tokens."""
    sessions = [Session(cm, Settings(**settings), system=None, sampling=Sampling(temperature=0.0)) for cm in models_]
    torch.manual_seed(seed)
    prompt = torch.randint(10, 1000, (30,)).tolist()
    for s in sessions:
        s.feed_raw(prompt, score=False)
    return sessions


def _fed(sessions: list[Session], token: int, message: int | None = None) -> list[torch.Tensor]:
    """Each session's logits after it reads ``token`` within message ``message`` (default: its last)."""
    return [s._feed([([token], len(s.messages) - 1 if message is None else message)], continue_message=True)[0]
            for s in sessions]


@pytest.mark.parametrize("held", ["model", "half", "operators"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_step_gives_the_models_logits_and_cache(arch, held, tokenizer):
    sessions = _prefilled(_models(arch, tokenizer, held), policy="h2o", budget=40, slack=4)
    idx = len(sessions[0].messages) - 1
    token = int(sessions[0].last_logits.argmax())
    close, close_kv = ({"atol": 1e-5, "rtol": 1e-5},) * 2 if held != "operators" else (COMPILED, COMPILED_KV)
    for _ in range(20):  # past the budget: compressions, h2o's statistics, re-rotated keys
        logits = _fed(sessions, token, idx)
        if held == "model":  # the same operations in the same order: bit for bit
            assert torch.equal(logits[0], logits[1])
        else:  # one fp16 product for q/k/v (gate/up) instead of three (two): the kernels may sum in another order
            torch.testing.assert_close(logits[0], logits[1], **close)
            assert int(logits[0].argmax()) == int(logits[1].argmax())
        token = int(logits[1].argmax())
    a, b = (s.cache.layers[1] for s in sessions)
    assert a.lens == b.lens and torch.equal(a.abs_pos, b.abs_pos)
    n = a.lens[0]
    torch.testing.assert_close(a.keys.view(a.heads, -1, a.keys.shape[-1])[:, :n],
                               b.keys.view(b.heads, -1, b.keys.shape[-1])[:, :n], **close_kv)
    torch.testing.assert_close(a.stats["acc"], b.stats["acc"], **close_kv)
    assert sessions[0].evicted_total > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_layer_operator_gives_the_bits_of_its_parts(arch, tokenizer, monkeypatch):
    """kvchat::layer (a whole layer where every head has a free slot) against kvchat::project, the cache layer's
    ``update`` and kvchat::block, through H2O's compressions: the same logits, keys, values, positions and
    statistics, bit for bit; Qwen2's q/k/v biases included."""
    model = build_tiny(arch, tokenizer)
    weights.apply(model, "half")
    cm = ChatModel.from_pretrained_model(model, tokenizer, name="ops")
    assert cm.step.without_ops is None
    fused, parts = _prefilled([cm, cm], policy="h2o", budget=40, slack=4)
    real, slots = KVLayer.free_slot, []

    def counted(self):
        slots.append(real(self))
        return slots[-1]

    token = 7
    for _ in range(20):
        with monkeypatch.context() as m:
            m.setattr(KVLayer, "free_slot", counted)
            a = _fed([fused], token, 0)[0]
        with monkeypatch.context() as m:
            m.setattr(KVLayer, "free_slot", lambda self: None)  # project, update and block
            b = _fed([parts], token, 0)[0]
        assert torch.equal(a, b)
        token = int(a.argmax())
    assert slots and None not in slots  # every layer of every step of ``fused`` ran on kvchat::layer
    assert fused.evicted_total > 0
    for x, y in zip(fused.cache.layers, parts.cache.layers):
        assert x.lens == y.lens and x.caps == y.caps
        for t in ("keys", "values", "abs_pos"):
            assert torch.equal(getattr(x, t), getattr(y, t)), t
        assert torch.equal(x.stats["acc"], y.stats["acc"])


def test_a_kvchat_killed_while_it_loaded_its_operators_does_not_stop_the_next_one():
    """torch marks a build or load of the operators in progress by a file in their build folder and every later
    load waits for it to go; ``kill -9`` in that second of a kvchat's start left it there, and the next kvchat (and
    every one after) waited forever (seen: the crash test's replays, killed at random moments, hung CI)."""
    assert kernels.load() is None
    baton = kernels.build_directory(kernels.extension_name()) / "lock"
    baton.touch()  # what the killed process left
    try:
        proc = subprocess.run([sys.executable, "-c", "from kvchat.core.ops import kernels; print(kernels.load())"],
                              capture_output=True, text=True, timeout=120)
    finally:
        baton.unlink(missing_ok=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr
    assert "left by a process killed" in proc.stderr


def test_two_installs_build_their_operators_apart(monkeypatch, tmp_path):
    """torch rebuilds an extension whose sources or include path differ from its last build's: two kvchat installs
    on one machine under one name rebuilt the operators (~30 s) for every process of the other (seen: a CI clone's
    suite beside the working tree took 26 minutes instead of 14)."""
    here = kernels.extension_name()
    assert kernels.extension_name() == here  # one install: one name, built once
    monkeypatch.setattr(kernels, "SOURCES", [tmp_path / "csrc" / p.name for p in kernels.SOURCES])
    other = kernels.extension_name()
    assert other != here and other.split("_")[:-1] == here.split("_")[:-1]  # the CPU kind kept, the folder told apart
    assert kernels.build_directory(other) != kernels.build_directory(here)


def test_layer_operator_refuses_bad_input():
    assert kernels.load() is None
    heads, groups, cap, dim, hidden, inner = 2, 2, 8, 16, 32, 24
    x, n1 = torch.randn(1, 1, hidden), torch.ones(hidden)
    qkv_w = torch.randn(heads * dim * (groups + 2), hidden).half()
    cos, sin = torch.ones(dim), torch.zeros(dim)
    keys, values = torch.zeros(heads * cap, dim), torch.zeros(heads * cap, dim)
    rest = (torch.randn(hidden, heads * groups * dim).half(), torch.ones(hidden), 1e-5,
            torch.randn(2 * inner, hidden).half(), torch.randn(hidden, inner).half())
    nq = heads * groups * dim

    def call(nq=nq, keys=keys, values=values, cap=cap, n=3, sums=None):
        return torch.ops.kvchat.layer(x, n1, 1e-5, qkv_w, None, cos, sin, nq, keys, values, cap, n, 0.25, *rest,
                                      sums)

    out, q, k, v, probs = call()
    assert out.shape == x.shape and q.shape == (1, heads * groups, 1, dim) and probs.shape == (heads, groups, 4)
    assert torch.equal(keys.view(heads, cap, dim)[:, 3], k[0, :, 0])  # written at slot 3 of each head
    assert torch.equal(values.view(heads, cap, dim)[:, 3], v[0, :, 0])
    sums = torch.rand(heads * cap)
    want = sums.clone()
    out, q, k, v, probs = call(sums=sums)  # H2O's sums: each slot's probability averaged over its head's queries
    want.view(heads, cap)[:, :4] += probs.mean(1)
    assert torch.equal(sums, want)
    with pytest.raises(RuntimeError, match="kvchat::layer: sums as one contiguous float32 CPU value per buffer row"):
        call(sums=torch.zeros(heads * cap - 1))
    with pytest.raises(RuntimeError, match="kvchat::layer: q/k/v outputs of whole heads, H \\* cap buffer rows"):
        call(n=cap)  # no free slot
    with pytest.raises(RuntimeError, match="kvchat::layer: q/k/v outputs of whole heads"):
        call(cap=cap - 1)
    with pytest.raises(RuntimeError, match="kvchat::layer: q/k/v outputs of whole heads"):
        call(nq=nq - dim // 2)
    with pytest.raises(RuntimeError, match="kvchat::layer: contiguous float32 CPU key and value buffers"):
        call(keys=keys.double())
    with pytest.raises(RuntimeError, match="kvchat::layer: contiguous float32 CPU key and value buffers"):
        call(values=values[:, :dim - 1])


def test_step_in_bf16_is_the_models(tokenizer):
    """A bf16 model (what GPUs load): the model's norm modules and transformers' SDPA attention, as in its forward."""
    model = build_tiny("qwen2", tokenizer).to(torch.bfloat16)
    fast = ChatModel.from_pretrained_model(model, tokenizer, name="fast")
    slow = ChatModel.from_pretrained_model(copy.deepcopy(model), tokenizer, name="slow", decode="model")
    assert fast.step.without_ops == "only fp32 models on the CPU (this one: torch.bfloat16 on cpu)"
    sessions = [Session(cm, Settings(policy="h2o", budget=40, slack=4), system=None) for cm in (fast, slow)]
    torch.manual_seed(3)
    prompt = torch.randint(10, 1000, (30,)).tolist()
    for s in sessions:
        s.feed_raw(prompt, score=False)
    token = 5
    for _ in range(12):
        logits = _fed(sessions, token)
        assert logits[0].dtype == torch.bfloat16 and torch.equal(logits[0], logits[1])
        token = int(logits[1].argmax())


@pytest.mark.parametrize("held", ["half", "operators"])
def test_greedy_replies_are_the_models(held, tokenizer):
    fast, slow = _models("llama", tokenizer, held)
    greedy = Sampling(max_new_tokens=16, temperature=0.0)
    replies = []
    for cm in (fast, slow):
        session = Session(cm, Settings(policy="streaming", budget=48, window=16, slack=6), sampling=greedy)
        replies.append([session.chat(f"Q{i} " + "tok " * 30).answer for i in range(3)])
    assert replies[0] == replies[1]


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv"])
def test_short_segments_fed_a_step_a_token_give_the_forwards_chat(policy, tokenizer):
    """A few tokens in a row (the reply's header, read apart from the message where recall runs; the template's
    closing) go a step a token where a step is the cheaper (``short_feed``: on kvchat's operators, not without):
    the chat's replies are those of reading them through the model's forward, its cache (H2O's sums, the query
    window's rows) too, past the budget, with recall. On the fp32 weights, where the step is the forward's to ~1e-5
    (on the operators' fp16 copies it is so to ~1e-2, as for every token it decodes, and a tiny random model's H2O
    can evict another slot on that)."""
    assert _models("llama", tokenizer, "operators")[0].step.short_feed == SHORT_FEED >= 3
    fast, _ = _models("llama", tokenizer, "model")
    assert fast.step.short_feed == 0
    settings = Settings(policy=policy, budget=48, window=8, slack=6, recall="on")
    sessions, steps = [], []
    plain = fast.step.decode
    for short in (SHORT_FEED, 0):
        fast.step.short_feed, calls = short, []
        fast.step.decode = lambda *a, **k: calls.append(1) or plain(*a, **k)
        session = Session(fast, settings, sampling=Sampling(max_new_tokens=6, temperature=0.0))
        replies = [session.chat(f"Q{i}. " + "tok word " * (8 + 3 * i)).answer for i in range(5)]
        sessions.append((session, replies))
        steps.append(len(calls))
    (a, replies_a), (b, replies_b) = sessions
    assert replies_a == replies_b and a.evicted_total > 0 and a.digests.count > 0
    assert steps[0] >= steps[1] + 2 * 5  # the closing (2 tokens or more) of each of the 5 turns went a step a token
    _assert_same_cache(a, b, atol=1e-4)  # lengths, positions, keys, values, statistics, the observer's state


@pytest.mark.parametrize("held", ["model", "operators"])
def test_heads_of_different_lengths(held, tokenizer):
    """Heads of one layer holding different numbers of positions (what per-head budgets leave) step as the model
    (on kvchat's operators: their q/k/v and output layer, the attention and the rest of the layer as without)."""
    sessions = _prefilled(_models("qwen2", tokenizer, held), seed=2, policy="window", budget=100)
    for s in sessions:
        for layer in s.cache.layers:  # head 0 forgets its first 7 positions
            layer.keep([torch.arange(7, 30), torch.arange(30)])
        assert not s.cache.layers[0].uniform
    idx = len(sessions[0].messages) - 1
    token = 5
    for _ in range(5):
        logits = _fed(sessions, token, idx)
        torch.testing.assert_close(logits[0], logits[1], **({"atol": 1e-5, "rtol": 1e-5} if held == "model" else
                                                            COMPILED))
        token = int(logits[1].argmax())
    assert sessions[0].cache.layers[1].lens == [28, 35]


def test_fused_projections_share_the_fp16_copies(tokenizer):
    model = build_tiny("qwen2", tokenizer)
    weights.apply(model, "half")
    before = weights.step_bytes(model)
    step = DecodeStep(model)
    attn = model.model.layers[0].self_attn
    fused = step.layers[0].qkv.weight
    assert attn.k_proj.step.data_ptr() == fused[attn.q_proj.out_features:].data_ptr()
    assert weights.step_bytes(model) == before
    x = torch.randn(1, 1, model.config.hidden_size)
    with torch.no_grad():
        want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)
        assert torch.equal(step.layers[0].qkv(x), want)
        with weights.as_loaded(model):  # the loaded weights, as HalfLinear reads them then
            want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)
            assert torch.equal(step.layers[0].qkv(x), want)


@pytest.mark.parametrize("size", [64, 576, 896])
def test_fused_norm_is_the_models_norm_bit_for_bit(size):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(size)
    module = LlamaRMSNorm(size, eps=1e-5)
    module.weight.data = torch.randn(size)
    norm = Norm(module)
    assert norm.fused
    for scale in (1e-3, 1.0, 1e3):
        x = torch.randn(1, 1, size) * scale
        assert torch.equal(norm(x), module(x))


@pytest.mark.parametrize("arch", ["gpt2", "gpt-neox", "phi3", "gemma"])
def test_other_architectures_decode_through_the_models_forward(arch, tokenizer):
    model = build_tiny(arch, tokenizer)
    assert DecodeStep.unsupported(model)
    assert ChatModel.from_pretrained_model(model, tokenizer).step is None


def test_unknown_decode_is_refused(tokenizer, model_dir):
    with pytest.raises(ValueError, match="unknown decode 'fast'"):
        build_step(build_tiny("llama", tokenizer), "fast")
    with pytest.raises(models.ModelError, match=r"unknown decode 'fast' \(auto, model, compiled, graph, triton\)"):
        models.load(str(model_dir), decode="fast")
    assert models.load(str(model_dir), decode="model").step is None


# --decode compiled: the whole step as one torch.compile graph (core/decode: CompiledStep) -------------------------
def _eager_and_compiled(arch, tokenizer):
    model = build_tiny(arch, tokenizer)
    weights.apply(model, "half")
    eager = ChatModel.from_pretrained_model(model, tokenizer, name="eager")
    compiled = ChatModel.from_pretrained_model(copy.deepcopy(model), tokenizer, name="compiled", decode="compiled")
    assert type(eager.step) is DecodeStep and isinstance(compiled.step, CompiledStep)
    return eager, compiled



@pytest.mark.parametrize("heads,groups,slots,dim", [(3, 3, 1088, 64), (2, 1, 5, 32), (1, 4, 129, 48), (2, 3, 130, 20),
                                                     (2, 2, 300, 128), (1, 2, 77, 88), (2, 3, 0, 64)])
def test_attention_operators_compute_what_torch_bmm_does(heads, groups, slots, dim):
    """core/ops/kernels.py: the compiled step's scores and weighted values, whole blocks and a partial last one; head
    sizes whose keys stay in registers (32, 48, 64), longer ones (88, 128) and one that is no multiple of 8 (20); no
    slots at all (an empty sum: zeros)."""
    assert kernels.load() is None  # built here (CI installs ninja and a C++ compiler)
    torch.manual_seed(slots)
    q, k, v = torch.randn(heads, groups, dim), torch.randn(heads, slots, dim), torch.randn(heads, slots, dim)
    scores = torch.ops.kvchat.scores(q, k)
    torch.testing.assert_close(scores, torch.bmm(q, k.transpose(1, 2)), atol=1e-5, rtol=1e-5)
    p = scores.softmax(-1)
    torch.testing.assert_close(torch.ops.kvchat.values(p, v), torch.bmm(p, v), atol=1e-6, rtol=1e-5)
    # non-contiguous inputs are read as what they hold
    torch.testing.assert_close(torch.ops.kvchat.values(p, v.transpose(1, 2).contiguous().transpose(1, 2)),
                               torch.bmm(p, v), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows,out,inner", [((1, 1), 1152, 576), ((3,), 7, 37), ((2, 1), 49, 64), ((2,), 3, 0)])
def test_matvec_operator_computes_the_widened_product(rows, out, inner):
    """kvchat::matvec: x times fp16 weights widened to fp32, as the compiled step's products; rows of 32 and a
    tail (37), several rows of x, an empty sum (0)."""
    assert kernels.load() is None
    torch.manual_seed(out)
    x, w = torch.randn(*rows, inner), torch.randn(out, inner).half()
    got = torch.ops.kvchat.matvec(x, w)
    assert got.shape == (*rows, out) and got.dtype == torch.float32
    torch.testing.assert_close(got, x @ w.float().T, atol=1e-4, rtol=1e-5)


def _block_reference(q, k, v, lens, x, o_w, n2, eps, gu_w, down_w):
    """What ``kvchat::block`` computes, as the graph computes it without the block (core/decode, ``_graph``)."""
    later = torch.arange(k.shape[1])[None, None, :] > lens[:, None, None]
    probs = torch.bmm(q, k.transpose(1, 2)).masked_fill(later, float("-inf")).softmax(-1)
    x = x + torch.bmm(probs, v).reshape(1, 1, -1) @ o_w.float().T
    gu = torch.nn.functional.rms_norm(x, (x.shape[-1],), n2, eps) @ gu_w.float().T
    inner = down_w.shape[1]
    return x + (torch.nn.functional.silu(gu[..., :inner]) * gu[..., inner:]) @ down_w.float().T, probs


@pytest.mark.parametrize("heads,groups,slots,dim,hidden,inner", [(3, 3, 1088, 64, 576, 1536), (2, 2, 37, 16, 64, 100),
                                                                  (1, 4, 5, 20, 24, 7)])
def test_block_operator_computes_the_rest_of_a_layer(heads, groups, slots, dim, hidden, inner):
    """kvchat::block: attention over each head's slots up to its length (later ones get probability 0, exactly),
    the output projection, the norm, the SiLU MLP, as the separate operations compute them; the default model's
    shapes, small ones, sizes no multiple of 8 (the exponentials' tails)."""
    assert kernels.load() is None
    torch.manual_seed(slots)
    q, k, v = torch.randn(heads, groups, dim) * 0.3, torch.randn(heads, slots, dim), torch.randn(heads, slots, dim)
    lens = torch.randint(0, slots, (heads,))
    lens[0] = slots - 1  # one head with every slot in use
    x, n2 = torch.randn(1, 1, hidden), torch.rand(hidden) + 0.5
    o_w = (torch.randn(hidden, heads * groups * dim) / (heads * groups * dim) ** 0.5).half()
    gu_w = (torch.randn(2 * inner, hidden) / hidden ** 0.5).half()
    down_w = (torch.randn(hidden, inner) / inner ** 0.5).half()
    out, probs = torch.ops.kvchat.block(q, k, v, lens, x, o_w, n2, 1e-5, gu_w, down_w)
    want_out, want_probs = _block_reference(q, k, v, lens, x, o_w, n2, 1e-5, gu_w, down_w)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs, want_probs, atol=1e-6, rtol=1e-5)
    for h in range(heads):
        assert torch.all(probs[h, :, lens[h] + 1:] == 0)
    with pytest.raises(RuntimeError, match="kvchat::block: one int64 length per head"):
        torch.ops.kvchat.block(q, k, v, lens.int(), x, o_w, n2, 1e-5, gu_w, down_w)
    with pytest.raises(RuntimeError, match=r"kvchat::block: o \[E, H\*G\*D\], gate/up \[2I, E\], down \[E, I\]"):
        torch.ops.kvchat.block(q, k, v, lens, x, o_w, n2, 1e-5, gu_w[1:], down_w)


def test_compiled_step_with_another_activation_keeps_the_separate_products(tokenizer):
    """A model whose MLP is not SiLU: the graph keeps kvchat's separate products (``CompiledStep.mode``), with the
    eager step's logits."""
    model = build_tiny("llama", tokenizer)
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.GELU(approximate="tanh")
    weights.apply(model, "half")
    eager = ChatModel.from_pretrained_model(model, tokenizer, name="eager")
    compiled = ChatModel.from_pretrained_model(copy.deepcopy(model), tokenizer, name="compiled", decode="compiled")
    sessions = _prefilled([eager, compiled], seed=3, policy="streaming", budget=40, slack=4)
    token = 5
    for _ in range(8):
        logits = _fed(sessions, token, 0)
        torch.testing.assert_close(logits[1], logits[0], **COMPILED)
        token = int(logits[0].argmax())
    assert compiled.step.ops is True and compiled.step.calls >= 6 and compiled.step.failed is None


@pytest.mark.parametrize("arch", ["llama", "llama3-scaled"])
def test_kept_rotary_values_are_the_rotary_modules(arch, tokenizer):
    """The step's kept cos/sin' blocks (``DecodeStep._rope_block``) hold what the model's rotary module gives for
    one position at a time, bit for bit, across a block's edges; past the model's maximum they are computed."""
    model = build_tiny(arch, tokenizer)
    step = DecodeStep(model)
    assert step.rope_limit == model.config.max_position_embeddings > 0
    token = torch.tensor([5])
    x = step.embed(token[None])
    for p in (0, 255, 256, 1000, step.rope_limit - 1, step.rope_limit + 3):
        _, cos, sin = step._embed(token, torch.tensor([p]))
        want_cos, want_sin = step._rope(x, torch.tensor([[p]]))
        assert torch.equal(cos, want_cos[:, None]) and torch.equal(sin, want_sin[:, None])
    assert all(b * ROPE_BLOCK < step.rope_limit for b in step._rope_blocks) and len(step._rope_blocks) <= 4


def _mapping(address: int) -> tuple[int, int, list[str]]:
    """The start, end and VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    span = None
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                lo, hi = (int(a, 16) for a in line.split(None, 1)[0].split("-"))
                span = (lo, hi) if lo <= address < hi else None
            elif span is not None and line.startswith("VmFlags:"):
                return (*span, line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not weights.huge_pages_allowed(), reason="no transparent huge pages on this system")
def test_step_reads_its_fp16_copies_from_huge_page_memory(tokenizer):
    """The fp16 copies a step reads move into one mapping advised for huge pages (VmFlags ``hg``), with their
    values, and the HalfLinear layers' views move with them."""
    model = build_tiny("qwen2", tokenizer)
    weights.apply(model, "half")
    halves = {n: m for n, m in model.named_modules() if isinstance(m, weights.HalfLinear)}
    before = {n: m.step.clone() for n, m in halves.items()}
    step = DecodeStep(model)
    for n, m in halves.items():
        assert torch.equal(m.step, before[n])
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.step.data_ptr() == step.layers[0].qkv.weight[attn.q_proj.out_features:].data_ptr()
    lo, hi, flags = _mapping(step.layers[0].qkv.weight.data_ptr())
    assert "hg" in flags
    assert all(lo <= m.step.data_ptr() < hi for m in halves.values())


def test_operators_read_the_first_slots_of_a_larger_buffer_as_a_copy_of_them():
    """The eager step hands attention each head's first n slots of its buffer (a view, heads ``capacity`` slots
    apart): the scores, values and block read them in place, with the same bits as a contiguous copy."""
    assert kernels.load() is None
    torch.manual_seed(7)
    heads, groups, cap, n, dim, hidden, inner = 3, 3, 300, 131, 64, 96, 80
    kbuf, vbuf = torch.randn(heads, cap, dim), torch.randn(heads, cap, dim)
    k, v = kbuf[:, :n], vbuf[:, :n]
    assert not k.is_contiguous()
    q = torch.randn(heads, groups, dim) * 0.3
    assert torch.equal(torch.ops.kvchat.scores(q, k), torch.ops.kvchat.scores(q, k.contiguous()))
    p = torch.rand(heads, groups, n)
    assert torch.equal(torch.ops.kvchat.values(p, v), torch.ops.kvchat.values(p, v.contiguous()))
    lens = torch.full((heads,), n - 1)
    x, n2 = torch.randn(1, 1, hidden), torch.rand(hidden) + 0.5
    o_w = (torch.randn(hidden, heads * groups * dim) * 0.02).half()
    gu_w, down_w = (torch.randn(2 * inner, hidden) * 0.1).half(), (torch.randn(hidden, inner) * 0.1).half()
    got = torch.ops.kvchat.block(q, k, v, lens, x, o_w, n2, 1e-5, gu_w, down_w)
    want = torch.ops.kvchat.block(q, k.contiguous(), v.contiguous(), lens, x, o_w, n2, 1e-5, gu_w, down_w)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _project_reference(x, n, eps, w, bias, cos, sin, rotated):
    """What ``kvchat::project`` computes, as the step without the operators computes it (core/decode)."""
    out = torch.nn.functional.rms_norm(x, (x.shape[-1],), n, eps) @ w.float().T
    out = out if bias is None else out + bias
    d = cos.numel()
    y = out[..., :rotated].reshape(-1, d)
    y = y * cos.view(-1) + y.roll(d // 2, -1) * sin.view(-1)
    return torch.cat([y.reshape(*out.shape[:-1], rotated), out[..., rotated:]], -1)


@pytest.mark.parametrize("hidden,out,rotated,dim,bias", [(576, 1152, 768, 64, False), (64, 96, 64, 16, True),
                                                        (37, 10, 0, 8, False), (40, 49152 // 64, 0, 64, True)])
def test_project_operator_computes_norm_product_and_rotary(hidden, out, rotated, dim, bias):
    """kvchat::project: the RMS norm, the product with fp16 weights, the bias and the rotary embedding of the first
    ``rotated`` outputs head by head, as the separate operations compute them; the default model's q/k/v shapes, a
    small one with biases (Qwen2's), the output layer (nothing rotated), a hidden size that is no multiple of 8."""
    assert kernels.load() is None
    torch.manual_seed(out)
    x, n = torch.randn(1, 1, hidden), torch.rand(hidden) + 0.5
    w = (torch.randn(out, hidden) / hidden ** 0.5).half()
    b = torch.randn(out) if bias else None
    angles = torch.rand(dim // 2) * 6
    cos = torch.cat([angles.cos(), angles.cos()]).view(1, 1, 1, dim)
    sin = torch.cat([-angles.sin(), angles.sin()]).view(1, 1, 1, dim)
    got = torch.ops.kvchat.project(x, n, 1e-5, w, b, cos, sin, rotated)
    assert got.shape == (1, 1, out)
    torch.testing.assert_close(got, _project_reference(x, n, 1e-5, w, b, cos, sin, rotated), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="kvchat::project: float32 cos and sin of one even head size"):
        torch.ops.kvchat.project(x, n, 1e-5, w, b, cos, sin, dim + 1)
    with pytest.raises(RuntimeError, match="kvchat::project: float32 cos and sin of one even head size"):
        torch.ops.kvchat.project(x, n, 1e-5, w, b, torch.zeros(0), torch.zeros(0), dim)
    with pytest.raises(RuntimeError, match="kvchat::project: a float32 bias of N values"):
        torch.ops.kvchat.project(x, n, 1e-5, w, torch.zeros(out + 1), cos, sin, rotated)
    with pytest.raises(RuntimeError, match="kvchat::project: one float32 token of E values and E norm weights"):
        torch.ops.kvchat.project(x, n[1:], 1e-5, w, b, cos, sin, rotated)


def test_eager_step_says_why_it_runs_without_the_operators(tokenizer, monkeypatch):
    """Without a compiler, with weights as loaded, with an MLP that is not SiLU: the step without the operators,
    and why."""
    model = build_tiny("llama", tokenizer)
    assert DecodeStep(model).without_ops.startswith("the weights are not fp16 copies")  # --weights model
    gelu = build_tiny("llama", tokenizer)
    for layer in gelu.model.layers:
        layer.mlp.act_fn = torch.nn.GELU(approximate="tanh")
    weights.apply(gelu, "half")
    assert DecodeStep(gelu).without_ops.endswith("or the MLP is not SiLU")
    weights.apply(model, "half")
    assert DecodeStep(model).without_ops is None
    monkeypatch.setattr(kernels, "load", lambda: "RuntimeError: Ninja is required to load C++ extensions")
    assert DecodeStep(model).without_ops.startswith("RuntimeError: Ninja")


def test_attention_operators_refuse_bad_input():
    kernels.load()
    with pytest.raises(RuntimeError, match="kvchat::scores: float32 tensors"):
        torch.ops.kvchat.scores(torch.zeros(1, 1, 4, dtype=torch.float64), torch.zeros(1, 3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="kvchat::values: one weight per slot"):
        torch.ops.kvchat.values(torch.zeros(1, 1, 4), torch.zeros(1, 3, 4))
    with pytest.raises(RuntimeError, match="kvchat::matvec: float32 x, float16 w"):
        torch.ops.kvchat.matvec(torch.zeros(1, 4), torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match=r"kvchat::matvec: x \[\.\.\., K\] and w \[N, K\]"):
        torch.ops.kvchat.matvec(torch.zeros(1, 4), torch.zeros(2, 5).half())


def test_compiled_step_without_the_attention_operators(tokenizer, monkeypatch):
    """Where they cannot be built (no ninja), the graph's attention is torch.bmm, with the same logits."""
    monkeypatch.setattr(kernels, "load", lambda: "RuntimeError: Ninja is required to load C++ extensions")
    sessions = _prefilled(_eager_and_compiled("llama", tokenizer), seed=5, policy="streaming", budget=40, slack=4)
    token = 5
    for _ in range(8):
        logits = _fed(sessions, token, 0)
        torch.testing.assert_close(logits[1], logits[0], **COMPILED)
        token = int(logits[0].argmax())
    step = sessions[1].model.step
    assert step.no_ops.startswith("RuntimeError: Ninja") and step.calls >= 6 and step.failed is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_operators_are_as_close_to_the_fp32_model_as_the_fp16_products(arch, tokenizer):
    """What the looser tolerance stands on: over 24 steps through compressions, the logits of the eager step on
    kvchat's operators and of the compiled step stay about as close to the model's own (fp32 weights, its forward) as
    the fp16 GEMMs of the step without the operators leave them."""
    model = build_tiny(arch, tokenizer)
    fp32 = ChatModel.from_pretrained_model(copy.deepcopy(model), tokenizer, name="fp32", decode="model")
    weights.apply(model, "half")
    plain = ChatModel.from_pretrained_model(copy.deepcopy(model), tokenizer, name="plain")
    plain.step.without_ops = "turned off by the test"
    eager = ChatModel.from_pretrained_model(model, tokenizer, name="eager")
    compiled = ChatModel.from_pretrained_model(copy.deepcopy(model), tokenizer, name="compiled", decode="compiled")
    assert eager.step.without_ops is None
    sessions = _prefilled([fp32, plain, eager, compiled], policy="streaming", budget=40, slack=4)
    token, worst = 5, [0.0, 0.0, 0.0]
    for _ in range(24):
        logits = _fed(sessions, token, 0)
        for i in (0, 1, 2):
            worst[i] = max(worst[i], float((logits[i + 1] - logits[0]).abs().max()))
        token = int(logits[0].argmax())
    assert compiled.step.calls >= 20
    assert 0 < worst[1] <= 1.5 * worst[0] and 0 < worst[2] <= 1.5 * worst[0] and worst[0] < COMPILED["atol"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_step_gives_the_eager_steps_logits_and_cache(arch, tokenizer):
    """Through compressions (h2o at budget 40): the same logits within fp16 rounding (``COMPILED``), the same
    positions, keys, values and H2O statistics within it, the same greedy tokens."""
    sessions = _prefilled(_eager_and_compiled(arch, tokenizer), policy="h2o", budget=40, slack=4)
    eager, compiled = (s.model for s in sessions)
    idx = len(sessions[0].messages) - 1
    token = int(sessions[0].last_logits.argmax())
    for _ in range(24):
        logits = _fed(sessions, token, idx)
        torch.testing.assert_close(logits[1], logits[0], **COMPILED)
        assert int(logits[1].argmax()) == int(logits[0].argmax())
        token = int(logits[0].argmax())
    step = compiled.step
    assert step.failed is None and step.calls >= 20  # the graph ran (steps right after a full cache run eagerly)
    assert step.no_ops is None and step.ops == "block"  # with kvchat's operators, a layer's rest as one call
    for a, b in zip(*(s.cache.layers for s in sessions)):
        assert a.lens == b.lens and torch.equal(a.abs_pos, b.abs_pos)
        n = a.lens[0]
        for t in ("keys", "values"):
            torch.testing.assert_close(getattr(b, t).view(b.heads, -1, b.keys.shape[-1])[:, :n],
                                       getattr(a, t).view(a.heads, -1, a.keys.shape[-1])[:, :n],
                                       **COMPILED_KV)
        torch.testing.assert_close(b.stats["acc"].view(b.heads, -1)[:, :n], a.stats["acc"].view(a.heads, -1)[:, :n],
                                   **COMPILED_KV)
    assert sessions[0].evicted_total == sessions[1].evicted_total > 0


def test_compiled_step_with_heads_of_different_lengths(tokenizer):
    """Heads of one capacity holding different numbers of positions: masked per head in the graph, and the
    observer's per-head probabilities as the eager step hands them over."""
    sessions = _prefilled(_eager_and_compiled("llama", tokenizer), seed=2, policy="h2o", budget=100)
    compiled = sessions[1].model
    for s in sessions:
        for layer in s.cache.layers:  # head 0 forgets its first 7 positions; both keep their capacity
            layer.keep([torch.arange(7, 30), torch.arange(30)])
        assert not s.cache.layers[0].uniform and len(set(s.cache.layers[0].caps)) == 1
    idx = len(sessions[0].messages) - 1
    token = 5
    for _ in range(5):
        logits = _fed(sessions, token, idx)
        torch.testing.assert_close(logits[1], logits[0], **COMPILED)
        token = int(logits[0].argmax())
    assert compiled.step.calls == 5
    a, b = (s.cache.layers[1] for s in sessions)
    assert a.lens == b.lens == [28, 35]
    for h in range(2):
        assert torch.equal(b.head_view(b.abs_pos, h), a.head_view(a.abs_pos, h))
        torch.testing.assert_close(b.head_view(b.stats["acc"], h), a.head_view(a.stats["acc"], h),
                                   **COMPILED_KV)


def test_compiled_step_through_budget_changes(tokenizer):
    """A live budget change gives the buffers another capacity: the graph compiles again (dynamic shapes from the
    second shape on) and still gives the eager step's logits, before and after each change."""
    sessions = _prefilled(_eager_and_compiled("llama", tokenizer), seed=3, policy="streaming", budget=40, slack=4)
    compiled = sessions[1].model.step
    idx = len(sessions[0].messages) - 1
    token = int(sessions[0].last_logits.argmax())
    caps = set()
    for budget in (40, 24, 56, 32):
        for s in sessions:
            s.configure(budget=budget)
        for _ in range(12):
            logits = _fed(sessions, token, idx)
            torch.testing.assert_close(logits[1], logits[0], **COMPILED)
            assert int(logits[1].argmax()) == int(logits[0].argmax())
            token = int(logits[0].argmax())
            caps.add(sessions[1].cache.layers[0].caps[0])
        assert [layer.lens for layer in sessions[0].cache.layers] == [layer.lens for layer in sessions[1].cache.layers]
    assert len(caps) >= 3 and compiled.failed is None and compiled.calls >= 30


@pytest.mark.parametrize("policy", ["snapkv", "cake"])  # cake: every layer its own capacity
def test_compiled_greedy_replies_are_the_eager_steps(policy, tokenizer):
    eager, compiled = _eager_and_compiled("llama", tokenizer)
    greedy = Sampling(max_new_tokens=16, temperature=0.0)
    replies = []
    for cm in (eager, compiled):
        session = Session(cm, Settings(policy=policy, budget=48, slack=6), sampling=greedy)
        replies.append([session.chat(f"Q{i} " + "tok " * 30).answer for i in range(3)])
    assert replies[0] == replies[1]
    assert compiled.step.calls > 0


def test_compiled_step_never_reads_uninitialised_slots(tokenizer, monkeypatch):
    """The cache's buffers allocated from memory full of NaN (what uninitialised memory may hold): cake's per-layer
    capacities leave unused slots at the end of each buffer, and the compiled step's attention over the whole buffer
    (unused slots masked) must stay finite and equal to the eager step's."""
    from kvchat.core.cache import layer as layer_module

    class NanTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            t = torch.empty(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(layer_module, "torch", NanTorch())
    eager, compiled = _eager_and_compiled("llama", tokenizer)
    sessions = [Session(cm, Settings(policy="cake", budget=40, slack=6), system=None) for cm in (eager, compiled)]
    torch.manual_seed(4)
    prompt = torch.randint(10, 1000, (60,)).tolist()
    for s in sessions:
        s.feed_raw(prompt, score=False)
    for token in range(5, 17):
        logits = _fed(sessions, token, 0)
        assert torch.isfinite(logits[1]).all()
        torch.testing.assert_close(logits[1], logits[0], **COMPILED)
    assert compiled.step.calls >= 10


def test_compiled_step_falls_back_when_compiling_fails(tokenizer, monkeypatch, caplog):
    """No C++ compiler (or any compiler error): the session keeps going on the eager step and says so once."""
    eager, compiled = _eager_and_compiled("llama", tokenizer)

    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("InductorError: no working C++ compiler found")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    sessions = [Session(cm, Settings(policy="streaming", budget=64), system=None) for cm in (eager, compiled)]
    for s in sessions:
        s.feed_raw(list(range(20, 50)), score=False)
    for token in (7, 8, 9):
        logits = _fed(sessions, token, 0)
        assert torch.equal(logits[0], logits[1])
    assert compiled.step.failed.startswith("RuntimeError: InductorError") and compiled.step.calls == 0
    assert [r.message for r in caplog.records].count(
        f"--decode compiled failed ({compiled.step.failed}); kvchat's eager step instead") == 1


def test_compiled_decode_is_refused_where_it_cannot_run(tokenizer, caplog):
    """A bf16 model (or one on a GPU) gets the eager step, with the reason logged."""
    model = build_tiny("llama", tokenizer).to(torch.bfloat16)
    cm = ChatModel.from_pretrained_model(model, tokenizer, decode="compiled")
    assert type(cm.step) is DecodeStep
    assert "fp32 models on the CPU (this one: torch.bfloat16 on cpu)" in caplog.text


def test_compiled_step_leaves_a_growing_cache_to_the_eager_step(tokenizer):
    """``full`` doubles its buffer: attention over the whole of it would read up to twice what it holds."""
    eager, compiled = _eager_and_compiled("llama", tokenizer)
    sessions = [Session(cm, Settings(policy="full"), system=None) for cm in (eager, compiled)]
    for s in sessions:
        s.feed_raw(list(range(20, 50)), score=False)
    for token in (7, 8, 9, 10):
        logits = _fed(sessions, token, 0)
        assert torch.equal(logits[0], logits[1])
    assert compiled.step.calls == 0 and compiled.step.eager_calls == 4


def test_compiled_step_serves_sessions_in_several_threads(tokenizer):
    """Two sessions of one model stepping at once (the web UI's threads) get what each gets alone."""
    import threading

    eager, compiled = _eager_and_compiled("llama", tokenizer)
    prompts = [list(range(20, 60)), list(range(300, 330))]

    def run(cm, prompt, out):
        s = Session(cm, Settings(policy="streaming", budget=48, slack=6), system=None)
        s.feed_raw(prompt, score=False)
        out.extend(s._feed([([t], 0)], continue_message=True)[0] for t in range(5, 25))

    want = [[], []]
    for prompt, out in zip(prompts, want):
        run(eager, prompt, out)
    got = [[], []]
    threads = [threading.Thread(target=run, args=(compiled, p, o)) for p, o in zip(prompts, got)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w, g in zip(want, got):
        assert len(g) == 20
        for a, b in zip(w, g):
            torch.testing.assert_close(b, a, **COMPILED)
    assert compiled.step.calls >= 30 and compiled.step.failed is None


def test_compiled_step_keeps_the_computed_keys_the_eager_step_keeps(tokenizer, tmp_path):
    """Every decoded token's computed key, and where it was computed, are kept as with the eager step (compressions
    in ``rerotate`` mode rotate the kept keys from them, so the logits after them depend on it)."""
    models_ = _eager_and_compiled("llama", tokenizer)
    sessions = [Session(cm, Settings(policy="h2o", budget=40, slack=4), system=None) for cm in models_]
    for s in sessions:
        s.feed_raw(list(range(40, 70)), score=False)
    for token in range(5, 25):  # through compressions
        logits = _fed(sessions, token, 0)
        torch.testing.assert_close(logits[1], logits[0], **COMPILED)
    assert models_[1].step.calls >= 15 and sessions[0].evicted_total > 0
    for la, lb in zip(sessions[0].cache.layers, sessions[1].cache.layers):
        assert torch.equal(la.positions(), lb.positions())
        assert torch.equal(la.padded(la.computed), lb.padded(lb.computed))
        torch.testing.assert_close(lb.padded(lb.k0), la.padded(la.k0), **COMPILED_KV)
        # exactly what the graph wrote into the cache: the last token, computed at its slot's position
        n, cap = lb.lens[0], lb.caps[0]
        assert lb.abs_pos.view(lb.heads, cap)[:, n - 1].tolist() == [49] * lb.heads
        assert torch.equal(lb.k0.view(lb.heads, cap, -1)[:, n - 1], lb.keys.view(lb.heads, cap, -1)[:, n - 1])
