"""Engine sessions of the web UI: one per browser session, all on the one loaded model, within caps.

Each browser tab (Gradio session) gets its own ``Session`` and cache. The manager bounds how many exist at once
and how many cache bytes they may reserve: a bounded session reserves budget + slack positions, with what its
policy keeps per slot and its query window (twice: the undo copy of the last turn), an unbounded one (``full``) the
model's max positions. A conversation is held by one tab at a time; opening it in a second tab moves it there (its
cache restored exactly from what its last turn stored).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..core.model.loading import ChatModel
from ..core.engine.session import ContextFullError, Sampling, Session
from ..core.engine.settings import Settings
from ..storage.db import Store
from .views import StoredTurns


class CapacityError(RuntimeError):
    """The server has no room for another session or a larger cache."""


#: What a handler shows as a visible error instead of raising (OSError: the disk refused, full or read-only).
USER_ERRORS = (ValueError, ContextFullError, CapacityError, OSError)


@dataclass
class Entry:
    session: Session
    rss_mb: dict[int, float] = field(default_factory=dict)  # turn -> memory after it (GPU allocated on CUDA, else RSS)
    stored: StoredTurns = field(default_factory=StoredTurns)  # the charts' turn statistics, read as they are stored
    busy: bool = False  # a reply is streaming
    #: the status line New or Open drew for it, set as they end (``after_reply`` draws it again after a stopped
    #: reply's late updates); None before
    said: str | None = None
    #: what settings changes made while a reply streamed said (their status line, which the reply's later updates
    #: draw over): repeated in the reply's last status
    during_reply: list[str] = field(default_factory=list)


class SessionManager:
    def __init__(self, model: ChatModel, store: Store, settings: Settings, sampling: Sampling,
                 system: str | None = "default", max_sessions: int = 8, max_cache_bytes: int = 2 << 30):
        if max_sessions < 1:
            raise ValueError("max sessions must be >= 1")
        if max_cache_bytes < 1:
            raise ValueError("the cache memory cap must be positive")
        settings.validate(model.max_positions, model.rotary_error)
        self.model, self.store = model, store
        self.settings, self.sampling, self.system = settings, sampling.validate(), system
        self.max_sessions, self.max_cache_bytes = max_sessions, max_cache_bytes
        self.entries: dict[str, Entry] = {}
        self.moved: set[str] = set()  # tabs whose conversation was opened in another tab
        self._lock = threading.RLock()
        self._probes: dict[tuple, tuple[int, int]] = {}  # policy and parameters -> ``_probe``

    # -- accounting -----------------------------------------------------------------------------------------------
    def per_position_bytes(self, settings: Settings | None = None) -> int:
        """Cache bytes per position over all layers, with what ``settings``' policy keeps per slot (H2O's attention
        received); the plain cache's without settings."""
        return self._probe(settings or Settings(policy="full"))[0]

    def _probe(self, settings: Settings) -> tuple[int, int]:
        """(bytes per cached position, bytes of the policy's query window) of a session with ``settings``, measured
        once per policy and parameters on a probe session fed the window's length of tokens."""
        key = (settings.policy, repr(sorted(settings.params.items())))
        with self._lock:
            if key not in self._probes:
                probe = Session(self.model, settings.changed(recall="off"), system=None)
                window = probe.observer.window if probe.observer is not None else 0
                probe.feed_raw([self.model.tokenizer.eos_token_id or 0] * (window + 1), score=False)
                state = probe.observer.state_tensors().values() if window else ()
                self._probes[key] = (probe.cache.bytes_per_position, sum(t.numel() * t.element_size() for t in state))
            return self._probes[key]

    def reserve(self, settings: Settings) -> int:
        """Bytes a session with ``settings`` may come to hold, twice (its cache and the undo copy): budget + slack
        positions (a ``full`` cache: the model's) with its policy's statistics per slot, and its query window."""
        per_position, window = self._probe(settings)
        positions = settings.capacity if settings.bounded else self.model.max_positions
        return 2 * (positions * per_position + window)

    def reserved(self, exclude: str | None = None) -> int:
        with self._lock:
            return sum(self.reserve(e.session.settings) for k, e in self.entries.items() if k != exclude)

    def check_room(self, key: str, settings: Settings, new: bool) -> None:
        """CapacityError with a one-line reason if ``key`` cannot hold a session with ``settings``."""
        with self._lock:
            if new and key not in self.entries and len(self.entries) >= self.max_sessions:
                raise CapacityError(f"kvchat is full: {len(self.entries)} chat sessions are open (the server allows "
                                    f"{self.max_sessions}); close a tab or try again later")
            need, used = self.reserve(settings), self.reserved(exclude=key)
            if used + need > self.max_cache_bytes:
                raise CapacityError(
                    f"not enough cache memory: this session needs {need / 2**20:.0f} MB, "
                    f"{(self.max_cache_bytes - used) / 2**20:.0f} MB of the server's "
                    f"{self.max_cache_bytes / 2**20:.0f} MB are free; choose a smaller budget or try again later")

    # -- sessions -------------------------------------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        with self._lock:
            return self.entries.get(key)

    def entry(self, key: str, settings: Settings | None = None) -> Entry:
        """The tab's session, created (a new conversation) if it has none."""
        with self._lock:
            if key in self.entries:
                return self.entries[key]
            return self.new(key, settings)

    def new(self, key: str, settings: Settings | None = None, system: str | None = None) -> Entry:
        """Start a new conversation in tab ``key`` (replacing the one it held)."""
        settings = settings or (self.entries[key].session.settings if key in self.entries else self.settings)
        with self._lock:
            self.check_room(key, settings, new=True)
            session = Session(self.model, settings, system=self.system if system is None else (system or None),
                              store=self.store, sampling=self._sampling(key), undo=True)
            self._drop(key)
            self.entries[key] = Entry(session)
            self.moved.discard(key)
            return self.entries[key]

    def open(self, key: str, conversation_id: int) -> Entry:
        """Continue a stored conversation in tab ``key``, its cache restored."""
        with self._lock:
            conv = self.store.conversation(conversation_id)
            holder = next((k for k, e in self.entries.items() if e.session.conversation_id == conversation_id), None)
            if holder == key:
                return self.entries[key]
            if holder is not None:
                if self.entries[holder].busy:
                    raise CapacityError("that conversation is generating a reply in another tab; wait for it to end")
            settings = Settings.from_dict(conv["settings"])
            self.check_room(key, settings, new=holder is None)
            if holder is not None:
                self.release(holder)
                self.moved.add(holder)
            sampling = self._sampling(key)
            session = Session.resume(self.model, self.store, conversation_id, sampling=sampling, undo=True)
            self._drop(key)
            self.entries[key] = Entry(session)
            self.moved.discard(key)
            return self.entries[key]

    def recover(self, key: str) -> Entry:
        """The tab's session after its turn failed midway: reopened at its last saved turn (``Session.reopened``)."""
        with self._lock:
            entry = self.entries[key]
            entry.session = entry.session.reopened()
            return entry

    def release(self, key: str) -> None:
        """The tab closed: free its session (every completed turn, cache included, is already stored)."""
        with self._lock:
            self._drop(key)
            self.moved.discard(key)

    def _drop(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        entry.session.close()

    def _sampling(self, key: str) -> Sampling:
        """The sampling settings a new session in tab ``key`` starts with: those of the tab's session (frozen, so
        shared safely), else the server's."""
        entry = self.entries.get(key)
        return entry.session.sampling if entry else self.sampling

    def holder(self, conversation_id: int) -> str | None:
        with self._lock:
            return next((k for k, e in self.entries.items() if e.session.conversation_id == conversation_id), None)

    def close(self) -> None:
        with self._lock:
            for key in list(self.entries):
                self._drop(key)
