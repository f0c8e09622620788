"""Recall across turns: a fact stated early, probed after it would have slid out of a window of the budget's size.

Each case: the user states a fact (names, numbers, places, codes) and the assistant acknowledges it; filler
exchanges from FastChat's dummy conversations follow (appended without generation) until the chat holds about
``--tokens`` tokens; then a probe: the question, with the reference answer teacher-forced, scoring the fact's tokens
(mean NLL, and hit = every one was the model's top choice). The full cache is the ceiling. Seeds are fixed.

    .venv/bin/python benchmarks/recall.py [--budgets 128 256] [--cases 6] [--tokens 1000] [--groups token]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from transformers.utils import logging as hf_logging

from kvchat.core import models
from kvchat.core.session import Sampling, Session
from kvchat.core.settings import Settings
from kvchat.policies import POLICIES

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "fastchat" / "dummy_conversation.json"

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


def filler_pairs() -> list[tuple[str, str]]:
    convs = json.loads(DATA.read_text())
    out = []
    for c in convs:
        turns = c["conversations"]
        for a, b in zip(turns[::2], turns[1::2]):
            if a["from"] == "human" and b["from"] == "gpt" and a["value"].strip() and b["value"].strip():
                out.append((a["value"], b["value"]))
    return out


def make_cases(n: int, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    pairs = filler_pairs()
    cases = []
    for i in range(n):
        say, ask, ref, value = FACTS[i % len(FACTS)]
        v = value(rnd)
        start = rnd.randrange(len(pairs) - 60)
        cases.append({"say": say.format(v=v), "ack": "Noted, I will remember that.", "ask": ask,
                      "reference": ref.format(v=v), "expect": v, "filler": pairs[start: start + 60]})
    return cases


def run_case(cm, settings: Settings, case: dict, tokens: int):
    session = Session(cm, settings, sampling=Sampling(max_new_tokens=16, temperature=0.0))
    session.exchange(case["say"], case["ack"])
    for user, assistant in case["filler"]:
        if session.total_tokens >= tokens:
            break
        session.exchange(user, assistant)
    res = session.probe(case["ask"], case["reference"], case["expect"])
    return res, session.total_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--cases", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--groups", default="token")
    ap.add_argument("--policies", nargs="+", default=[p for p in POLICIES if p != "full"])
    args = ap.parse_args()
    cm = models.load("default")
    cases = make_cases(args.cases)
    runs = [("full", None)] + [(p, b) for b in args.budgets for p in args.policies]
    rows = []
    print(f"{'policy':10s} {'budget':>6s} {'hits':>6s} {'mean NLL':>9s} {'tokens':>7s}")
    for policy, budget in runs:
        settings = Settings(policy=policy, groups=args.groups) if budget is None else \
            Settings(policy=policy, budget=budget, groups=args.groups)
        results = [run_case(cm, settings, case, args.tokens) for case in cases]
        hits = sum(bool(r.hit) for r, _ in results)
        nll = statistics.mean(r.expect_nll for r, _ in results)
        tokens = statistics.mean(t for _, t in results)
        rows.append({"policy": policy, "budget": budget, "groups": args.groups, "hits": hits, "cases": len(cases),
                     "mean_nll": nll, "mean_tokens": tokens})
        print(f"{policy:10s} {budget or '-':>6} {hits:3d}/{len(cases):<2d} {nll:9.3f} {tokens:7.0f}", flush=True)
    print(json.dumps({"tokens": args.tokens, "rows": rows}))


if __name__ == "__main__":
    main()
