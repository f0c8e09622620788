"""Speed: decode ms/token and prefill ms per turn against the length of the conversation, for every policy.

The history (PG19 stand-in text, fed with ``feed_raw(score=False)``) is built once under ``streaming`` at
``--budget``; at each length in ``--lengths`` every bounded policy is switched in live (kvchat's own settings switch:
the cache keeps its size, the policy takes over from there) and answers a user turn of ``--prompt`` tokens with
``--steps`` decoded tokens (stop tokens disabled); the turn is then undone so every policy sees the same history. The
full cache gets its own session (up to the model's max positions). Timers around the compression and the attention
observer give the policy bookkeeping as a share of the decode time. The StreamingLLM paper's baseline, sliding
window with recomputation, re-encodes the last ``--budget`` tokens from scratch for each generated token. The
roofline ratio compares a measured decode step with (bytes of the weights a step reads + the cache's key and value
buffers, which the compiled step reads whole) / the memory bandwidth, which the bench measures itself with a large
tensor copy at the start and the end (the larger counts; each the best of copies in ordinary and in huge-page
memory); beside each policy's steps too (a copy after every block of the transformers loop's steps, the median of
those: this machine's copies vary by tens of percent within minutes), for a second ratio. A bare transformers loop
(DynamicCache, SDPA, greedy: what ``generate`` does per token, without its processors; ``Reference``) holding as
many positions as the bounded caches runs beside every policy: blocks of its steps are timed between blocks of the
policy's, so both see the same machine (this one's speed drifts by tens of percent within minutes); ``speedup`` is
its median step over the policy's. The same loop at each history, where it fits the model's positions, runs twice on
the same model object: with kvchat's weights, and with the fp16 copies of ``--weights half`` switched off (the
weights as transformers loads them, ``weights.as_loaded``). TTFT (prefill of the user message until the first
token's logits) is measured for messages of ``--ttft-prompts`` tokens at turns ``--ttft-turns`` of a chat of
FastChat exchanges. """

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch

from ..core.cache import compress
from ..core.decode import weights as weight_formats
from ..core.decode.weights import on_huge_pages
from ..core.cache.observe import Observer
from ..core.engine.session import Sampling, Session
from ..core.engine.settings import Settings
from ..policies import POLICIES
from .common import Run, data_dir, fastchat_pairs, log, read_text
from . import speed_cuda
from .speed_report import EAGER, TRANSFORMERS, markdown, plot  # noqa: F401  (the report's: bench/report.py)

NAME = "speed"
TITLE = "Speed"
BOUNDED = [p for p, cls in POLICIES.items() if cls.bounded]
OUTLIER = 1.5  # a cell this much slower than the policy's fastest is measured again (this VM's slow phases)
QUICK = {"lengths": [300, 900], "budget": 256, "steps": 6, "prompt": 64, "policies": ["streaming", "h2o"],
         "recompute_lengths": 1, "recompute_steps": 2, "ttft_turns": [2, 6], "ttft_prompts": [30, 120]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=int, nargs="+", default=[1000, 5000, 10000, 20000],
                   help="conversation lengths (tokens of history) at which to measure")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--policies", nargs="+", default=BOUNDED)
    p.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    p.add_argument("--prompt", type=int, default=256, help="tokens of the user turn whose prefill is timed")
    p.add_argument("--recompute-lengths", type=int, default=2, help="how many of --lengths get the recompute baseline")
    p.add_argument("--recompute-steps", type=int, default=3)
    p.add_argument("--ttft-turns", type=int, nargs="+", default=[10, 1000],
                   help="turns of a chat (FastChat exchanges, streaming at --budget) at which TTFT is measured")
    p.add_argument("--ttft-prompts", type=int, nargs="+", default=[30, 500], help="user message sizes for TTFT")
    p.add_argument("--data", default=None, help="the shared data directory (default ../shared/data)")
    speed_cuda.add_arguments(p.add_argument_group("on a GPU (--device cuda: bench/speed_cuda.py)"))


def bandwidth_gbs(mb: int = 256, repeats: int = 5) -> float:
    """Memory bandwidth from the best of ``repeats`` copies of a ``mb`` MB tensor (bytes read + written), in
    ordinary memory and, where the decode step's weights get them, in huge-page memory (``weights.on_huge_pages``:
    a few percent faster here), taking turns."""
    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    pairs = [(src, dst)]
    huge = on_huge_pages([src, dst])
    if huge is not None:
        pairs.append(tuple(huge))
    best = float("inf")
    for _ in range(repeats):
        for a, b in pairs:
            t = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


class Reference:
    """A bare transformers decode loop (DynamicCache, SDPA, greedy: what ``generate`` does per token, without its
    processors) on ``ids``, kept open so that its steps can be timed in blocks between kvchat's: on a machine whose
    speed drifts by tens of percent within minutes, only steps taken side by side compare."""

    def __init__(self, cm, ids: list[int]):
        from transformers import DynamicCache

        self.cm, self.length = cm, len(ids)
        with self._sdpa():
            self.cache = DynamicCache(config=cm.model.config)
            out = cm.model(input_ids=torch.tensor([ids]).to(cm.device), **{cm.cache_arg: self.cache}, use_cache=True,
                           logits_to_keep=1)
            self.first = self.token = out.logits[:, -1:].argmax(-1)

    @contextlib.contextmanager
    def _sdpa(self):
        self.cm.model.set_attn_implementation("sdpa")
        try:
            with torch.no_grad():
                yield
        finally:
            self.cm.model.set_attn_implementation("kvchat")

    def rewind(self) -> None:
        """Back to the prefilled ``ids`` (the cache cropped), so every measurement starts at the same length."""
        extra = self.cache.get_seq_length() - self.length
        if extra:
            self.cache.crop(-extra)
        self.token = self.first

    def steps(self, n: int) -> list[float]:
        times = []
        with self._sdpa():
            for _ in range(n):
                t = time.perf_counter()
                out = self.cm.model(input_ids=self.token, **{self.cm.cache_arg: self.cache}, use_cache=True,
                                    logits_to_keep=1)
                self.token = out.logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - t)
        return times


def timed_turn(session: Session, prompt: str, steps: int, reference: Reference | None = None,
               block: int = 8) -> dict:
    """One user turn with exactly ``steps`` decoded tokens: prefill ms, decode ms/token (the median step, so that a
    shared machine's occasional stalls do not move it), bookkeeping share of the summed decode steps. With
    ``reference``, ``block`` of its steps are timed after every ``block`` decoded tokens (``reference_ms``, the
    median, and ``speedup``, reference / kvchat)."""
    beside: list[float] = []
    copies: list[float] = []  # the memory bandwidth, measured beside the steps (``bandwidth_gbs``)
    block = min(block, steps)
    book: list[float] = []  # compressions and attention bookkeeping, from the first decoded token on
    feeds: list[float] = []  # every forward of the turn with the compressions before it: the prompt's prefill
    # chunks, one per decoded token, the closing tokens
    compressing: list[float] = []  # compressions since the last forward

    def timed(fn, into: list[float]):
        def wrapped(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                into.append(time.perf_counter() - t)
                if into is compressing:
                    book.append(into[-1])
        return wrapped

    def forward(*args, **kwargs):
        t = time.perf_counter()
        try:
            return plain_forward(*args, **kwargs)
        finally:
            feeds.append(time.perf_counter() - t + sum(compressing))
            compressing.clear()

    plain_forward = session.forward
    session.forward = forward
    patches = [mock.patch.object(compress, "compress", timed(compress.compress, compressing))]
    if session.observer is not None:
        patches.append(mock.patch.object(Observer, "__call__", timed(Observer.__call__, book)))
    cm = session.model
    stop_ids, cm.stop_ids = cm.stop_ids, frozenset()
    try:
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            gen = session.reply(prompt, max_new_tokens=steps + 1, temperature=0.0)
            prefill_forwards = None
            mark = block
            for _ in gen:
                if prefill_forwards is None:  # the prompt's prefill (and its compressions) is over
                    book.clear()
                    prefill_forwards = len(feeds)
                if reference is not None and len(feeds) - prefill_forwards >= mark and len(beside) < steps:
                    beside += reference.steps(block)
                    copies.append(bandwidth_gbs(repeats=2))
                    mark += block
        res = session.history[-1]
    finally:
        cm.stop_ids = stop_ids
        del session.forward
    decode = feeds[prefill_forwards: prefill_forwards + steps]  # after them, the turn's closing tokens are fed
    if len(decode) != steps:
        raise RuntimeError(f"expected {steps} decode steps, timed {len(decode)}")
    out = {"prefill_ms": res.prefill_ms, "prompt_tokens": res.prompt_tokens,
           "decode_ms_per_token": 1000 * statistics.median(decode), "decode_ms_mean": 1000 * statistics.mean(decode),
           "bookkeeping": sum(book) / sum(decode),
           "cache_tokens": session.cache_tokens, "kv_bytes": session.cache_now()["kv_bytes"]}
    if beside:
        out.update(reference_ms=1000 * statistics.median(beside), reference_tokens=reference.length,
                   speedup=statistics.median(beside) / statistics.median(decode),
                   bandwidth_gbs=statistics.median(copies))
    return out


def transformers_ms(cm, ids: list[int], steps: int) -> float:
    """A bare transformers loop for reference: ``ids`` prefilled into a DynamicCache (SDPA), then greedy decode
    steps; median ms per step."""
    return 1000 * statistics.median(Reference(cm, ids).steps(steps))


def recompute_ms(cm, ids: list[int], window: int, steps: int) -> float:
    """Sliding window with recomputation: each generated token re-encodes the last ``window`` tokens."""
    model = cm.model
    model.set_attn_implementation("sdpa")
    times = []
    try:
        with torch.no_grad():
            for s in range(steps):
                x = torch.tensor(ids[len(ids) - window + s: len(ids) + s])[None].to(cm.device)
                t = time.perf_counter()
                model(input_ids=x, use_cache=False, logits_to_keep=1)
                times.append(time.perf_counter() - t)
    finally:
        model.set_attn_implementation("kvchat")
    return 1000 * statistics.median(times)


def run(args, run: Run, cm) -> None:
    text = cm.tokenizer(read_text(data_dir(args.data), "pg19"), add_special_tokens=False)["input_ids"]
    if max(args.lengths) + args.prompt + args.steps > len(text):
        raise ValueError(f"the text holds {len(text)} tokens, too few for length {max(args.lengths)}")
    prompt = cm.tokenizer.decode(text[-args.prompt - 2000: -2000])
    bw = bandwidth_gbs()
    weights = weight_formats.step_bytes(cm.model)
    rows: list[dict] = []
    ttft: list[dict] = []
    run.rows = {"rows": rows, "ttft": ttft, "bandwidth_gbs": bw, "weight_bytes": weights, "weights": cm.weights,
                "max_positions": cm.max_positions}
    log(f"speed: memory bandwidth {bw:.1f} GB/s, a decode step reads {weights / 2**20:.0f} MiB of weights "
        f"(--weights {cm.weights})")

    def roofline(row: dict, gbs: float) -> None:
        """The row's roofline at the run's bandwidth (``gbs``); ``roofline_ratio_beside``: at the bandwidth measured
        beside its steps, where it has one."""
        row["roofline_ms"] = 1000 * (weights + row["kv_bytes"]) / (gbs * 1e9)
        row["roofline_ratio"] = row["decode_ms_per_token"] / row["roofline_ms"]
        if "bandwidth_gbs" in row:
            row["roofline_ratio_beside"] = row["roofline_ratio"] * row["bandwidth_gbs"] / gbs

    def record(policy: str, length: int, m: dict) -> None:
        row = {"policy": policy, "length": length, **m}
        roofline(row, bw)
        rows.append(row)
        beside = (f", transformers beside it {m['reference_ms']:.1f} ms/token at {m['reference_tokens']} positions "
                  f"(x{m['speedup']:.2f}), memory {m['bandwidth_gbs']:.1f} GB/s" if "speedup" in m else "")
        log(f"speed {policy:10s} history {length:6d}: decode {m['decode_ms_per_token']:6.1f} ms/token "
            f"(bookkeeping {100 * m['bookkeeping']:4.1f}%, roofline x{row['roofline_ratio']:.1f}), prefill "
            f"{m['prefill_ms']:7.0f} ms / {m['prompt_tokens']} tokens, cache {m['cache_tokens']}{beside}")

    def grow(session: Session, target: int) -> None:
        while session.total_tokens < target:
            n = min(1024, target - session.total_tokens)
            session.feed_raw(text[session.total_tokens: session.total_tokens + n], score=False)

    base = Settings(policy="streaming", budget=args.budget)
    session = Session(cm, base, system=None, sampling=Sampling(temperature=0.0), undo=True)
    grow(session, min(args.lengths))
    warm = timed_turn(session, prompt, args.steps)  # warm-up (first-call costs), not recorded
    session.undo()
    compile_s = getattr(cm.step, "compile_s", None)
    if compile_s is not None:  # --decode compiled: its first step compiled the graph
        run.rows["compile_s"] = compile_s
        log(f"speed: the compiled decode step compiled in {compile_s:.1f} s (its first step; inductor's cache on "
            f"disk makes a later process's compile shorter)")
    # transformers at the bounded caches' length, its steps timed in blocks between each policy's decode steps
    reference = Reference(cm, text[: warm["cache_tokens"]])
    reference.steps(4)
    # With --decode compiled each policy is also timed on the eager step, in the same turn order and beside the same
    # transformers loop: the compiled graph's gain as measured, not across runs on a machine whose speed drifts.
    variants = [("", contextlib.nullcontext)]
    if compile_s is not None:
        variants.append((EAGER, cm.step.eager_only))
    for length in sorted(args.lengths):
        grow(session, length)
        for p in args.policies:
            for suffix, context in variants:
                for attempt in range(2):  # an outlier cell is measured once more: noise from a regression
                    session.configure(policy=p)
                    reference.rewind()
                    with context():
                        m = timed_turn(session, prompt, args.steps, reference)
                    session.undo()
                    session.configure(policy="streaming")
                    earlier = [r["decode_ms_per_token"] for r in rows if r["policy"] == p + suffix]
                    if attempt or not earlier or m["decode_ms_per_token"] <= OUTLIER * min(earlier):
                        break
                    log(f"speed {p + suffix} history {length}: {m['decode_ms_per_token']:.1f} ms/token, over "
                        f"{OUTLIER}x its fastest cell: measured again")
                    first = m
                if attempt:
                    second = m
                    m = min(first, second, key=lambda x: x["decode_ms_per_token"])
                    m["measured_ms"] = [first["decode_ms_per_token"], second["decode_ms_per_token"]]
                record(p + suffix, length, m)
    del session
    full = Session(cm, Settings(policy="full"), system=None, sampling=Sampling(temperature=0.0), undo=True)
    for length in sorted(args.lengths):
        if length + args.prompt + args.steps + 16 > cm.max_positions:
            break
        grow(full, length)
        record("full", length, timed_turn(full, prompt, args.steps))
        full.undo()
    del full

    # TTFT at turn N of a chat: FastChat exchanges appended (teacher-forced) until turn N - 1, then a user message
    # of each size is answered (and undone, so every size sees the same chat).
    pairs = fastchat_pairs(data_dir(args.data))
    chat = Session(cm, base, sampling=Sampling(temperature=0.0), undo=True)
    fed = 0
    for turn in sorted(args.ttft_turns):
        while chat.turn < turn - 1:
            chat.exchange(*pairs[fed % len(pairs)])
            fed += 1
        for n in args.ttft_prompts:
            m = timed_turn(chat, cm.tokenizer.decode(text[-n - 4000: -4000]), 2)
            chat.undo()
            ttft.append({"turn": chat.turn + 1, "prompt_tokens": m["prompt_tokens"], "ttft_ms": m["prefill_ms"],
                         "history_tokens": chat.total_tokens, "cache_tokens": m["cache_tokens"]})
            log(f"speed TTFT turn {chat.turn + 1:5d} ({chat.total_tokens} tokens of chat): "
                f"{m['prompt_tokens']:4d}-token message {m['prefill_ms']:6.0f} ms")
    del chat

    references = [("transformers", cm.weights, contextlib.nullcontext)]
    if cm.weights != "model":  # transformers on the weights as loaded, for what --weights half gives
        references.append(("transformers_model_weights", "model", lambda: weight_formats.as_loaded(cm.model)))
    for name, held, context in references:
        for length in sorted(args.lengths):
            if length + args.steps > cm.max_positions:
                break
            with context():
                ms = transformers_ms(cm, text[:length], args.steps)
            rows.append({"policy": name, "length": length, "decode_ms_per_token": ms, "weights": held})
            log(f"speed {name} history {length:6d}: {ms:.1f} ms/token (DynamicCache, SDPA, no compression, "
                f"--weights {held})")
    for length in sorted(args.lengths)[: args.recompute_lengths]:
        ms = recompute_ms(cm, text[:length], min(args.budget, length), args.recompute_steps)
        rows.append({"policy": "recompute", "length": length, "decode_ms_per_token": ms, "window": args.budget})
        log(f"speed recompute  history {length:6d}: {ms:.0f} ms/token (re-encoding {args.budget} tokens)")

    step = cm.step
    if step is not None:  # what kvchat's eager step ran on: its operators (core/ops/kernels.py) or the separate ones
        run.rows["eager_step"] = ("kvchat's operators" if step.without_ops is None
                                  else f"separate operations ({step.without_ops})")
        log(f"speed: the eager decode step ran on {run.rows['eager_step']}")
    if compile_s is not None:
        # What the graph's products ran as: kvchat's operators (core/ops/kernels.py), or torch.bmm and inductor's own
        # products where the operators were not built.
        operators = ("kvchat's operators" if cm.step.no_ops is None
                     else f"torch.bmm and inductor's products ({cm.step.no_ops})")
        run.rows["compiled_steps"] = {"graph": cm.step.calls, "eager": cm.step.eager_calls, "failed": cm.step.failed,
                                      "products": operators}
        log(f"speed: compiled decode: {cm.step.calls} steps in the graph, {cm.step.eager_calls} in the eager step "
            f"(heads of different capacities, the growing cache of `full`); products: {operators}"
            + (f"; compiling failed: {cm.step.failed}" if cm.step.failed else ""))
    # The copy's bandwidth also drifts: the run's figure is the larger of the measurements at the start and the end.
    end_bw = bandwidth_gbs()
    run.rows["bandwidth_gbs_measured"] = [bw, end_bw]
    if end_bw > bw:
        bw = run.rows["bandwidth_gbs"] = end_bw
        for row in rows:
            if "kv_bytes" in row:
                roofline(row, bw)
    log(f"speed: memory bandwidth {end_bw:.1f} GB/s at the end; rooflines at {bw:.1f} GB/s")
    for p in args.policies:
        ms = [r["decode_ms_per_token"] for r in rows if r["policy"] == p]
        run.check(f"{p} decode flat", max(ms) < 2 * min(ms),
                  f"decode ms/token {min(ms):.1f}-{max(ms):.1f} across histories {min(args.lengths)}-"
                  f"{max(args.lengths)}")
    rec = [r["decode_ms_per_token"] for r in rows if r["policy"] == "recompute"]
    stream = [r["decode_ms_per_token"] for r in rows if r["policy"] == "streaming"]
    if rec and stream:
        run.check("cached decode beats recomputation", max(stream) < min(rec),
                  f"streaming {max(stream):.1f} ms/token vs recompute {min(rec):.0f} ms/token")
