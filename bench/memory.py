"""Memory: a headless replay of ``--turns`` exchanges (FastChat dummy conversations, appended without generation)
with cache bytes and the process's resident memory sampled after every turn. Once the cache has filled both
should be flat: the slope of a least-squares line over the turns after the first eviction is reported in MB per
1000 turns. The session keeps 20 bytes of token metadata per token ever fed (README), which is the expected
residual growth.
"""

from __future__ import annotations

import argparse
import gc

from ..core.session import Session, rss_mb
from ..core.settings import Settings
from .common import Run, data_dir, fastchat_pairs, log, save_figure

NAME = "memory"
TITLE = "Memory"
QUICK = {"turns": 60, "budget": 256}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--turns", type=int, default=2000)
    p.add_argument("--policies", nargs="+", default=["streaming"])
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--data", default=None, help="the shared data directory (default ../shared/data)")


def slope_per_1000(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs, times 1000."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def replay(cm, settings: Settings, pairs: list[tuple[str, str]], turns: int) -> dict:
    gc.collect()
    session = Session(cm, settings)
    samples, filled = [], None
    for t in range(turns):
        user, assistant = pairs[t % len(pairs)]
        session.exchange(user, assistant)
        if filled is None and session.evicted_total:
            filled = t
        samples.append((t, session.cache_bytes, rss_mb(), session.cache_tokens))
    after = [s for s in samples if filled is not None and s[0] >= max(filled, turns // 10)]
    xs = [s[0] for s in after]
    return {"policy": settings.policy, "budget": settings.budget, "turns": turns, "tokens": session.total_tokens,
            "first_filled_turn": filled, "max_cache_tokens": max(s[3] for s in samples), "bound": settings.capacity,
            "cache_bytes_last": samples[-1][1], "cache_mb_slope": slope_per_1000(xs, [s[1] / 2**20 for s in after]),
            "rss_mb_first": after[0][2] if after else None, "rss_mb_last": samples[-1][2],
            "rss_mb_slope": slope_per_1000(xs, [s[2] for s in after]),
            "samples": [[s[0], round(s[1] / 2**20, 3), round(s[2], 1)] for s in samples]}


def run(args, run: Run, cm) -> None:
    pairs = fastchat_pairs(data_dir(args.data))
    run.rows = {"runs": []}
    for p in args.policies:
        r = replay(cm, Settings(policy=p, budget=args.budget), pairs, args.turns)
        run.rows["runs"].append(r)
        log(f"memory {p:10s} {r['turns']} turns, {r['tokens']} tokens: cache {r['cache_bytes_last'] / 2**20:.1f} MiB "
            f"(slope {r['cache_mb_slope']:.3f} MB/1000 turns), RSS {r['rss_mb_last']:.0f} MB "
            f"(slope {r['rss_mb_slope']:.2f} MB/1000 turns)")
        run.check(f"{p} cache bounded", r["first_filled_turn"] is not None and r["max_cache_tokens"] <= r["bound"],
                  f"max cache {r['max_cache_tokens']} tokens (bound {r['bound']}), filled at turn "
                  f"{r['first_filled_turn']}")
        run.check(f"{p} cache bytes flat", abs(r["cache_mb_slope"]) < 0.01,
                  f"{r['cache_mb_slope']:.4f} MB per 1000 turns after the cache filled")


def plot(result: dict, plots, plt) -> list:
    runs = result["results"]["runs"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        s = r["samples"]
        ax.plot([x[0] for x in s], [x[2] for x in s], label=f"RSS, {r['policy']}")
        ax.plot([x[0] for x in s], [x[1] for x in s], ls="--", label=f"cache, {r['policy']}")
    ax.set_xlabel("turn")
    ax.set_ylabel("MB")
    ax.set_title(f"Memory over a {runs[0]['turns']}-turn replay, budget {runs[0]['budget']}")
    ax.legend(fontsize=8)
    return [save_figure(fig, plots / "memory.png", plt)]


def markdown(result: dict) -> str:
    lines = ["| policy | budget | turns | tokens fed | max cache tokens (bound) | cache MiB | cache slope MB/1000 turns "
             "| RSS MB (after fill → end) | RSS slope MB/1000 turns |", "| --- " * 9 + "|"]
    for r in result["results"]["runs"]:
        lines.append(f"| {r['policy']} | {r['budget']} | {r['turns']} | {r['tokens']} | {r['max_cache_tokens']} "
                     f"({r['bound']}) | {r['cache_bytes_last'] / 2**20:.1f} | {r['cache_mb_slope']:.3f} | "
                     f"{r['rss_mb_first']:.0f} → {r['rss_mb_last']:.0f} | {r['rss_mb_slope']:.2f} |")
    return "\n".join(lines)
