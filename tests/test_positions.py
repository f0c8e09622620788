"""Re-rotation: a key moved from position p to q equals the key the model computes at q."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from kvchat.core.cache.kvcache import KVCache
from kvchat.core.cache.positions import Rotary
from kvchat.core.model.loading import cache_argument

from tinymodels import ROPE_ARCHS, build_tiny


def _keys_at(model, token: int, position: int) -> list[torch.Tensor]:
    """Every layer's cached key for ``token`` fed alone at ``position``.

    With a single token, attention returns its own value whatever the position, so hidden states (and so the
    un-rotated keys) are identical at every position: the cached keys differ only by the rotation.
    """
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]),
              **{cache_argument(model): cache}, use_cache=True)
    return [layer.keys[0, :, 0].clone() for layer in cache.layers]


@pytest.mark.parametrize("arch", ROPE_ARCHS)
def test_rerotated_key_equals_key_computed_at_new_position(arch, tokenizer):
    model = build_tiny(arch, tokenizer)
    rotary = Rotary.from_model(model)
    assert rotary is not None
    for p, q in [(5, 0), (300, 7), (17, 400), (0, 511)]:
        moved = [rotary.rotate(k, torch.tensor(q - p)) for k in _keys_at(model, 1234, p)]
        for got, want in zip(moved, _keys_at(model, 1234, q)):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_partial_rotary_leaves_pass_through_dims(tokenizer):
    model = build_tiny("gpt-neox", tokenizer)
    rotary = Rotary.from_model(model)
    assert rotary.rotary_dim == 4  # head_dim 16 * 0.25
    keys = torch.randn(3, 16)
    out = rotary.rotate(keys, torch.tensor(9))
    assert torch.equal(out[:, 4:], keys[:, 4:])
    assert not torch.allclose(out[:, :4], keys[:, :4])


def test_rotation_composes_and_inverts():
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    keys = torch.randn(2, 5, 8)
    there = rotary.rotate(keys, torch.tensor([3, 1, 4, 1, 5]))
    torch.testing.assert_close(rotary.rotate(there, -torch.tensor([3, 1, 4, 1, 5])), keys, atol=1e-5, rtol=1e-5)


def test_the_cpus_shortcuts_give_the_angles_a_gpu_computes_for_every_key():
    """On the CPU, many keys with few distinct deltas take cos/sin once per delta (and a repeated call reuses the
    last); a GPU computes every key's: the same bits."""
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    delta = torch.randint(-40, 900, (16, 8, 300))  # 38,400 keys, 940 distinct deltas: the gathered path
    rotary = Rotary(inv)
    for _ in range(2):  # computed, then reused
        cos, sin = rotary._trig(delta)
        angle = delta.to(torch.float32)[..., None] * inv
        assert torch.equal(cos, angle.cos()) and torch.equal(sin, angle.sin())


def test_reused_trig_gives_the_result_of_a_fresh_rotation():
    """A rotation by the deltas of the call before reuses their cos/sin; any other deltas are computed anew."""
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    warm = Rotary(inv)
    keys = torch.randn(3, 6, 8)
    deltas = [torch.tensor([[3, 1, 4, 1, 5, 9]] * 3), torch.tensor([[3, 1, 4, 1, 5, 9]] * 3),
              torch.tensor([[3, 1, 4, 1, 5, 8]] * 3), torch.tensor([3, 1, 4, 1, 5, 8]), torch.tensor(7),
              torch.tensor([[3, 1, 4, 1, 5, 8]] * 3)]
    for delta in deltas:
        got = warm.rotate(keys, delta)
        assert torch.equal(got, Rotary(inv).rotate(keys, delta))
    # and the half-rotation is the model's own: k * cos + rotate_half(k) * sin
    angle = 7 * inv
    cos, sin = torch.cat([angle.cos()] * 2), torch.cat([angle.sin()] * 2)
    want = keys * cos + torch.cat([-keys[..., 4:], keys[..., :4]], -1) * sin
    assert torch.equal(warm.rotate(keys, torch.tensor(7)), want)


def test_rotating_many_keys_by_few_deltas_gives_the_bits_of_each_key_rotated_alone():
    """A rebuild rotates thousands of keys (every layer, head and slot) by deltas within the cache's length: cos and
    sin are then computed once per distinct delta and gathered, which must leave every key bit for bit as rotated
    on its own, and as the model's own half-rotation would."""
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    keys = torch.randn(4, 3, 300, 64)
    delta = torch.randint(-500, 500, (4, 3, 300))
    many = Rotary(inv).rotate(keys, delta)
    for li, h, i in [(0, 0, 0), (3, 2, 299), (1, 1, 17), (2, 0, 150)]:
        alone = Rotary(inv).rotate(keys[li, h, i: i + 1], delta[li, h, i: i + 1])
        assert torch.equal(many[li, h, i: i + 1], alone)
        angle = int(delta[li, h, i]) * inv
        cos, sin = torch.cat([angle.cos()] * 2), torch.cat([angle.sin()] * 2)
        k = keys[li, h, i]
        assert torch.equal(many[li, h, i], k * cos + torch.cat([-k[32:], k[:32]]) * sin)


def test_models_without_rope_need_no_rotation(tokenizer):
    assert Rotary.from_model(build_tiny("gpt2", tokenizer)) is None


def test_length_dependent_rope_is_refused():
    from transformers import AutoModelForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                 "factor": 2.0})
    with pytest.raises(ValueError, match="--positions original"):
        Rotary.from_model(AutoModelForCausalLM.from_config(config))


def test_keep_rerotates_kept_keys_to_their_new_slots():
    """After keep(), head h's kept keys end right before next_pos: each equals its computed key rotated by the
    change of position (per head, with different numbers kept per head)."""
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    cache = KVCache(num_layers=1, capacity=16, max_capacity=16, keeps_computed=True)
    layer = cache.layers[0]
    keys, values = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    cache.incoming_abs = torch.arange(10, dtype=torch.int32)
    layer.update(keys, values)
    index = [torch.tensor([0, 1, 6, 9]), torch.tensor([0, 3, 9])]
    layer.keep(index, rotary, next_pos=4, caps=[9, 7])
    per_slot = 3 * 8 * 4 + 4 + 4 + 8  # keys, values, computed keys; absolute and computed positions; storage row
    assert layer.lens == [4, 3] and layer.caps == [9, 7] and layer.nbytes == (9 + 7) * per_slot
    for h in range(2):
        kept_keys = layer.keys[layer.offs[h]: layer.offs[h] + layer.lens[h]]
        for slot, old in enumerate(index[h].tolist()):
            new_pos = 4 - len(index[h]) + slot
            torch.testing.assert_close(kept_keys[slot], rotary.rotate(keys[0, h, old], torch.tensor(new_pos - old)))
            assert torch.equal(layer.values[layer.offs[h] + slot], values[0, h, old])
            assert layer.abs_pos[layer.offs[h] + slot] == old
