"""What a turn reports, and the errors a turn can raise."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


class ContextFullError(ValueError):
    """The conversation cannot take more tokens without passing the model's position limit."""


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
