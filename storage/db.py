"""SQLite storage (through sqlite-utils): conversations, messages, per-turn stats, eviction events, settings.

WAL mode; everything a completed turn produces is written in one transaction, so a killed process loses at most
the turn in flight and a failed turn leaves nothing half-written. A conversation row is created together with
its first exchange.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
import shutil
import sqlite3
import threading
from pathlib import Path

import sqlite_utils

from . import holding
from .files import tree_size


def now_iso() -> str:
    """The time stamp of a stored row (UTC, milliseconds)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


SCHEMA: dict[str, tuple[dict, list]] = {
    "conversations": ({
        "id": int, "title": str, "model": str, "settings": str, "next_turn": int, "total_tokens": int,
        "kept": str, "seed": int, "snapshot_path": str, "snapshot_turn": int, "created_at": str, "updated_at": str,
        "archive": str, "live_settings": str,
    }, []),
    "messages": ({
        "id": int, "conversation_id": int, "idx": int, "turn": int, "role": str, "text": str, "tokens": str,
        "n_tokens": int, "created_at": str,
    }, [("conversation_id", "idx")]),
    "turn_stats": ({
        "id": int, "conversation_id": int, "turn": int, "role": str, "policy": str, "settings": str,
        "prompt_tokens": int, "new_tokens": int, "cache_tokens": int, "cache_bytes": int, "peak_cache_tokens": int,
        "evicted_tokens": int, "evicted_groups": int, "prefill_ms": float, "decode_ms_per_token": float,
        "stopped": str, "expect": str, "hit": int, "expect_nll": float, "warnings": str, "created_at": str,
        "recalled_tokens": int, "recalled_groups": int, "recall_ms": float, "recalled": str,
        "recall_declined": str, "recall_gain": float, "archive_bytes": int, "disk_bytes": int,
    }, [("conversation_id", "turn")]),
    "eviction_events": ({
        "id": int, "conversation_id": int, "turn": int, "reason": str, "before": int, "after": int,
        "evicted_tokens": int, "evicted_groups": int, "total_tokens": int, "created_at": str,
    }, [("conversation_id", "turn")]),
    "settings_changes": ({
        "id": int, "conversation_id": int, "turn": int, "changes": str, "settings": str, "created_at": str,
    }, [("conversation_id", "turn")]),
}
JSON_FIELDS = {"settings", "live_settings", "kept", "tokens", "warnings", "changes", "recalled", "recall_declined"}
STAT_FIELDS = [c for c in SCHEMA["turn_stats"][0] if c not in ("id", "conversation_id")]


class StoreError(ValueError, sqlite3.OperationalError):
    """The database cannot be read or written: not a database, damaged, read-only, locked by another writer, full.
    One line naming the file and SQLite's reason; the transaction in progress was rolled back. A ValueError, so the
    CLI and the web UI show it as bad input; still an ``sqlite3.OperationalError`` for callers that catch that."""


def _reason(exc: sqlite3.Error) -> str:
    text = " ".join(str(exc).split())
    if "locked" in text or "busy" in text:
        text += " (another program holds a write lock on it; try again when it is done)"
    return text


def guarded(method):
    """One caller at a time (``self._lock``, an ``RLock``), with SQLite's errors turned into a StoreError."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            with self._lock:
                return method(self, *args, **kwargs)
        except sqlite3.Error as exc:
            raise StoreError(f"database {self.path}: {_reason(exc)}") from exc
    return wrapper


def _dump(row: dict) -> dict:
    """A row's JSON fields as JSON text; None stays SQL NULL."""
    return {k: json.dumps(v) if k in JSON_FIELDS and v is not None and not isinstance(v, str) else v
            for k, v in row.items()}


def _load(row: dict) -> dict:
    return {k: json.loads(v) if k in JSON_FIELDS and isinstance(v, str) else v for k, v in row.items()}


class Store:
    def __init__(self, path: str | Path):
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.RLock()
        try:
            self.db = sqlite_utils.Database(sqlite3.connect(path, check_same_thread=False))
        except sqlite3.Error as exc:
            raise StoreError(f"database {path}: {_reason(exc)}") from exc
        try:
            self._open()
        except sqlite3.Error as exc:
            self.db.close()
            raise StoreError(f"database {path}: {_reason(exc)}") from exc

    def _open(self) -> None:
        """WAL mode, and the tables (a database of an older kvchat gets the newer columns)."""
        self.db.enable_wal()
        for name, (columns, indexes) in SCHEMA.items():
            fks = [("conversation_id", "conversations", "id")] if "conversation_id" in columns else None
            table = self.db.table(name)
            table.create(columns, pk="id", foreign_keys=fks, if_not_exists=True)
            for column, kind in columns.items():  # a database from an older kvchat gets the newer columns
                if column not in table.columns_dict:
                    table.add_column(column, kind)
            for cols in indexes:
                table.create_index(list(cols), if_not_exists=True)

    @contextlib.contextmanager
    def _writing(self):
        """One write transaction, its write lock taken first (BEGIN IMMEDIATE): another writer is waited for up to
        SQLite's busy timeout (5 s) instead of failing at once when a read inside the transaction would have to be
        upgraded. Rolled back on any error, so nothing is half-written."""
        conn = self.db.conn
        if conn.in_transaction:  # inside another transaction: a savepoint of it
            with self.db.atomic():
                yield
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise
        conn.commit()

    @guarded
    def close(self) -> None:
        self.db.close()

    # -- writing ----------------------------------------------------------------------------------------------
    @guarded
    def commit_turns(self, conversation_id: int | None, conversation: dict, records: list[dict],
                     settings_changes: list[dict] = ()) -> int:
        """Write completed turns (messages, stats, eviction events) and the conversation state in one transaction."""
        with self._writing():
            conv = self.db.table("conversations")
            if conversation_id is None:
                created = records[0]["stats"]["created_at"] if records else conversation["updated_at"]
                conversation_id = conv.insert(_dump({**conversation, "created_at": created})).last_pk
            else:
                conv.update(conversation_id, _dump(conversation))
            for record in records:
                self.db.table("messages").insert_all(
                    _dump({**m, "conversation_id": conversation_id, "n_tokens": len(m["tokens"])})
                    for m in record["messages"]
                )
                stats = {k: record["stats"].get(k) for k in STAT_FIELDS}
                self.db.table("turn_stats").insert(_dump({**stats, "conversation_id": conversation_id}))
                self.db.table("eviction_events").insert_all(
                    {**e, "conversation_id": conversation_id} for e in record["events"]
                )
            for change in settings_changes:
                self.db.table("settings_changes").insert(_dump({**change, "conversation_id": conversation_id}))
        return conversation_id

    @guarded
    def record_settings(self, conversation_id: int, change: dict, settings: dict) -> None:
        """A settings change (``change``: its record, the settings it left as they resolve) and the conversation's
        settings as set (what a reopen takes: a window left to the budget stays so)."""
        with self._writing():
            self.db.table("settings_changes").insert(_dump({**change, "conversation_id": conversation_id}))
            self.db.table("conversations").update(conversation_id, _dump({"settings": settings,
                                                                          "live_settings": None}))

    @guarded
    def record_live_settings(self, conversation_id: int, settings: dict) -> None:
        """The conversation's settings as set by a change made while a turn is open: the change is written with the
        turn as it closes (``record_settings``), and until then its settings wait on the conversation's row
        (``live_settings``; cleared by every later write of the row), so that a crash mid-turn reopens the
        conversation as the person left it (``Session.resume``)."""
        with self._writing():
            self.db.table("conversations").update(conversation_id, _dump({"live_settings": settings}))

    @guarded
    def truncate(self, conversation_id: int, turn: int, conversation: dict) -> None:
        """Remove turn ``turn`` and later (undo), in one transaction with the conversation's new state. Settings
        changes made after those turns stay; they now precede turn ``turn``."""
        with self._writing():
            for table in ("messages", "turn_stats", "eviction_events"):
                self.db.execute(f"DELETE FROM {table} WHERE conversation_id = ? AND turn >= ?", [conversation_id, turn])
            self.db.execute("UPDATE settings_changes SET turn = ? WHERE conversation_id = ? AND turn > ?",
                            [turn, conversation_id, turn])
            self.db.table("conversations").update(conversation_id, _dump(conversation))

    @guarded
    def rename(self, conversation_id: int, title: str) -> None:
        row = self.conversation(conversation_id)
        if not title.strip():
            raise ValueError("title is empty")
        with self._held(row), self._writing():  # refused while another process has it open: it would write its title
            self.db.table("conversations").update(conversation_id, {"title": title.strip()})

    def check_openable(self, conversation_id: int) -> dict:
        """Conversation ``conversation_id``'s row; ValueError if it is not stored here or another process has it open,
        holding nothing (``holding.check``: a refusal before a slow start; opening it checks again)."""
        row = self.conversation(conversation_id)
        if (folder := self._folder(row)) is not None:
            holding.check(folder, f"conversation {row['id']}")
        return row

    def _held(self, row: dict):
        """Conversation ``row`` held by this process for a block (storage/holding.py): ValueError if another process
        has it open."""
        folder = self._folder(row)
        return contextlib.nullcontext() if folder is None else holding.held(folder, f"conversation {row['id']}")

    def _folder(self, row: dict) -> Path | None:
        """Conversation ``row``'s folder, where it has one on disk (one that has none yet is held by no process)."""
        folder = self.archive_folder(row["archive"]) if row.get("archive") else None
        return folder if folder is not None and folder.is_dir() else None

    def archive_folder(self, name: str) -> Path:
        """The folder a conversation keeps beside the database: its cache's rows, state file and recall's digests."""
        return self.path.parent / "archive" / name

    @guarded
    def delete(self, conversation_id: int, keep_archive: bool = False) -> None:
        """Delete a conversation with (unless ``keep_archive``) its archive; a cache snapshot of an older kvchat
        goes too."""
        row = self.conversation(conversation_id)
        with self._held(row):  # refused while another process has it open; no process opens it while it goes
            with self._writing():
                for table in ("messages", "turn_stats", "eviction_events", "settings_changes"):
                    self.db.execute(f"DELETE FROM {table} WHERE conversation_id = ?", [conversation_id])
                self.db.execute("DELETE FROM conversations WHERE id = ?", [conversation_id])
            if row.get("snapshot_path"):
                Path(row["snapshot_path"]).unlink(missing_ok=True)
            if row.get("archive") and not keep_archive:
                shutil.rmtree(self.archive_folder(row["archive"]), ignore_errors=True)

    # -- reading ----------------------------------------------------------------------------------------------
    @guarded
    def has(self, conversation_id: int) -> bool:
        return bool(list(self.db.query("SELECT 1 FROM conversations WHERE id = ?", [conversation_id])))

    @guarded
    def conversation(self, conversation_id: int) -> dict:
        rows = list(self.db.query("SELECT * FROM conversations WHERE id = ?", [conversation_id]))
        if not rows:
            raise ValueError(f"no conversation {conversation_id} in {self.path}")
        return _load(rows[0])

    @guarded
    def conversations(self, search: str = "", limit: int | None = None) -> list[dict]:
        """The stored conversations, the last used first, each with its message count and what it keeps beside the
        database (``disk_bytes``): those whose title or any message contains ``search`` (``_matching``), at most
        ``limit`` of them. Their ``settings`` are those a reopen takes (a change made during a turn a crash cut short
        included: ``record_live_settings``)."""
        where, params = _matching(search)
        sql = f"""SELECT c.id, c.title, c.model, COALESCE(c.live_settings, c.settings) AS settings,
                         c.total_tokens, c.next_turn, c.created_at, c.updated_at,
                         c.archive, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS messages
                  FROM conversations c {where} ORDER BY c.updated_at DESC, c.id DESC"""
        if limit is not None:
            sql, params = sql + " LIMIT ?", params + [limit]
        rows = [_load(r) for r in self.db.query(sql, params)]
        for r in rows:  # what each keeps beside the database: its cache's rows, state file and recall's digests
            r["disk_bytes"] = tree_size(self.archive_folder(r["archive"])) if r.get("archive") else 0
        return rows

    @guarded
    def conversation_count(self, search: str = "") -> int:
        """How many stored conversations ``conversations(search)`` lists without a limit."""
        where, params = _matching(search)
        return self.db.execute(f"SELECT COUNT(*) FROM conversations c {where}", params).fetchone()[0]

    def _rows(self, table: str, conversation_id: int, order: str, after_id: int = 0) -> list[dict]:
        sql = f"SELECT * FROM {table} WHERE conversation_id = ? AND id > ? ORDER BY {order}"
        return [_load(r) for r in self.db.query(sql, [conversation_id, after_id])]

    @guarded
    def messages(self, conversation_id: int) -> list[dict]:
        return self._rows("messages", conversation_id, "idx")

    @guarded
    def turn_stats(self, conversation_id: int, after_id: int = 0) -> list[dict]:
        """The conversation's turn statistics in turn order; those stored after row ``after_id`` (the rows a later
        commit adds have larger ids and later turns)."""
        return self._rows("turn_stats", conversation_id, "turn, id", after_id)

    @guarded
    def turn_stats_count(self, conversation_id: int, upto_id: int) -> int:
        """How many of the conversation's turn statistics rows up to row ``upto_id`` are stored (fewer than were
        read: an undo took turns back)."""
        sql = "SELECT COUNT(*) FROM turn_stats WHERE conversation_id = ? AND id <= ?"
        return self.db.execute(sql, [conversation_id, upto_id]).fetchone()[0]

    @guarded
    def eviction_events(self, conversation_id: int) -> list[dict]:
        return self._rows("eviction_events", conversation_id, "id")

    @guarded
    def settings_changes(self, conversation_id: int) -> list[dict]:
        return self._rows("settings_changes", conversation_id, "id")


def _matching(search: str) -> tuple[str, list]:
    """The WHERE clause (and its parameters) of the conversations whose title or any message contains ``search``,
    its spaces at either end left out and LIKE's wildcards in it taken as themselves; SQLite's LIKE ignores the case
    of ASCII letters only. Nothing for an empty search: all of them."""
    text = search.strip()
    if not text:
        return "", []
    pattern = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    return ("WHERE c.title LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id = c.id "
            "AND m.text LIKE ? ESCAPE '\\')", [pattern, pattern])
