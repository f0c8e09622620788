"""What a turn reports, the errors a turn can raise, and the stages of a turn a profiler sees."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
from torch.profiler import record_function

#: The ranges a turn marks for PyTorch's profiler while one runs (``stage``): a profiled turn (the GPU bench's
#: ``turn_profile``) reports each one's host time, where the turn's time goes.
STAGES = {
    "kvchat.message": "a user message read first, its queries kept for recall",
    "kvchat.recall.plan": "recall's scoring and choice, the re-ranking's forward included",
    "kvchat.recall.back": "the chosen text read back, the message read again, the gate, the way back where declined",
    "kvchat.prefill": "a turn's tokens read (all of them without recall; after it, what follows the message)",
    "kvchat.token": "a reply token: the step run ahead on the device, and the host reading the token",
    "kvchat.token.next": "a token the step could not run ahead of, fed once read; the next token picked",
    "kvchat.closing": "the reply's last token and the template's closing tokens read",
    "kvchat.digests": "recall's digests of the turn's sentences",
    "kvchat.commit": "the turn made durable: the new rows, the state file, the database",
}


def stage(name: str):
    """The profiler's range ``name`` (one of ``STAGES``) while a profiler runs, else nothing: a range costs ~5 µs
    even with no profiler, and a reply's every token passes two."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


class ContextFullError(ValueError):
    """The conversation cannot take more tokens without passing the model's position limit."""


class ReadStopped(Exception):
    """A reply was stopped (``Session.cancel``) while its user message was still being read: the session is back as
    it was before the message, nothing of it kept or stored (the message is the caller's to offer again)."""

    def __init__(self, read: int, total: int):
        super().__init__(f"stopped while reading the message ({read:,} of its {total:,} tokens read); nothing of it "
                         "was kept")
        self.read, self.total = read, total


@dataclass
class TurnResult:
    turn: int
    role: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    cache_tokens: int = 0  # positions per layer and head, averaged (cache.mean_length), at the turn's end
    cache_bytes: int = 0
    peak_cache_tokens: int = 0  # the same measure at its highest during the turn (before each compression)
    evicted_tokens: int = 0
    evicted_groups: int = 0
    prefill_ms: float = 0.0
    decode_ms_per_token: float | None = None
    answer: str | None = None
    stopped: str | None = None
    expect: str | None = None
    hit: bool | None = None
    expect_nll: float | None = None
    recalled_tokens: int = 0  # positions recall brought back before this turn's answer
    recalled_groups: int = 0
    recall_ms: float | None = None  # None: recall did not run
    recalled: list[list[int]] = field(default_factory=list)  # [start, end) positions of each recalled group
    #: what recall read back and gave up again (core/recall/gate.py: the message no more predictable with it)
    recall_declined: list[list[int]] = field(default_factory=list)
    recall_gain: float | None = None  # nats per content token of the message the recalled text saved (the gate's)
    archive_bytes: int = 0  # recall's digests on disk after the turn (capped by archive_mb)
    disk_bytes: int | None = None  # everything the conversation keeps beside the database after the turn's commit
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def recall_note(self) -> str | None:
        """What recall did for this turn, in words for the status line; None when it brought nothing to decide."""
        if self.recalled_tokens:
            gain = f", the message {self.recall_gain:.2f} nats/token more predictable" if self.recall_gain else ""
            return f"{self.recalled_tokens} recalled in {self.recall_ms:.0f} ms{gain}"
        if self.recall_declined:
            n = sum(e - s for s, e in self.recall_declined)
            return (f"recall read {n} evicted tokens back and gave them up (the message only "
                    f"{self.recall_gain or 0:.2f} nats/token more predictable) in {self.recall_ms:.0f} ms")
        return None
