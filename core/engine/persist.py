"""A session in SQLite and on disk: the records each turn writes, the cache state after each turn, and reopening
a conversation.

Every completed turn is durable, cache included. When a turn closes: the archive (every token's KV as computed,
storage/archive.py) is synced; then the cache's slot state (which positions each layer and head keeps and where,
per-slot statistics, observer queries, policy state, the sampling generator) is written atomically as
``state-<turn>.safetensors`` beside the archive; then the turn's records go to SQLite in one transaction, which
is the commit point; older state files are removed after it. A crash at any moment leaves SQLite at the last
committed turn and the state file of that turn on disk, so ``resume`` rebuilds exactly the cache that turn left
(``restored_from == "archive"``). Conversations from before the archive (or opened with ``exact=False``) are
rebuilt by prefilling the tokens they kept (``restored_from == "tokens"``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, fields
from pathlib import Path

import torch

from ..cache import compress
from ...storage import statefile
from ...storage.archive import Archive
from ..recall.digest import Digests
from .settings import Settings
from ...storage.db import now_iso
from .turns import TurnResult


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
    if session.archive is not None:
        write_state(session)
    session.conversation_id = store.commit_turns(session.conversation_id, conversation_row(session),
                                                 session.pending, session.pending_settings)
    session.pending, session.pending_settings = [], []
    if session.archive is not None:
        remove_states(session.archive, keep=session.turn)


def new_archive(store, model) -> Archive | None:
    """A new conversation's archive beside the database (None without a store)."""
    return open_archive(store.archive_folder(uuid.uuid4().hex), model) if store is not None else None


def open_archive(folder: Path, model) -> Archive:
    """A conversation's archive and the recall digests beside it."""
    archive = Archive(folder, model.num_layers)
    archive.digests = Digests(folder, model.num_layers)
    return archive


def write_state(session) -> Path:
    """Make the archive durable, then write the cache's slot state after this turn (atomically)."""
    archive = session.archive
    archive.sync()
    tensors = session.cache.slot_state()
    if session.observer is not None:
        tensors.update(session.observer.state_tensors())
    tensors["generator"] = session.generator.get_state()
    if session.last_logits is not None:
        tensors["last_logits"] = session.last_logits.float().cpu()
    meta = {"turn": str(session.turn), "total_tokens": str(session.log.n), "positions": session.settings.positions,
            "policy": session.settings.policy, "policy_state": json.dumps(session.policy.get_state()),
            "evicted_total": str(session.evictions.total)}
    return statefile.write(archive.folder, session.turn, tensors, meta)


def remove_states(archive: Archive, keep: int) -> None:
    statefile.remove_others(archive.folder, keep)


def _load_state(session, folder: Path) -> bool:
    """Restore the cache exactly from the archive and the state file of the current turn; whether it could."""
    archive = session.archive
    meta = statefile.metadata(folder, session.turn)
    if meta is None or archive.n < session.log.n:
        return False
    if int(meta.get("total_tokens", -1)) != session.log.n or meta.get("positions") != session.settings.positions:
        return False
    archive.truncate(session.log.n)  # what a crash left past the committed turn
    tensors = statefile.read(folder, session.turn)
    model = session.model
    session.cache.load_slot_state(tensors, model.rotary, session.settings.positions == "original", model.device)
    if session.observer is not None:
        session.observer.load_state_tensors(tensors, model.device)
    if meta.get("policy") == session.settings.policy and meta.get("policy_state"):
        session.policy.set_state(json.loads(meta["policy_state"]))
    session.generator.set_state(tensors["generator"])
    if "last_logits" in tensors:
        session.last_logits = tensors["last_logits"].to(device=model.device, dtype=model.dtype)
    session.evictions.total = int(meta["evicted_total"])
    return True


def undo(session, created_conversation: bool) -> None:
    """Take the undone turn out of SQLite and the archive. The state of the turn before is written first, so a
    crash in between reopens either turn exactly."""
    store, archive = session.store, session.archive
    if store is not None and session.conversation_id is not None:
        if created_conversation:  # the undone turn created the conversation: it goes
            store.delete(session.conversation_id, keep_archive=True)
            session.conversation_id = None
        else:
            if archive is not None:
                write_state(session)
            store.truncate(session.conversation_id, session.turn, conversation_row(session))
    if archive is not None:
        archive.truncate(session.log.n)
        remove_states(archive, keep=session.turn)


def record_settings(session, record: dict) -> None:
    """A live settings change: written now if the conversation exists (with the cache state it left: a smaller
    budget compresses at once), else with its first turn."""
    if session.store is not None and session.conversation_id is not None:
        if session.archive is not None:
            write_state(session)
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
            "archive": session.archive.folder.name if session.archive is not None else None,
            "updated_at": now_iso()}


def resume(cls, model, store, conversation_id: int, exact: bool = True, sampling=None, undo: bool = False):
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
    session.archive = session.cache.archive = None
    if conv.get("archive"):
        session.archive = open_archive(store.archive_folder(conv["archive"]), model)
        if session.archive.n < session.log.n:
            session.archive = None  # incomplete: the conversation goes on without one
        else:
            session.cache.archive = session.archive
            if exact and _load_state(session, session.archive.folder):
                session.restored_from = "archive"
                return session
            session.cache.archive = None
            session.archive.truncate(session.log.n)
    kept = [p for a, b in conv["kept"] or [] for p in range(a, b)]
    rebuild(session, torch.tensor(kept, dtype=torch.long))
    session.restored_from = "tokens"
    session.cache.archive = session.archive
    return session


def rebuild(session, positions: torch.Tensor) -> None:
    """Prefill the tokens at ``positions`` (absolute, ascending) into an empty cache."""
    tokens = session.log.column("token")[positions].long()
    total, i = session.evictions.total, 0
    while i < positions.numel():  # per-head policies keep a union of positions that may pass the budget
        c = compress.make_room(session, positions.numel() - i)
        session.forward(tokens[i: i + c], positions[i: i + c])
        i += c
    session.evictions.events, session.evictions.total = [], total  # a rebuild's own compressions are not the chat's
