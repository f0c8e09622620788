"""Cache settings of a session: which policy, how many positions, how they are grouped and positioned.

Everything here can change on a live session; ``validate`` checks a combination before any of it is applied.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..policies import make_policy, policy_class
from .groups import AGGREGATES, GROUP_MODES
from .positions import POSITION_MODES


def max_slack(budget: int) -> int:
    """The largest overshoot allowed above the budget: max(64, budget/8) positions."""
    return max(64, budget // 8)


@dataclass(frozen=True)
class Settings:
    policy: str = "streaming"
    params: dict = field(default_factory=dict)
    budget: int = 1024  # cached positions per layer
    sink: int = 4
    window: int | None = None  # protected recent tokens; None: budget // 4
    slack: int | None = None  # compression starts at budget + slack; None: max(64, budget/8)
    groups: str = "token"
    positions: str = "rerotate"
    aggregate: str = "mean"  # how token scores become a group score

    # -- derived ----------------------------------------------------------------------------------------------
    @property
    def window_tokens(self) -> int:
        return self.budget // 4 if self.window is None else self.window

    @property
    def slack_tokens(self) -> int:
        return max_slack(self.budget) if self.slack is None else self.slack

    @property
    def capacity(self) -> int:
        return self.budget + self.slack_tokens

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["window"] = self.window_tokens
        d["slack"] = self.slack_tokens
        return d

    def changed(self, **changes: Any) -> "Settings":
        """A copy with ``changes`` applied; policy parameters are reset when the policy changes."""
        if "policy" in changes and changes["policy"] != self.policy and "params" not in changes:
            changes["params"] = {}
        return replace(self, **changes)

    def validate(self, max_positions: int, rotary_error: str | None = None) -> None:
        """ValueError with a one-line reason if this combination cannot run."""
        cls = policy_class(self.policy)
        make_policy(self.policy, **self.params)
        if self.groups not in GROUP_MODES:
            raise ValueError(f"groups must be one of {', '.join(GROUP_MODES)}, got {self.groups!r}")
        if self.positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {', '.join(POSITION_MODES)}, got {self.positions!r}")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {', '.join(AGGREGATES)}, got {self.aggregate!r}")
        if self.positions == "rerotate" and rotary_error:
            raise ValueError(rotary_error)
        for name in ("budget", "sink"):
            if getattr(self, name) < (1 if name == "budget" else 0):
                raise ValueError(f"{name} must be {'positive' if name == 'budget' else '>= 0'}")
        if self.window_tokens < 0:
            raise ValueError("window must be >= 0")
        if not cls.bounded:
            return
        if self.budget < self.sink + self.window_tokens:
            raise ValueError(
                f"budget ({self.budget}) must be at least sink + window ({self.sink} + {self.window_tokens})"
            )
        if not 1 <= self.slack_tokens <= max_slack(self.budget):
            raise ValueError(f"slack must be between 1 and {max_slack(self.budget)} for budget {self.budget}")
        if self.positions == "rerotate" and self.capacity > max_positions:
            raise ValueError(
                f"budget + slack ({self.capacity}) exceeds the model's {max_positions} positions"
            )
