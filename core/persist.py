"""A session in SQLite and on disk: the records each turn writes, cache snapshots, and reopening a conversation.

Every completed turn is written in one transaction (``commit``); the system prompt waits for the first exchange,
so opening a session writes nothing. A snapshot (``save_snapshot``) holds the kept KV, positions, observer queries
and policy state in a safetensors file beside the database; ``resume`` restores the cache from it when it is
current, else rebuilds it by prefilling the kept tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from . import compress
from .settings import Settings
from .turns import TurnResult, now_iso


def turn_record(session, res: TurnResult, messages: list[tuple[int, list[int]]]) -> dict:
    """What a closing turn writes: its messages (index, tokens), its statistics and its eviction events."""
    stamp = now_iso()
    return {
        "turn": session.turn,
        "messages": [{"idx": i, "role": session.messages[i]["role"], "text": session.messages[i]["content"],
                      "tokens": ids, "turn": session.turn, "created_at": stamp} for i, ids in messages],
        "stats": {**res.as_dict(), "policy": session.settings.policy, "settings": session.settings.as_dict(),
                  "created_at": stamp},
        "events": session.evictions.take(),
    }


def commit(session, record: dict) -> None:
    """Write a closed turn (with any turns and settings changes waiting) in one transaction."""
    session.pending.append(record)
    store = session.store
    if store is None:
        session.pending.clear()
        return
    if session.conversation_id is None and all(m["role"] == "system" for r in session.pending
                                               for m in r["messages"]):
        return  # a conversation is created with its first exchange, not by opening a session
    if session.title is None:
        first = next((m["text"] for r in session.pending for m in r["messages"] if m["role"] == "user"), "")
        session.title = " ".join(first.split())[:60] or "conversation"
    session.conversation_id = store.commit_turns(session.conversation_id, conversation_row(session),
                                                 session.pending, session.pending_settings)
    session.pending, session.pending_settings = [], []


def record_settings(session, record: dict) -> None:
    """A live settings change: written now if the conversation exists, else with its first turn."""
    if session.store is not None and session.conversation_id is not None:
        session.store.record_settings(session.conversation_id, record)
    else:
        session.pending_settings.append(record)


def conversation_row(session) -> dict:
    """The conversation's row: settings, counters and the kept positions as [start, end) ranges."""
    kept = session.kept_positions().tolist()
    ranges, start = [], None
    for a, b in zip(kept, kept[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            ranges.append([start, a + 1])
            start = None
    return {"title": session.title, "model": session.model.name, "settings": asdict(session.settings),
            "next_turn": session.turn, "total_tokens": session.log.n, "kept": ranges, "seed": session.seed,
            "updated_at": now_iso()}


def save_snapshot(session) -> Path | None:
    """Write the kept KV and its positions next to the database (safetensors, atomically) and reference it from
    the conversation. Returns the path, or None when nothing has been stored yet."""
    store = session.store
    if store is None or session.conversation_id is None or session.pending:
        return None
    folder = store.path.parent / "snapshots"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"conversation-{session.conversation_id}.safetensors"
    tmp = path.with_suffix(".tmp")
    meta = {"turn": str(session.turn), "model": session.model.name, "total_tokens": str(session.log.n),
            "positions": session.settings.positions, "policy": session.settings.policy,
            "policy_state": json.dumps(session.policy.get_state())}
    tensors = session.cache.state_tensors()
    if session.observer is not None:
        tensors.update(session.observer.state_tensors())
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    store.set_snapshot(session.conversation_id, str(path), session.turn)
    return path


def resume(cls, model, store, conversation_id: int, use_snapshot: bool = True, sampling=None, undo: bool = False):
    """Reopen stored conversation ``conversation_id`` as a ``cls`` session (see ``Session.resume``)."""
    conv = store.conversation(conversation_id)
    if conv["model"] != model.name:
        raise ValueError(f"conversation {conversation_id} was held by model {conv['model']}, not {model.name}")
    settings = Settings.from_dict(conv["settings"])
    session = cls(model, settings, system=None, store=store, sampling=sampling, seed=conv["seed"] or 0,
                  title=conv["title"], undo=undo)
    session.conversation_id = conversation_id
    for m in store.messages(conversation_id):
        idx = session.new_message(m["role"], m["text"])
        session.turn = m["turn"]
        session.log.append_messages(model.tokenizer, [(m["tokens"], idx, m["role"])], session.turn)
        if idx == 0 and m["role"] == "system":
            session.system_tokens = len(m["tokens"])
    session.turn = conv["next_turn"]
    session.generator.manual_seed(session.seed + session.turn)
    stat_fields = {f.name for f in fields(TurnResult)}
    session.history.extend(TurnResult(**{k: v for k, v in row.items() if k in stat_fields})
                           for row in store.turn_stats(conversation_id))
    session.evictions.total = sum(r.evicted_tokens for r in session.history)
    if use_snapshot and _load_snapshot(session, conv):
        session.restored_from = "snapshot"
        return session
    kept = [p for a, b in conv["kept"] or [] for p in range(a, b)]
    rebuild(session, torch.tensor(kept, dtype=torch.long))
    session.restored_from = "tokens"
    return session


def _load_snapshot(session, conv: dict) -> bool:
    """Restore the cache from the conversation's snapshot if it is current; whether it was."""
    snap = conv.get("snapshot_path")
    if not (snap and conv.get("snapshot_turn") == session.turn and Path(snap).is_file()):
        return False
    with safe_open(snap, "pt") as f:
        meta = f.metadata() or {}
    settings = session.settings
    if int(meta.get("total_tokens", -1)) != session.log.n or meta.get("positions") != settings.positions:
        return False
    tensors = load_file(snap)
    session.cache.load_state_tensors(tensors, session.model.device, session.model.dtype)
    if session.observer is not None:
        session.observer.load_state_tensors(tensors, session.model.device)
    if meta.get("policy") == settings.policy and meta.get("policy_state"):
        session.policy.set_state(json.loads(meta["policy_state"]))
    return True


def rebuild(session, positions: torch.Tensor) -> None:
    """Prefill the tokens at ``positions`` (absolute, ascending) into an empty cache."""
    tokens = session.log.column("token")[positions].long()
    total, i = session.evictions.total, 0
    while i < positions.numel():  # per-head policies keep a union of positions that may pass the budget
        c = compress.make_room(session, positions.numel() - i)
        session.forward(tokens[i: i + c], positions[i: i + c])
        i += c
    session.evictions.events, session.evictions.total = [], total  # a rebuild's own compressions are not the chat's
