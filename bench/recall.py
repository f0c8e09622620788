"""Recall across turns: facts planted in the chat, asked for after 1K+ tokens of chat have evicted them, with recall
of evicted text off and on.

Each case plants a fact (a code, a name, a place, a number: values random, seeded), at the start of the chat or
in its middle, as a user message the assistant acknowledges; filler exchanges follow (FastChat's dummy
conversations and MT-Bench questions with GPT-4's reference answers, appended without generation) until
``--after`` tokens of chat follow the fact (and the chat is past the budget); then the question, of one of three
kinds:

* ``direct``: the question in the fact's words ("What is my bike lock code?");
* ``paraphrase``: in other words ("Which numbers open the lock on my bicycle?");
* ``distractor``: two more facts of the same kind are planted beside it ("my locker code is …", "my phone PIN is
  …") and the direct question must find the right one.

Scored both ways on the same cache: the generated answer (greedy) contains the fact; then that turn is undone and
the probe runs: the reference answer teacher-forced, mean NLL of the fact's tokens and hit = each was the model's
top choice. The full cache, holding everything, is the ceiling. Also measured: recall's cost (ms per user message,
and the scoring alone against archives of 1K, 10K and 100K tokens), the question's time to first token with recall
off and on, and the NLL of the assistant's MT-Bench answers replayed (teacher-forced) with recall off and on.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from ..core.recall import choose as recall_engine, rerank
from ..core.recall.choose import choose
from ..core.recall.digest import REPS
from ..core.recall.lexical import bm25, fuse, word_forms
from ..core.recall.score import QUERY_ROWS, relevance, scoring_layers
from ..core.engine.session import ContextFullError, Sampling, Session
from ..core.engine.settings import Settings
from ..policies import POLICIES
from ..storage.db import Store
from .common import Run, data_dir, log, save_figure
from .recall_facts import FACTS, FIELDS, argument as facts_argument, load as load_facts

NAME = "recall"
TITLE = "Recall across turns"
BOUNDED = [p for p, cls in POLICIES.items() if cls.bounded]
KINDS = ("direct", "paraphrase", "distractor")
QUICK = {"policies": ["streaming"], "budgets": [128], "cases": 2, "kinds": ["direct"], "after": 400,
         "max_new_tokens": 8, "replay_turns": 6, "archive_sizes": [1000, 10000]}

# (statement, direct question, paraphrased question, reference answer, value, family); a family's statements are
# each other's same-kind distractors.
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", nargs="+", default=["streaming", "h2o", "tova", "snapkv"])
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--recall", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--cases", type=int, default=4, help="cases per kind and cell (facts cycle through the templates)")
    p.add_argument("--after", type=int, default=1024, help="tokens of chat after the fact before the question")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--replay-turns", type=int, default=24, help="MT-Bench exchanges replayed for the answers' NLL")
    p.add_argument("--archive-sizes", type=int, nargs="+", default=[1000, 10000, 100000],
                   help="archived tokens at which recall's scoring is timed")
    p.add_argument("--recall-rerank", type=int, default=None,
                   help="candidates re-ranked by the model per message (the setting's default: 16 on a GPU, 0 on a "
                        "CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--facts", type=facts_argument, default="bench", metavar="{bench,heldout,FILE}",
                   help="the facts planted: the bench's own, a held-out set never used to tune recall, or a JSONL "
                        "file of your own, one object a line: " + "; ".join(f"{k}: {v}" for k, v in FIELDS.items()))
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


def make_cases(data: Path, kinds: list[str], n: int, seed: int, facts: list | None = None) -> list[dict]:
    rnd = random.Random(seed)
    facts = FACTS if facts is None else facts
    pairs = filler_pairs(data)
    cases = []
    for kind in kinds:
        for i in range(n):
            j = (i + KINDS.index(kind)) % len(facts)
            say, direct, para, ref, value, family = facts[j]
            v = value(rnd)
            planted = [(say.format(v=v), "Noted, I will remember that.")]
            if kind == "distractor":
                others = [f for f in facts if f[5] == family and f is not facts[j]]
                for other in rnd.sample(others, min(2, len(others))):
                    w = other[4](rnd)
                    while w == v:
                        w = other[4](rnd)
                    planted.append((other[0].format(v=w), "Noted, I will remember that."))
                rnd.shuffle(planted)
            start = rnd.randrange(len(pairs) - 200)
            cases.append({"kind": kind, "where": "start" if i % 2 == 0 else "middle", "planted": planted,
                          "ask": para if kind == "paraphrase" else direct, "reference": ref.format(v=v),
                          "expect": v, "filler": pairs[start:] + pairs[:start]})  # the same first 200 as ever
    return cases


def run_case(cm, settings: Settings, case: dict, after: int, max_new_tokens: int, store: Store) -> dict:
    session = Session(cm, settings, sampling=Sampling(max_new_tokens=max_new_tokens, temperature=0.0), undo=True,
                      store=store)
    filler = iter(case["filler"])
    if case["where"] == "middle":  # half the chat before the fact
        while session.total_tokens < after // 2:
            session.exchange(*next(filler))
    fact = None  # the true fact's message: [start, end)
    for user, ack in case["planted"]:
        start = session.total_tokens
        session.exchange(user, ack)
        if case["expect"] in user:
            fact = (start, session.total_tokens)
    fact_end = session.total_tokens
    while session.total_tokens - fact_end < after or session.total_tokens < settings.budget + 64:
        session.exchange(*next(filler))
    scoring, engine_plan = [], recall_engine.plan  # the question's scoring and choice alone (recall_ms adds the
    # put-back)

    def plan(*args, **kwargs):
        found = engine_plan(*args, **kwargs)
        scoring.append(found["recall_ms"])
        return found

    with mock.patch.object(recall_engine, "plan", plan):
        reply = session.chat(case["ask"])
    session.undo()
    probe = session.probe(case["ask"], case["reference"], case["expect"])
    out = {"generated_hit": case["expect"].lower() in reply.answer.lower(), "answer": reply.answer,
           "probe_hit": bool(probe.hit), "nll": probe.expect_nll, "history": session.total_tokens - probe.prompt_tokens,
           "evicted": session.evicted_total, "ttft_ms": reply.prefill_ms, "recall_ms": reply.recall_ms,
           "recalled_tokens": reply.recalled_tokens, "archive_tokens": session.total_tokens,
           "putback_ms": reply.recall_ms - scoring[0] if reply.recalled_tokens else None,
           "fact_recalled": fact is not None and any(a < fact[1] and b > fact[0] for a, b in reply.recalled)}
    session.close()
    if session.conversation_id is not None:
        store.delete(session.conversation_id)
    return out


def cell(cm, settings: Settings, cases: list[dict], after: int, max_new_tokens: int, store: Store) -> list[dict]:
    rows = []
    for kind in dict.fromkeys(c["kind"] for c in cases):
        res = [run_case(cm, settings, c, after, max_new_tokens, store) for c in cases if c["kind"] == kind]
        ms = [r["recall_ms"] for r in res if r["recall_ms"] is not None]
        row = {"policy": settings.policy, "budget": settings.budget if POLICIES[settings.policy].bounded else None,
               "recall": settings.recall, "rerank": settings.recall_rerank,
               "rerank_bf16": rerank.bf16_reads(cm), "kind": kind, "after_tokens": after,
               "cases": len(res),
               "generated_hits": sum(r["generated_hit"] for r in res), "probe_hits": sum(r["probe_hit"] for r in res),
               "fact_recalled": sum(r["fact_recalled"] for r in res),
               "mean_nll": statistics.mean(r["nll"] for r in res), "evicted": [r["evicted"] for r in res],
               "ttft_ms": statistics.mean(r["ttft_ms"] for r in res), "recall_ms": statistics.mean(ms) if ms else None,
               "recalled_tokens": statistics.mean(r["recalled_tokens"] for r in res),
               "putback_ms": [r["putback_ms"] for r in res if r["putback_ms"] is not None],
               "history": statistics.mean(r["history"] for r in res), "answers": [r["answer"] for r in res]}
        log(f"recall {settings.policy:10s} budget {row['budget'] or '-':>5} recall {settings.recall:3s} {kind:10s}: "
            f"generated {row['generated_hits']}/{len(res)}, probe {row['probe_hits']}/{len(res)}, fact recalled "
            f"{row['fact_recalled']}/{len(res)}, "
            f"NLL {row['mean_nll']:.3f}, TTFT {row['ttft_ms']:.0f} ms")
        rows.append(row)
    return rows


def replay_nll(cm, settings: Settings, data: Path, turns: int, store: Store) -> dict:
    """Mean NLL of the assistant's tokens over ``turns`` MT-Bench exchanges teacher-forced on one chat."""
    session = Session(cm, settings, sampling=Sampling(temperature=0.0), store=store)
    nlls, weights = [], []
    try:
        for user, answer in [p for p in filler_pairs(data) if len(p[1]) > 200][:turns]:
            res = session.probe(user, answer, answer)
            n = len(cm.tokenizer(answer, add_special_tokens=False)["input_ids"])
            nlls.append(res.expect_nll * n)
            weights.append(n)
    finally:
        session.close()
        if session.conversation_id is not None:
            store.delete(session.conversation_id)
    nll = sum(nlls) / sum(weights)
    return {"policy": settings.policy, "budget": settings.budget if settings.bounded else None,
            "recall": settings.recall, "turns": turns, "tokens": sum(weights), "nll": nll, "ppl": math.exp(nll)}


def scoring_cost(cm, sizes: list[int], group_tokens: float, seed: int) -> list[dict]:
    """Recall's scoring (relevance over every digest, the words shared, then the choice) against archives of
    ``sizes`` tokens: random digests (the cost does not depend on their values) written to a digest store as a chat
    writes them (int8, on disk) and read back as recall reads them, the queries a 20-token message's and a long
    message's (the ``QUERY_ROWS`` rows kept at most), the archive's and the message's tokens random."""
    import tempfile

    from ..core.recall.digest import Digests

    gen = torch.Generator().manual_seed(seed)
    layers = scoring_layers(cm.num_layers)
    cfg = cm.model.config
    heads, qheads = cfg.num_key_value_heads, cfg.num_attention_heads
    kdim = getattr(cfg, "head_dim", None) or cfg.hidden_size // qheads
    rows = []
    for size in sizes:
        groups = max(1, round(size / group_tokens))
        spans = torch.stack([torch.arange(groups), torch.arange(groups) + 1], 1) * round(group_tokens)
        with tempfile.TemporaryDirectory(prefix="kvchat-recall-cost-") as folder:
            store = Digests(folder, cm.num_layers, cm.rotary, cap_mb=1 << 20)
            for start in range(0, groups, 4096):
                block = torch.randn(min(4096, groups - start), len(layers), heads, REPS, kdim, generator=gen)
                store.append(block, spans[start: start + block.shape[0]])
            _, digests, coarse = store.read()
            held = torch.zeros(groups)
            content = torch.ones(groups, dtype=torch.bool)
            row = {"archive_tokens": size, "groups": groups, "digest_mb": store.nbytes / 2**20}
            ids = torch.randint(0, len(cm.tokenizer), (int(spans[-1, 1]),), generator=gen, dtype=torch.int32)
            for key, n in (("ms", 20), ("ms_long", QUERY_ROWS)):
                queries = {li: torch.randn(qheads, n, kdim, generator=gen) for li in layers}
                times = []
                for _ in range(5):
                    t = time.perf_counter()
                    rel = relevance(digests, coarse, layers, queries, {})
                    choose(fuse(rel, bm25(ids[:n], ids, spans, word_forms(cm))), spans, held, content, 6, 64, 0.0)
                    times.append(1000 * (time.perf_counter() - t))
                row[key] = statistics.median(times)
        rows.append(row)
        log(f"recall scoring at {size:7d} archived tokens ({groups} groups): {row['ms']:.1f} ms (20-token message), "
            f"{row['ms_long']:.1f} ms ({QUERY_ROWS} query rows)")
    return rows


def run(args, run: Run, cm) -> None:
    import tempfile

    data = data_dir(args.data)
    cases = make_cases(data, args.kinds, args.cases, args.seed, load_facts(args.facts))
    run.rows = {"cells": [], "replay": [], "scoring": [], "facts": [c["expect"] for c in cases]}
    cells = run.rows["cells"]
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-recall-") as tmp:
        store = Store(Path(tmp) / "recall.db")
        if args.after + 1024 < cm.max_positions:  # the full cache holds the whole chat: the ceiling
            cells.extend(cell(cm, Settings(policy="full"), cases, args.after, args.max_new_tokens, store))
            try:
                run.rows["replay"].append(replay_nll(cm, Settings(policy="full"), data, args.replay_turns, store))
            except ContextFullError as exc:  # the replayed answers alone pass the model's positions
                log(f"recall: no full-cache replay: {exc}")
        else:
            log(f"recall: no full-cache ceiling: {args.after} tokens after the fact pass the model's "
                f"{cm.max_positions} positions")
        for budget in args.budgets:
            for p in args.policies:
                for mode in args.recall:
                    settings = Settings(policy=p, budget=budget, recall=mode, recall_rerank=args.recall_rerank)
                    cells.extend(cell(cm, settings, cases, args.after, args.max_new_tokens, store))
                    if p == args.policies[0]:
                        row = replay_nll(cm, settings, data, args.replay_turns, store)
                        run.rows["replay"].append(row)
                        log(f"recall replay NLL {p} budget {budget} recall {mode}: {row['nll']:.4f}")
    measured = [c for c in cells if c["recall"] == "on" and c["recalled_tokens"]]
    sample = Session(cm, Settings(policy="full"))  # the filler's mean sentence group, for the scoring's sizes
    for pair in filler_pairs(data)[:20]:
        sample.exchange(*pair)
    group_tokens = sample.total_tokens / sample.group_count()
    run.rows["group_tokens"] = group_tokens
    run.rows["scoring"] = scoring_cost(cm, args.archive_sizes, group_tokens, args.seed)
    bounded = [c for c in cells if c["policy"] != "full"]
    run.check("evicted", all(min(c["evicted"]) > 0 for c in bounded),
              "every bounded case evicted before the question (the fact was at risk)")
    pairs = [(c, o) for c in bounded if c["recall"] == "on" for o in bounded
             if o["recall"] == "off" and (o["policy"], o["budget"], o["kind"]) == (c["policy"], c["budget"], c["kind"])]
    if pairs:
        on = statistics.mean(c["mean_nll"] for c, _ in pairs)
        off = statistics.mean(o["mean_nll"] for _, o in pairs)
        run.check("recall brings evicted facts back", on < off,
                  f"mean fact NLL with recall on {on:.2f} < recall off {off:.2f} (same cases, same policies)")
    if measured:
        log(f"recall: {statistics.mean(c['recall_ms'] for c in measured):.0f} ms per question on average")
    total = per_message(run.rows)
    if total:  # the aim is 50 ms at 100K archived tokens: reported, not asserted (as the speed targets)
        log(f"recall per message at {total['archive_tokens']:,} archived tokens: {total['ms']:.1f} ms (scoring "
            f"{total['ms'] - total['putback_mean']:.1f} + put-back {total['putback_mean']:.1f}) for a 20-token message"
            + (f", {total['ms_long']:.1f} ms for a long one" if "ms_long" in total else ""))

def plot(result: dict, plots, plt) -> list:
    cells = result["results"]["cells"]
    budget = min((c["budget"] for c in cells if c["budget"]), default=None)
    if budget is None:
        return []
    kinds = list(dict.fromkeys(c["kind"] for c in cells))
    bars = [("full cache", [c for c in cells if c["policy"] == "full"])]
    for p in dict.fromkeys(c["policy"] for c in cells if c["budget"] == budget):
        for mode in ("off", "on"):
            rows = [c for c in cells if (c["policy"], c["budget"], c["recall"]) == (p, budget, mode)]
            if rows:
                bars.append((f"{p}, recall {mode}", rows))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(bars)
    for i, (label, rows) in enumerate(bars):
        by_kind = {c["kind"]: c["mean_nll"] for c in rows}
        ax.bar([k + i * width for k in range(len(kinds))], [by_kind.get(k, 0) for k in kinds], width, label=label,
               **({"color": "black"} if label == "full cache" else {}))
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))], kinds)
    ax.set_ylabel("mean NLL of the fact's tokens (probe)")
    ax.set_title(f"Recall across turns at budget {budget} (lower is better)")
    ax.legend(fontsize=7)
    return [save_figure(fig, plots / "recall.png", plt)]


def markdown(result: dict) -> str:
    cfg = result["config"]
    res = result["results"]
    cells = res["cells"]
    n = cells[0]["cases"] if cells else 0
    lines = [f"{n} cases per kind and cell (seed {cfg['seed']}), facts planted at the start or in the middle of the "
             f"chat with {cfg['after']}+ tokens of chat after them; cells: generated hits / probe hits / mean NLL of "
             "the fact's tokens.", ""]
    kinds = list(dict.fromkeys(c["kind"] for c in cells))

    def fmt(c):
        return f"{c['generated_hits']}/{c['cases']} · {c['probe_hits']}/{c['cases']} · {c['mean_nll']:.2f}"

    lines += ["| policy | budget | recall | " + " | ".join(kinds) + " | TTFT ms | recall ms |",
              "| --- " * (len(kinds) + 5) + "|"]
    groups: dict = {}
    for c in cells:
        groups.setdefault((c["policy"], c["budget"], c["recall"]), {})[c["kind"]] = c
    for (p, b, mode), row in groups.items():
        name = "full cache (ceiling)" if p == "full" else p
        ttft = statistics.mean(c["ttft_ms"] for c in row.values())
        rms = [c["recall_ms"] for c in row.values() if c["recall_ms"] is not None]
        recall_ms = f"{statistics.mean(rms):.0f}" if rms else "–"
        lines.append(f"| {name} | {b or '–'} | {mode if p != 'full' else '–'} | "
                     + " | ".join(fmt(row[k]) if k in row else "–" for k in kinds) + f" | {ttft:.0f} | {recall_ms} |")
    if res.get("replay"):
        lines += ["", "Assistant answers of MT-Bench replayed (teacher-forced) on one chat, recall off and on:", "",
                  "| policy | budget | recall | tokens | NLL | PPL |", "| --- | --- | --- | --- | --- | --- |"]
        for r in res["replay"]:
            lines.append(f"| {r['policy']} | {r['budget'] or '–'} | {r['recall'] if r['budget'] else '–'} | "
                         f"{r['tokens']} | {r['nll']:.4f} | {r['ppl']:.3f} |")
    if res.get("scoring"):
        lines += ["", f"Recall's scoring (relevance over every digest and the choice) against the archive's size, "
                      f"sentence groups of {res.get('group_tokens', 0):.1f} tokens:", "",
                  "| archived tokens | groups | digests MB | ms, 20-token message | ms, long message |",
                  "| --- | --- | --- | --- | --- |"]
        for r in res["scoring"]:
            long = f"{r['ms_long']:.1f}" if "ms_long" in r else "–"
            lines.append(f"| {r['archive_tokens']:,} | {r['groups']:,} | {r['digest_mb']:.1f} | {r['ms']:.1f} | "
                         f"{long} |")
        total = per_message(res)
        if total:
            lines += ["", f"Putting the chosen groups back (the session marked before the message's first read and "
                          f"put back after it, room made, the groups read again from their tokens at the end of the "
                          f"cache and every layer and head put back in conversation order) took "
                          f"{total['putback_mean']:.1f} ms on average, {total['putback_max']:.1f} at most, over the "
                          f"{total['recalls']} questions above that recalled something; it reads only the recalled "
                          f"tokens, whatever the archive's size. Recall per user message at "
                          f"{total['archive_tokens']:,} archived tokens, scoring plus the average put-back: "
                          f"{total['ms']:.1f} ms for a 20-token message"
                          + (f", {total['ms_long']:.1f} ms for a long one." if total.get("ms_long") else ".")
                          + " The message is then read again after the recalled text (its prefill, not counted here)."]
    return "\n".join(lines)


def per_message(res: dict) -> dict | None:
    """Recall's cost per user message at the largest archive measured: the scoring there plus the mean put-back
    measured in the cells (None without both)."""
    putback = [ms for c in res.get("cells", []) for ms in c.get("putback_ms", [])]
    if not putback or not res.get("scoring"):
        return None
    big = max(res["scoring"], key=lambda r: r["archive_tokens"])
    mean = statistics.mean(putback)
    out = {"archive_tokens": big["archive_tokens"], "recalls": len(putback), "putback_mean": mean,
           "putback_max": max(putback), "ms": big["ms"] + mean}
    if "ms_long" in big:
        out["ms_long"] = big["ms_long"] + mean
    return out
