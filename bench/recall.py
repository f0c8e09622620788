"""Recall across turns: a fact planted in the first exchange, asked for after it would have left a window of the
budget's size.

Each case: the user states a fact (a name, number, place or code from templates, seeded) and the assistant
acknowledges it; filler exchanges follow (FastChat's dummy conversations and MT-Bench questions with GPT-4's
reference answers, appended without generation) until the chat holds ``budget + --margin`` tokens; then the
question. Scored both ways on the same cache: the generated answer (greedy) contains the fact; then that turn is
undone and the probe runs: the reference answer teacher-forced, mean NLL of the fact's tokens and hit = each was
the model's top choice. The full cache, holding everything, is the ceiling.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from ..core.session import Sampling, Session
from ..core.settings import Settings
from ..policies import POLICIES
from .common import Run, data_dir, log, save_figure

NAME = "recall"
TITLE = "Recall across turns"
BOUNDED = [p for p, cls in POLICIES.items() if cls.bounded]
QUICK = {"policies": ["streaming", "h2o"], "budgets": [128], "cases": 2, "groups": [], "margin": 160,
         "max_new_tokens": 8}

FACTS = [
    ("Please remember: my locker code is {v}.", "What is my locker code?", "Your locker code is {v}.",
     lambda r: str(r.randint(1000, 9999))),
    ("Please remember: my sister's name is {v}.", "What is my sister's name?", "Your sister's name is {v}.",
     lambda r: r.choice(["Margaret", "Beatrice", "Eleanor", "Harriet", "Josephine", "Clementine"])),
    ("Please remember: the meeting is in {v}.", "Where is the meeting?", "The meeting is in {v}.",
     lambda r: r.choice(["Lisbon", "Nairobi", "Winnipeg", "Osaka", "Valparaiso", "Tbilisi"])),
    ("Please remember: I parked on level {v} of the garage.", "Which level did I park on?",
     "You parked on level {v}.", lambda r: str(r.randint(3, 9))),
    ("Please remember: my flight number is {v}.", "What is my flight number?", "Your flight number is {v}.",
     lambda r: f"{r.choice(['KL', 'AF', 'LH', 'BA'])}{r.randint(100, 999)}"),
    ("Please remember: the wifi password is {v}.", "What is the wifi password?", "The wifi password is {v}.",
     lambda r: r.choice(["bluefalcon", "copperkettle", "silverbirch", "quietharbor"])),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", nargs="+", default=BOUNDED)
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    p.add_argument("--groups", nargs="*", default=["sentence", "turn"], choices=["sentence", "turn"],
                   help="group modes run besides token groups (at the smallest budget)")
    p.add_argument("--cases", type=int, default=3, help="cases per cell (facts cycle through 6 templates)")
    p.add_argument("--margin", type=int, default=256, help="history beyond the budget before the question")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="the shared data directory (default ../shared/data)")


def filler_pairs(data: Path) -> list[tuple[str, str]]:
    """(user, assistant) pairs: FastChat dummy conversations interleaved with MT-Bench reference answers."""
    dummy = []
    for c in json.loads((data / "fastchat" / "dummy_conversation.json").read_text(encoding="utf-8")):
        turns = c["conversations"]
        for a, b in zip(turns[::2], turns[1::2]):
            if a["from"] == "human" and b["from"] == "gpt" and a["value"].strip() and b["value"].strip():
                dummy.append((a["value"], b["value"]))
    questions = {}
    for line in (data / "fastchat" / "mt_bench_question.jsonl").read_text(encoding="utf-8").splitlines():
        q = json.loads(line)
        questions[q["question_id"]] = q["turns"]
    mt = []
    for line in (data / "fastchat" / "mt_bench_reference_answer_gpt-4.jsonl").read_text(encoding="utf-8").splitlines():
        a = json.loads(line)
        for q, ans in zip(questions.get(a["question_id"], []), a["choices"][0]["turns"]):
            if q.strip() and ans.strip():
                mt.append((q, ans))
    out = []
    for i, pair in enumerate(dummy):
        out.append(pair)
        if i % 4 == 3:
            out.append(mt[(i // 4) % len(mt)])
    return out


def make_cases(data: Path, n: int, seed: int) -> list[dict]:
    rnd = random.Random(seed)
    pairs = filler_pairs(data)
    cases = []
    for i in range(n):
        say, ask, ref, value = FACTS[i % len(FACTS)]
        v = value(rnd)
        start = rnd.randrange(len(pairs) - 120)
        cases.append({"say": say.format(v=v), "ack": "Noted, I will remember that.", "ask": ask,
                      "reference": ref.format(v=v), "expect": v, "filler": pairs[start: start + 120]})
    return cases


def run_case(cm, settings: Settings, case: dict, tokens: int, max_new_tokens: int) -> dict:
    session = Session(cm, settings, sampling=Sampling(max_new_tokens=max_new_tokens, temperature=0.0), undo=True)
    session.exchange(case["say"], case["ack"])
    for user, assistant in case["filler"]:
        if session.total_tokens >= tokens:
            break
        session.exchange(user, assistant)
    if session.total_tokens < tokens:
        raise ValueError(f"the filler ran out before {tokens} tokens")
    answer = session.chat(case["ask"]).answer
    session.undo()
    probe = session.probe(case["ask"], case["reference"], case["expect"])
    return {"generated_hit": case["expect"].lower() in answer.lower(), "answer": answer,
            "probe_hit": bool(probe.hit), "nll": probe.expect_nll, "history": session.total_tokens - probe.prompt_tokens,
            "evicted": session.evicted_total}


def cell(cm, settings: Settings, cases: list[dict], tokens: int, max_new_tokens: int) -> dict:
    res = [run_case(cm, settings, c, tokens, max_new_tokens) for c in cases]
    row = {"policy": settings.policy, "budget": settings.budget if POLICIES[settings.policy].bounded else None,
           "groups": settings.groups, "history_tokens": tokens, "cases": len(res),
           "generated_hits": sum(r["generated_hit"] for r in res), "probe_hits": sum(r["probe_hit"] for r in res),
           "mean_nll": statistics.mean(r["nll"] for r in res), "evicted": [r["evicted"] for r in res],
           "answers": [r["answer"] for r in res]}
    log(f"recall {settings.policy:10s} budget {row['budget'] or '-':>5} {settings.groups:8s} history {tokens:5d}: "
        f"generated {row['generated_hits']}/{len(res)}, probe {row['probe_hits']}/{len(res)}, "
        f"NLL {row['mean_nll']:.3f}")
    return row


def run(args, run: Run, cm) -> None:
    cases = make_cases(data_dir(args.data), args.cases, args.seed)
    run.rows = {"cells": [], "facts": [c["expect"] for c in cases]}
    cells = run.rows["cells"]
    for budget in args.budgets:
        tokens = budget + args.margin
        ceiling = cell(cm, Settings(policy="full"), cases, tokens, args.max_new_tokens)
        ceiling["ceiling_for"] = budget
        cells.append(ceiling)
        for p in args.policies:
            cells.append(cell(cm, Settings(policy=p, budget=budget), cases, tokens, args.max_new_tokens))
    small = min(args.budgets)
    for mode in args.groups:
        for p in args.policies:
            cells.append(cell(cm, Settings(policy=p, budget=small, groups=mode), cases, small + args.margin,
                              args.max_new_tokens))
    bounded = [c for c in cells if c["policy"] != "full"]
    run.check("evicted", all(min(c["evicted"]) > 0 for c in bounded),
              "every bounded case evicted before the question (the fact was at risk)")
    ceilings = [c for c in cells if c["policy"] == "full"]
    streaming = [c for c in bounded if c["policy"] == "streaming" and c["groups"] == "token"]
    if streaming:
        worst = max(c["mean_nll"] for c in ceilings)
        best = min(c["mean_nll"] for c in streaming)
        run.check("full cache recalls better than streaming", worst < best,
                  f"full cache mean fact NLL {worst:.2f} (worst budget) < streaming {best:.2f} (best budget)")


def plot(result: dict, plots, plt) -> list:
    cells = [c for c in result["results"]["cells"] if c["groups"] == "token"]
    if not cells:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for p in dict.fromkeys(c["policy"] for c in cells):
        rs = sorted((c for c in cells if c["policy"] == p), key=lambda c: c.get("ceiling_for") or c["budget"])
        xs = [c.get("ceiling_for") or c["budget"] for c in rs]
        ax.plot(xs, [c["mean_nll"] for c in rs], marker="o", label="full cache (ceiling)" if p == "full" else p,
                **({"color": "black", "ls": "--"} if p == "full" else {}))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (history = budget + margin tokens)")
    ax.set_ylabel("mean NLL of the fact's tokens (probe)")
    ax.set_title("Recall across turns (lower is better)")
    ax.legend(fontsize=8)
    return [save_figure(fig, plots / "recall.png", plt)]


def markdown(result: dict) -> str:
    cfg = result["config"]
    cells = result["results"]["cells"]
    n = cells[0]["cases"] if cells else 0
    lines = [f"{n} cases per cell (seed {cfg['seed']}); history = budget + {cfg['margin']} tokens of filler "
             "exchanges after the fact; cells: generated hits / probe hits / mean NLL of the fact's tokens.", ""]
    budgets = sorted({c["budget"] for c in cells if c["budget"]})
    lines += ["| policy | groups | " + " | ".join(f"budget {b}" for b in budgets) + " |",
              "| --- " * (len(budgets) + 2) + "|"]

    def fmt(c):
        return f"{c['generated_hits']}/{c['cases']} · {c['probe_hits']}/{c['cases']} · {c['mean_nll']:.2f}"

    full = {c["ceiling_for"]: c for c in cells if c["policy"] == "full"}
    lines.append("| full cache (ceiling) | – | " + " | ".join(fmt(full[b]) if b in full else "–" for b in budgets)
                 + " |")
    keys = list(dict.fromkeys((c["policy"], c["groups"]) for c in cells if c["policy"] != "full"))
    for p, g in sorted(keys, key=lambda k: (k[1] != "token", k[1], BOUNDED.index(k[0]) if k[0] in BOUNDED else 99)):
        row = {c["budget"]: c for c in cells if c["policy"] == p and c["groups"] == g}
        lines.append(f"| {p} | {g} | " + " | ".join(fmt(row[b]) if b in row else "–" for b in budgets) + " |")
    return "\n".join(lines)
