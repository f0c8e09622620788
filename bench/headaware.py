"""Head-aware claims: what the seed design's claims amount to on this model.

* the head class map per layer and the budget each class gets, with the seed's thresholds and with
  ``--tau-local`` lowered (where local heads appear), after streaming ``--tokens`` of the PG19 stand-in;
* the memory upper bound: the always-kept bytes M_max the policy computes, and the cache's allocation against a
  uniform budget's (asserted: per-head budgets never allocate more than the uniform budget);
* quality against a uniform budget at the same bytes: ``headaware`` with classes forced uniform (no head can be
  local or induction: ``tau_local`` 1, ``tau_period`` 1e9, the same scoring) against ``headaware`` with
  per-head budgets, and group-level (sentence) against token-level eviction, on benchmark 1 (PPL) and
  benchmark 2 (recall probe NLL).
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

from ..core.engine.settings import Settings
from ..storage.db import Store
from . import ppl as ppl_bench
from . import recall as recall_bench
from .common import Run, data_dir, log, read_text, save_figure

NAME = "headaware"
TITLE = "Head-aware claims"
QUICK = {"tokens": 500, "budget": 256, "recall_budget": 128, "cases": 1}
UNIFORM = {"tau_local": 1.0, "tau_period": 1e9}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=2500, help="tokens of PG19 stand-in for the PPL comparison")
    p.add_argument("--budget", type=int, default=512, help="budget of the PPL comparison")
    p.add_argument("--recall-budget", type=int, default=256)
    p.add_argument("--cases", type=int, default=3, help="recall cases")
    p.add_argument("--tau-local", type=float, default=0.4, help="the lowered local threshold")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--data", default=None, help="the shared data directory (default ../shared/data)")


def variants(tau_local: float) -> dict[str, tuple[dict, str]]:
    return {
        "uniform budgets": (UNIFORM, "token"),
        "seed thresholds": ({}, "token"),
        f"per-head budgets (tau_local {tau_local})": ({"tau_local": tau_local}, "token"),
        f"per-head budgets (tau_local {tau_local}), sentence groups": ({"tau_local": tau_local}, "sentence"),
    }


def inspect(session) -> dict:
    rep = session.policy.report()
    classes, kept = rep["head_classes"], rep["head_budgets"]
    per_class: dict[str, list[int]] = {}
    for layer_cls, layer_kept in zip(classes, kept):
        for c, k in zip(layer_cls, layer_kept):
            per_class.setdefault(c, []).append(k)
    kv = session.cache_now()["kv_bytes"]
    cfg = session.model.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    uniform = (cfg.num_hidden_layers * cfg.num_key_value_heads * session.settings.capacity * head_dim * 2
               * session.model.model.dtype.itemsize)
    return {"classes": classes, "kept": kept, "memory_bound_bytes": rep["memory_bound_bytes"], "kv_bytes": kv,
            "uniform_kv_bytes": uniform,
            "per_class": {c: {"heads": len(v), "mean_budget": sum(v) / len(v)} for c, v in per_class.items()}}


def run(args, run: Run, cm) -> None:
    data = data_dir(args.data)
    ids = cm.tokenizer(read_text(data, "pg19"), add_special_tokens=False)["input_ids"][: args.tokens]
    cases = recall_bench.make_cases(data, ["direct"], args.cases, 0)
    run.rows = {"variants": []}
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-headaware-") as tmp:
        store = Store(Path(tmp) / "recall.db")
        for label, (params, groups) in variants(args.tau_local).items():
            settings = Settings(policy="headaware", budget=args.budget, params=params, groups=groups)
            row = ppl_bench.stream(cm, ids, settings, args.chunk, inspect=inspect)
            rec = recall_bench.cell(cm, Settings(policy="headaware", budget=args.recall_budget, params=params,
                                                 groups=groups), cases, 256, 16, store)[0]
            counts = Counter(c for layer in row["classes"] for c in layer)
            run.rows["variants"].append({"label": label, "params": params, "groups": groups, "ppl": row["ppl"],
                                         "recall": rec, "class_counts": dict(counts), **{k: row[k] for k in (
                                             "classes", "kept", "memory_bound_bytes", "kv_bytes", "uniform_kv_bytes",
                                             "per_class", "cache_bytes")}})
            log(f"headaware {label:50s} PPL {row['ppl']:.3f}, recall NLL {rec['mean_nll']:.3f} "
                f"({rec['probe_hits']}/{rec['cases']}), classes {dict(counts)}")
            run.check(f"memory bound ({label})",
                      row["kv_bytes"] <= row["uniform_kv_bytes"] and row["memory_bound_bytes"] <= row["kv_bytes"],
                      f"always-kept bound {row['memory_bound_bytes']} <= allocated {row['kv_bytes']} <= uniform "
                      f"{row['uniform_kv_bytes']} bytes")
        store.close()
    budgets_ok = all(sum(k) == len(k) * args.budget for v in run.rows["variants"] for k in v["kept"])
    run.check("per-head budgets sum to the uniform total", budgets_ok,
              f"every layer's head budgets sum to heads x {args.budget}")


def plot(result: dict, plots, plt) -> list:
    v = next((x for x in result["results"]["variants"] if x["params"].get("tau_local", 0.8) < 0.8), None)
    if v is None:
        return []
    code = {"retrieval": 2, "induction": 1, "local": 0}
    grid = [[code[c] for c in layer] for layer in v["classes"]]
    fig, axes = plt.subplots(1, 2, figsize=(8, 5), gridspec_kw={"width_ratios": [1, 1]})
    im = axes[0].imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=2)
    axes[0].set_xlabel("KV head")
    axes[0].set_ylabel("layer")
    axes[0].set_title(f"head classes ({v['label']})", fontsize=8)
    cb = fig.colorbar(im, ax=axes[0], ticks=[0, 1, 2])
    cb.ax.set_yticklabels(["local", "induction", "retrieval"])
    im2 = axes[1].imshow(v["kept"], aspect="auto", cmap="magma")
    axes[1].set_xlabel("KV head")
    axes[1].set_title("positions kept per head", fontsize=8)
    fig.colorbar(im2, ax=axes[1])
    return [save_figure(fig, plots / "headaware_classes.png", plt)]


def markdown(result: dict) -> str:
    cfg = result["config"]
    vs = result["results"]["variants"]
    lines = [f"`headaware` at budget {cfg['budget']} over {cfg['tokens']} tokens of the PG19 stand-in (PPL) and at "
             f"budget {cfg['recall_budget']} on {cfg['cases']} recall cases (probe NLL of the fact). \"Uniform "
             "budgets\" is the same policy with no head allowed to be local or induction (equal budgets, the same "
             "scores), i.e. a uniform budget at the same bytes.", "",
             "| variant | head classes (retrieval / induction / local) | mean budget per class | PPL | recall: "
             "generated · probe hits · NLL | KV bytes allocated | always-kept bound M_max |", "| --- " * 7 + "|"]
    for v in vs:
        cc = v["class_counts"]
        per = ", ".join(f"{c} {d['mean_budget']:.0f}" for c, d in v["per_class"].items())
        r = v["recall"]
        lines.append(f"| {v['label']} | {cc.get('retrieval', 0)} / {cc.get('induction', 0)} / {cc.get('local', 0)} "
                     f"| {per} | {v['ppl']:.3f} | {r['generated_hits']}/{r['cases']} · {r['probe_hits']}/{r['cases']} "
                     f"· {r['mean_nll']:.2f} | {v['kv_bytes']:,} | {v['memory_bound_bytes']:,} |")
    base = vs[0]
    lines += ["", "Gains against uniform budgets (negative = worse than uniform): "
              + "; ".join(f"{v['label']}: PPL {100 * (base['ppl'] / v['ppl'] - 1):+.1f}%, recall NLL "
                          f"{base['recall']['mean_nll'] - v['recall']['mean_nll']:+.2f}" for v in vs[1:]) + "."]
    v = next((x for x in vs if x["params"].get("tau_local", 0.8) < 0.8), None)
    if v is not None:
        letters = {"retrieval": "r", "induction": "i", "local": "l"}
        lines += ["", f"Head class map ({v['label']}; r = retrieval, i = induction, l = local; one letter per KV "
                      "head):", "", "| layer | " + " | ".join(str(i) for i in range(len(v["classes"]))) + " |",
                  "| --- " * (len(v["classes"]) + 1) + "|",
                  "| heads | " + " | ".join("".join(letters[c] for c in layer) for layer in v["classes"]) + " |"]
    return "\n".join(lines)
