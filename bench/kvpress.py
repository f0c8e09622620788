"""Side by side with kvpress: the same model, the same text (PG19 stand-in from Chapter I), the same budgets, for
the presses that exist in both: StreamingLLM, SnapKV, TOVA and ObservedAttention (H2O), one-shot, and each
inside kvpress's DecodingPress for decode-time compression.

* one-shot: a ``--prefix``-token prefix compressed once to the budget, then the next ``--cont`` tokens scored
  with the compressed cache (kvchat: ``feed_raw`` the prefix, lower the budget, switch to ``full`` and score);
* decode-time: a prefix of ``budget`` tokens, then ``--decode-tokens`` fed one per step (teacher forcing) while
  the cache is compressed back to the budget every ``--interval`` steps (kvchat: slack = interval).

kvchat runs with ``--positions original`` (kvpress keeps original positions) and the press's own settings (sink,
window, pooling). kvpress pins transformers < 5.3, so its side runs in its own virtual environment (``--venv``,
created on first use with this torch, kvpress 0.5.5 and transformers < 5.3) from ``bench/kvpress_side.py``. In
``--quick`` mode only the kvchat side runs (no environment is created).
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

from ..core.model import loading as models
from ..core.engine.session import Session
from ..core.engine.settings import Settings
from ..storage.files import kvchat_home
from .common import Run, data_dir, log, read_text

NAME = "kvpress"
TITLE = "Side by side with kvpress"
QUICK = {"budgets": [256], "prefix": 512, "cont": 64, "decode_tokens": 32, "decode_budget": 256}
KVPRESS = "kvpress==0.5.5"

# kvchat policy -> (kvpress press, its arguments, kvchat settings that reproduce the press's definition)
PAIRS = {
    "streaming": ("StreamingLLMPress", {"n_sink": 4}, dict(sink=4, window=0)),
    "snapkv": ("SnapKVPress", {"window_size": 32, "kernel_size": 5},
               dict(sink=0, window=32, params={"obs_window": 32, "kernel": 5, "pool": "avg"})),
    "tova": ("TOVAPress", {}, dict(sink=0, window=1)),
    "h2o": ("ObservedAttentionPress", {}, dict(sink=0, window=0, params={"average": True})),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budgets", type=int, nargs="+", default=[1024], help="one-shot budgets")
    p.add_argument("--prefix", type=int, default=2048, help="one-shot prefix tokens")
    p.add_argument("--cont", type=int, default=512, help="one-shot continuation tokens scored")
    p.add_argument("--decode-budget", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--interval", type=int, default=64, help="decode-time compression interval (kvchat's slack)")
    p.add_argument("--venv", default=None, help="kvpress's virtual environment (default $KVCHAT_HOME/kvpress-venv)")
    p.add_argument("--data", default=None, help="the shared data directory (default ../shared/data)")


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if python.exists():
        return python
    version = torch.__version__.split("+")[0]
    log(f"creating {venv} (torch {version}, {KVPRESS}, transformers<5.3) ...")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [f"torch=={version}"], check=True)
    subprocess.run(pip + [KVPRESS, "transformers<5.3"], check=True)
    return python


def _settings(policy: str, overrides: dict, budget: int, **extra) -> Settings:
    return Settings(policy=policy, budget=budget, positions="original", params=overrides.get("params", {}),
                    **{k: v for k, v in overrides.items() if k != "params"}, **extra)


def oneshot(cm, policy: str, overrides: dict, ids: list[int], prefix: int, keep: int, cont: int) -> dict:
    session = Session(cm, _settings(policy, overrides, prefix), system=None)
    session.feed_raw(ids[:prefix], score=False)
    if keep < prefix:
        session.configure(budget=keep)  # one compression of the prefix, like a press
    kept = session.cache_tokens
    session.configure(policy="full")  # no further eviction while the continuation is scored
    t = time.perf_counter()
    logprobs, _ = session.feed_raw(ids[prefix: prefix + cont])
    return {"ppl": math.exp(float(-logprobs.mean())), "kept": kept,
            "ms_per_token": 1000 * (time.perf_counter() - t) / cont}


def decoding(cm, policy: str, overrides: dict, ids: list[int], budget: int, interval: int, n: int) -> dict:
    session = Session(cm, _settings(policy, overrides, budget, slack=interval), system=None)
    session.feed_raw(ids[:budget], score=False)
    nll, times = [], []
    for tok in ids[budget: budget + n]:
        t = time.perf_counter()
        lp, _ = session.feed_raw([tok])
        times.append(time.perf_counter() - t)
        nll.append(-float(lp[0]))
    return {"ppl": math.exp(sum(nll) / len(nll)), "kept": session.cache_tokens,
            "max_cache": max(r.peak_cache_tokens for r in session.history),
            "ms_per_token": 1000 * sum(times) / len(times)}


# Policies whose decode-time rule is the same on both sides, so their PPL must agree once kvpress keeps its cache in
# position order (snapkv's and h2o's differ: see the note that markdown() writes).
SAME_DECODE_RULE = ("streaming", "tova")
IN_ORDER = "/in-order"  # suffix of a task's id for its run with the kept tokens in position order


def tasks(args) -> list[dict]:
    out = []
    for name, (cls, kw, overrides) in PAIRS.items():
        for b in args.budgets:
            out.append({"id": f"oneshot/{name}/{b}", "mode": "oneshot", "policy": name, "class": cls, "args": kw,
                        "overrides": overrides, "prefix": args.prefix, "keep": b, "cont": args.cont})
        out.append({"id": f"decoding/{name}/{args.decode_budget}", "mode": "decoding", "policy": name, "class": cls,
                    "args": kw, "overrides": overrides, "prefix": args.decode_budget, "keep": args.decode_budget,
                    "cont": args.decode_tokens, "interval": args.interval})
    return out


def in_order(todo: list[dict]) -> list[dict]:
    """Each decode-time task once more on the kvpress side with the kept tokens put back in position order after
    each compression (kvpress_side.kept_in_position_order): what the press's rule gives without kvpress's
    reordering of the cache."""
    return [{**t, "id": t["id"] + IN_ORDER, "in_order": True} for t in todo if t["mode"] == "decoding"]


def kvpress_side(args, ids: list[int], todo: list[dict], run: Run) -> dict:
    python = ensure_venv(Path(args.venv) if args.venv else kvchat_home() / "kvpress-venv")
    job = {"model": str(models.resolve(args.model)), "ids": ids, "threads": torch.get_num_threads(),
           "tasks": [{k: v for k, v in t.items() if k not in ("overrides", "policy")} for t in todo]}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    # -I: isolated, so the script's folder (holding this kvpress.py) does not shadow the kvpress package
    proc = subprocess.run([str(python), "-I", str(Path(__file__).with_name("kvpress_side.py"))],
                          input=json.dumps(job), stdout=subprocess.PIPE, text=True, env=env, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    run.rows["kvpress"] = {k: out[k] for k in ("kvpress", "transformers", "torch")}
    return out["results"]


def run(args, run: Run, cm) -> None:
    text = read_text(data_dir(args.data), "pg19")
    ids = cm.tokenizer(text, add_special_tokens=False)["input_ids"][: max(args.prefix + args.cont,
                                                                         args.decode_budget + args.decode_tokens)]
    todo = tasks(args)
    rows = []
    run.rows = {"rows": rows, "kvpress": None}
    if args.quick:
        run.rows["kvpress_skipped"] = ("--quick runs only the kvchat side; the kvpress side needs its own "
                                       "virtual environment, created by the full run")
        theirs = {}
    else:
        try:
            theirs = kvpress_side(args, ids, todo + in_order(todo), run)
        except (OSError, subprocess.CalledProcessError, ValueError) as exc:
            run.rows["kvpress_skipped"] = f"the kvpress side failed: {exc}"
            run.check("kvpress side ran", False, str(exc))
            theirs = {}
    full = oneshot(cm, "full", {}, ids, args.prefix, args.prefix, args.cont)
    run.rows["full"] = full
    log(f"kvpress full cache: PPL {full['ppl']:.3f} over {args.cont} tokens after {args.prefix}")
    for t in todo:
        if t["mode"] == "oneshot":
            ours = oneshot(cm, t["policy"], t["overrides"], ids, t["prefix"], t["keep"], t["cont"])
        else:
            ours = decoding(cm, t["policy"], t["overrides"], ids, t["keep"], t["interval"], t["cont"])
        ref = theirs.get(t["id"])
        row = {"id": t["id"], "mode": t["mode"], "policy": t["policy"], "press": t["class"], "budget": t["keep"],
               "kvchat": ours, "kvpress": ref}
        if ref and "ppl" in ref:
            row["relative_diff"] = ours["ppl"] / ref["ppl"] - 1
        ordered = theirs.get(t["id"] + IN_ORDER)
        if ordered and "ppl" in ordered:
            row["kvpress_in_order"] = ordered
            row["relative_diff_in_order"] = ours["ppl"] / ordered["ppl"] - 1
        rows.append(row)
        log(f"kvpress {t['id']:24s} kvchat PPL {ours['ppl']:8.3f} {ours['ms_per_token']:6.1f} ms/tok | kvpress "
            + (f"PPL {ref['ppl']:8.3f} {ref['ms_per_token']:6.1f} ms/tok" if ref and "ppl" in ref else str(ref)))
    kept_ok = all(r["kvchat"]["kept"] <= r["budget"] + (args.interval if r["mode"] == "decoding" else 0) for r in rows)
    run.check("kvchat kept within the budget", kept_ok, "every kvchat run kept at most its budget (+ interval)")
    oneshot_rows = [r for r in rows if r["mode"] == "oneshot" and "relative_diff" in r]
    if oneshot_rows:
        worst = max(abs(r["relative_diff"]) for r in oneshot_rows)
        run.check("one-shot PPL matches kvpress", worst < 0.01, f"largest one-shot PPL difference {100 * worst:.2f}%")
    ordered_rows = [r for r in rows if "relative_diff_in_order" in r and r["policy"] in SAME_DECODE_RULE]
    if ordered_rows:
        worst = max(abs(r["relative_diff_in_order"]) for r in ordered_rows)
        run.check("decode-time PPL matches kvpress with the cache in position order", worst < 0.01,
                  f"largest decode-time PPL difference {100 * worst:.2f}% ({', '.join(SAME_DECODE_RULE)}) against "
                  "kvpress with kept tokens in position order")


def markdown(result: dict) -> str:
    res, cfg = result["results"], result["config"]
    lines = [f"Default model, fp32, PG19 stand-in from Chapter I. One-shot: a {cfg['prefix']}-token prefix compressed "
             f"once to the budget, then PPL of the next {cfg['cont']} tokens (full cache: {res['full']['ppl']:.3f}); "
             f"ms/token of that continuation forward. Decode-time: {cfg['decode_budget']} tokens, then "
             f"{cfg['decode_tokens']} tokens fed one per step, compressed back to the budget every {cfg['interval']} "
             "steps (kvpress: DecodingPress around the press); ms/token per step."]
    if res.get("kvpress"):
        k = res["kvpress"]
        lines[0] += f" kvpress {k['kvpress']} with transformers {k['transformers']}, torch {k['torch']}."
    if res.get("kvpress_skipped"):
        lines += ["", f"kvpress side not run: {res['kvpress_skipped']}."]
    lines += ["", "| protocol | kvchat policy | kvpress press | budget | kvchat PPL | kvpress PPL | difference | "
                  "kvpress PPL, cache kept in position order | difference | kvchat ms/token | kvpress ms/token |",
              "| --- " * 11 + "|"]
    for r in res["rows"]:
        ours, ref = r["kvchat"], r["kvpress"]
        press = r["press"] if r["mode"] == "oneshot" else f"DecodingPress({r['press']})"
        ordered = (f"{r['kvpress_in_order']['ppl']:.3f} | {100 * r['relative_diff_in_order']:+.2f}%"
                   if "kvpress_in_order" in r else "– | –")
        if ref and "ppl" in ref:
            theirs = f"{ref['ppl']:.3f} | {100 * r['relative_diff']:+.2f}% | {ordered} | " \
                     f"{ours['ms_per_token']:.1f} | {ref['ms_per_token']:.1f}"
        elif ref:
            theirs = f"fails: {ref['error'].splitlines()[0][:80]} | – | {ordered} | {ours['ms_per_token']:.1f} | –"
        else:
            theirs = f"– | – | – | – | {ours['ms_per_token']:.1f} | –"
        lines.append(f"| {r['mode']} | {r['policy']} | {press} | {r['budget']} | {ours['ppl']:.3f} | {theirs} |")
    if any("kvpress_in_order" in r for r in res["rows"]):
        lines += ["", "kvpress's ScorerPress gathers the tokens it keeps in top-k (score) order, so after a compression"
                  " its cache is no longer in position order ([kvpress issue "
                  "#173](https://github.com/NVIDIA/kvpress/issues/173), where a maintainer expected it could matter"
                  " only when presses are composed or run inside DecodingPress). StreamingLLMPress scores by slot "
                  "(the first 4 slots are sinks, the next ones the oldest), so from DecodingPress's second "
                  "compression on it evicts other tokens than its rule names. The column *cache kept in position "
                  "order* runs each decode-time press again with the kept indices sorted (`kept_in_position_order` "
                  "in `bench/kvpress_side.py`): the rule as written. One-shot runs compress once, where the order "
                  "does not matter. The decode-time rules differ for two pairs: SnapKV (kvchat pools the window's "
                  "votes before protecting the window, kvpress after) and H2O (inside DecodingPress, "
                  "ObservedAttentionPress scores from the attention of the one query of the compressing step; "
                  "kvchat accumulates every step's attention, as H2O does)."]
    return "\n".join(lines)


def plot(result: dict, plots, plt) -> list:
    return []
