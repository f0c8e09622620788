"""Engine overhead: decode ms/token of a kvchat session vs a bare transformers loop with DynamicCache.

For each cache length L the bare loop prefills L tokens into a DynamicCache and times greedy decode steps; the
engine runs a real reply (its own reported decode ms/token) with the cache at L positions: `full` holding L
tokens, and `streaming` at budget L (which also pays its amortized compressions). Both report the mean time per
decode step; each is run --repeats times, interleaved, and the best run is kept (timing noise on a shared CPU only
ever adds time). Prints a table and JSON.

    .venv/bin/python benchmarks/overhead.py [--lengths 512 1024 2048] [--steps 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache
from transformers.utils import logging as hf_logging

from kvchat.core import models
from kvchat.core.session import Sampling, Session
from kvchat.core.settings import Settings

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


def filler_text(tokenizer, n_tokens: int) -> str:
    words = ("the river bends past quiet fields where herons wait and the morning light settles on old stones "
             "while travellers count the miles to the next town ").split()
    text, i = [], 0
    while len(tokenizer(" ".join(text))["input_ids"]) < n_tokens:
        text.extend(words[i % len(words): i % len(words) + 8])
        i += 8
    return " ".join(text)


def bare_ms(cm, length: int, steps: int) -> float:
    model = cm.model
    model.set_attn_implementation("sdpa")
    try:
        ids = torch.randint(100, 40000, (1, length))
        times = []
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(steps):
                t = time.perf_counter()
                out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
                token = out.logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - t)
    finally:
        model.set_attn_implementation("kvchat")
    return 1000 * statistics.mean(times)


def engine_ms(cm, settings: Settings, length: int, steps: int, prepare=None) -> tuple[float, int]:
    session = Session(cm, settings, system=None, sampling=Sampling(max_new_tokens=steps, temperature=0.0))
    text = filler_text(cm.tokenizer, length)
    session.add("user", text)
    while session.cache_tokens < length - 32:
        session.add("assistant", filler_text(cm.tokenizer, min(256, length - session.cache_tokens - 16)))
    stop_ids, cm.stop_ids = cm.stop_ids, frozenset()  # decode exactly `steps` tokens
    if prepare is not None:
        prepare(session)
    try:
        res = session.chat("Continue.")
    finally:
        cm.stop_ids = stop_ids
    return res.decode_ms_per_token, res.peak_cache_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    cm = models.load(args.model)
    torch.manual_seed(0)
    rows = []
    print(f"{'length':>7} {'bare ms/tok':>12} {'full ms/tok':>12} {'ratio':>6} {'streaming ms/tok':>17} {'ratio':>6}")
    for length in args.lengths:
        runs = [(bare_ms(cm, length, args.steps),
                 engine_ms(cm, Settings(policy="full"), length, args.steps),
                 engine_ms(cm, Settings(policy="streaming", budget=length), length, args.steps))
                for _ in range(args.repeats)]
        bare = min(r[0] for r in runs)
        full, full_peak = min(r[1] for r in runs)
        stream, stream_peak = min(r[2] for r in runs)
        rows.append({"length": length, "bare_ms": bare, "full_ms": full, "full_peak": full_peak,
                     "streaming_ms": stream, "streaming_peak": stream_peak,
                     "full_ratio": full / bare, "streaming_ratio": stream / bare})
        print(f"{length:7d} {bare:12.1f} {full:12.1f} {full / bare:6.2f} {stream:17.1f} {stream / bare:6.2f}",
              flush=True)
    print(json.dumps({"device": str(cm.device), "threads": torch.get_num_threads(), "steps": args.steps,
                      "rows": rows}))


if __name__ == "__main__":
    main()
