"""--weights half: reads of several tokens run on the loaded weights unchanged; one-token steps on an fp16 copy."""

import copy

import pytest
import torch

from kvchat.core.model import loading as models
from kvchat.core.decode import weights
from kvchat.core.model.loading import ChatModel
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings

from tinymodels import build_tiny


@pytest.fixture(params=["llama", "qwen2"])  # qwen2: q/k/v projections with a bias
def pair(request, tokenizer):
    plain = build_tiny(request.param, tokenizer)
    half = copy.deepcopy(plain)
    assert weights.apply(half, "half") == "half"
    return plain, half


def test_several_tokens_run_on_the_loaded_weights_exactly(pair):
    plain, half = pair
    ids = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, half(ids).logits)


def test_one_token_steps_use_the_fp16_copy_and_stay_close(pair):
    plain, half = pair
    assert any(isinstance(m, weights.HalfLinear) for m in half.modules())
    assert not any(type(m) is torch.nn.Linear for m in half.modules())
    ids = torch.randint(0, 1000, (1, 1))
    with torch.no_grad():
        a, b = plain(ids).logits, half(ids).logits
    assert not torch.equal(a, b)  # the fp16 path really ran
    assert torch.allclose(a, b, atol=2e-2 * a.abs().max().item())
    assert half.model.layers[0].mlp.up_proj.step.dtype == torch.float16
    with torch.no_grad(), weights.as_loaded(half):  # the reference the speed bench compares with
        assert torch.equal(half(ids).logits, a)
    with torch.no_grad():
        assert torch.equal(half(ids).logits, b)


def test_tied_output_layer_stays_tied_and_a_step_reads_half_the_bytes(tokenizer):
    plain = build_tiny("llama", tokenizer)
    plain.config.tie_word_embeddings = True
    plain.tie_weights()
    half = copy.deepcopy(plain)
    weights.apply(half, "half")
    assert half.lm_head.weight is half.model.embed_tokens.weight
    full, fast = weights.step_bytes(plain), weights.step_bytes(half)
    norms = sum(p.numel() * 4 for n, p in plain.named_parameters() if "norm" in n)
    assert fast - norms == (full - norms) // 2


def test_budget_larger_than_the_chat_gives_the_full_caches_replies_with_half_weights(tokenizer):
    model = build_tiny("llama", tokenizer)
    weights.apply(model, "half")
    cm = ChatModel.from_pretrained_model(model, tokenizer, name="tiny-half")
    greedy = Sampling(max_new_tokens=12, temperature=0.0)
    replies = []
    for settings in (Settings(policy="full"), Settings(policy="h2o", budget=400)):
        session = Session(cm, settings, sampling=greedy)
        replies.append([session.chat(q).answer for q in ("Hello there.", "Tell me about the sea.")])
        assert session.evicted_total == 0
    assert replies[0] == replies[1]


def test_weights_are_resolved_and_checked(model_dir):
    cpu = torch.device("cpu")
    assert weights.resolve("auto", cpu, torch.float32) == "half"
    assert weights.resolve("auto", cpu, torch.bfloat16) == "model"
    assert weights.resolve("auto", torch.device("cuda"), torch.float32) == "model"
    assert weights.resolve("half", cpu, torch.bfloat16) == "half"
    assert models.load(str(model_dir), weights="model").weights == "model"
    assert models.load(str(model_dir)).weights == "half"
    with pytest.raises(models.ModelError, match="unknown weights 'int3'"):
        models.load(str(model_dir), weights="int3")
