"""kvchat's policies against kvpress's presses of the same name: one-shot compression, same model, same text.

A 4096-token prefix of Pride and Prejudice (from Chapter I) is compressed to 1024 positions, then the next 512
tokens are scored with the compressed cache; perplexity per policy/press. kvpress pins transformers < 5.3, so its
side runs in a separate virtual environment (created at --venv on first use: torch, kvpress 0.5.5,
transformers < 5.3) from benchmarks/kvpress_side.py. kvchat runs with --positions original (kvpress keeps the
original positions) and with the press's own settings (sink, window, pooling) where they differ from kvchat's
defaults.

    .venv/bin/python benchmarks/kvpress_compare.py [--prefix 4096] [--keep 1024] [--cont 512]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from kvchat.core import models
from kvchat.core.session import Session
from kvchat.core.settings import Settings

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "gutenberg" / "pg1342_pride_and_prejudice.txt"

# kvchat policy -> (kvpress press, its arguments, kvchat settings that reproduce the press's definition)
PAIRS = {
    "streaming": ("StreamingLLMPress", {"n_sink": 4}, dict(sink=4, window=0)),
    "snapkv": ("SnapKVPress", {"window_size": 64, "kernel_size": 5},
               dict(sink=0, window=64, params={"obs_window": 64, "kernel": 5, "pool": "avg"})),
    "tova": ("TOVAPress", {}, dict(sink=0, window=1)),
    "h2o": ("ObservedAttentionPress", {}, dict(sink=0, window=0, params={"average": True})),
}


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if python.exists():
        return python
    print(f"creating {venv} (torch {torch.__version__.split('+')[0]}, kvpress 0.5.5, transformers<5.3) ...",
          file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [f"torch=={torch.__version__.split('+')[0]}"], check=True)
    subprocess.run(pip + ["kvpress==0.5.5", "transformers<5.3"], check=True)
    return python


def kvchat_ppl(cm, policy: str, overrides: dict, ids: list[int], prefix: int, keep: int) -> dict:
    settings = Settings(policy=policy, budget=prefix, positions="original",
                        **{k: v for k, v in overrides.items() if k != "params"}, params=overrides.get("params", {}))
    session = Session(cm, settings, system=None)
    t = time.perf_counter()
    session.feed_raw(ids[:prefix], score=False)
    session.configure(budget=keep)  # one-shot compression of the prefix, like a press
    prefill_s = time.perf_counter() - t
    kept = session.cache_tokens
    session.configure(policy="full")  # no further eviction while the continuation is scored
    t = time.perf_counter()
    logprobs, _ = session.feed_raw(ids[prefix:])
    return {"ppl": math.exp(float(-logprobs.mean())), "kept": kept, "prefill_s": prefill_s,
            "continuation_ms_per_token": 1000 * (time.perf_counter() - t) / (len(ids) - prefix)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--keep", type=int, default=1024)
    ap.add_argument("--cont", type=int, default=512)
    ap.add_argument("--venv", default=str(models.kvchat_home() / "kvpress-venv"))
    args = ap.parse_args()
    cm = models.load("default")
    text = TEXT.read_text(encoding="utf-8")
    text = text[text.index("It is a truth universally acknowledged"):]
    ids = cm.tokenizer(text, add_special_tokens=False)["input_ids"][: args.prefix + args.cont]
    python = ensure_venv(Path(args.venv))
    job = {"model": str(models.default_model_dir()), "ids": ids, "prefix": args.prefix, "keep": args.keep,
           "presses": {name: {"class": cls, "args": kw} for name, (cls, kw, _) in PAIRS.items()}}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    proc = subprocess.run([str(python), str(Path(__file__).with_name("kvpress_side.py"))], input=json.dumps(job),
                          capture_output=True, text=True, env=env, check=True)
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    full = kvchat_ppl(cm, "full", {}, ids, args.prefix, args.prefix)
    rows = []
    print(f"full cache PPL {full['ppl']:.3f} (prefix {args.prefix}, next {args.cont} tokens); kept {args.keep}")
    print(f"{'policy':10s} {'kvchat PPL':>10s} {'kvpress PPL':>11s} {'diff':>7s} {'kvchat ms/tok':>13s} "
          f"{'kvpress ms/tok':>14s}")
    for name, (cls, _, overrides) in PAIRS.items():
        ours = kvchat_ppl(cm, name, overrides, ids, args.prefix, args.keep)
        ref = theirs["results"][name]
        diff = ours["ppl"] / ref["ppl"] - 1
        rows.append({"policy": name, "press": cls, "kvchat": ours, "kvpress": ref, "relative_diff": diff})
        print(f"{name:10s} {ours['ppl']:10.3f} {ref['ppl']:11.3f} {100 * diff:6.2f}% "
              f"{ours['continuation_ms_per_token']:13.1f} {ref['continuation_ms_per_token']:14.1f}", flush=True)
    print(json.dumps({"full": full, "rows": rows, "kvpress": theirs["kvpress"]}))


if __name__ == "__main__":
    main()
