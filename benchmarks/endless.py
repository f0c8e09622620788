"""Endless chat: replay StreamingLLM's 158 MT-Bench turns as one conversation and check it stays bounded and flat.

Prints: total tokens (it must pass the model's 8192 positions), the largest cache seen against budget + slack, and
decode ms/token of the last 20 turns against the 20 turns right after the cache first filled.

    .venv/bin/python benchmarks/endless.py [--policy streaming] [--budget 512] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from transformers.utils import logging as hf_logging

from kvchat.app.replay import load_scripts, run_step
from kvchat.core import models
from kvchat.core.session import Sampling, Session
from kvchat.core.settings import Settings

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "streaming-llm" / "mt_bench.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--script", default=str(DATA))
    ap.add_argument("--policy", default="streaming")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--groups", default="token")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    (script,) = load_scripts(args.script)
    cm = models.load("default")
    settings = Settings(policy=args.policy, budget=args.budget, groups=args.groups)
    session = Session(cm, settings, sampling=Sampling(max_new_tokens=args.max_new_tokens, temperature=0.0))
    start = time.perf_counter()
    results = [run_step(session, step, {}) for step in script.steps]
    wall = time.perf_counter() - start
    filled = next(i for i, r in enumerate(results) if r.evicted_tokens > 0)
    decode = [r.decode_ms_per_token for r in results]
    early = [d for d in decode[filled: filled + 20] if d]
    late = [d for d in decode[-20:] if d]
    out = {
        "policy": args.policy, "budget": args.budget, "slack": settings.slack_tokens, "turns": len(results),
        "total_tokens": session.total_tokens, "max_cache_tokens": max(r.peak_cache_tokens for r in results),
        "bound": settings.capacity, "cache_bytes": results[-1].cache_bytes, "first_filled_turn": results[filled].turn,
        "decode_ms_after_fill": statistics.mean(early), "decode_ms_last20": statistics.mean(late),
        "ratio": statistics.mean(late) / statistics.mean(early), "wall_s": wall,
    }
    print(f"{out['turns']} turns, {out['total_tokens']} tokens; max cache {out['max_cache_tokens']} "
          f"(bound {out['bound']}); decode {out['decode_ms_after_fill']:.1f} ms/token after the cache filled "
          f"(turn {out['first_filled_turn']}), {out['decode_ms_last20']:.1f} over the last 20 turns "
          f"(x{out['ratio']:.2f}); {wall:.0f} s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
