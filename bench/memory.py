"""Memory: a headless replay of ``--turns`` exchanges (FastChat dummy conversations, appended without generation)
with cache bytes and the process's resident memory sampled after every turn. Once the cache has filled both
should be flat: the slope of a least-squares line over the turns after the first eviction (or after a tenth of the
turns, if later) is reported in MB per 1000 turns, and the RSS growth from the turn the cache filled to the end is
checked (under 50 MB). The session keeps 4 bytes of token metadata per token ever fed (its id; role, turn, message
and sentence as runs), the expected residual growth.

With ``--store`` the replay is a stored conversation as a chat is (SQLite, the cache's rows, the turn's state file
and, with ``--recall on``, recall's digests capped by ``--archive-mb``; every turn committed), and each one's bytes
on disk are sampled too. At the turns ``--decode-at`` (and the last)
``--decode-repeats`` replies of ``--decode-steps`` greedy tokens are generated as part of the chat, and each one's
decode ms/token (the median step) recorded, the least of them kept. Between them the same reply is timed on a short
reference chat (same settings, its cache just as full, in the same process): what the machine's own speed does
between two measurement points (a shared CPU's load, its clock) shows there, and the long chat's ratio to the
reference at each point is what its length costs. The soak of a long chat: ``--turns 10000 --store``, once per policy
(``--policies streaming h2o``), with ``--recall off`` (disk flat once the cache is full) and ``--recall on
--archive-mb 64`` (the digests held at their cap).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

from ..core.engine.session import Session, rss_mb
from ..core.engine.settings import Settings
from ..storage.db import Store
from .common import DISK, Run, data_dir, disk, fastchat_pairs, log, read_text, save_figure

NAME = "memory"
TITLE = "Memory"
QUICK = {"turns": 60, "budget": 256, "decode_at": [20], "decode_steps": 4, "decode_repeats": 1}
REFERENCE_TURNS = 40  # exchanges fed to a reference chat whose cache never fills (``full``)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--turns", type=int, default=2000)
    p.add_argument("--policies", nargs="+", default=["streaming"])
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--store", action="store_true",
                   help="replay as a stored conversation (SQLite, rows, state file, digests) and sample their bytes")
    p.add_argument("--recall", choices=("on", "off"), default="on", help="recall (its digests on disk; default on)")
    p.add_argument("--archive-mb", type=float, default=1024.0, help="recall's archive cap per conversation (MB)")
    p.add_argument("--decode-at", type=int, nargs="+", default=[100],
                   help="turns (and the last) at which a reply's decode ms/token is measured")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--decode-repeats", type=int, default=3,
                   help="replies timed at each --decode-at turn, alternating with a short reference chat's")
    p.add_argument("--data", default=None, help="the shared data directory (default ../shared/data)")


def slope_per_1000(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs, times 1000."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def reference_chat(cm, settings: Settings, pairs: list[tuple[str, str]]) -> tuple[Session, int]:
    """The short chat timed beside the long one, its cache as full: exchanges until its policy first evicts (so at
    any budget; 40 exchanges, the fixed count before, did not fill a cache of budget 4096), or ``REFERENCE_TURNS``
    for a cache that never fills. Returns it and its count of exchanges."""
    reference, t = Session(cm, settings), 0
    while (not reference.evicted_total) if settings.bounded else (t < REFERENCE_TURNS):
        reference.exchange(*pairs[t % len(pairs)])
        t += 1
    return reference, t


def replay(cm, settings: Settings, pairs: list[tuple[str, str]], turns: int, args, prompt: str,
           folder: Path | None = None) -> dict:
    from .speed import timed_turn

    gc.collect()
    reference, reference_turns = reference_chat(cm, settings, pairs)
    store = Store(folder / f"{settings.policy}.db") if folder is not None else None
    session = Session(cm, settings, store=store)
    samples, filled, decode = [], None, []
    at = {t for t in args.decode_at if t < turns} | {turns}
    for t in range(1, turns + 1):
        if t in at:
            long, ref = [], []
            for _ in range(args.decode_repeats):
                long.append(timed_turn(session, prompt, args.decode_steps))
                ref.append(timed_turn(reference, prompt, args.decode_steps)["decode_ms_per_token"])
            m = min(long, key=lambda r: r["decode_ms_per_token"])
            decode.append({"turn": t, "decode_ms_per_token": m["decode_ms_per_token"],
                           "cache_tokens": m["cache_tokens"],
                           "all_ms_per_token": [r["decode_ms_per_token"] for r in long],
                           "reference_ms_per_token": min(ref), "reference_all": ref})
            log(f"memory {settings.policy:10s} turn {t}: decode {m['decode_ms_per_token']:.1f} ms/token (reference "
                f"chat {min(ref):.1f})")
        else:
            session.exchange(*pairs[(t - 1) % len(pairs)])
        if filled is None and session.evicted_total:
            filled = t
        samples.append((t, session.cache_bytes, rss_mb(), session.cache_tokens, session.total_tokens,
                        *disk(store, session)))
        if t % 500 == 0:  # a soak cut short still says what it measured
            s = samples[-1]
            log(f"memory {settings.policy:10s} turn {t}: {s[4]} tokens, cache {s[3]}, RSS {s[2]:.1f} MB, disk "
                + ", ".join(f"{k} {v:,} B" for k, v in zip(DISK, s[5:])))
    after = [s for s in samples if filled is not None and s[0] >= max(filled, turns // 10)]
    xs = [s[0] for s in after]
    out = {"policy": settings.policy, "budget": settings.budget, "turns": turns, "tokens": session.total_tokens,
           "first_filled_turn": filled, "max_cache_tokens": max(s[3] for s in samples), "bound": settings.capacity,
           "cache_bytes_last": samples[-1][1], "cache_mb_slope": slope_per_1000(xs, [s[1] / 2**20 for s in after]),
           "rss_mb_first": after[0][2] if after else None, "rss_mb_last": samples[-1][2],
           "rss_mb_filled": samples[filled - 1][2] if filled is not None else None,
           "rss_mb_slope": slope_per_1000(xs, [s[2] for s in after]),
           "token_log_bytes": session.stats()["token_log_bytes"], "decode": decode,
           "reference_turns": reference_turns,
           "stored": store is not None,
           "recall": settings.recall, "archive_mb": settings.archive_mb,
           "samples": [[s[0], round(s[1] / 2**20, 3), round(s[2], 1), s[4], *s[5:]] for s in samples]}
    if len(decode) > 1:
        first, last = decode[0], decode[-1]
        out["decode_ratio"] = last["decode_ms_per_token"] / first["decode_ms_per_token"]
        out["decode_ratio_to_reference"] = ((last["decode_ms_per_token"] / last["reference_ms_per_token"])
                                            / (first["decode_ms_per_token"] / first["reference_ms_per_token"]))
    if store is not None:
        last = dict(zip(DISK, samples[-1][5:]))
        out.update({f"{k}_bytes": v for k, v in last.items()}, sqlite_bytes_per_turn=last["sqlite"] / turns,
                   digests_bytes_per_token=last["digests"] / max(session.total_tokens, 1),
                   disk_at={t: dict(zip(("tokens", *DISK), s[4:])) for s in samples for t in [s[0]]
                            if t in (1000, 5000, turns) or t == turns})
        session.close()
        store.close()
    return out


def run(args, run: Run, cm) -> None:
    data = data_dir(args.data)
    pairs = fastchat_pairs(data)
    text = cm.tokenizer(read_text(data, "pg19")[:4000], add_special_tokens=False)["input_ids"]
    prompt = cm.tokenizer.decode(text[:30])
    run.rows = {"runs": []}
    for p in args.policies:
        with tempfile.TemporaryDirectory(prefix="kvchat-bench-memory-") as tmp:
            r = replay(cm, Settings(policy=p, budget=args.budget, recall=args.recall, archive_mb=args.archive_mb),
                       pairs, args.turns, args, prompt, Path(tmp) if args.store else None)
        run.rows["runs"].append(r)
        log(f"memory {p:10s} {r['turns']} turns, {r['tokens']} tokens: cache {r['cache_bytes_last'] / 2**20:.1f} MiB "
            f"(slope {r['cache_mb_slope']:.3f} MB/1000 turns), RSS {r['rss_mb_last']:.0f} MB "
            f"(slope {r['rss_mb_slope']:.2f} MB/1000 turns)")
        run.check(f"{p} cache bounded", r["first_filled_turn"] is not None and r["max_cache_tokens"] <= r["bound"],
                  f"max cache {r['max_cache_tokens']} tokens (bound {r['bound']}), filled at turn "
                  f"{r['first_filled_turn']}")
        run.check(f"{p} cache bytes flat", abs(r["cache_mb_slope"]) < 0.01,
                  f"{r['cache_mb_slope']:.4f} MB per 1000 turns after the cache filled")
        if r["rss_mb_first"] is not None:
            log(f"memory {p:10s} RSS {r['rss_mb_first']:.0f} -> {r['rss_mb_last']:.0f} MB from turn "
                f"{max(r['first_filled_turn'], args.turns // 10)} (the cache filled at {r['first_filled_turn']}) "
                "to the end")
            grown = r["rss_mb_last"] - r["rss_mb_filled"]
            run.check(f"{p} RSS growth under 50 MB", grown < 50,
                      f"{grown:+.1f} MB from the cache filling (turn {r['first_filled_turn']}) to the end")
        if "decode_ratio" in r and not args.quick:
            d0, d1 = r["decode"][0], r["decode"][-1]
            run.check(f"{p} decode at turn {d1['turn']} within 1.1x of turn {d0['turn']}",
                      r["decode_ratio"] <= 1.1 or r["decode_ratio_to_reference"] <= 1.1,
                      f"{d0['decode_ms_per_token']:.1f} -> {d1['decode_ms_per_token']:.1f} ms/token "
                      f"({r['decode_ratio']:.2f}x); against the reference chat timed beside each "
                      f"({d0['reference_ms_per_token']:.1f}, {d1['reference_ms_per_token']:.1f} ms/token): "
                      f"{r['decode_ratio_to_reference']:.2f}x")


def plot(result: dict, plots, plt) -> list:
    runs = result["results"]["runs"]
    stored = any(r.get("stored") for r in runs)
    fig, axes = plt.subplots(1, 2 if stored else 1, figsize=(12 if stored else 7, 4), squeeze=False)
    ax = axes[0][0]
    for r in runs:
        s = r["samples"]
        ax.plot([x[0] for x in s], [x[2] for x in s], label=f"RSS, {r['policy']}")
        ax.plot([x[0] for x in s], [x[1] for x in s], ls="--", label=f"cache, {r['policy']}")
    ax.set_xlabel("turn")
    ax.set_ylabel("MB")
    ax.set_title(f"Memory over a {runs[0]['turns']}-turn replay, budget {runs[0]['budget']}")
    ax.legend(fontsize=8)
    if stored:
        ax = axes[0][1]
        for r in runs:
            s = r["samples"]
            for i, (name, style) in enumerate(zip(DISK, ("-", "--", ":", "-."))):
                if len(s[0]) > 4 + i and any(x[4 + i] for x in s):
                    ax.plot([x[0] for x in s], [x[4 + i] / 2**20 for x in s], ls=style, label=f"{name}, {r['policy']}")
        ax.set_xlabel("turn")
        ax.set_ylabel("MiB on disk")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    return [save_figure(fig, plots / "memory.png", plt)]


def markdown(result: dict) -> str:
    lines = ["| policy | budget | turns | tokens fed | max cache tokens (bound) | cache MiB | "
             "cache slope MB/1000 turns | RSS MB (cache filled → end) | RSS slope MB/1000 turns |",
             "| --- " * 9 + "|"]
    for r in result["results"]["runs"]:
        lines.append(f"| {r['policy']} | {r['budget']} | {r['turns']} | {r['tokens']} | {r['max_cache_tokens']} "
                     f"({r['bound']}) | {r['cache_bytes_last'] / 2**20:.1f} | {r['cache_mb_slope']:.3f} | "
                     f"{r.get('rss_mb_filled') or r['rss_mb_first']:.0f} → {r['rss_mb_last']:.0f} | "
                     f"{r['rss_mb_slope']:.2f} |")
    runs = [r for r in result["results"]["runs"] if r.get("stored") or r.get("decode")]
    if runs:
        lines += ["", "| policy | recall | SQLite bytes per turn (file at the end) | rows MiB | state file MiB | "
                  "digests bytes per token (MiB) | token log MiB | "
                  "decode ms/token at turns (a short chat's beside it) |",
                  "| --- " * 8 + "|"]
        for r in runs:
            dec = ", ".join(f"{d['decode_ms_per_token']:.1f} @ {d['turn']}"
                            + (f" (reference {d['reference_ms_per_token']:.1f})"
                               if "reference_ms_per_token" in d else "")
                            for d in r.get("decode", []))
            disk = (f"{r['sqlite_bytes_per_turn']:,.0f} ({r['sqlite_bytes'] / 2**20:.1f} MiB) | "
                    f"{r['rows_bytes'] / 2**20:.1f} | {r['state_bytes'] / 2**20:.2f} | "
                    f"{r['digests_bytes_per_token']:,.0f} ({r['digests_bytes'] / 2**20:.1f})"
                    if r.get("stored") and "rows_bytes" in r else "– | – | – | –")
            lines.append(f"| {r['policy']} | {r.get('recall', '–')} | {disk} | "
                         f"{r.get('token_log_bytes', 0) / 2**20:.1f} | {dec or '–'} |")
    return "\n".join(lines)
