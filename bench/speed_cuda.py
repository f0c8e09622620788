"""Speed on a GPU (``kvchat bench speed --device cuda``): decode ms/token of every policy against the memory-bandwidth
limit and against transformers beside it, TTFT, peak GPU memory over a long chat.

Models are built from configs with random weights in bf16 (``--shapes``: ``llama-1b``, ``llama-8b``; no large
weights can be had offline, and a decode step's cost does not depend on their values), or loaded with ``--model
PATH``. The tokenizer is the default model's (``--tokenizer``: any folder with a tokenizer and a chat template).

For each shape, budget and policy: one session prefills ``budget + slack - 64`` random tokens (so the decode's
first compression comes early; nothing is evicted before it), then answers a user message with ``--steps`` greedy
tokens (stop tokens off). A token's time is the wall time from one decode step's start to the next's: the step, the
sampler's device-to-host copy of the token id, the detokenizer and the engine's bookkeeping, what a chatting user
waits for. ``ms_per_token`` is the median over steps without a compression; each compression is timed apart
(``compress_ms``) and amortized over the ``slack`` steps between compressions in a long chat. The roofline divides
the bytes a step must read — every weight matrix once, and the cache's key and value buffers (budget + slack per
head), which attention reads whole — by the bandwidth of a device-to-device copy measured in the same run.
``graph_ms``: the device's time for one replay of the captured step alone (CUDA events over 50 replays), what the
step costs without the engine around it; ``kernels`` (``streaming`` at the first budget): a replay's kernels, their
count and time, and the time between them (``speed_cuda_kernels.py``). The grid runs once per ``--graph-variants``,
each over every shape before the next: the graph step as written (``graph``), its layers compiled by inductor
(``compiled``; ``capture_ms`` includes the compiling), in kvchat's Triton kernels (``triton``), and as written fed
each token once the host has read it (``graph-sync``: what the run-ahead of core/engine/generate.py buys).

Beside them, at the same context length: transformers' ``generate`` with a DynamicCache (SDPA; per token, the time
for ``--steps`` new tokens less the time for one), and a static cache with the forward compiled by ``torch.compile``
(``mode="reduce-overhead"``: CUDA graphs) in a loop of its own, ``torch.compiler.cudagraph_mark_step_begin()``
before each step and the token cloned out of the graph. TTFT: messages of ``--ttft-prompts`` tokens at turns
``--ttft-turns`` of a chat (``streaming``, the first budget, recall as the defaults have it, its re-ranking with
them: ``recall_ms`` is recall's part), whose replies are generated (8 tokens each), and before the chat messages of
those lengths read into a full cache through the step's layers and through the model's forward (``reads``); the peak GPU
memory (over the 20 turns up to each), disk and time of its turns 100, every 250th and ``--replay-turns`` (the first
shape's chat; stored, and continued from ``--chat-store`` by a run after one stopped early: bench/speed_cuda_chat.py).
The compiled reference runs at the first budget only (a new cache length compiles again, a minute or more).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import torch

from ..core.decode.graph import GraphStep
from ..core.engine.session import Sampling, Session
from ..core.engine.settings import Settings
from ..core.model.loading import ChatModel, default_model_dir, load_model
from ..policies import POLICIES
from . import speed_cuda_baselines as baselines
from . import speed_cuda_kernels as kernels
from .common import Run, log
from .speed_cuda_chat import (above_base, chat_cell, random_ids, read_cell, reads_line, stored_chat, text,
                              timing_compressions)

NAME = "speed-cuda"
TITLE = "Speed on a GPU"
BUILDS_MODELS = True  # bench/cli.py loads no model for it
SHAPES = {  # Llama-3.2-1B-like and Llama-3-8B as the issue sets them; tiny: the tests' CPU run of this bench
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=49152),
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=128256, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=49152),
}
GPU_DEFAULTS = {"steps": 256, "ttft_turns": [10, 500], "ttft_prompts": [30, 2000]}


def add_arguments(g) -> None:
    """The options of a GPU run (``kvchat bench speed``'s group for them)."""
    g.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: this bench on the loaded model; cuda: random-weight models of --shapes on the GPU")
    g.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-8b"], choices=tuple(SHAPES),
                   help="model shapes built from configs with random bf16 weights (unless --model PATH)")
    g.add_argument("--budgets", type=int, nargs="+", default=[1024, 4096])
    g.add_argument("--tokenizer", default=None,
                   help="a folder with a tokenizer and chat template (default: $KVCHAT_TOKENIZER, else the default "
                        "model's)")
    g.add_argument("--compiled-reference", action=argparse.BooleanOptionalAction, default=True,
                   help="also time transformers with a static cache and torch.compile, at the first budget "
                        "(compiling takes a minute)")
    g.add_argument("--graph-variants", nargs="+", default=["triton", "graph", "compiled"],
                   choices=("graph", "compiled", "triton", "graph-sync"),
                   help="graph steps measured in turn on one model: in kvchat's Triton kernels (auto's on CUDA), as "
                        "written (graph), its layers compiled (compiled), as written fed each token once the host "
                        "has read it (graph-sync: what running ahead buys)")
    g.add_argument("--replay-turns", type=int, default=2000,
                   help="turns of the TTFT chat, whose peak GPU memory is compared at turn 100 and at the last")
    g.add_argument("--chat-store", default=None, metavar="DIR",
                   help="keep the chat stored in DIR, and continue the one found there (a run stopped early)")
    g.add_argument("--grid", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the decode grid and the references (--no-grid: only the chat, e.g. to continue one)")


def build(shape: str, tokenizer_dir: str, device: str, decode: str) -> ChatModel:
    """A random-weight Llama of ``shape`` in bf16 (fp32 off CUDA), made on the device itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False,
                         initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return ChatModel.from_pretrained_model(model, tokenizer, name=shape, decode=decode)


def timed_reply(session: Session, prompt: str, steps: int, device: str) -> dict:
    """One reply of exactly ``steps`` tokens: the wall time between consecutive decode steps (median over those
    without a compression), each compression's time, the TTFT."""
    starts: list[float] = []
    squeezes: list[tuple[int, float]] = []  # (decode steps before it, seconds)
    plain_forward = session.forward

    def forward(ids, *args, **kwargs):
        if ids.numel() == 1:
            starts.append(time.perf_counter())
        return plain_forward(ids, *args, **kwargs)

    cm = session.model
    stop_ids, cm.stop_ids = cm.stop_ids, frozenset()
    session.forward = forward
    try:
        with timing_compressions(device, squeezes, lambda: len(starts)):
            for _ in session.reply(prompt, max_new_tokens=steps + 1, temperature=0.0):
                pass
    finally:
        cm.stop_ids = stop_ids
        del session.forward
    res = session.history[-1]
    gaps = [b - a for a, b in zip(starts, starts[1: steps])]
    squeezed = {n for n, _ in squeezes}
    clean = [g for i, g in enumerate(gaps, 1) if i not in squeezed]
    decode_squeezes = [s for n, s in squeezes if n >= 1]
    return {"ms_per_token": 1000 * statistics.median(clean), "ms_mean": 1000 * statistics.mean(gaps),
            "compress_ms": [1000 * s for s in decode_squeezes], "ttft_ms": res.prefill_ms,
            "prompt_tokens": res.prompt_tokens, "cache_tokens": session.cache_tokens,
            "kv_bytes": session.cache.kv_bytes}


def policy_cell(cm, policy: str, budget: int, steps: int, device: str, profile: bool = False,
                squeeze: bool = False) -> dict:
    settings = Settings(policy=policy, budget=budget) if POLICIES[policy].bounded else Settings(policy="full")
    slack = Settings(budget=budget).slack_tokens
    history = budget + slack - 64
    session = Session(cm, settings, system=None, sampling=Sampling(temperature=0.0))
    session.feed_raw(random_ids(cm, history, 1), score=False)
    step = cm.step
    before = (step.captures, step.replays, step.eager_calls, len(step.capture_ms)) if isinstance(step, GraphStep) \
        else None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out = timed_reply(session, text(cm, 24, 2), steps, device)
    out.update(policy=policy, budget=budget if POLICIES[policy].bounded else None, history=history, slack=slack)
    if before is not None:
        out.update(captures=step.captures - before[0], replays=step.replays - before[1],
                   eager_steps=step.eager_calls - before[2], capture_ms=step.capture_ms[before[3]:],
                   step=_variant(step), compile_error=step.compile_error)
    if device == "cuda":
        out["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        replay = kernels.replay_ms(step, session.cache) if before is not None else None
        if replay is not None:  # the step alone: the device's time for one replay
            out["graph_ms"] = replay
    if profile and before is not None:  # what a step's time goes to: its kernels, and the gaps between them
        out["kernels"] = kernels.profile_step(step, session.cache, len(step.layers))
    if squeeze and POLICIES[policy].bounded:  # what a compression's time goes to (it compresses the session)
        out["compress_profile"] = kernels.profile_compression(session, budget)
    squeezes = out["compress_ms"]
    out["compress_ms_per_token"] = statistics.mean(squeezes) / slack if squeezes else 0.0
    session.close()
    return out


def grid(args, cm, name: str, entry: dict, budget: int, gbs: float, device: str, references: bool = True) -> None:
    """Every policy at ``budget``, then (``references``) transformers beside them at the same length."""
    rows, weights = entry["rows"], entry["weight_bytes"]
    variant = _variant(cm.step)
    for p in args.policies + ["full"]:
        if p == "full" and any(r["policy"] == "full" and r.get("step", variant) == variant for r in rows):
            continue  # the full cache does not depend on the budget
        try:
            profile = p == "streaming" and budget == args.budgets[0]
            row = policy_cell(cm, p, budget, args.steps, device, profile, references and budget == args.budgets[0])
        except Exception as exc:  # noqa: BLE001 — one failing policy is reported; the others are still measured
            rows.append({"policy": p, "budget": budget, "step": variant, "error": _failure(exc)})
            log(f"speed-cuda {name} {variant} budget {budget} {p}: failed ({rows[-1]['error']})")
            continue
        row["roofline_ms"] = 1000 * (weights + row["kv_bytes"]) / (gbs * 1e9)
        row["roofline_ratio"] = row["ms_per_token"] / row["roofline_ms"]
        rows.append(row)
        log(f"speed-cuda {name} {variant} budget {budget} {p:10s}: {row['ms_per_token']:.3f} ms/token "
            f"(x{row['roofline_ratio']:.2f} roofline; replay {row.get('graph_ms', 0):.3f} ms), mean "
            f"{row['ms_mean']:.3f}, compressions {', '.join(f'{c:.1f}' for c in row['compress_ms']) or '-'} ms, "
            f"peak {row.get('peak_mb', 0):.0f} MiB")
    if not references:
        return
    context = random_ids(cm, budget + Settings(budget=budget).slack_tokens - 64, 1)
    baseline = [("transformers", baselines.generate_ms)]
    if args.compiled_reference and budget == args.budgets[0]:  # compiling again for each cache length: a minute each
        baseline.append(("transformers-compiled", baselines.compiled_ms))
    for label, fn in baseline:
        try:
            got = fn(cm, context, args.steps, device)
        except Exception as exc:  # noqa: BLE001 — a baseline that fails is reported, not fatal
            rows.append({"policy": label, "budget": budget, "error": _failure(exc)})
            log(f"speed-cuda {name} budget {budget} {label}: failed ({rows[-1]['error']})")
            continue
        got = got if isinstance(got, dict) else {"ms": got}
        rows.append({"policy": label, "budget": budget, "ms_per_token": got.pop("ms"), "context": len(context), **got})
        log(f"speed-cuda {name} budget {budget} {label}: {rows[-1]['ms_per_token']:.3f} ms/token at {len(context)} "
            "positions")


def _variant(step) -> str:
    """Which step decodes: a graph step's ``asked`` (+ ``-sync`` where it does not run ahead), else its class."""
    if isinstance(step, GraphStep):  # as asked for: a step that fell back says so in its rows' compile_error
        return step.asked + ("" if step.runs_ahead else "-sync")
    return type(step).__name__ if step is not None else "model"


def _failure(exc: Exception) -> str:
    """One line: the exception and the innermost frames that raised it."""
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)[:-4:-1])
    return f"{type(exc).__name__}: {str(exc)[:300]} [{where}]"


def _save(run: Run, path: Path | None) -> None:
    """What is measured so far, in case the run is stopped (a GPU lease's time limit)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run.result(), indent=1) + "\n", encoding="utf-8")


def run(args, run: Run, cm=None) -> None:
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    gbs = baselines.bandwidth_gbs(device)
    run.rows = {"bandwidth_gbs": [gbs], "shapes": {}, "device": torch.cuda.get_device_name() if device == "cuda"
                else "cpu"}
    log(f"speed-cuda: device {run.rows['device']}, copy bandwidth {gbs:.0f} GB/s")
    models = [(args.model, None)] if args.model != "default" else [(None, s) for s in args.shapes]
    if args.chat_store:  # a chat it cannot continue is refused now, not after the grids
        stored_chat(args.chat_store, str(models[0][0] or models[0][1]), args.budgets[0])
    tokenizer = args.tokenizer or os.environ.get("KVCHAT_TOKENIZER") or str(default_model_dir())
    out = getattr(args, "out", None)
    partial = Path(out) / "results" / f"{NAME}.partial.json" if out else None  # bench/cli.py writes the whole
    built, first = {}, {}
    for path, shape in models:  # every shape's grids, then the chats: the grids matter most in a short lease
        name = path or shape
        cm = built[name] = load_model(path, device=device, decode=args.decode) if path else \
            build(shape, tokenizer, device, args.decode)
        weights, first[name] = baselines.weight_bytes(cm.model), cm.step
        entry = run.rows["shapes"][name] = {"weight_bytes": weights, "rows": [], "step": type(cm.step).__name__}
        log(f"speed-cuda {name}: {weights / 2**30:.2f} GiB of weights per step, decode step {entry['step']}")
    variants = args.graph_variants if args.grid else []
    for i, variant in enumerate(variants):  # each over every shape: a call stopped early keeps the first
        for name, cm in built.items():
            if not isinstance(first[name], GraphStep) and i > 0:
                continue
            if isinstance(first[name], GraphStep) and variant != _variant(cm.step):
                cm.step = GraphStep(cm.model, compiled=variant == "compiled", triton=variant == "triton")
                cm.step.runs_ahead = variant != "graph-sync"
            for budget in args.budgets:
                grid(args, cm, name, run.rows["shapes"][name], budget, gbs, device, references=i == 0)
                _save(run, partial)
    for name, cm in built.items():
        cm.step = first[name]  # the chat decodes with the step --decode picks
        if args.ttft_turns and args.ttft_prompts:  # what reading through the step's layers saves (docs/gpu.md)
            try:
                run.rows["shapes"][name]["reads"] = read_cell(cm, args.budgets[0], args.ttft_prompts, device)
            except Exception as exc:  # noqa: BLE001 — reported; the chat still runs
                run.rows["shapes"][name]["reads"] = {"error": _failure(exc)}
            _save(run, partial)
    for i, (name, cm) in enumerate(built.items()):
        turns = args.replay_turns if i == 0 else 0  # the long chat once: its memory is the engine's, not the shape's
        if args.ttft_turns or turns:
            chat = run.rows["shapes"][name]["chat"] = {"ttft": [], "peak_mb": {}}
            try:
                chat_cell(cm, args.budgets[0], args.ttft_turns, args.ttft_prompts, turns, device, chat,
                          lambda: _save(run, partial), store=args.chat_store if i == 0 else None)
            except Exception as exc:  # noqa: BLE001 — reported; what the chat measured before it stays
                chat["error"] = _failure(exc)
                log(f"speed-cuda {name} chat: failed at turn {chat.get('turns')} ({chat['error']})")
            _save(run, partial)
    del built, cm
    if device == "cuda":
        torch.cuda.empty_cache()
    gbs_end = baselines.bandwidth_gbs(device)
    run.rows["bandwidth_gbs"].append(gbs_end)
    checks(run)
    if partial is not None:
        partial.unlink(missing_ok=True)


def checks(run: Run) -> None:
    for name, entry in run.rows["shapes"].items():
        rows = [r for r in entry["rows"] if r["policy"] in POLICIES]
        served = all(r.get("eager_steps", 0) <= 1 for r in rows if POLICIES[r["policy"]].bounded)
        run.check(f"{name}: the graph took the steps", served or entry["step"] != "GraphStep",
                  ", ".join(f"{r['policy']}/{r['budget']}: {r.get('eager_steps')}" for r in rows))
        peaks = above_base(entry.get("chat", {}))  # the chat's own: above what its run allocated before it
        if len(peaks) >= 2 and 100 in peaks:  # turn 100 against the last turn watched
            a, b = peaks[100], peaks[max(peaks)]
            run.check(f"{name}: peak GPU memory flat over the chat", b <= a + 0.02 * max(a, 0.0),
                      f"turn 100 vs turn {max(peaks)}: {a:.0f} vs {b:.0f} MiB")


def markdown(res: dict) -> str:
    rows = res["results"]
    bands = rows["bandwidth_gbs"]
    lines = [f"Device: {rows['device']}; copy bandwidth {', '.join(f'{g:.0f}' for g in bands)} GB/s "
             + ("(start, end)." if len(bands) > 1 else "(start; the run was stopped by its time limit before its "
                "end: what it measured until then)."), ""]
    for name, entry in rows["shapes"].items():
        lines += [f"**{name}** ({entry['weight_bytes'] / 2**30:.2f} GiB of weights per step, decode step "
                  f"{entry['step']}):", ""]
        lines += ["| budget | policy | ms/token | tokens/s | × roofline | replay ms | compression ms (per token) | "
                  "peak MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"] if entry["rows"] else []
        for r in entry["rows"]:
            label = _label(r)
            if "error" in r:
                lines.append(f"| {r['budget']} | {label} | failed: {r['error'][:80]} | | | | | |")
                continue
            ms = r["ms_per_token"]
            squeeze = (f"{statistics.mean(r['compress_ms']):.1f} ({r['compress_ms_per_token']:.3f})"
                       if r.get("compress_ms") else "–")
            replay = f"{r['graph_ms']:.3f}" if "graph_ms" in r else "–"
            lines.append(f"| {r['budget'] or '–'} | {label} | {ms:.3f} | {1000 / ms:.0f} | "
                         f"{r['roofline_ratio']:.2f} | {replay} | {squeeze} | {r.get('peak_mb', 0):.0f} |"
                         if "roofline_ratio" in r else
                         f"| {r['budget']} | {label} | {ms:.3f} | {1000 / ms:.0f} | | | | |")
        profiled = [kernels.line(name, _label(r), r) for r in entry["rows"] if r.get("kernels")]
        profiled += [kernels.profile_line(name, _label(r), r["compress_profile"]) for r in entry["rows"]
                     if r.get("compress_profile")]
        lines += [""] + profiled if profiled else []
        compiles = [c for r in entry["rows"] if r.get("step") == "compiled" for c in r.get("capture_ms", [])]
        notes = [f"Compiled step: captures (compiling included) {min(compiles) / 1e3:.1f}-{max(compiles) / 1e3:.1f} s"
                 ] if compiles else []
        notes += sorted({f"{r['step']} fell back to the step as written: {r['compile_error'][:120]}"
                         for r in entry["rows"] if r.get("compile_error")})
        lines += ["", "; ".join(notes)] if notes else []
        reads = entry.get("reads")
        lines += ["", f"Reads failed: {reads['error']}" if "error" in reads else reads_line(reads)] if reads else []
        chat = entry.get("chat")
        if chat:
            held = above_base(chat, "held_mb")
            window, counted = chat.get("peak_window", 0), {int(k): n for k, n in chat.get("peak_turns", {}).items()}
            lines += ["", "TTFT: " + "; ".join(f"turn {t['turn']}, {t['prompt_tokens']} tokens: {t['ttft_ms']:.1f} ms"
                                               + (f" (recall {t['recall_ms']:.1f})" if t.get("recall_ms") else "")
                                               + (f" ({t['compressions']} compressions: {t['compress_ms']:.1f} ms)"
                                                  if t.get("compressions") else "")
                                               for t in chat["ttft"]),
                      (f"Peak GPU memory over the {chat['peak_window']} turns up to each watched one"
                       if chat.get("peak_window") else "Peak GPU memory of a chat turn")
                      + " above the weights (allocated before the chat)"
                      + (", and what stayed allocated after it" if chat.get("held_mb") else "") + ": "
                      + ", ".join(f"turn {k}: {v:.0f} MiB" + (f" ({held[k]:.0f})" if k in held else "")
                                  + (f" (over {counted[k]} turns)" if counted.get(k, window) < window else "")
                                  for k, v in above_base(chat).items())]
            for t in [chat[k] for k in ("turn_profile", "late_profile") if chat.get(k)]:
                lines.append(kernels.profile_line(name, f"turn {t['turn']}", t, "a chat turn") + f" Its TTFT "
                             f"{t['ttft_ms']:.1f} ms, recall {t['recall_ms'] or 0:.1f} ms ("
                             + (f"{t['recalled_tokens']} tokens recalled" if t["recalled_tokens"] else
                                "what it brought back declined" if t["declined"] else "nothing brought back")
                             + "; under the profiler).")
            if chat.get("disk_mb"):
                pace = chat.get("turn_s", {})
                runs = [str(r["from_turn"]) for r in chat.get("runs", [])[1:]]
                lines.append("On disk (database, rows, state, digests), and a turn's mean time before it: "
                             + ", ".join(f"turn {k}: {v:.1f} MB" + (f", {1000 * pace[k]:.0f} ms" if k in pace else "")
                                         for k, v in chat["disk_mb"].items())
                             + (f" (continued by another run at turn {', '.join(runs)})" if runs else "") + ".")
        lines.append("")
    return "\n".join(lines)


def _label(row: dict) -> str:
    """A row's policy, and its step where not the graph step as written (``compiled``, ``graph-sync``)."""
    return row["policy"] + (f" · {row['step']}" if row.get("step") not in (None, "graph") else "")


def plot(res: dict, plots: Path, plt) -> list[Path]:
    return []
