"""Durability: what it costs to make every completed turn durable, cache included.

A chat of ``--turns`` user messages from the FastChat conversations, each answered with ``--max-new-tokens``
greedy tokens, stored in SQLite with its archive. Per turn, the time spent writing the archive (every fed token's
KV, as it is fed), making it durable and writing the cache's slot state (fsync'd, atomic), and committing the
turn's rows to SQLite, against the turn's whole time; the bytes the archive and SQLite grow by per turn and the
size of the state file (rewritten each turn). Then the
conversation is reopened and the reopened cache checked equal to the live one.
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
from ..storage.archive import Archive
from ..core.engine.session import Sampling, Session
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
    p.add_argument("--data", default=None, help="the shared data directory (default ../shared/data)")


def user_messages(data: Path, n: int) -> list[str]:
    out = []
    for c in json.loads((data / "fastchat" / "dummy_conversation.json").read_text(encoding="utf-8")):
        out += [t["value"] for t in c["conversations"] if t["from"] == "human" and t["value"].strip()]
        if len(out) >= n:
            break
    return out[:n]


def _disk(folder: Path) -> dict[str, int]:
    files = {p.name: p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    return {"archive": sum(v for k, v in files.items() if k in ("kv.bin", "pos.bin")),
            "state": sum(v for k, v in files.items() if k.startswith("state-")),
            "sqlite": sum(v for k, v in files.items() if k.startswith("kv.db"))}


def chat(model, settings: Settings, messages: list[str], max_new_tokens: int) -> dict:
    spent: dict[str, float] = {"archive": 0.0, "state": 0.0, "sqlite": 0.0}

    def timed(fn, key):
        def wrapped(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t
        return wrapped

    patches = [mock.patch.object(Archive, "append", timed(Archive.append, "archive")),
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
            for k in spent:
                spent[k] = 0.0
            t = time.perf_counter()
            res = session.chat(text)
            wall = time.perf_counter() - t
            now = _disk(folder)
            rows.append({"turn": res.turn, "tokens": res.prompt_tokens + res.new_tokens, "turn_ms": 1000 * wall,
                         **{f"{k}_ms": 1000 * v for k, v in spent.items()},
                         "archive_bytes": now["archive"] - before["archive"],  # appended by the turn
                         "sqlite_bytes": now["sqlite"] - before["sqlite"],
                         "state_bytes": now["state"],  # the state file is replaced, not appended to
                         "cache_tokens": res.cache_tokens, "evicted": res.evicted_tokens})
            before = now
        reopened = Session.resume(model, Store(folder / "kv.db"), session.conversation_id)
        live, back = session.cache.state_tensors(), reopened.cache.state_tensors()
        exact = reopened.restored_from == "archive" and live.keys() == back.keys() and all(
            torch.equal(live[k], back[k]) for k in live)
        archive_bytes = session.archive.nbytes
        session.close()
        reopened.close()
        store.close()
    durable = [r["archive_ms"] + r["state_ms"] + r["sqlite_ms"] for r in rows]
    return {"policy": settings.policy, "budget": settings.budget, "turns": rows, "exact": exact,
            "tokens": sum(r["tokens"] for r in rows), "archive_bytes": archive_bytes,
            "archive_bytes_per_token": archive_bytes / max(sum(r["tokens"] for r in rows), 1),
            "durable_ms_mean": statistics.mean(durable), "durable_ms_max": max(durable),
            "turn_ms_mean": statistics.mean(r["turn_ms"] for r in rows),
            "share_mean": statistics.mean(d / r["turn_ms"] for d, r in zip(durable, rows)),
            "share_max": max(d / r["turn_ms"] for d, r in zip(durable, rows)),
            "state_bytes_per_turn": statistics.mean(r["state_bytes"] for r in rows),
            "evicted_tokens": sum(r["evicted"] for r in rows),
            "sqlite_bytes_per_turn": statistics.mean(r["sqlite_bytes"] for r in rows),
            "archive_bytes_per_turn": statistics.mean(r["archive_bytes"] for r in rows)}


def run(args, run: Run, model) -> None:
    messages = user_messages(data_dir(args.data), args.turns)
    run.rows = {"runs": []}
    for policy in args.policies:
        r = chat(model, Settings(policy=policy, budget=args.budget), messages, args.max_new_tokens)
        run.rows["runs"].append(r)
        log(f"durability {policy:10s} budget {args.budget}: {len(r['turns'])} turns, {r['tokens']} tokens; durable "
            f"writes {r['durable_ms_mean']:.1f} ms/turn (max {r['durable_ms_max']:.1f}) = {100 * r['share_mean']:.2f}% "
            f"of a turn (max {100 * r['share_max']:.2f}%); {r['evicted_tokens']} evicted; archive "
            f"{r['archive_bytes_per_token'] / 1024:.1f} KiB/token, "
            f"state file {r['state_bytes_per_turn'] / 1024:.0f} KiB, SQLite {r['sqlite_bytes_per_turn'] / 1024:.1f} "
            f"KiB per turn; reopened exactly: {r['exact']}")
        run.check(f"{policy} reopens exactly", r["exact"], "the reopened cache's keys and positions equal the live one")


def plot(result: dict, plots, plt) -> list:
    return []


def markdown(result: dict) -> str:
    lines = ["| policy | budget | turns | tokens | evicted | durable writes ms/turn (max) | "
             "share of a turn's time (max) | archive KiB/token | state file KiB | SQLite KiB/turn | reopened exactly |",
             "| --- " * 11 + "|"]
    for r in result["results"]["runs"]:
        lines.append(f"| {r['policy']} | {r['budget']} | {len(r['turns'])} | {r['tokens']} | {r['evicted_tokens']} | "
                     f"{r['durable_ms_mean']:.1f} ({r['durable_ms_max']:.1f}) | {100 * r['share_mean']:.2f}% "
                     f"({100 * r['share_max']:.2f}%) | {r['archive_bytes_per_token'] / 1024:.1f} | "
                     f"{r['state_bytes_per_turn'] / 1024:.0f} | {r['sqlite_bytes_per_turn'] / 1024:.1f} | "
                     f"{'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines)
