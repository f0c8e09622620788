"""A read of several tokens through the decode step's layers (``DecodeStep.read``, core/decode/eager.py: a message, a
long paste's chunks, recall's text read again) computes what the model's forward computes: the same logits, cache,
policy statistics and recall's queries, so every reply and every choice of a chat is the same as when each read went
through the model's forward."""

import pytest
import torch

from kvchat.core.decode import weights
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.core.model.loading import ChatModel
from kvchat.core.recall import rerank
from kvchat.core.recall.score import QueryTap

from test_graph import _assert_same_cache, cuda
from tinymodels import build_tiny

# past the budget of 48 from the first message: chunks of the slack with compressions between them, recall reading
# evicted sentences back
MESSAGES = ["Hello there. Tell me about the sea! The sea is wide and deep, and it is blue. " * 3,
            "And the mountains? Are they tall? Some are.", "Hi",
            "What about the rivers in the north, and the lakes? Tell me about the sea again. " * 4]
BF16 = 2e-2


def _counted(cm: ChatModel) -> list[int]:
    """The lengths of the reads ``cm``'s step takes from now on."""
    calls, read = [], cm.step.read

    def counted(ids, *args, **kwargs):
        calls.append(ids.numel())
        return read(ids, *args, **kwargs)

    cm.step.read = counted
    return calls


def _chats(tokenizer, arch="llama", held="model", decode="auto", policy="h2o", dtype=torch.float32, device="cpu"):
    """The same chat twice: reads through the step (with the lengths of its reads), and through the model."""
    out = []
    for through_model in (False, True):
        model = build_tiny(arch, tokenizer).to(device=device, dtype=dtype)
        weights.apply(model, held)
        cm = ChatModel.from_pretrained_model(model, tokenizer, name=f"tiny-{arch}", decode=decode)
        cm.step.reads = not through_model  # else the model's forward, as every read went before
        calls = _counted(cm)
        session = Session(cm, Settings(policy=policy, budget=48, window=8, slack=8),
                          sampling=Sampling(max_new_tokens=12, temperature=0.0))
        turns = [session.chat(m) for m in MESSAGES]
        out.append((session, [(t.answer, t.recalled, t.recall_declined) for t in turns], calls))
    return out


def _assert_same_chats(chats, atol: float = 0.0, recalls: bool = True) -> None:
    (a, turns_a, calls), (b, turns_b, _) = chats
    assert calls and max(calls) > 8  # the step read the messages, in chunks past the budget
    assert not recalls or any(recalled or declined for _, recalled, declined in turns_a)  # recall read text back
    assert turns_a == turns_b  # every reply, every recall and what its gate declined
    _assert_same_cache(a, b, atol=atol)
    if atol == 0:  # recall's digests of the turns' sentences, from the keys as they were computed
        for name in ("span", "keys", "scale"):
            assert (a.digests.store.field(name) == b.digests.store.field(name)).all()


@pytest.mark.parametrize("held", ["model", "half"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "llama3-scaled"])
def test_a_chat_read_through_the_step_is_the_chat_read_through_the_model_bit_for_bit(arch, held, tokenizer):
    """Each family (Qwen2's q/k/v biases, a scaled rotary embedding) with its weights as loaded and with kvchat's fp16
    copies (which serve one token's row, in the step and in the model's linear layers alike)."""
    _assert_same_chats(_chats(tokenizer, arch, held))


@pytest.mark.parametrize("policy", ["streaming", "tova", "snapkv", "cake", "headaware", "full"])
def test_every_policy_sees_the_same_statistics_through_the_step(policy, tokenizer):
    _assert_same_chats(_chats(tokenizer, held="half", policy=policy), recalls=policy != "full")


@pytest.mark.parametrize("arch, policy", [("llama", "h2o"), ("qwen2", "snapkv")])
def test_the_graph_steps_read_in_one_product_is_the_models_bit_for_bit_in_fp32(arch, policy, tokenizer):
    """The graph step reads with its concatenated q/k/v and gate/up weights and PyTorch's ``rms_norm``: in fp32 on the
    CPU the same bits as the model's three and two products and its norm."""
    _assert_same_chats(_chats(tokenizer, arch, decode="graph", policy=policy))


def test_the_graph_steps_read_in_bf16_is_the_models_within_its_rounding(tokenizer):
    """In bf16 ``rms_norm`` may round where the model's norm module rounds otherwise (on a GPU it does)."""
    _assert_same_chats(_chats(tokenizer, decode="graph", dtype=torch.bfloat16), atol=BF16)


@pytest.mark.parametrize("keep", ["all", "tail"])
def test_a_read_gives_the_models_logits_of_every_row_or_the_last_and_recalls_queries(keep, tokenizer):
    """A chunk read with recall's query tap, every row's log-probabilities asked (a replay's scoring) or the last
    ``tail`` rows' (recall's gate): the same numbers and the same kept queries."""
    sessions = [s for s, _, _ in _chats(tokenizer, held="half")]
    ids = torch.randint(10, 1000, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    out = []
    for s in sessions:
        tap = QueryTap(s.digests.layers)
        res = s._feed([(ids, len(s.messages) - 1)], want_logprobs=keep == "all", continue_message=True, tap=tap,
                      tail=7 if keep == "tail" else 0)
        out.append((res, s.tail_logprobs if keep == "tail" else None, tap.queries))
    (res_a, tail_a, q_a), (res_b, tail_b, q_b) = out
    for x, y in zip(res_a, res_b):
        assert (x is None and y is None) or torch.equal(x, y)
    if keep == "tail":
        assert tail_a[1].numel() == 7 and all(torch.equal(x, y) for x, y in zip(tail_a, tail_b))
    assert q_a.keys() == q_b.keys() and q_a and all(torch.equal(q_a[li], q_b[li]) for li in q_a)
    _assert_same_cache(sessions[0], sessions[1], atol=0.0)


@pytest.mark.parametrize("decode, held", [("auto", "model"), ("auto", "half"), ("graph", "model")])
def test_recalls_re_ranking_reads_its_candidates_through_the_step_bit_for_bit(decode, held, tokenizer):
    """Re-ranking reads the message after each candidate in padded rows with no cache (``DecodeStep.hidden``): the
    gains the model's forward gives, and the step's layers are what read them."""
    model = build_tiny("qwen2", tokenizer)
    weights.apply(model, held)
    cm = ChatModel.from_pretrained_model(model, tokenizer, name="tiny-qwen2", decode=decode)
    words = lambda t: torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    question = words("Where did I put the spare key for the shed?")
    candidates = [words(t) for t in ("The key is under the pot.", "Hi.", "Rome was not built in a day, they say.")]
    rows, hook = [], cm.model.model.register_forward_hook(lambda *args: rows.append(1))
    try:
        through_step = rerank.gains(cm, question, candidates)
        assert not rows  # the model's forward did not run
        cm.step.reads = False
        through_model = rerank.gains(cm, question, candidates)
        assert rows
    finally:
        hook.remove()
    assert torch.equal(through_step, through_model)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["streaming", "full"])
def test_the_graph_steps_read_on_the_gpu_is_the_models_within_bf16(policy, tokenizer):
    """On a GPU (bf16, SDPA's lower-right causal bias, the fused ``rms_norm``): 200 tokens read in chunks with
    compressions between them (``streaming``: which slots stay does not hang on a rounding) or into the full cache, a
    cache and last logits within bf16's rounding of the model's forward."""
    sessions = []
    for through_model in (False, True):
        model = build_tiny("llama", tokenizer).to(device="cuda", dtype=torch.bfloat16)
        cm = ChatModel.from_pretrained_model(model, tokenizer, name="tiny-llama", decode="graph")
        cm.step.reads = not through_model
        session = Session(cm, Settings(policy=policy, budget=48, window=8, slack=8) if policy != "full" else
                          Settings(policy="full"), system=None, sampling=Sampling(temperature=0.0))
        session.feed_raw(torch.randint(10, 1000, (200,), generator=torch.Generator().manual_seed(5)).tolist(),
                         score=False)
        sessions.append(session)
    a, b = sessions
    torch.testing.assert_close(a.last_logits.float(), b.last_logits.float(), atol=BF16, rtol=BF16)
    _assert_same_cache(a, b, atol=BF16)
