"""Sampling through transformers' logits processors: what each setting does, what the penalties may look at, and
the model's defaults."""

import pytest
import torch
from transformers import GenerationConfig

from kvchat.core.model.loading import ChatModel
from kvchat.core.engine.sampling import Sampler, logits_processors
from kvchat.core.engine.session import Session
from kvchat.core.engine.settings import Sampling, Settings


def _logits(best: int, second: int, vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(vocab)
    logits[best], logits[second] = 5.0, 4.0
    return logits


def test_greedy_without_penalties_is_plain_argmax():
    sampler = Sampler(Sampling(temperature=0.0), torch.Generator())
    assert len(sampler.processors) == 0
    assert sampler(_logits(3, 7)) == 3


def test_repetition_penalty_sees_only_the_visible_tokens():
    greedy = Sampling(temperature=0.0, repetition_penalty=2.0)
    assert Sampler(greedy, torch.Generator(), torch.tensor([1, 2, 3]))(_logits(3, 7)) == 7  # 3 is visible: penalized
    assert Sampler(greedy, torch.Generator(), torch.tensor([1, 2, 4]))(_logits(3, 7)) == 3  # 3 was evicted: free
    sampler = Sampler(greedy, torch.Generator(), torch.tensor([1]))
    assert sampler(_logits(3, 7)) == 3
    assert sampler(_logits(3, 7)) == 7  # the reply so far counts too


def test_no_repeat_ngram_blocks_a_visible_bigram():
    sampler = Sampler(Sampling(temperature=0.0, no_repeat_ngram_size=2), torch.Generator(), torch.tensor([5, 3, 5]))
    assert sampler(_logits(3, 7)) == 7  # "5 3" already occurred


def test_top_k_one_is_greedy_even_at_high_temperature():
    sampler = Sampler(Sampling(temperature=5.0, top_k=1, top_p=1.0), torch.Generator().manual_seed(0))
    assert {sampler(_logits(3, 7)) for _ in range(20)} == {3}


def test_min_p_drops_unlikely_tokens():
    logits = torch.full((10,), -10.0)
    logits[2], logits[6] = 3.0, 2.5
    sampler = Sampler(Sampling(temperature=1.0, top_p=1.0, min_p=0.3), torch.Generator().manual_seed(1))
    assert {sampler(logits) for _ in range(50)} == {2, 6}


def test_processors_follow_generate_order():
    names = [type(p).__name__ for p in logits_processors(Sampling(temperature=0.5, top_k=4, top_p=0.8, min_p=0.1,
                                                                  repetition_penalty=1.2, no_repeat_ngram_size=3))]
    assert names == ["RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor", "TemperatureLogitsWarper",
                     "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper"]


@pytest.mark.parametrize("field, value, match", [
    ("temperature", -1, "temperature must be >= 0"),
    ("top_p", 0, "top_p must be >= "),
    ("top_k", -3, "top_k must be >= 0"),
    ("min_p", 1.5, "min_p must be <= 1"),
    ("repetition_penalty", 0.5, "repetition_penalty must be >= 1"),
    ("no_repeat_ngram_size", "two", "no_repeat_ngram_size must be a whole number"),
    ("temperature", float("nan"), "temperature must be a finite number"),
    ("max_new_tokens", 0, "max_new_tokens must be >= 1"),
])
def test_bad_sampling_settings_are_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        Sampling().changed(**{field: value})


def test_model_generation_config_gives_the_defaults(tiny):
    model = tiny("qwen2")
    wrapped = ChatModel.from_pretrained_model(model.model, model.tokenizer, name="tiny-with-config")
    assert wrapped.sampling_defaults == {}
    wrapped.model.generation_config = GenerationConfig(do_sample=True, temperature=0.6, top_k=20,
                                                       repetition_penalty=1.05)
    wrapped = ChatModel.from_pretrained_model(wrapped.model, model.tokenizer, name="tiny-with-config")
    smp = Sampling.for_model(wrapped, top_p=0.5)
    assert (smp.temperature, smp.top_k, smp.repetition_penalty, smp.top_p) == (0.6, 20, 1.05, 0.5)
    wrapped.model.generation_config = GenerationConfig()


def test_reply_penalizes_only_what_the_cache_holds(tiny):
    """The sampler of a reply starts from the tokens at the kept positions, not from everything ever fed."""
    model = tiny("llama")
    session = Session(model, Settings(policy="streaming", budget=48, window=8, slack=4),
                      sampling=Sampling(max_new_tokens=2, temperature=0.0, repetition_penalty=1.3), system=None)
    for i in range(4):
        session.exchange(f"Question {i}: " + "word " * 20, "Answer. " + "reply " * 10)
    seen = []
    original = Sampler.__init__

    def spy(self, sampling, generator, visible=None):
        seen.append(visible.clone())
        original(self, sampling, generator, visible)

    Sampler.__init__ = spy
    try:
        session.chat("And now?")
    finally:
        Sampler.__init__ = original
    assert session.evicted_total > 0
    kept = seen[0]
    assert kept.numel() < session.total_tokens
    assert kept.numel() <= 48 + 4
