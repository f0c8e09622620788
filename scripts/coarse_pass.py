"""Time recall's coarse pass (core/recall/score.py, ``_blocked_shares`` in its three layers) against the number of
archived groups, with the first pass's products kept for the second (``KEPT_LOGITS_MB``, the default) and made
again (``KEPT_LOGITS_MB = 0``), in turn, in one process tuned as kvchat's are (``tune_malloc``) (docs/recall.md).

    .venv/bin/python scripts/coarse_pass.py --groups 60000 156250 --rows 20 64

The keys and queries are random (the cost does not depend on their values), of the default model's shapes unless
told: 3 KV heads, 9 query heads, 64 dimensions. ``--rows`` are a message's query rows (the pass samples at most
``COARSE_ROWS`` of them). Prints the median and least of ``--repeat`` timings of each, and whether they agree.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvchat.core.engine.procinfo import tune_malloc
from kvchat.core.recall import score


def coarse_pass(q: torch.Tensor, coarse: torch.Tensor) -> list[torch.Tensor]:
    return [score._blocked_shares(q, coarse[i], q.shape[-1] ** -0.5) for i in range(coarse.shape[0])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--groups", type=int, nargs="+", default=[60000, 156250])
    p.add_argument("--rows", type=int, nargs="+", default=[20, 64])
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--query-heads", type=int, default=9)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    tune_malloc()
    kept_mb = score.KEPT_LOGITS_MB
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, coarse keys in {score.COARSE_DTYPE}, kept up to {kept_mb} MB")
    for groups in args.groups:
        coarse = torch.randn(3, args.kv_heads, groups, args.dim, generator=gen).to(score.COARSE_DTYPE)
        for rows in args.rows:
            q = torch.randn(args.query_heads, min(rows, score.COARSE_ROWS), args.dim, generator=gen)
            times, shares = {"kept": [], "made again": []}, {}
            for _ in range(args.repeat):
                for name, mb in (("kept", kept_mb), ("made again", 0)):
                    score.KEPT_LOGITS_MB = mb
                    t = time.perf_counter()
                    shares[name] = coarse_pass(q, coarse)
                    times[name].append(1000 * (time.perf_counter() - t))
            score.KEPT_LOGITS_MB = kept_mb
            same = all(torch.equal(a, b) for a, b in zip(shares["kept"], shares["made again"]))
            print(f"{groups:8d} groups, {rows:3d} query rows: " + ", ".join(
                f"{name} {statistics.median(t):.1f} ms (least {min(t):.1f})" for name, t in times.items())
                + f"; the same shares: {same}")


if __name__ == "__main__":
    main()
