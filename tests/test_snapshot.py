"""A copy of the cache's held slots (core/cache/snapshot.py), what undo and recall's way back put back: exactly the
cache it was taken from, in the same buffers where they are still there (the graph step captured over them stays
valid), layer by layer where a budget change or a new statistic gave the cache others; a few operations a slab."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvchat.core.cache import snapshot
from kvchat.core.cache.kvcache import KVCache
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings

GREEDY = Sampling(max_new_tokens=10, temperature=0.0)
LONG = "Tell me about the sea and the mountains, and the rivers and lakes, and the sky above them all, please."


def _state(cache) -> dict:
    return {k: t.clone() for k, t in cache.state_tensors().items()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("policy", ["streaming", "h2o", "headaware"])
def test_a_copy_goes_back_exactly_into_the_same_buffers(tiny, policy, monkeypatch):
    session = Session(tiny("llama"), Settings(policy=policy, budget=48, window=8, slack=6, recall="off"),
                      sampling=GREEDY)
    session.chat(LONG)
    before, copy = _state(session.cache), snapshot.take(session.cache)
    evicted = session.evicted_total
    session.chat("And the rivers? " + LONG)  # compressions move the slots in place in between
    assert session.evicted_total > evicted
    where = [(layer.version, layer.keys.data_ptr(), layer.slab) for layer in session.cache.layers]

    def layer_by_layer(*args):
        raise AssertionError("put back layer by layer")

    monkeypatch.setattr(KVCache, "load_state_tensors", layer_by_layer)
    copy.put_back(session.cache)
    _same(before, _state(session.cache))
    assert [(layer.version, layer.keys.data_ptr(), layer.slab) for layer in session.cache.layers] == where
    rows = [before[f"{i}.{h}.rows"] for i, layer in enumerate(session.cache.layers) for h in range(layer.heads)]
    assert torch.equal(torch.from_numpy(copy.rows_named()), torch.cat(rows))


def test_a_copy_goes_back_layer_by_layer_after_a_budget_change_or_a_new_statistic(tiny, monkeypatch):
    session = Session(tiny("llama"), Settings(policy="streaming", budget=48, window=8, slack=6, recall="off"),
                      sampling=GREEDY)
    session.chat(LONG)
    before, copy = _state(session.cache), snapshot.take(session.cache)
    loads = []
    plain = KVCache.load_state_tensors
    monkeypatch.setattr(KVCache, "load_state_tensors", lambda cache, t: loads.append(1) or plain(cache, t))
    session.cache.set_capacity(80)  # new slabs
    copy.put_back(session.cache)
    _same(before, _state(session.cache))
    session.configure(policy="h2o")  # H2O's accumulated attention: a statistic the copy has none of
    session.chat("And the rivers?")
    assert "stat.acc" in session.cache.layers[0].per_slot()
    copy.put_back(session.cache)
    _same(before, _state(session.cache))
    assert len(loads) == 2
    again = Session(tiny("llama"), Settings(policy="streaming", budget=48, window=8, slack=6, recall="off"),
                    sampling=GREEDY)
    again.chat(LONG)  # and the cache put back answers as the cache it was copied from
    session.configure(policy="streaming")
    assert session.chat("What about the sky?").answer == again.chat("What about the sky?").answer


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_copy_is_taken_and_put_back_with_a_few_operations_per_slab_tensor():
    """8 layers of 4 heads in one slab: a copy per layer, head and tensor would take 8 x 4 x 7 operations each way."""
    cache = KVCache(num_layers=8, capacity=16, max_capacity=64, keeps_computed=True)
    cache.incoming_abs = cache.incoming_pos = torch.arange(10, dtype=torch.int32)
    for layer in cache.layers:
        layer.update(torch.randn(1, 4, 10, 8), torch.randn(1, 4, 10, 8))
        layer.ensure_stat("acc").copy_(torch.rand(layer.keys.shape[0]))
    tensors = len(cache.layers[0].slab.bases)
    assert tensors == 7 and all(layer.slab is cache.layers[0].slab for layer in cache.layers)
    before = _state(cache)
    with _Count() as taking:
        copy = snapshot.take(cache)
    for layer in cache.layers:
        layer.keys.normal_()
        layer.stats["acc"].zero_()
    with _Count() as putting:
        copy.put_back(cache)
    _same(before, _state(cache))
    assert taking.ops <= tensors + 2 and putting.ops <= tensors + 2, (taking.ops, putting.ops)
