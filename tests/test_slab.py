"""Slabs (core/cache/slab.py): a compression moves the kept slots of every layer of a slab at once. What a user relies
on: the same cache as moving each head by itself, whatever the slabs' sizes; buffers that stay where they are between
compressions (the captured decode step reads them); memory that holds no dead rows and no slab over its bound."""

import pytest
import torch

from kvchat.core.cache import slab
from kvchat.core.cache.kvcache import KVCache
from kvchat.core.cache.positions import Rotary
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.core.model.loading import ChatModel

from tinymodels import build_tiny

ROTARY = Rotary(1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))


def _filled(layers: int, heads: int, n: int, caps: list[int], stat: bool = True) -> tuple[KVCache, list[dict]]:
    """A hand-fed cache: ``layers`` layers of ``heads`` heads holding n random tokens each (a statistic too), and a
    copy of every layer's per-slot tensors."""
    cache = KVCache(num_layers=layers, capacity=None, max_capacity=64, keeps_computed=True)
    cache.incoming_abs = torch.arange(n, dtype=torch.int32) + 100
    cache.incoming_pos = torch.arange(n, dtype=torch.int32) + 7
    for layer in cache.layers:
        layer.update(torch.randn(1, heads, n, 8), torch.randn(1, heads, n, 8))
        if stat:
            layer.ensure_stat("acc").copy_(torch.rand(layer.keys.shape[0]))
        layer.rows.copy_(torch.arange(layer.rows.numel()))
    slab.move(cache.layers, [layer.held_slots() for layer in cache.layers], [layer.lens for layer in cache.layers],
              caps=[caps] * layers)
    return cache, [{k: t.clone() for k, t in layer.per_slot().items()} for layer in cache.layers]


def _expected(before: dict, offs: list[int], idx: torch.Tensor, h: int, next_pos: int) -> dict:
    """Head h's kept slots as moving them one by one gives: every tensor gathered, keys re-rotated from the computed
    ones to the slots ending before ``next_pos``."""
    src = idx + offs[h]
    out = {name: t[src] for name, t in before.items()}
    new_pos = next_pos - len(idx) + torch.arange(len(idx))
    out["keys"] = ROTARY.rotate(before["k0"][src], new_pos - before["computed"][src].long())
    return out


@pytest.mark.parametrize("new_caps", [None, [12, 10, 20]], ids=["in-place", "new-capacities"])
@pytest.mark.parametrize("slab_bytes", [1, 1 << 30], ids=["a-slab-a-layer", "one-slab"])
@pytest.mark.parametrize("stat_layers", [(0, 1, 2), (0, 2)], ids=["stat-everywhere", "stat-in-two-layers"])
def test_move_gives_each_heads_slots_as_moving_them_one_by_one(new_caps, slab_bytes, stat_layers, monkeypatch):
    """Three layers, heads keeping different numbers of slots (one none), in an order other than ascending in one
    head, a statistic made after the slabs (outside them; in some layers only): the same keys (re-rotated), values,
    computed keys, positions, rows and statistics as gathering each head apart, and the heads' lengths and first
    positions. In place, every buffer stays where it was; into new capacities, every tensor is in the new slabs (one
    for layers of the same tensors within the bound)."""
    monkeypatch.setattr(slab, "SLAB_BYTES", slab_bytes)
    torch.manual_seed(0)
    cache, before = _filled(3, 3, 10, [16, 16, 16], stat=False)
    for li in stat_layers:
        before[li]["stat.acc"] = cache.layers[li].ensure_stat("acc").copy_(torch.rand(48)).clone()
    offs = [list(layer.offs) for layer in cache.layers]
    where = [{name: t.data_ptr() for name, t in layer.per_slot().items()} for layer in cache.layers]
    index = [[torch.tensor([0, 2, 9]), torch.tensor([9, 1, 4, 5]), torch.tensor([], dtype=torch.long)],
             [torch.tensor([3]), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9]), torch.tensor([8, 9])],
             [torch.tensor([1, 2]), torch.tensor([4]), torch.tensor([0, 7])]]
    padded = [torch.nn.utils.rnn.pad_sequence(i, batch_first=True) for i in index]
    kept = [[len(i) for i in li] for li in index]
    slab.move(cache.layers, padded, kept, ROTARY, next_pos=12, caps=[new_caps] * 3 if new_caps else None)
    for layer, saved, heads, off in zip(cache.layers, before, index, offs):
        assert layer.lens == [len(i) for i in heads] and layer.pos_off == [12 - len(i) for i in heads]
        for h, idx in enumerate(heads):
            want = _expected(saved, off, idx, h, 12)
            for name, t in layer.per_slot().items():
                torch.testing.assert_close(layer.head_view(t, h), want[name], rtol=0, atol=0)
    if new_caps is None:
        assert [{name: t.data_ptr() for name, t in layer.per_slot().items()} for layer in cache.layers] == where
    else:
        slabs = {id(layer.slab) for layer in cache.layers}
        assert len(slabs) == (3 if slab_bytes == 1 or len(stat_layers) == 2 else 1)
        assert all(t.untyped_storage().data_ptr() == layer.slab.bases[name].untyped_storage().data_ptr()
                   for layer in cache.layers for name, t in layer.per_slot().items())


def test_compressions_move_the_slots_in_place_in_one_slab_per_bound(tokenizer, monkeypatch):
    """A chat through many compressions: after the first, every layer's tensors are views of slabs that hold nothing
    else, none larger than the bound (a layer each at a bound under a layer); a compression that keeps the capacities
    leaves every buffer where it was (a captured step stays valid); a budget change moves them into new slabs with
    their contents."""
    model = ChatModel.from_pretrained_model(build_tiny("llama", tokenizer), tokenizer, name="tiny", decode="graph")
    session = Session(model, Settings(policy="h2o", budget=48, window=8, slack=8, recall="off"),
                      sampling=Sampling(max_new_tokens=16, temperature=0.0))
    session.chat("Hello there. Tell me about the sea and the mountains, and rivers, lakes and the sky above them.")
    layers = session.cache.layers
    for bound, budget, per_slab in ((1 << 30, 40, len(layers)), (1, 36, 1)):
        monkeypatch.setattr(slab, "SLAB_BYTES", bound)
        session.configure(budget=budget)
        slabs = {id(layer.slab): layer.slab for layer in layers}
        assert len(slabs) == len(layers) // per_slab
        assert sum(s.size for s in slabs.values()) == sum(sum(layer.caps) for layer in layers)
        where = [(layer.version, layer.keys.data_ptr(), layer.rows.data_ptr()) for layer in layers]
        evictions = session.evictions.total
        session.chat("And what about the rivers in the north? Are they cold, and long?")
        assert session.evictions.total > evictions
        assert [(layer.version, layer.keys.data_ptr(), layer.rows.data_ptr()) for layer in layers] == where


def test_a_budget_change_keeps_every_slot(tokenizer):
    """``KVCache.set_capacity`` moves every held slot into the new capacity unchanged, into one slab."""
    torch.manual_seed(1)
    cache, before = _filled(2, 2, 6, [8, 8])
    cache.set_capacity(20)
    for layer, saved in zip(cache.layers, before):
        assert layer.caps == [20, 20] and layer.lens == [6, 6] and layer.slab is cache.layers[0].slab
        for name, t in layer.per_slot().items():
            for h in range(2):
                assert torch.equal(layer.head_view(t, h), saved[name][h * 8: h * 8 + 6])


def test_a_compression_gathers_layers_that_left_their_slab_back_into_one():
    """A layer moved into new buffers by itself (a keep of its own into other capacities) leaves its rows in the old
    slab dead: the next compression moves every layer into one new slab, so no memory stays held for nothing."""
    cache, _ = _filled(2, 2, 6, [8, 8])
    cache.layers[1].keep([torch.arange(6)] * 2, caps=[10, 10])
    assert cache.layers[1].slab is not cache.layers[0].slab
    slab.move(cache.layers, [layer.held_slots() for layer in cache.layers], [[6, 6]] * 2, stack=True)
    first = cache.layers[0].slab
    assert cache.layers[1].slab is first and first.size == 8 + 8 + 10 + 10


@pytest.mark.parametrize("policy", ["streaming", "h2o"])  # h2o: a statistic made after the layers' first buffers
def test_a_new_caches_layers_share_one_slab_and_the_first_compression_moves_in_place(policy, tokenizer):
    """A bounded cache's layers take their first buffers from one slab (and H2O's statistic from the same), so the
    first compression already moves their slots in place: nothing is copied into new storage, a graph captured
    before it stays valid."""
    model = ChatModel.from_pretrained_model(build_tiny("llama", tokenizer), tokenizer, name="tiny", decode="graph")
    session = Session(model, Settings(policy=policy, budget=64, window=8, slack=8, recall="off"), system=None,
                      sampling=Sampling(max_new_tokens=8, temperature=0.0))
    session.chat("Hello there.")
    layers = session.cache.layers
    assert session.evicted_total == 0 and all(layer.slab is layers[0].slab for layer in layers)
    assert slab.in_slabs(layers) and ("stat.acc" in layers[0].slab.bases) == (policy == "h2o")
    where = [(layer.version, layer.keys.data_ptr()) for layer in layers]
    session.chat("Tell me about the sea and the mountains, and the rivers and lakes, and the sky above them all.")
    assert session.evicted_total > 0
    assert [(layer.version, layer.keys.data_ptr()) for layer in layers] == where


def test_a_reopened_conversations_layers_share_one_slab(tokenizer, tmp_path):
    """A stored conversation reopened (its cache rebuilt layer by layer from the slot state and the rows) holds its
    layers in one slab, as a new cache does, with the cache it had."""
    from kvchat.storage.db import Store

    model = ChatModel.from_pretrained_model(build_tiny("llama", tokenizer), tokenizer, name="tiny", decode="graph")
    store = Store(tmp_path / "kv.db")
    session = Session(model, Settings(policy="h2o", budget=40, window=8, slack=8, recall="off"), store=store,
                      sampling=Sampling(max_new_tokens=8, temperature=0.0))
    session.chat("Hello there. Tell me about the sea and the mountains, and the rivers and lakes.")
    session.chat("And the sky?")
    saved = session.cache.state_tensors()
    again = Session.resume(model, store, session.conversation_id)
    layers = again.cache.layers
    assert all(layer.slab is layers[0].slab for layer in layers) and slab.in_slabs(layers)
    restored = again.cache.state_tensors()
    assert restored.keys() == saved.keys()
    for name, t in saved.items():
        torch.testing.assert_close(restored[name], t, rtol=0, atol=0)
