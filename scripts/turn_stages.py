"""Where a chat turn's time goes on this machine: a chat of ``--turns`` turns (the GPU bench's random 24-token
messages and 8-token greedy replies, bench/speed_cuda_chat.py), the median turn and TTFT over its second half, then
``--profiled`` more turns under PyTorch's profiler: each stage's median host time (core/engine/turns.py STAGES).

    .venv/bin/python scripts/turn_stages.py --turns 40 --budget 256
    .venv/bin/python scripts/turn_stages.py --turns 40 --budget 256 --short-feed 0   # short segments via the forward
    .venv/bin/python scripts/turn_stages.py --shape llama-1b --device cuda               # a random-weight GPU shape

The default model unless ``--shape`` (the GPU bench's shapes, random weights; its tokenizer is the default model's).
``--short-feed N`` sets the decode step's ``short_feed`` (core/decode/eager.py) for a paired comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvchat.bench import speed_cuda, speed_cuda_kernels as kernels
from kvchat.bench.speed_cuda_chat import CHAT_REPLY, MESSAGE, text
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.core.model.loading import default_model_dir, load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--profiled", type=int, default=3)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--policy", default="streaming")
    p.add_argument("--shape", choices=sorted(speed_cuda.SHAPES), default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--short-feed", type=int, default=None)
    args = p.parse_args()
    if args.turns < 2 or args.profiled < 0:
        p.error("--turns must be at least 2 and --profiled not negative")
    cm = (speed_cuda.build(args.shape, str(default_model_dir()), args.device, "auto") if args.shape else
          load_model(str(default_model_dir()), device=args.device))
    if args.short_feed is not None and cm.step is not None:
        cm.step.short_feed = args.short_feed
    session = Session(cm, Settings(policy=args.policy, budget=args.budget), sampling=Sampling(temperature=0.0))
    walls, ttfts, recalled = [], [], 0
    for turn in range(1, args.turns + 1):
        t = time.perf_counter()
        res = session.chat(text(cm, MESSAGE, 10 + turn), max_new_tokens=CHAT_REPLY)
        walls.append(1000 * (time.perf_counter() - t))
        ttfts.append(res.prefill_ms)
        recalled += bool(res.recall_ms)
    half = args.turns // 2
    print(f"{cm.name} {args.policy} budget {args.budget}, short_feed {getattr(cm.step, 'short_feed', None)}: "
          f"turns {half + 1}-{args.turns}: a turn {statistics.median(walls[half:]):.1f} ms, TTFT "
          f"{statistics.median(ttfts[half:]):.1f} ms (median); recall ran at {recalled} of {args.turns} messages")
    stages: dict[str, list[float]] = {}
    for turn in range(args.turns + 1, args.turns + 1 + args.profiled):
        prof = kernels.profile_call(lambda: session.chat(text(cm, MESSAGE, 10 + turn), max_new_tokens=CHAT_REPLY),
                                    args.device)
        for name, v in prof["stages"].items():
            stages.setdefault(name, []).append(v["ms"])
    if stages:
        print(f"stages (median of {args.profiled} profiled turns, ms): " + ", ".join(
            f"{k.removeprefix('kvchat.')} {statistics.median(v):.1f}"
            for k, v in sorted(stages.items(), key=lambda kv: -statistics.median(kv[1]))))


if __name__ == "__main__":
    main()
