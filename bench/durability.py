"""Durability: what it costs to make every completed turn durable, cache included.

A chat of ``--turns`` user messages from the FastChat conversations, each answered with ``--max-new-tokens``
greedy tokens, stored as a chat is (``--recall on|off``). Per turn, the time spent on what makes it durable — the
cache's new rows written and synced, recall's digests computed and synced, the slot state written (fsync'd, atomic),
the turn's rows committed to SQLite — against the turn's whole time; the bytes on disk after each turn: the rows
file (bounded by the cache), the state file (rewritten each turn), the digests, SQLite. Then the conversation is
reopened and the reopened cache checked equal to the live one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from ..core.engine import persist
from ..core.engine.session import Sampling, Session
from ..core.recall.digest import Digests
from ..core.engine.settings import Settings
from ..storage.db import Store
from .common import Run, data_dir, log

NAME = "durability"
TITLE = "Durability"
QUICK = {"turns": 4, "budget": 128, "max_new_tokens": 8, "policies": ["streaming"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--policies", nargs="+", default=["streaming", "h2o"])
    p.add_argument("--recall", choices=("on", "off"), default="on", help="recall and its digests (default on)")
    p.add_argument("--data", default=None, help="the shared data directory (default ../shared/data)")


def user_messages(data: Path, n: int) -> list[str]:
    out = []
    for c in json.loads((data / "fastchat" / "dummy_conversation.json").read_text(encoding="utf-8")):
        out += [t["value"] for t in c["conversations"] if t["from"] == "human" and t["value"].strip()]
        if len(out) >= n:
            break
    return out[:n]


def _disk(folder: Path) -> dict[str, int]:
    files = {p: p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    return {"rows": sum(v for k, v in files.items() if k.name == "rows.bin"),
            "state": sum(v for k, v in files.items() if k.name.startswith("state-")),
            "digests": sum(v for k, v in files.items() if k.parent.name == "digests"),
            "sqlite": sum(v for k, v in files.items() if k.name.startswith("kv.db"))}


def chat(model, settings: Settings, messages: list[str], max_new_tokens: int) -> dict:
    spent: dict[str, float] = {"rows": 0.0, "digests": 0.0, "state": 0.0, "sqlite": 0.0, "sync": 0.0}

    def timed(fn, key):
        def wrapped(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t
        return wrapped

    patches = [mock.patch.object(persist, "write_rows", timed(persist.write_rows, "rows")),
               mock.patch.object(Digests, "add", timed(Digests.add, "digests")),
               mock.patch.object(Digests, "sync", timed(Digests.sync, "sync")),
               mock.patch.object(persist, "write_state", timed(persist.write_state, "state")),
               mock.patch.object(Store, "commit_turns", timed(Store.commit_turns, "sqlite"))]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvchat-durability-") as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp)
        for patch in patches:
            stack.enter_context(patch)
        store = Store(folder / "kv.db")
        session = Session(model, settings, store=store, sampling=Sampling(max_new_tokens=max_new_tokens,
                                                                          temperature=0.0))
        before = _disk(folder)
        for text in messages:
            spent.update(rows=0.0, digests=0.0, state=0.0, sqlite=0.0, sync=0.0)
            t = time.perf_counter()
            res = session.chat(text)
            wall = time.perf_counter() - t
            now = _disk(folder)
            # write_state includes writing the rows and syncing the digests: the state alone is what is left of it
            spent["state"] -= spent["rows"] + spent["sync"]
            spent["digests"] += spent.pop("sync")
            rows.append({"turn": res.turn, "tokens": res.prompt_tokens + res.new_tokens, "turn_ms": 1000 * wall,
                         **{f"{k}_ms": 1000 * v for k, v in spent.items()},
                         "rows_bytes": now["rows"], "state_bytes": now["state"], "digests_bytes": now["digests"],
                         "sqlite_bytes": now["sqlite"] - before["sqlite"],
                         "cache_tokens": res.cache_tokens, "evicted": res.evicted_tokens})
            before = now
        reopened = Session.resume(model, Store(folder / "kv.db"), session.conversation_id)
        live, back = session.cache.state_tensors(), reopened.cache.state_tensors()
        exact = reopened.restored_from == "archive" and live.keys() == back.keys() and all(
            torch.equal(live[k], back[k]) for k in live)
        tokens = session.total_tokens
        session.close()
        reopened.close()
        store.close()
    durable = [r["rows_ms"] + r["digests_ms"] + r["state_ms"] + r["sqlite_ms"] for r in rows]
    return {"policy": settings.policy, "budget": settings.budget, "recall": settings.recall, "turns": rows,
            "exact": exact, "tokens": sum(r["tokens"] for r in rows), "total_tokens": tokens,
            "rows_bytes_max": max(r["rows_bytes"] for r in rows), "rows_bytes_last": rows[-1]["rows_bytes"],
            "digests_bytes_per_token": rows[-1]["digests_bytes"] / max(tokens, 1),
            "durable_ms_mean": statistics.mean(durable), "durable_ms_max": max(durable),
            "turn_ms_mean": statistics.mean(r["turn_ms"] for r in rows),
            "share_mean": statistics.mean(d / r["turn_ms"] for d, r in zip(durable, rows)),
            "share_max": max(d / r["turn_ms"] for d, r in zip(durable, rows)),
            "state_bytes_per_turn": statistics.mean(r["state_bytes"] for r in rows),
            "evicted_tokens": sum(r["evicted"] for r in rows),
            "sqlite_bytes_per_turn": statistics.mean(r["sqlite_bytes"] for r in rows)}


def run(args, run: Run, model) -> None:
    messages = user_messages(data_dir(args.data), args.turns)
    run.rows = {"runs": []}
    for policy in args.policies:
        r = chat(model, Settings(policy=policy, budget=args.budget, recall=args.recall), messages,
                 args.max_new_tokens)
        run.rows["runs"].append(r)
        log(f"durability {policy:10s} budget {args.budget}: {len(r['turns'])} turns, {r['tokens']} tokens; durable "
            f"writes {r['durable_ms_mean']:.1f} ms/turn (max {r['durable_ms_max']:.1f}) = {100 * r['share_mean']:.2f}% "
            f"of a turn (max {100 * r['share_max']:.2f}%); {r['evicted_tokens']} evicted; rows file at most "
            f"{r['rows_bytes_max'] / 2**20:.1f} MiB, digests {r['digests_bytes_per_token'] / 1024:.2f} KiB/token, "
            f"state file {r['state_bytes_per_turn'] / 1024:.0f} KiB, SQLite {r['sqlite_bytes_per_turn'] / 1024:.1f} "
            f"KiB per turn; reopened exactly: {r['exact']}")
        run.check(f"{policy} reopens exactly", r["exact"], "the reopened cache's keys and positions equal the live one")


def plot(result: dict, plots, plt) -> list:
    return []


def markdown(result: dict) -> str:
    lines = ["| policy | recall | budget | turns | tokens | evicted | durable writes ms/turn (max) | "
             "share of a turn's time (max) | rows file MiB (max) | digests KiB/token | state file KiB | "
             "SQLite KiB/turn | reopened exactly |", "| --- " * 13 + "|"]
    for r in result["results"]["runs"]:
        if "rows_bytes_max" not in r:  # a run of an older kvchat (its archive kept every token)
            continue
        lines.append(f"| {r['policy']} | {r.get('recall', '–')} | {r['budget']} | {len(r['turns'])} | "
                     f"{r['tokens']} | {r['evicted_tokens']} | "
                     f"{r['durable_ms_mean']:.1f} ({r['durable_ms_max']:.1f}) | "
                     f"{100 * r['share_mean']:.2f}% ({100 * r['share_max']:.2f}%) | "
                     f"{r['rows_bytes_last'] / 2**20:.1f} ({r['rows_bytes_max'] / 2**20:.1f}) | "
                     f"{r['digests_bytes_per_token'] / 1024:.2f} | {r['state_bytes_per_turn'] / 1024:.0f} | "
                     f"{r['sqlite_bytes_per_turn'] / 1024:.1f} | {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines)
