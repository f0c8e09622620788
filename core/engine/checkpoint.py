"""The state of a session before a turn, so ``undo()`` can put it back exactly.

``Checkpoint.capture`` and ``Checkpoint.restore`` are the one place that lists what a turn changes: the kept KV
and what indexes it (observer queries, token log length, sentence numbering), the messages, the counters, the
records not yet written, the policy's learned state and the sampling generator. A new piece of turn state gets a
field here, or undo would not take it back.

``ReadMark`` and ``TailMark`` are the marks recall takes while it first reads a user message, where its last
``budget`` tokens start (the whole message when it is shorter), to forget the read from there and read those tokens
again after putting text back. Where the rest of the message is read without a compression, reading it only
appends (tokens, the statistics and observer window it adds to, the logits), so a ``ReadMark`` marks only that; a
new piece of state that feeding a message changes gets a field there too. Otherwise a ``TailMark`` copies the whole
session (a ``Checkpoint``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from ...policies import make_policy
from ..cache import compress, snapshot
from ..cache.compress import Evictions
from .settings import Settings


@dataclass
class Checkpoint:
    settings: Settings
    policy_state: dict
    capacity: int | None
    cache: snapshot.CacheCopy
    observer: dict[str, torch.Tensor]
    log_n: int
    sentence: tuple[int, bool]
    messages: list[dict]
    turn: int
    history: list  # the turns' results
    evictions: Evictions
    system_tokens: int
    last_logits: torch.Tensor | None
    warned: set[str]
    warnings: list[str]  # the open turn's, given as it closes: those of a read taken back are not (with ``warned``)
    pending: list[dict]
    pending_settings: list[dict]
    title: str | None
    conversation_id: int | None
    generator: torch.Tensor
    digests: tuple[int, int, int] | None  # recall's digest window (first, end, covered)
    log: object = None  # a copy of the token log (``whole``), where restoring may go forward in time


    @classmethod
    def capture(cls, session, whole: bool = False) -> "Checkpoint":
        """A copy of the kept KV and of everything that indexes it. ``whole``: the token log copied too (a redo
        copy, which puts back a session that lost tokens since, where an undo copy only cuts the log back)."""
        observer = session.observer
        return cls(
            settings=session.settings, policy_state=copy.deepcopy(session.policy.get_state()),
            capacity=session.cache.capacity,
            cache=snapshot.take(session.cache),
            observer={k: t.clone() for k, t in observer.state_tensors().items()} if observer is not None else {},
            log_n=session.log.n, sentence=session.log.sentence, messages=[dict(m) for m in session.messages],
            turn=session.turn, history=list(session.history), evictions=copy.deepcopy(session.evictions),
            system_tokens=session.system_tokens, last_logits=session.last_logits, warned=set(session.warned),
            warnings=list(session._warnings),
            pending=list(session.pending), pending_settings=list(session.pending_settings), title=session.title,
            conversation_id=session.conversation_id, generator=session.generator.get_state(),
            digests=session.digests.window() if session.digests is not None else None,
            log=copy.deepcopy(session.log) if whole else None,
        )

    def restore(self, session) -> list[dict]:
        """Put the session back as it was at capture (the caller re-applies settings changed since); returns the
        messages that were added after it."""
        model = session.model
        removed = session.messages[len(self.messages):]
        session.settings, session.policy = self.settings, make_policy(self.settings.policy, **self.settings.params)
        session.policy.set_state(self.policy_state)
        cache = session.cache  # written back in place where it can be (the graph step's capture over it stays valid)
        held = self.cache.layers
        if cache.capacity != self.capacity or any(layer.is_initialized and i not in held
                                                  for i, layer in enumerate(cache.layers)):
            session.cache = cache = session.new_cache(self.capacity)
        self.cache.put_back(cache)
        session.observer = session.make_observer(session.policy)
        if session.observer is not None and self.observer:
            session.observer.load_state_tensors(self.observer, model.device)
        if self.log is not None:
            session.log = copy.deepcopy(self.log)
        else:
            session.log.truncate(self.log_n, self.sentence)
        session.messages, session.turn = self.messages, self.turn
        session.history[:] = self.history
        session.evictions = self.evictions
        session.system_tokens, session.last_logits, session.warned = self.system_tokens, self.last_logits, self.warned
        session._warnings = list(self.warnings)
        session.pending, session.pending_settings = self.pending, self.pending_settings
        session.title = self.title
        session.generator.set_state(self.generator)
        if session.digests is not None and self.digests is not None:
            session.digests.rewind(*self.digests)
        return removed

    def rows_named(self) -> np.ndarray:
        """The storage rows the copy's slots name (core/engine/persist.py keeps them until the copy is gone)."""
        return self.cache.rows_named()


@dataclass
class ReadMark:
    """The session before ``tokens`` tokens are read, when reading them can only append: no compression (and no
    reallocation) runs while they are fed, so nothing is staged for recall's digests either. ``restore`` forgets the
    read: each head's length, the per-slot statistics the read added to, the observer's query window, the token log
    (to where it was at the mark) and the last logits. ``at``: where in its message the mark was taken; ``ms``: what
    taking it cost."""

    lens: list[list[int]]
    stats: list[dict[str, torch.Tensor]]
    observer: tuple | None
    log_n: int
    sentence: tuple[int, bool]
    last_logits: torch.Tensor | None
    at: int = 0
    ms: float = 0.0

    @classmethod
    def capture(cls, session, tokens: int, more: int = 0) -> "ReadMark | None":
        """The mark before ``tokens`` tokens (then ``more`` in the same turn) are read, or None when reading them
        could compress the cache."""
        cache, observer = session.cache, session.observer
        layers = cache.layers
        if not session.policy.bounded or not all(layer.is_initialized for layer in layers) or \
                not compress.reads_without_compressing(session, tokens, more):
            return None
        return cls(
            lens=[list(layer.lens) for layer in layers],
            stats=[{name: t.clone() for name, t in layer.stats.items()} for layer in layers],
            observer=observer.mark() if observer is not None else None,
            log_n=session.log.n, sentence=session.log.sentence, last_logits=session.last_logits,
        )

    def restore(self, session) -> None:
        for layer, lens, stats in zip(session.cache.layers, self.lens, self.stats):
            layer.lens = lens
            for name, t in layer.stats.items():
                if name in stats:
                    t.copy_(stats[name])
                else:  # a statistic the read started: nothing held before it had any
                    t.zero_()
        if self.observer is not None:
            session.observer.restore(self.observer)
        session.log.truncate(self.log_n, self.sentence)
        session.last_logits = self.last_logits


@dataclass
class TailMark:
    """The session part way through reading a message whose rest may compress the cache: a copy of all of it, and of
    what recall's digests staged so far (a compression stages the keys it drops). ``at``, ``ms``: as ``ReadMark``'s.
    Recall puts its text back there and reads only the rest again: the part of the message the cache can still hold
    at its end is computed with the recalled text before it; the earlier part, evicted or scored by the policy on
    the first read, is not read twice."""

    checkpoint: Checkpoint
    stage: object  # recall's staged keys (core/recall/digest.py) at the mark
    at: int = 0
    ms: float = 0.0

    @classmethod
    def capture(cls, session) -> "TailMark":
        return cls(Checkpoint.capture(session),
                   copy.deepcopy(session.digests.stage) if session.digests is not None else None)

    def restore(self, session) -> None:
        """Back to the mark (once: the staged keys are handed over)."""
        self.checkpoint.restore(session)
        if session.digests is not None:
            session.digests.stage, self.stage = self.stage, None
