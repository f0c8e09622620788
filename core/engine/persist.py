"""A session on disk: what each turn writes. Reopening a conversation is core/engine/reopen.py.

Every completed turn is durable, cache included, and what is on disk is bounded like the cache. A stored
conversation has a folder beside the database (``archive/<name>/``) holding:

* ``rows.bin`` (storage/kvrows.py): the computed key and value of every (layer, KV head, position) the cache holds,
  one row each; rows the cache no longer holds are reused, so the file stays about the cache's size plus a turn;
* ``state-<turn>.safetensors`` (storage/statefile.py): which position and row each slot holds, where each key was
  computed, the per-slot statistics, the observer's queries, the policy's state, the sampling generator, and the
  window of recall's digests;
* ``digests/`` (storage/digests.py): recall's digests of every sentence group (recall on), capped;
* ``held``: locked by the process that has the conversation open, one at a time (storage/holding.py).

When a turn closes: the cache's new rows (the turn's tokens it still holds, recalled text) are written into rows
that no committed state and no undo copy names, and synced; the digests are synced; the state is written atomically;
then the turn's records go to SQLite in one transaction, the commit point. After it, older state files and
forgotten digest segments go and the rows file's free tail is cut. A crash at any moment leaves SQLite at the last
committed turn with its state file and every row and digest it names on disk, so the conversation reopens exactly
as that turn left it. Nothing is written per token: the new rows of a turn leave the device once, at its commit.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
import weakref
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ...storage import holding, statefile
from ...storage.db import StoreError, now_iso
from ...storage.files import tree_size
from ...storage.kvrows import RowFile
from ..cache import slab
from ..recall.digest import Digests
from .turns import TurnResult

FORMAT = "2"  # the state files' format (1: kvchat's old archive of every token, storage/legacy.py)


class Files:
    """A conversation's folder: its rows, its state files and (recall on) its digests; ``temporary`` for a session
    without a store, whose recall digests live in a temporary folder deleted with the session."""

    def __init__(self, folder: Path, temporary: bool = False):
        self.folder = Path(folder)
        self.temporary = temporary
        self.rows = RowFile(self.folder)
        self.named = np.zeros(0, dtype=np.int64)  # the rows the last committed state names
        self.legacy = None  # an old archive (storage/legacy.py) to delete once a turn has committed in the new form
        self._holding = None  # this process's hold of the folder (storage/holding.py), given back when called
        # a temporary folder goes when its session is closed, collected, or the interpreter exits (never left in /tmp)
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.folder), True) if temporary else None

    @classmethod
    def new(cls, store) -> "Files":
        if store is None:
            return cls(Path(tempfile.mkdtemp(prefix="kvchat-recall-")), temporary=True)
        return cls(store.archive_folder(uuid.uuid4().hex))

    def nbytes(self) -> int:
        """Bytes on disk: rows, state files and digests."""
        return tree_size(self.folder)

    def hold(self, what: str) -> None:
        """Hold the conversation's folder for this process (storage/holding.py): ValueError if another has it open."""
        if self._holding is None and not self.temporary:
            self.folder.mkdir(parents=True, exist_ok=True)
            holding.hold(self.folder, what)
            self._holding = weakref.finalize(self, holding.release, self.folder)  # or when collected

    def release(self) -> None:
        if self._holding is not None:
            self._holding()
            self._holding = None

    def close(self, stored: bool) -> None:
        """Given back (another process may open the conversation now); deleted if nothing was ever ``stored`` with
        them, or if they were a temporary folder."""
        if self.temporary or not stored:
            self.delete()
        else:
            self.release()

    def delete(self) -> None:
        self.release()
        if self._cleanup is not None:
            self._cleanup()
        else:
            shutil.rmtree(self.folder, ignore_errors=True)


def open_digests(session) -> Digests | None:
    """The session's recall digests, opened (or started) in its folder when recall is on or some are there."""
    files = session.files
    if session.digests is None and files is not None and (session.settings.recall == "on" or
                                                           (files.folder / "digests").is_dir()):
        session.digests = Digests(files.folder, session.model.num_layers, session.model.rotary,
                                  session.settings.archive_mb)
        session.cache.on_compress.append(session.digests.capture)
    if session.digests is not None:
        session.digests.cap_mb = session.settings.archive_mb
        session.digests.activate(session.settings.recall == "on", session.log.n)
    return session.digests


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
    if store is None:  # an unsaved chat: nothing reopens it, so what its digests forgot goes now
        session.pending.clear()
        drop_forgotten(session)
        return
    if session.conversation_id is None and all(m["role"] == "system" for r in session.pending
                                               for m in r["messages"]):
        return  # a conversation is created with its first exchange, not by opening a session
    if session.title is None:
        first = next((m["text"] for r in session.pending for m in r["messages"] if m["role"] == "user"), "")
        session.title = " ".join(first.split())[:60] or "conversation"
    session.files.hold("this conversation")  # a new one: its folder is new, and held before the conversation exists
    write_state(session)
    record["stats"]["disk_bytes"] = session.disk_bytes  # what the conversation keeps beside the database now
    session.conversation_id = store.commit_turns(session.conversation_id, conversation_row(session),
                                                 session.pending, session.pending_settings)
    session.pending, session.pending_settings = [], []
    committed(session)


def write_state(session) -> Path:
    """Make the cache's new rows and the digests durable, then write the slot state after this turn (atomically)."""
    files = session.files
    write_rows(session)
    if session.digests is not None:
        session.digests.sync()
    tensors = session.cache.slot_state()
    if session.observer is not None:
        tensors.update(session.observer.state_tensors())
    tensors["generator"] = session.generator.get_state()
    if session.last_logits is not None:
        tensors["last_logits"] = session.last_logits.float().cpu()
    window = session.digests.window() if session.digests is not None else None
    meta = {"format": FORMAT, "turn": str(session.turn), "total_tokens": str(session.log.n),
            "positions": session.settings.positions, "policy": session.settings.policy,
            "policy_state": json.dumps(session.policy.get_state()), "evicted_total": str(session.evictions.total),
            "digests": json.dumps(window), "settings": json.dumps(asdict(session.settings))}
    return statefile.write(files.folder, session.turn, tensors, meta)


def write_rows(session) -> None:
    """Write the computed key and value of every slot without a row (the turn's new ones) into free rows: none that
    the last committed state, the undo copy or the cache itself names. One copy off the device for all of them."""
    rows, cache = session.files.rows, session.cache
    layers = [layer for layer in cache.layers if layer.is_initialized]
    pending = []
    for layer, host in zip(layers, slab.on_host(layers, {"rows"})):  # every layer's rows read back at once
        heads, j = slab.places(layer.lens)
        used = np.asarray(layer.offs)[heads] + j
        fresh = used[host["rows"].numpy()[used] < 0]
        if fresh.size:
            pending.append((layer, torch.from_numpy(fresh).to(layer.device)))
    if not pending:
        return
    first = pending[0][0]
    if rows.layout is None:
        rows.start(first.keys.shape[-1], first.values.shape[-1], first.dtype)
    named = [session.files.named, cache.rows_named().numpy()]
    if session.undo_copy is not None:
        named.append(session.undo_copy.rows_named())
    count = sum(int(idx.numel()) for _, idx in pending)
    at = RowFile.allocate(count, rows.rows, np.concatenate(named))
    data = torch.cat([torch.cat([(layer.k0 if layer.k0 is not None else layer.keys)[idx], layer.values[idx]], -1)
                      for layer, idx in pending])
    rows.write(at, data)
    start = 0
    for layer, idx in pending:
        layer.rows[idx] = torch.from_numpy(at[start: start + idx.numel()]).to(layer.device)
        start += idx.numel()
    rows.sync()


def committed(session) -> None:
    """After the commit point: the rows the committed state names are the ones to keep; older state files,
    forgotten digest segments (but the undo copy's) and the rows file's free tail go."""
    files = session.files
    files.named = session.cache.rows_named().numpy()
    files.named = files.named[files.named >= 0]
    statefile.remove_others(files.folder, keep=session.turn)
    keep = [files.named] + ([session.undo_copy.rows_named()] if session.undo_copy is not None else [])
    files.rows.shrink(np.concatenate(keep))
    drop_forgotten(session)
    if files.legacy is not None:
        files.legacy.delete()
        files.legacy = None


def drop_forgotten(session) -> None:
    """Delete the digest segments recall's archive forgot, but those the undo copy's window names (an undo brings
    them back; they go at the next commit after it, or when the conversation reopens)."""
    if session.digests is not None:
        undo = session.undo_copy
        session.digests.drop_forgotten(undo.digests if undo is not None else None)


def undo(session, created_conversation: bool) -> None:
    """Take the undone turn out of SQLite and off disk. The state of the turn before is written first, so a crash in
    between reopens either turn exactly."""
    store = session.store
    if store is not None and session.conversation_id is not None:
        if created_conversation:  # the undone turn created the conversation: it goes
            store.delete(session.conversation_id, keep_archive=True)
            session.conversation_id = None
        else:
            write_state(session)
            store.truncate(session.conversation_id, session.turn, conversation_row(session))
            committed(session)


def settings_record(turn: int, old, new) -> dict:
    """A settings change as stored (``Store.record_settings``): at which turn, what changed from ``old`` to ``new``
    (both ``Settings``), the settings after it, when."""
    before = old.as_dict()
    return {"turn": turn, "changes": {k: v for k, v in new.as_dict().items() if before.get(k) != v},
            "settings": new.as_dict(), "created_at": now_iso()}


def record_settings(session, record: dict) -> None:
    """A live settings change: written now if the conversation exists (with the cache state it left: a smaller
    budget compresses at once), else with its first turn; one made while a turn is open (the settings panel while a
    reply streams) is written with that turn, so that the committed turn's state file is never overwritten by a
    cache holding part of a turn (a crash then reopened the conversation from its tokens, not exactly); its settings
    wait on the conversation's row meanwhile, so that a crash before the turn closes loses the turn, not them."""
    if session.store is not None and session.conversation_id is not None and not session.turn_open:
        write_state(session)
        session.store.record_settings(session.conversation_id, record, asdict(session.settings))
        committed(session)
    else:
        session.pending_settings.append(record)
        if session.store is not None and session.conversation_id is not None:  # a crash mid-turn keeps them
            try:
                session.store.record_live_settings(session.conversation_id, asdict(session.settings))
            except StoreError as exc:  # applied all the same: it is stored with the turn, as before
                session.warn("live settings", f"a settings change made during the reply is stored only with it: {exc}")


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
            "archive": session.files.folder.name if session.files is not None and not session.files.temporary
            else None, "live_settings": None, "updated_at": now_iso()}
