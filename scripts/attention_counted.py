"""How a policy that counts attention (h2o, headaware) treats tokens it did not see arrive: those cached when it is
switched in mid-chat, and those recall brings back (docs/how-it-works.md, Policies; docs/recall.md).

    .venv/bin/python scripts/attention_counted.py switch --policy h2o --chats 6
    .venv/bin/python scripts/attention_counted.py recall --policy h2o --chats 16

The default model, greedy, recall off unless said; a fact from ``kvchat bench recall``'s set, then FastChat/MT-Bench
exchanges from ``../shared/data``.

* ``switch``: ``--history`` tokens of chat, then two more exchanges and a probe of the fact (its question with the
  reference answer: the mean NLL of the fact's tokens), once under the policy at ``--budget`` all along and once
  under ``full`` switched to the policy at that budget after the history. Printed: the probe's NLL under each, the
  Jaccard overlap of each (layer, head)'s held positions between the two, the share of the switched chat's cache
  that is the newest 300 tokens, and how long the switch took (``configure``: what the policy reads, and the
  compression to the budget).
* ``recall``: under the policy with recall on, ``--history`` tokens of chat, then the fact's question (recall brings
  the fact back), then recall off and four exchanges (the fact asked in other words with its answer, another
  exchange, the question with its answer, another). Printed: the positions recalled, and after each exchange the
  share of them each (layer, head) still holds, on average.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from kvchat.bench.recall import filler_pairs
from kvchat.bench.recall_facts import FACTS
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.core.model import loading as models


def held(session) -> list[set[int]]:
    """Each (layer, KV head)'s held positions."""
    return [set(layer.head_view(layer.abs_pos, h)[: layer.lens[h]].tolist()) for layer in session.cache.layers
            for h in range(layer.heads)]


def history(session, pairs, k: int, tokens: int, chars: int) -> int:
    while session.log.n < tokens:
        user, reply = pairs[k % len(pairs)]
        session.exchange(user[:chars], reply[:chars])
        k += 1
    return k


def switch(model, pairs, args, case: int) -> tuple:
    fact, question, _, answer, value, _ = FACTS[case % len(FACTS)]
    v = value(random.Random(case))
    out = []
    for settings, change in ((Settings(policy=args.policy, budget=args.budget, recall="off"), None),
                             (Settings(policy="full", recall="off"), {"policy": args.policy, "budget": args.budget})):
        session = Session(model, settings, sampling=Sampling(temperature=0))
        session.exchange("Hi! " + fact.format(v=v), "Noted, I will remember that.")
        k = history(session, pairs, 3 + 5 * case, args.history, 500)
        if change:
            start = time.perf_counter()
            session.configure(**change)
            switch_ms = 1000 * (time.perf_counter() - start)
        for user, reply in pairs[k: k + 2]:
            session.exchange(user[:200], reply[:200])
        out.append((session, session.probe(question, answer.format(v=v), v).expect_nll))
    (ran, nll_ran), (switched, nll_switched) = out
    a, b = held(ran), held(switched)
    newest = set(range(switched.log.n - 300, switched.log.n))
    return (nll_ran, nll_switched, sum(len(x & y) / len(x | y) for x, y in zip(a, b)) / len(a),
            sum(len(y & newest) / len(y) for y in b) / len(b), switch_ms)


def recall(model, pairs, args, case: int) -> tuple:
    fact, question, paraphrase, answer, value, _ = FACTS[case % len(FACTS)]
    v = value(random.Random(case))
    session = Session(model, Settings(policy=args.policy, budget=args.budget, recall="on"),
                      sampling=Sampling(temperature=0))
    session.exchange(fact.format(v=v), "Noted.")
    k = history(session, pairs, 3 + 7 * case, args.history, 600)
    recalled = torch.tensor([p for a, b in session.chat(question, max_new_tokens=16).recalled for p in range(a, b)])
    session.configure(recall="off")
    shares = []
    for j in range(4):
        if j % 2 == 0:
            session.exchange(paraphrase if j == 0 else question, answer.format(v=v))
        else:
            user, reply = pairs[k % len(pairs)]
            session.exchange(user[:400], reply[:400])
            k += 1
        shares.append(session.held_fraction()[recalled].mean().item() if recalled.numel() else 0.0)
    return (recalled.numel(), *shares)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("probe", choices=["switch", "recall"])
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--history", type=int, help="tokens of chat before the switch or the question (default 900 for "
                   "switch, 1300 for recall)")
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    args = p.parse_args()
    args.history = args.history or (900 if args.probe == "switch" else 1300)
    model = models.load(str(models.default_model_dir()))
    pairs = filler_pairs(Path(args.data))
    probe = switch if args.probe == "switch" else recall
    names = (["NLL all along", "NLL switched", "overlap", "newest 300", "switch ms"] if args.probe == "switch" else
             ["recalled", "held after 1", "after 2", "after 3", "after 4"])
    rows = []
    for case in range(args.chats):
        rows.append(probe(model, pairs, args, case))
        print(f"chat {case}: " + ", ".join(f"{n} {x:.3f}" for n, x in zip(names, rows[-1])), flush=True)
    mean = [sum(r[i] for r in rows) / len(rows) for i in range(len(names))]
    print(f"{args.probe}, {args.policy} at {args.budget}, {len(rows)} chats: " +
          ", ".join(f"{n} {x:.3f}" for n, x in zip(names, mean)))


if __name__ == "__main__":
    main()
