"""Per-policy decode cost at a fixed budget: what each policy's bookkeeping adds to a decode step.

Every policy decodes ``--steps`` tokens (enough to pass at least one compression) with its cache filled to the
budget. Bookkeeping is measured directly: the time spent in the attention observer (every step, for policies that
read attention) and in compressions (scoring, selection, gather, re-rotation; amortized over the steps), as a share
of the decode time. (A difference of two noisy ms/token totals cannot resolve a few percent on a shared CPU.)
`full` holding the same number of positions is shown for reference. Best of ``--repeats`` runs.

    .venv/bin/python benchmarks/policies.py [--budget 1024] [--steps 160] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvchat.core import models
from kvchat.core.settings import Settings
from kvchat.policies import POLICIES

from overhead import engine_ms


def instrumented(cm, name: str, budget: int, steps: int) -> tuple[float, float]:
    """(decode ms/token, bookkeeping share of the decode time) for one reply."""
    spent = {"s": 0.0}

    def prepare(session):
        def timed(fn):
            def run(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent["s"] += time.perf_counter() - t
            return run

        session._compress = timed(session._compress)
        if session.observer is not None:  # its per-step work (window attention is inside _compress)
            session.observer._accumulate = timed(session.observer._accumulate)
            session.observer._remember = timed(session.observer._remember)

    ms, _ = engine_ms(cm, Settings(policy=name, budget=budget), budget, steps, prepare=prepare)
    return ms, 1000 * spent["s"] / (ms * steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    cm = models.load("default")
    torch.manual_seed(0)
    names = list(POLICIES)
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.repeats):
        for name in names:
            ms, share = instrumented(cm, name, args.budget, args.steps)
            if name not in best or ms < best[name][0]:
                best[name] = (ms, share)
    rows = []
    print(f"{'policy':10s} {'ms/token':>9s} {'bookkeeping':>12s}")
    for name in names:
        ms, share = best[name]
        rows.append({"policy": name, "ms_per_token": ms, "bookkeeping": share})
        print(f"{name:10s} {ms:9.1f} {100 * share:11.1f}%")
    print(json.dumps({"budget": args.budget, "steps": args.steps, "rows": rows}))


if __name__ == "__main__":
    main()
