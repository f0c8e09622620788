"""Chat quality: do replies loop? MT-Bench first turns (and the two-turn lighthouse chat a new user tried) answered
with the sampling settings before and after the model's chat defaults, greedy and sampled.

Per configuration, over every reply: distinct-1/2 (unique n-grams / n-grams, per reply, averaged), the repeated
4-gram rate (share of a reply's 4-grams that already occurred earlier in it), and the share of replies that hit
``--max-new-tokens`` in a loop (stopped at the limit with at least half of the 4-grams of the reply's second half
repeated from before). Each question is asked in a fresh session, so the cache policy plays no part.
"""

from __future__ import annotations

import argparse
import json

from ..core.engine.session import Session
from ..core.engine.settings import Sampling, Settings
from .common import Run, data_dir, log

NAME = "chat"
TITLE = "Chat quality"
QUICK = {"questions": 2, "max_new_tokens": 32}
LIGHTHOUSE = ["Hi! My name is Ada and my favourite colour is teal. Please tell me a short story about a lighthouse.",
              "What is my name and favourite colour?"]
#: "before": the sampling kvchat used until the model's defaults (temperature 0.7, top-p 0.9, no penalties).
BEFORE = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
          "no_repeat_ngram_size": 0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--questions", type=int, default=20, help="MT-Bench first turns asked")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="the shared data directory (default ../shared/data)")


def ngrams(tokens: list, n: int) -> list[tuple]:
    return [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]


def distinct(tokens: list, n: int) -> float | None:
    grams = ngrams(tokens, n)
    return len(set(grams)) / len(grams) if grams else None


def repeated_rate(tokens: list, n: int = 4, start: int = 0) -> float | None:
    """Share of the n-grams starting at ``start`` or later that already occurred earlier in ``tokens``."""
    grams = ngrams(tokens, n)
    seen, repeated, counted = set(), 0, 0
    for i, g in enumerate(grams):
        if i >= start:
            counted += 1
            repeated += g in seen
        seen.add(g)
    return repeated / counted if counted else None


def looping(tokens: list, stopped: str | None) -> bool:
    rate = repeated_rate(tokens, 4, start=len(tokens) // 2)
    return stopped == "max_tokens" and rate is not None and rate >= 0.5


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def configurations(model, max_new_tokens: int) -> dict[str, Sampling]:
    chat_defaults = Sampling.for_model(model, max_new_tokens=max_new_tokens)
    before = Sampling(max_new_tokens=max_new_tokens, **BEFORE)
    return {"before, sampled": before, "before, greedy": before.changed(temperature=0.0),
            "after, sampled": chat_defaults, "after, greedy": chat_defaults.changed(temperature=0.0)}


def ask(model, sampling: Sampling, turns: list[str], seed: int) -> list[dict]:
    session = Session(model, Settings(policy="streaming", budget=2048), sampling=sampling, seed=seed)
    out = []
    for text in turns:
        res = session.chat(text)
        ids = model.tokenizer(res.answer or "", add_special_tokens=False)["input_ids"]
        out.append({"question": text, "answer": res.answer, "tokens": res.new_tokens, "stopped": res.stopped,
                    "distinct_1": distinct(ids, 1), "distinct_2": distinct(ids, 2),
                    "repeated_4": repeated_rate(ids, 4), "loop": looping(ids, res.stopped)})
    return out


def run(args, run: Run, model) -> None:
    data = data_dir(args.data)
    lines = (data / "fastchat" / "mt_bench_question.jsonl").read_text(encoding="utf-8").splitlines()
    questions = [json.loads(line)["turns"][0] for line in lines if line.strip()][: args.questions]
    run.rows = {"configs": []}
    for name, sampling in configurations(model, args.max_new_tokens).items():
        replies = ask(model, sampling, LIGHTHOUSE, args.seed)
        for i, q in enumerate(questions):
            replies += ask(model, sampling, [q], args.seed + i)
        row = {"config": name, "sampling": sampling.as_dict(), "replies": replies, "n": len(replies),
               "distinct_1": _mean(r["distinct_1"] for r in replies),
               "distinct_2": _mean(r["distinct_2"] for r in replies),
               "repeated_4": _mean(r["repeated_4"] for r in replies),
               "loops": sum(r["loop"] for r in replies), "hit_max": sum(r["stopped"] == "max_tokens" for r in replies),
               "lighthouse_loops": sum(r["loop"] for r in replies[:2])}
        run.rows["configs"].append(row)
        log(f"chat {name:16s} {row['n']} replies: distinct-2 {row['distinct_2']:.3f}, repeated 4-grams "
            f"{row['repeated_4']:.3f}, loops {row['loops']}/{row['n']} (hit max {row['hit_max']})")
    by = {r["config"]: r for r in run.rows["configs"]}
    run.check("measured", all(r["n"] == len(questions) + 2 for r in by.values()),
              f"{len(questions) + 2} replies per configuration")
    if not args.quick:
        run.check("defaults loop less", by["after, sampled"]["loops"] <= by["before, sampled"]["loops"],
                  f"loops with the chat defaults {by['after, sampled']['loops']}, before "
                  f"{by['before, sampled']['loops']}")


def plot(result: dict, plots, plt) -> list:
    return []


def markdown(result: dict) -> str:
    rows = result["results"]["configs"]
    s = rows[0]["sampling"]
    lines = [f"{rows[0]['n']} replies per configuration (the lighthouse chat's two turns and "
             f"{rows[0]['n'] - 2} MT-Bench first turns), at most {s['max_new_tokens']} new tokens.", "",
             "| configuration | sampling | distinct-1 | distinct-2 | repeated 4-grams | replies looping at the limit "
             "| lighthouse chat looping | replies at the limit |", "| --- " * 8 + "|"]
    for r in rows:
        smp = r["sampling"]
        shown = ", ".join(f"{k} {v}" for k, v in smp.items() if k != "max_new_tokens")
        lines.append(f"| {r['config']} | {shown} | {r['distinct_1']:.3f} | {r['distinct_2']:.3f} | "
                     f"{r['repeated_4']:.3f} | {r['loops']}/{r['n']} | {r['lighthouse_loops']}/2 | "
                     f"{r['hit_max']}/{r['n']} |")
    return "\n".join(lines)
