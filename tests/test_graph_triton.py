"""``--decode triton``: the graph step's layers in kvchat's own Triton kernels (core/decode/graph_triton.py). On the
CPU the kernels run in Triton's interpreter and must compute what the layer as written does, through compressions,
per-head capacities and the policies' statistics; the tests marked ``cuda`` compile them for a GPU."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvchat.core.decode import GraphStep, graph_triton, weights
from kvchat.core.decode.eager import DecodeStep
from kvchat.core.engine.session import Session
from kvchat.core.engine.settings import Settings
from kvchat.core.model.loading import ChatModel

from test_graph import (GREEDY, MESSAGES, _as_accurate, _assert_same_cache, _bf16_errors, _settings, cuda,
                        ragged_heads_step_alike)
from tinymodels import build_tiny

try:
    import triton
    _WHY = None if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7) else \
        f"Triton {triton.__version__}'s interpreter fails on NumPy 2.4's scalars (3.7 reads them)"
except ImportError:
    _WHY = "Triton is not installed (scripts/setup.sh installs it for these tests)"
interpreter = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))


def _steps(tokenizer, policy, budget=None, arch="llama"):
    """One session per step over the same tiny fp32 model: the graph step as written, and in Triton's kernels."""
    out = []
    for use in (False, True):
        cm = ChatModel.from_pretrained_model(build_tiny(arch, tokenizer), tokenizer, name="tiny", decode="graph")
        cm.step = GraphStep(cm.model, triton=use)
        assert cm.step.triton == use and cm.step.compile_error is None
        settings = _settings(policy) if budget is None else Settings(policy=policy, budget=budget)
        out.append(Session(cm, settings, system=None if budget else "default", sampling=GREEDY))
    return out


@interpreter
@pytest.mark.parametrize("arch, policy", [("llama", p) for p in ("streaming", "h2o", "snapkv", "tova")]
                         + [("qwen2", "h2o")])
def test_triton_step_gives_the_graph_steps_replies_and_cache(arch, policy, tokenizer):
    """Three replies through compressions: the same greedy answers, and the same cache within 1e-5 — keys,
    values, positions, storage rows, H2O's sums and SnapKV's query window, which the kernels write (Qwen2: q/k/v
    with biases)."""
    a, b = _steps(tokenizer, policy, arch=arch)
    for text in MESSAGES:
        assert b.chat(text).answer == a.chat(text).answer
    assert b.evicted_total == a.evicted_total > 0
    _assert_same_cache(a, b, atol=1e-5)
    assert b.model.step.triton and b.model.step.replays >= 60 and b.model.step.eager_calls <= 1


@interpreter
def test_triton_attention_over_heads_of_different_capacities_and_several_splits(tokenizer):
    """Heads of one layer with different capacities and lengths (``headaware``'s per-head budgets), each head's
    region read from its own first row, in four splits of 128 slots (``graph_triton.SPLIT``: for the shorter head the
    third empty until it passes slot 255, the fourth always): the graph step's logits, H2O's sums and the cache, step
    by step."""
    assert -(-400 // graph_triton.SPLIT) == 4  # the widest head's splits
    sessions = _steps(tokenizer, "h2o", budget=400)
    ragged_heads_step_alike(sessions, 260, [270, 400], 6)
    assert [s.model.step.replays for s in sessions] == [6, 6] and sessions[1].model.step.triton
    assert sessions[1].cache.layers[1].lens == [259, 266]
    _assert_same_cache(*sessions, atol=1e-5)


@interpreter
def test_triton_step_in_bf16_is_as_accurate_as_the_eager_step(tokenizer):
    """bf16 on the CPU, through compressions with H2O's sums: the kernels' error against fp32 at most 1.5x the eager
    step's, as the graph step's is (tests/test_graph.py)."""
    errors, step = _bf16_errors("h2o", tokenizer, "cpu", triton=True)
    _as_accurate(errors)
    assert step.triton and step.replays == 40 and step.eager_calls == 0


def test_triton_step_falls_back_to_the_layer_as_written_saying_why(tokenizer):
    """Layers the kernels do not serve (here kvchat's fp16 weight copies, ``--weights half``): the graph step as
    written, with the reason in ``compile_error``; the same replies as that step."""
    cms = []
    for _ in range(2):
        model = build_tiny("llama", tokenizer)
        weights.apply(model, "half")
        cms.append(ChatModel.from_pretrained_model(model, tokenizer, name="tiny-half", decode="graph"))
    cms[1].step = GraphStep(cms[1].model, triton=True)
    assert not cms[1].step.triton and "fp16 weight copies" in cms[1].step.compile_error
    a, b = (Session(cm, _settings("h2o"), sampling=GREEDY) for cm in cms)
    assert b.chat(MESSAGES[0]).answer == a.chat(MESSAGES[0]).answer


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "headaware"])
def test_captured_triton_step_is_as_accurate_as_the_eager_step(policy, tokenizer):
    """``--decode triton`` on the GPU: the kernels compiled by Triton and captured, as accurate as the eager step,
    every step through the graph."""
    errors, step = _bf16_errors(policy, tokenizer, "cuda", triton=True)
    _as_accurate(errors)
    assert step.triton and step.compile_error is None
    assert step.captures >= 1 and step.replays == 40 and step.eager_calls == 0


def test_decode_triton_off_cuda_is_kvchats_eager_step(tokenizer):
    """``--decode triton`` asks for CUDA's kernels: on the CPU kvchat's eager step decodes (with a warning)."""
    cm = ChatModel.from_pretrained_model(build_tiny("llama", tokenizer), tokenizer, name="tiny", decode="triton")
    assert type(cm.step) is DecodeStep


def _hopper():
    """Why the kernels cannot be compiled for a GPU here, None if they can (Triton's NVIDIA backend, with its ptxas)."""
    if _WHY is not None:
        return _WHY
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as exc:
        return f"Triton has no NVIDIA backend here ({exc})"
    return None


@pytest.mark.skipif(_hopper() is not None, reason=str(_hopper()))
def test_every_launch_of_a_bf16_step_compiles_for_a_hopper_gpu(tokenizer, monkeypatch):
    """What the interpreter cannot check — the kernels' types, their products' shapes, the loops' bounds — checked on
    the CPU: every distinct launch a bf16 step makes (its arguments' types and constants as launched: H2O's sums,
    SnapKV's query ring, the first layer's norm without a sum; heads of 16 and of 128 dimensions, 4 and 8 warps)
    compiled by Triton for sm_90 (an H100), to PTX and machine code."""
    import inspect

    from triton.runtime.jit import mangle_type

    from kvchat.core.decode import graph_triton_kernels

    launches, kernel = {}, graph_triton._kernel

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **constants):
                params = list(inspect.signature(getattr(graph_triton_kernels, self.name)).parameters)
                types = tuple((p, mangle_type(a)) for p, a in zip(params, args))
                launches[(self.name, types, tuple(sorted(constants.items())))] = None
                return kernel(self.name)[grid](*args, **constants)
            return launch

    monkeypatch.setattr(graph_triton, "_kernel", Recorder)
    wide = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)  # heads of 128, as Llama-3-8B's (8 warps)
    for policy, model in [(p, build_tiny("llama", tokenizer)) for p in ("streaming", "h2o", "snapkv")] + \
            [("h2o", AutoModelForCausalLM.from_config(wide))]:
        cm = ChatModel.from_pretrained_model(model.to(torch.bfloat16), tokenizer, name="tiny", decode="graph")
        cm.step = GraphStep(cm.model, triton=True)
        session = Session(cm, _settings(policy), system=None, sampling=GREEDY)
        session.feed_raw(list(range(20, 40)), score=False)
        for token in (5, 6):
            session._feed([([token], len(session.messages) - 1)], continue_message=True)
        assert cm.step.triton and cm.step.replays == 2
    flags = {(name, dict(c).get("ACC"), dict(c).get("RING"), dict(c).get("ADD")) for name, _, c in launches}
    assert {dict(c).get("num_warps") for name, _, c in launches if name == "attend_part"} == {4, 8}
    assert {("attend_done", True, None, None), ("attend_done", False, None, None), ("rotate_write", None, True, None),
            ("add_norm", None, None, False), ("add_norm", None, None, True)} <= flags
    # compiled in a process of its own: Triton compiles nothing in one whose interpreter is on (TRITON_INTERPRET)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    job = json.dumps([[name, list(types), list(constants)] for name, types, constants in launches])
    done = subprocess.run([sys.executable, "-c", _COMPILE], input=job, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["compiled"] * len(launches)


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from kvchat.core.decode import graph_triton_kernels as source
for name, types, constants in json.load(sys.stdin):
    options = {k: v for k, v in constants if k in ("num_warps", "num_stages")}  # the launch's, not the kernel's
    constants = {k: v for k, v in constants if k not in options}
    signature = {p: t for p, t in types} | {p: "constexpr" for p in constants}
    kernel = triton.compile(ASTSource(JITFunction(getattr(source, name)), signature, constants),
                            target=GPUTarget("cuda", 90, 32), options=options)
    print("compiled" if kernel.asm["cubin"] else "empty")
"""


@cuda
@pytest.mark.cuda
def test_captured_triton_step_at_a_budget_larger_than_the_chat_gives_the_full_caches_tokens(tokenizer):
    """fp32 on the GPU (the kernels' products in IEEE fp32): streaming at a budget the chat never reaches, in the
    Triton kernels, captured, gives the eager step's greedy replies over the full cache."""
    models = [ChatModel.from_pretrained_model(build_tiny("llama", tokenizer).to("cuda"), tokenizer, name="tiny",
                                              decode="graph") for _ in range(2)]
    models[0].step = DecodeStep(models[0].model)
    models[1].step = GraphStep(models[1].model, triton=True)
    full = Session(models[0], Settings(policy="full"), sampling=GREEDY)
    bounded = Session(models[1], Settings(policy="streaming", budget=400), sampling=GREEDY)
    for text in MESSAGES:
        assert bounded.chat(text).answer == full.chat(text).answer
    assert models[1].step.triton and models[1].step.captures == 1 and models[1].step.replays >= 60
