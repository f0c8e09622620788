"""Long-text perplexity, streaming: the text is fed in chunks on top of the compressed cache and the NLL of every
token is accumulated.

Runs (each one Session fed ``--chunk`` tokens at a time with ``feed_raw``; the first token has no prediction):

* long: ``--tokens`` of the PG19 stand-in for ``--long-policies`` at ``--long-budget``, ``streaming`` with
  original positions, and the full cache: ``streaming`` with a budget above the text length and original
  positions evicts nothing, so it *is* the full cache, and it goes on past the model's max positions (kvchat's
  ``full`` policy stops there by design);
* grid: every policy x ``--budgets`` on ``--grid-tokens`` tokens of each of ``--texts``, token groups (the second
  text at ``--long-budget`` only), the full cache as reference;
* groups: every policy in each of ``--groups`` at ``--group-budget``;
* ablations (StreamingLLM): window in ``--windows`` at sink 4 (budget = sink + window), sink in ``--sinks`` at
  window 1020, over ``--ablation-tokens`` and ``--sink-tokens``.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from ..core.engine.session import Session
from ..core.engine.settings import Settings
from ..policies import POLICIES
from .common import Run, SanityError, data_dir, log, read_text, save_figure

NAME = "ppl"
TITLE = "Long-text perplexity, streaming"
BOUNDED = [p for p, cls in POLICIES.items() if cls.bounded]
SEGMENT = 250  # tokens per stored NLL segment
QUICK = {"tokens": 800, "full_tokens": 800, "grid_tokens": 600, "ablation_tokens": 1000, "texts": ["pg19"],
         "budgets": [256], "policies": ["streaming", "h2o"], "long_policies": ["streaming"], "long_budget": 256,
         "groups": [], "windows": [64, 256], "sinks": [0, 4], "sink_window": 124, "sink_tokens": 1000}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=20000, help="tokens of the long run (past the model's positions)")
    p.add_argument("--grid-tokens", type=int, default=2500, help="tokens of each policy x budget run")
    p.add_argument("--ablation-tokens", type=int, default=4000, help="tokens of each window ablation run")
    p.add_argument("--chunk", type=int, default=64, help="tokens fed per step")
    p.add_argument("--texts", nargs="+", default=["pg19", "wikitext"], choices=["pg19", "wikitext"])
    p.add_argument("--policies", nargs="+", default=BOUNDED, help="bounded policies of the grid")
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--groups", nargs="*", default=["sentence", "turn"], choices=["sentence", "turn"],
                   help="group modes run besides token groups (at --group-budget)")
    p.add_argument("--group-budget", type=int, default=512)
    p.add_argument("--full-tokens", type=int, default=12288,
                   help="tokens of the full-cache reference in the long run (its attention grows with every token)")
    p.add_argument("--long-policies", nargs="+", default=["streaming"])
    p.add_argument("--long-budget", type=int, default=1024)
    p.add_argument("--windows", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--sinks", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    p.add_argument("--sink-window", type=int, default=1020, help="window of the sink ablation")
    p.add_argument("--sink-tokens", type=int, default=2500, help="tokens of each sink ablation run")
    p.add_argument("--data", default=None, help="the shared data directory (default ../shared/data)")


def stream(cm, ids: list[int], settings: Settings, chunk: int, inspect=None) -> dict:
    """Feed ``ids`` in chunks; per-segment mean NLL, the largest cache seen (the engine's per-turn peak: positions per
    layer and head, averaged, as per-layer and per-head budgets let single layers hold more; beside it the fullest
    layer after a chunk's compression) and where eviction began (plus ``inspect(session)``'s entries at the end)."""
    session = Session(cm, settings, system=None)
    nll = torch.full((len(ids),), float("nan"))
    fullest, first_evict, t0 = 0, None, time.perf_counter()
    for i in range(0, len(ids), chunk):
        part = ids[i: i + chunk]
        lp, _ = session.feed_raw(part)
        nll[i: i + len(part)] = -lp
        fullest = max(fullest, session.cache.length)
        if first_evict is None and session.evicted_total:
            first_evict = i + len(part)
    wall = time.perf_counter() - t0
    segs = [float(nll[a: a + SEGMENT].nanmean()) for a in range(0, len(ids), SEGMENT)]
    bound = settings.capacity if session.policy.bounded else None
    return {"tokens": len(ids), "ppl": math.exp(float(nll[1:].mean())), "segments": segs,
            "max_cache": max(r.peak_cache_tokens for r in session.history),
            "max_layer": fullest, "bound": bound, "first_evict": first_evict, "ms_per_token": 1000 * wall / len(ids),
            "cache_bytes": session.cache_bytes, **(inspect(session) if inspect else {})}


def ppl_between(row: dict, start: int, end: int | None = None) -> float:
    """PPL over the stored segments covering tokens [start, end)."""
    segs = row["segments"]
    a, b = start // SEGMENT, len(segs) if end is None else math.ceil(end / SEGMENT)
    vals = [v for v in segs[a:b] if not math.isnan(v)]
    return math.exp(sum(vals) / len(vals)) if vals else float("nan")


def _label(s: Settings) -> str:
    return f"{s.policy} b={s.budget} sink={s.sink} window={s.window_tokens} {s.groups} {s.positions}"


def run(args, run: Run, cm) -> None:
    data = data_dir(args.data)
    texts = {t: cm.tokenizer(read_text(data, t), add_special_tokens=False)["input_ids"] for t in args.texts}
    if "pg19" not in texts:
        texts["pg19"] = cm.tokenizer(read_text(data, "pg19"), add_special_tokens=False)["input_ids"]
    rows: list[dict] = []
    run.rows = {"runs": rows, "max_positions": cm.max_positions, "segment": SEGMENT}

    def one(kind: str, text: str, n: int, settings: Settings, **extra) -> dict:
        ids = texts[text][:n]
        if len(ids) < n:
            raise ValueError(f"{text} holds only {len(ids)} tokens, fewer than the {n} asked for")
        row = {"kind": kind, "text": text, "policy": settings.policy, "budget": settings.budget,
               "sink": settings.sink, "window": settings.window_tokens, "groups": settings.groups,
               "positions": settings.positions, **extra, **stream(cm, ids, settings, args.chunk)}
        rows.append(row)
        log(f"ppl {kind:9s} {text:8s} {row.get('label') or _label(settings):60s} {n:6d} tok  PPL {row['ppl']:8.3f}  "
            f"max cache {row['max_cache']} ({row['ms_per_token']:.1f} ms/tok)")
        return row

    # long run: past the model's positions
    n_full = min(args.full_tokens, args.tokens)
    full_long = one("long", "pg19", n_full,
                    Settings(policy="streaming", budget=n_full, positions="original"), label="full cache")
    long_rows = {p: one("long", "pg19", args.tokens, Settings(policy=p, budget=args.long_budget))
                 for p in args.long_policies}
    original = one("long", "pg19", args.tokens,
                   Settings(policy="streaming", budget=args.long_budget, positions="original"))
    # grid and group modes
    for text in args.texts:
        n = args.grid_tokens
        if cm.max_positions > n:
            one("grid", text, n, Settings(policy="full"))
        budgets = args.budgets if text == "pg19" else [args.long_budget]
        for budget in budgets:
            for p in args.policies:
                one("grid", text, n, Settings(policy=p, budget=budget))
    for mode in args.groups:
        for p in args.policies:
            one("groups", "pg19", args.grid_tokens, Settings(policy=p, budget=args.group_budget, groups=mode))
    # StreamingLLM ablations
    win = {w: one("window", "pg19", args.ablation_tokens, Settings(policy="streaming", budget=4 + w, sink=4,
                                                                     window=w)) for w in args.windows}
    sinks = {s: one("sink", "pg19", args.sink_tokens,
                    Settings(policy="streaming", budget=s + args.sink_window, sink=s, window=args.sink_window))
             for s in args.sinks}

    # sanity checks
    over = [r for r in rows if r["bound"] is not None and r["max_cache"] > r["bound"]]
    run.check("bounded", not over, "every bounded cache stayed within budget + slack" if not over else
              f"{len(over)} runs passed budget + slack")
    ws = sorted(win)
    if len(ws) >= 2:
        lo, hi = win[ws[0]], win[ws[-1]]
        run.check("window moves PPL", lo["ppl"] > 1.01 * hi["ppl"] and lo["first_evict"] is not None,
                  f"window {ws[0]}: PPL {lo['ppl']:.3f}, window {ws[-1]}: PPL {hi['ppl']:.3f}")
    if 0 in sinks and 4 in sinks:
        start = sinks[0]["first_evict"] or args.sink_tokens
        if start >= args.sink_tokens:
            raise SanityError("the sink ablation never slid its window; raise --sink-tokens")
        p0, p4 = ppl_between(sinks[0], start), ppl_between(sinks[4], start)
        run.check("sink 0 worse than sink 4", p0 > p4,
                  f"after the window slid (token {start}+): sink 0 PPL {p0:.3f}, sink 4 PPL {p4:.3f}")
    if n_full > cm.max_positions + SEGMENT and "streaming" in long_rows:
        a = ppl_between(full_long, cm.max_positions, n_full)
        b = ppl_between(long_rows["streaming"], cm.max_positions, n_full)
        run.check("full past max positions worse than streaming", a > b,
                  f"tokens {cm.max_positions}-{n_full}: full cache PPL {a:.2f}, streaming PPL {b:.2f}")
    del original


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------
def _rows(result, kind, text=None):
    return [r for r in result["results"]["runs"] if r["kind"] == kind and (text is None or r["text"] == text)]


def _name(r: dict) -> str:
    if r.get("label"):
        return r["label"]
    return r["policy"] + (" (original positions)" if r["positions"] == "original" else "")


def plot(result: dict, plots, plt) -> list:
    out = []
    res = result["results"]
    seg = res["segment"]
    long = _rows(result, "long")
    if long:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        k = max(1, long[0]["tokens"] // (20 * seg))  # about 20 points per curve
        for r in long:
            segs = r["segments"]
            xs = [min(i + k, len(segs)) * seg for i in range(0, len(segs) - k + 1, k)]
            ys = [math.exp(sum(segs[i: i + k]) / k) for i in range(0, len(segs) - k + 1, k)]
            budget = f", budget {r['budget']}" if r.get("label") is None else ""
            ax.plot(xs, ys, marker=".", label=f"{_name(r)}{budget}")
        if long[0]["tokens"] > res["max_positions"]:
            ax.axvline(res["max_positions"], color="grey", ls=":", lw=1)
            ax.text(res["max_positions"], ax.get_ylim()[1], " model's max positions", color="grey", va="top",
                    fontsize=8)
        ax.set_yscale("log")
        ax.set_xlabel("tokens processed")
        ax.set_ylabel(f"PPL of each {k * seg}-token segment")
        ax.set_title(f"Streaming perplexity, PG19 stand-in (chunks of {result['config']['chunk']})")
        ax.legend(fontsize=8)
        out.append(save_figure(fig, plots / "ppl_long.png", plt))
    grid = [r for r in _rows(result, "grid", "pg19") if r["policy"] != "full"]
    if grid:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for p in dict.fromkeys(r["policy"] for r in grid):
            rs = sorted((r for r in grid if r["policy"] == p), key=lambda r: r["budget"])
            ax.plot([r["budget"] for r in rs], [r["ppl"] for r in rs], marker="o", label=p)
        for r in _rows(result, "grid", "pg19"):
            if r["policy"] == "full":
                ax.axhline(r["ppl"], color="black", ls="--", lw=1, label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (cached positions per layer)")
        ax.set_ylabel("PPL")
        ax.set_title(f"PPL by budget, {grid[0]['tokens']} tokens of the PG19 stand-in, token groups")
        ax.legend(fontsize=8)
        out.append(save_figure(fig, plots / "ppl_budgets.png", plt))
    win, sink = _rows(result, "window"), _rows(result, "sink")
    if win or sink:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
        if win:
            axes[0].plot([r["window"] for r in win], [r["ppl"] for r in win], marker="o")
            axes[0].set_xscale("log", base=2)
            axes[0].set_xlabel("window (sink 4)")
            axes[0].set_ylabel("PPL")
        if sink:
            axes[1].plot([str(r["sink"]) for r in sink], [r["ppl"] for r in sink], marker="o")
            axes[1].set_xlabel(f"sink tokens (window {sink[0]['window']})")
        fig.suptitle("StreamingLLM ablations (streaming, rerotate)")
        out.append(save_figure(fig, plots / "ppl_ablations.png", plt))
    return out


def _fmt(v: float) -> str:
    return "–" if math.isnan(v) else f"{v:.2f}"


def markdown(result: dict) -> str:
    res = result["results"]
    cfg = result["config"]
    maxp = res["max_positions"]
    lines = [f"Chunks of {cfg['chunk']} tokens fed with `feed_raw` on top of the compressed cache; PPL over every "
             "token but the first; slack = max(64, budget/8), window = budget/4, sink 4 unless stated."]
    long = _rows(result, "long")
    if long:
        n = max(r["tokens"] for r in long)
        cuts = [c for c in (0, maxp, maxp + 2048, maxp + 4096) if c < n]
        spans = list(zip(cuts, cuts[1:] + [n]))
        lines += ["", f"**Long text** (up to {n} tokens of the PG19 stand-in; the full cache is `streaming` with a "
                      "budget above its text and original positions, so it never evicts and goes past the model's "
                      f"{maxp} positions, over {long[0]['tokens']} tokens):", "",
                  "| run | budget | max cache (mean per layer) | " + " | ".join(f"PPL {a}-{b}" for a, b in spans)
                  + " | PPL all | ms/token |",
                  "| --- " * (len(spans) + 5) + "|"]
        for r in long:
            budget = "–" if r.get("label") else r["budget"]
            lines.append(f"| {_name(r)} | {budget} | {r['max_cache']} | "
                         + " | ".join(_fmt(ppl_between(r, a, b)) if a < r["tokens"] else "–" for a, b in spans)
                         + f" | {r['ppl']:.2f} | {r['ms_per_token']:.1f} |")
    for text in dict.fromkeys(r["text"] for r in _rows(result, "grid")):
        grid = _rows(result, "grid", text)
        budgets = sorted({r["budget"] for r in grid if r["policy"] != "full"})
        full = [r for r in grid if r["policy"] == "full"]
        lines += ["", f"**Every policy x budget** ({grid[0]['tokens']} tokens of {text}, token groups"
                      + (f"; full cache PPL {full[0]['ppl']:.3f}" if full else "") + "):", "",
                  "| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |",
                  "| --- " * (len(budgets) + 1) + "|"]
        for p in dict.fromkeys(r["policy"] for r in grid if r["policy"] != "full"):
            cells = {r["budget"]: r["ppl"] for r in grid if r["policy"] == p}
            lines.append(f"| {p} | " + " | ".join(f"{cells[b]:.3f}" if b in cells else "–" for b in budgets) + " |")
    groups = _rows(result, "groups")
    if groups:
        budget = groups[0]["budget"]
        token = {r["policy"]: r["ppl"] for r in _rows(result, "grid", "pg19") if r["budget"] == budget}
        modes = list(dict.fromkeys(r["groups"] for r in groups))
        lines += ["", f"**Group modes** (budget {budget}, {groups[0]['tokens']} tokens of pg19; in `turn` mode a "
                      f"group is one fed chunk of {cfg['chunk']} tokens):", "",
                  "| policy | token | " + " | ".join(modes) + " |", "| --- " * (len(modes) + 2) + "|"]
        for p in dict.fromkeys(r["policy"] for r in groups):
            cells = {r["groups"]: r["ppl"] for r in groups if r["policy"] == p}
            tok = f"{token[p]:.3f}" if p in token else "–"
            lines.append(f"| {p} | {tok} | " + " | ".join(f"{cells[m]:.3f}" for m in modes) + " |")
    for kind, key, what in (("window", "window", "window (sink 4)"), ("sink", "sink", "sink")):
        rs = _rows(result, kind)
        if rs:
            extra = "" if kind == "window" else f", window {rs[0]['window']}"
            lines += ["", f"**Ablation: {what}** (streaming{extra}, {rs[0]['tokens']} tokens of pg19; PPL after "
                          "the window first slid = from the first eviction on):", "",
                      f"| {key} | " + " | ".join(str(r[key]) for r in rs) + " |", "| --- " * (len(rs) + 1) + "|",
                      "| PPL | " + " | ".join(f"{r['ppl']:.3f}" for r in rs) + " |",
                      "| PPL after the window slid | " + " | ".join(
                          f"{ppl_between(r, r['first_evict']):.3f}" if r["first_evict"] else "(never slid)"
                          for r in rs) + " |"]
    return "\n".join(lines)
