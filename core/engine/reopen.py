"""Reopening a stored conversation with the cache its last completed turn left (``Session.resume``).

Three ways, the first that applies:

* **exactly** (``restored_from == "archive"``): the state file of the committed turn names, per slot, the row of
  its computed key and value (storage/kvrows.py) and where the key was computed; every key is rotated once from
  there to its slot, as a compression does, so the cache is the live one, tensor for tensor. What a crash left past
  the committed turn (digests, state files) is cut back first;
* **from an old archive** (conversations stored by kvchat before the bounded storage, storage/legacy.py): the same,
  reading the keys and values by position from the old archive; its digests are carried over, and the next commit
  writes the new form (the old files go once it has);
* **from the tokens** (``restored_from == "tokens"``; a conversation without either, or ``exact=False``): the
  tokens the cache kept are prefilled again.
"""

from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import torch

from ...storage import statefile
from ...storage.legacy import LegacyArchive
from ..recall.digest import Digests
from ..cache import compress
from ..model.names import check_held_by
from . import persist
from .settings import Settings
from .turns import TurnResult


def resume(cls, model, store, conversation_id: int, exact: bool = True, sampling=None, undo: bool = False):
    """Reopen stored conversation ``conversation_id`` as a ``cls`` session (see ``Session.resume``)."""
    conv = store.conversation(conversation_id)
    check_held_by(conversation_id, conv["model"], model.name)
    settings = Settings.from_dict(conv["settings"])
    folder = store.archive_folder(conv["archive"]) if conv.get("archive") else None
    later = _later_settings(folder, conv["next_turn"], settings) if exact else None
    session = cls(model, later or settings, system=None, store=store, sampling=sampling, seed=conv["seed"] or 0,
                  title=conv["title"], undo=undo, folder=folder)
    session.conversation_id = conversation_id
    if later is not None:  # written with the next commit, as a change made before a conversation exists is
        session.pending_settings.append(persist.settings_record(conv["next_turn"], settings, later))
    try:
        if folder is not None and folder.is_dir():  # another process with it open would write under us (a missing
            session.files.hold(f"conversation {conversation_id}")  # folder is made, and held, by the next commit)
            store.conversation(conversation_id)  # not deleted meanwhile (a delete holds it while it goes)
        _read(session, store, conv, folder, exact)
        if conv.get("live_settings"):  # changed while a turn was open that never closed (a crash): changed again
            set_as(session, Settings.from_dict(conv["live_settings"]))
        return session
    except BaseException:
        session.close()  # the conversation given back at once
        raise


def _later_settings(folder, turn: int, stored: Settings) -> Settings | None:
    """The settings the committed turn's state file was written under where they differ from the database's: a live
    change writes its state file, then its row, and a crash between the two left the cache as the change made it.
    The state file is the later word (under the database's settings the cache would be read under settings it was
    not made with, or, for a change of positions, not at all)."""
    meta = statefile.metadata(folder, turn) if folder is not None and folder.is_dir() else None
    if not meta or not meta.get("settings"):
        return None
    written = Settings.from_dict(json.loads(meta["settings"]))
    return written if written != stored else None


def _read(session, store, conv: dict, folder, exact: bool):
    """The stored conversation ``conv`` into ``session``: its messages, statistics and cache."""
    conversation_id, model = conv["id"], session.model
    segments, turns = [], []
    for m in store.messages(conversation_id):
        idx = session.new_message(m["role"], m["text"])
        segments.append((m["tokens"], idx, m["role"]))
        turns.append(m["turn"])
        if idx == 0 and m["role"] == "system":
            session.system_tokens = len(m["tokens"])
    session.log.append_messages(model.tokenizer, segments, turns)  # at once (a call a message: 1 s of 6,000)
    session.turn = conv["next_turn"]
    session.generator.manual_seed(session.seed + session.turn)
    stat_fields = {f.name for f in fields(TurnResult)}
    session.history.extend(TurnResult(**{k: v for k, v in row.items() if k in stat_fields})
                           for row in store.turn_stats(conversation_id))
    session.evictions.total = sum(r.evicted_tokens for r in session.history)
    if folder is not None and exact and _load_state(session):
        session.restored_from = "archive"
        return session
    if folder is not None and LegacyArchive.present(folder):  # not the exact state: its files go at the next commit
        session.files.legacy = LegacyArchive(folder, model.num_layers)
    kept = [p for a, b in conv["kept"] or [] for p in range(a, b)]
    rebuild(session, torch.tensor(kept, dtype=torch.long))
    session.restored_from = "tokens"
    return session


def after_failure(session):
    """The session a turn that failed midway leaves (see ``Session.reopened``)."""
    if session.store is None:
        raise ValueError("a conversation without a database cannot be reopened after a failed turn")
    session.close()
    model, store, cls = session.model, session.store, type(session)
    if session.conversation_id is None:  # the first exchange failed: nothing was stored
        system = session.messages[0]["content"] if session.messages and session.messages[0]["role"] == "system" \
            else None
        return cls(model, session.settings, system=system, store=store, sampling=session.sampling, seed=session.seed,
                   title=session.title, undo=session.undo_enabled)
    fresh = resume(cls, model, store, session.conversation_id, sampling=session.sampling, undo=session.undo_enabled)
    set_as(fresh, session.settings)  # settings changed since the last saved turn: changed again, as they were left
    return fresh


def set_as(session, settings: Settings) -> None:
    """Change ``session``'s settings to ``settings`` as a live change does (``configure``: recorded, a smaller budget
    compressing at once), where they differ (``Settings.changes_to``: a parameter back at its default included)."""
    changes = session.settings.changes_to(settings)
    if changes:
        session.configure(**changes)


def _load_state(session) -> bool:
    """Restore the cache exactly from the committed turn's state file; whether it could."""
    files, model = session.files, session.model
    meta = statefile.metadata(files.folder, session.turn)
    if meta is None or int(meta.get("total_tokens", -1)) != session.log.n or \
            meta.get("positions") != session.settings.positions:
        return False
    legacy = meta.get("format") != persist.FORMAT
    if legacy and not LegacyArchive.present(files.folder):
        return False
    tensors = statefile.read(files.folder, session.turn)
    original = session.settings.positions == "original"
    if legacy:
        _load_legacy(session, tensors, original)
    else:
        dims = files.rows.layout

        def read(layer: int, rows: torch.Tensor) -> torch.Tensor:
            return files.rows.read(rows.reshape(-1).numpy()).view(*rows.shape, -1)

        session.cache.load_slot_state(tensors, read, model.rotary, original, model.device, model.dtype,
                                      (dims[0], dims[1]) if dims else (0, 0))
        files.named = session.cache.rows_named().numpy()
        files.named = files.named[files.named >= 0]
        window = json.loads(meta.get("digests") or "null")
        if window is not None and persist.open_digests(session) is not None:
            session.digests.restore(*window)
        if LegacyArchive.present(files.folder):  # moved to the new form, its old files not deleted yet: next commit
            files.legacy = LegacyArchive(files.folder, model.num_layers)
    if session.observer is not None:
        session.observer.load_state_tensors(tensors, model.device)
    if meta.get("policy") == session.settings.policy and meta.get("policy_state"):
        session.policy.set_state(json.loads(meta["policy_state"]))
    session.generator.set_state(tensors["generator"])
    if "last_logits" in tensors:
        session.last_logits = tensors["last_logits"].to(device=model.device, dtype=model.dtype)
    session.evictions.total = int(meta["evicted_total"])
    return True


def _load_legacy(session, tensors: dict[str, torch.Tensor], original: bool) -> None:
    """A conversation of the old archive: each slot's computed key and value read by position, the per-slot
    statistics (saved whole per layer then) cut per head; its digests quantized into the new store. The slots have
    no rows yet: the next commit writes them, and the old files go after it (``persist.committed``)."""
    model, files = session.model, session.files
    old = LegacyArchive(files.folder, model.num_layers)
    heads_n, kdim, vdim, dtype = old.layout
    converted = {}
    for i in range(model.num_layers):
        if f"{i}.caps" not in tensors:
            continue
        caps = tensors[f"{i}.caps"].tolist()
        offs = np.concatenate([[0], np.cumsum(caps)[:-1]]).tolist()
        converted[f"{i}.caps"], converted[f"{i}.pos_off"] = tensors[f"{i}.caps"], tensors[f"{i}.pos_off"]
        for h in range(len(caps)):
            held = tensors[f"{i}.{h}.abs_pos"].long()
            n = held.numel()
            converted[f"{i}.{h}.abs_pos"] = held.to(torch.int32)
            data, computed = old.read(i, held[None], [h])
            converted[f"{i}.{h}.computed"] = computed[0].to(torch.int32)
            converted[f"{i}.{h}.rows"] = torch.full((n,), -1, dtype=torch.int64)
            converted[f"{i}.{h}.legacy"] = data[0]
            for key, t in tensors.items():
                if key.startswith(f"{i}.stat."):
                    converted[f"{i}.{h}.stat.{key[len(f'{i}.stat.'):]}"] = t[offs[h]: offs[h] + n]

    def read(layer: int, rows: torch.Tensor) -> torch.Tensor:
        heads, width = rows.shape
        return torch.stack([torch.nn.functional.pad(converted[f"{layer}.{h}.legacy"],
                                                    (0, 0, 0, width - converted[f"{layer}.{h}.legacy"].shape[0]))
                            for h in range(heads)])

    session.cache.load_slot_state({k: v for k, v in converted.items() if not k.endswith(".legacy")}, read,
                                  model.rotary, original, model.device, dtype, (kdim, vdim))
    found = old.digests()
    if (files.folder / "digests").is_dir():  # carried over by an earlier reopening whose turn never committed
        Digests(files.folder, model.num_layers, model.rotary, session.settings.archive_mb).delete()
    if found is not None and persist.open_digests(session) is not None:
        spans, reps, layers = found
        if layers == session.digests.layers and len(spans):
            session.digests.append(torch.from_numpy(reps.astype(np.float32)), torch.from_numpy(spans).long())
            session.digests.covered = int(spans[-1, 1])
    files.legacy = old


def rebuild(session, positions: torch.Tensor) -> None:
    """Prefill the tokens at ``positions`` (absolute, ascending) into an empty cache."""
    tokens = session.log.column("token")[positions].long()
    total, i = session.evictions.total, 0
    while i < positions.numel():  # per-head policies keep a union of positions that may pass the budget
        c = compress.make_room(session, positions.numel() - i)
        session.forward(tokens[i: i + c], positions[i: i + c])
        i += c
    session.evictions.events, session.evictions.total = [], total  # a rebuild's own compressions are not the chat's

