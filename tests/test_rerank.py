"""Recall's re-ranking (core/recall/rerank.py): the model reads the message after each of the best candidates, and
the candidates that make it likeliest come back first; a paraphrased question finds its fact among unrelated chat."""

import pytest
import torch

from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.core.recall import choose, rerank


def _ids(cm, text):
    return torch.tensor(cm.tokenizer(text, add_special_tokens=False)["input_ids"])


def _loglik(cm, prefix, question):
    """log P(question | prefix), the sequence read alone, unpadded, through the whole model's logits."""
    ids = torch.tensor([prefix + question])
    with torch.inference_mode():
        logprobs = cm.model(input_ids=ids, use_cache=False).logits[0].float().log_softmax(-1)
    at = torch.arange(len(prefix) - 1, len(prefix) - 1 + len(question))
    return float(logprobs[at, torch.tensor(question)].sum())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_gains_read_in_padded_batches_equal_each_sequence_read_alone(tiny, monkeypatch, arch, bf16):
    """In fp32 to its rounding; in bf16 (where the CPU multiplies it natively, rerank.BF16_READS) to bf16's."""
    cm = tiny(arch)
    monkeypatch.setattr(rerank, "BF16_READS", bf16)
    monkeypatch.setattr(rerank, "BATCH", 3)  # several batches, each padded to its longest row
    monkeypatch.setattr(rerank, "ROWS", 7)  # the logits of 7 positions at a time, over the whole vocabulary
    question = _ids(cm, "Where did I put the spare key for the shed?")
    candidates = [_ids(cm, t) for t in ("The key is under the pot.", "Hi.", "Rome was not built in a day, they say, "
                                        "and neither was any other city worth the name.", "Sure.", "Cats purr.")]
    rows = []
    hook = cm.model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(out.shape[0]))
    try:
        got = rerank.gains(cm, question, candidates)
    finally:
        hook.remove()
    assert max(rows) == 7 and sum(rows) == 6 * len(question)
    head, tail = cm.chat.user_wrap()
    q = question.tolist()
    none = _loglik(cm, head, q)
    want = torch.tensor([(_loglik(cm, head + c.tolist() + tail + head, q) - none) / len(q) for c in candidates])
    if bf16:
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
        monkeypatch.setattr(rerank, "BF16_READS", False)
        assert not torch.equal(got, rerank.gains(cm, question, candidates))  # the products did run in bf16
    else:
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_bf16_reads_take_a_few_shapes_and_fp32_reads_no_padding(tiny, monkeypatch):
    """oneDNN keeps a kernel for every shape it multiplies in bf16 (about 2 MB each for the default model), so the
    bf16 reads are padded to a few (rows: a full pool's, else a power of two; width: a multiple of 16), which changes
    no gain; bf16's gains are fp32's to its rounding, and fp32 reads are not padded."""
    cm = tiny("llama")
    seen, real = [], rerank._hidden
    monkeypatch.setattr(rerank, "_hidden", lambda cm, ids: seen.append(
        (tuple(ids.shape), torch.is_autocast_enabled("cpu"))) or real(cm, ids))
    gen = torch.Generator().manual_seed(0)
    words = lambda n: torch.randint(300, 2000, (n,), generator=gen)  # noqa: E731
    cases = [(words(int(torch.randint(1, 30, (1,), generator=gen))),
              [words(int(torch.randint(1, 40, (1,), generator=gen))) for _ in range(k)]) for k in range(1, 17)]
    for bf16 in (True, False):
        monkeypatch.setattr(rerank, "BF16_READS", bf16)
        seen.clear()
        got = [rerank.gains(cm, question, candidates, pool=16) for question, candidates in cases]
        head, tail = cm.chat.user_wrap()
        if bf16:
            padded = got
            for (question, candidates), a in zip(cases, got):  # the padding rows change nothing
                torch.testing.assert_close(a, rerank.gains(cm, question, candidates), atol=1e-3, rtol=0)
            del seen[len(cases):]  # the shapes of those unpadded reads
            assert all(on for _, on in seen)
            shapes = {shape for shape, _ in seen}
            assert {rows for rows, _ in shapes} <= {2, 4, 8, 16, 17} and all(w % 16 == 0 for _, w in shapes)
            assert len(shapes) <= 5 * 3, shapes
        else:
            assert not any(on for _, on in seen)
            assert [shape for shape, _ in seen] == [
                (len(c) + 1, len(head) + max([0] + [min(len(x), rerank.CANDIDATE_TOKENS) + len(tail) + len(head)
                                                    for x in c]) + min(len(q), rerank.QUESTION_TOKENS))
                for q, c in cases]
            for a, b in zip(padded, got):  # bf16's rounding: some 3% of the largest gain (tiny random models)
                torch.testing.assert_close(a, b, atol=4e-2 * max(1.0, float(b.abs().max())), rtol=0)


def test_the_message_is_read_after_its_candidates_as_a_user_message(tokenizer, tiny):
    head, tail = tiny("llama").chat.user_wrap()
    assert tokenizer.decode(head) == "<|im_start|>user\n" and tokenizer.decode(tail) == "<|im_end|>\n"


FILLER = ["How can I help you today?", "The capital of France is Paris.", "Photosynthesis turns light into chemical "
          "energy.", "Here is a recipe for a simple tomato soup.", "Python lists can hold items of any type.",
          "The meeting notes are attached below.", "I enjoyed the film we talked about.",
          "Sure, here are three tips for better sleep.", "The train was delayed by twenty minutes.",
          "Exercise helps the heart stay healthy.", "Let me know if you need anything else.",
          "The sum of the angles in a triangle is 180 degrees.", "My favourite season is autumn."]


@pytest.mark.parametrize("fact, question", [
    ("The gate code for the car park is 7741.", "How do I open the barrier when I drive in?"),
    ("Our landlord is called Mr. Abernathy.", "Who owns the flat we rent?"),
    ("The passport is in the top drawer of my desk.", "Where did I put my travel documents?"),
])
def test_the_default_model_ranks_a_fact_first_for_a_question_sharing_no_word_with_it(smol, fact, question):
    candidates = FILLER[:6] + [fact] + FILLER[6:]
    gains = rerank.gains(smol, _ids(smol, question), [_ids(smol, t) for t in candidates])
    assert int(gains.argmax()) == 6 and float(gains[6]) > 0


def test_only_the_pool_is_reranked_and_only_a_likelier_message_brings_a_candidate_back(tiny, monkeypatch):
    cm = tiny("llama")
    texts = {g: (100 + g,) for g in range(8)}
    texts[5] = texts[1]  # a copy of a better candidate's text
    held = torch.tensor([0.0, 0, 0, 1, 0, 0, 0, 0])  # group 3 is held: neither it nor its text comes back
    content = torch.tensor([True, True, True, True, True, True, True, False])
    wanted = torch.tensor([0.9, 0.8, 0.7, 0.95, 0.6, 0.75, 0.5, 0.99])
    seen = []

    def gains(model, question, candidates, pool=None):
        seen.append([tuple(c.tolist()) for c in candidates])
        return torch.tensor([-0.2, 0.3, 0.0, 0.1])[: len(candidates)]

    monkeypatch.setattr(rerank, "gains", gains)
    out = choose.reranked(cm, wanted, held, content, texts.__getitem__, torch.tensor([7, 8]), pool=4)
    # the pool: the best four eligible, distinct texts (7: no content; 3: held; 5: a copy of 1)
    assert len(seen[0]) == 4 and seen == [[texts[0], texts[1], texts[2], texts[4]]]
    assert out.tolist() == pytest.approx([0.0, 0.3, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0])


def test_a_chat_with_reranking_recalls_only_from_its_pool(tiny, monkeypatch):
    from test_durability import TURNS

    pools, spent = [], []
    real = rerank.gains

    def spy(model, question, candidates, pool=None):
        pools.append(len(candidates))
        out = real(model, question, candidates, pool)
        spent.append(out)
        return out

    monkeypatch.setattr(rerank, "gains", spy)
    monkeypatch.setattr("kvchat.core.recall.gate.keeps", lambda without, with_recall: True)
    session = Session(tiny("llama"), Settings(policy="streaming", budget=48, window=8, slack=6, recall="on",
                                              groups="sentence", recall_rerank=3),
                      sampling=Sampling(max_new_tokens=6, temperature=0.0))
    recalled = 0
    for user, reply in TURNS * 2:
        calls = len(spent)
        res = session.exchange(user, reply)
        recalled += res.recalled_groups
        if res.recalled_groups:  # each recalled group made the message likelier when this message re-ranked it
            assert len(spent) == calls + 1 and res.recalled_groups <= int((spent[-1] > 0).sum())
    assert pools and max(pools) == 3 and recalled > 0


def test_reranking_is_on_by_default_on_a_gpu_only_and_its_setting_is_checked(tiny):
    assert Settings().recall_rerank is None
    assert rerank.pool_size(None, torch.device("cpu")) == 0
    assert rerank.pool_size(None, torch.device("cuda")) == rerank.GPU_DEFAULT
    assert rerank.pool_size(8, torch.device("cpu")) == 8 and rerank.pool_size(0, torch.device("cuda")) == 0
    session = Session(tiny("llama"), Settings(policy="streaming", budget=48, window=8, slack=6))
    with pytest.raises(ValueError, match="recall_rerank"):
        session.configure(recall_rerank=-1)
    session.configure(recall_rerank=4)
    assert session.settings.recall_rerank == 4
