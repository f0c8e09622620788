"""The settings of a session, declared once: what the cache keeps (``Settings``) and how replies are sampled
(``Sampling``).

Each setting is a ``Param`` in ``CACHE_SETTINGS`` or ``SAMPLING_SETTINGS``; the CLI flags, the chat's ``/set`` help, the
web UI's settings panel and the flag table of docs/usage.md are generated from these declarations (the policies' own
parameters come from their classes the same way). Everything here can change on a live session; ``validate`` checks a
combination before any of it is applied.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ...policies import POLICIES, Param, make_policy, policy_class
from ..cache.groups import AGGREGATES, GROUP_MODES
from ..cache.positions import POSITION_MODES

RECALL_MODES = ("off", "on")


def max_slack(budget: int) -> int:
    """The largest overshoot allowed above the budget: max(64, budget/8) positions."""
    return max(64, budget // 8)


CACHE_SETTINGS: tuple[Param, ...] = (
    Param("policy", str, "streaming", "eviction policy (kvchat policies lists them)", choices=tuple(POLICIES)),
    Param("budget", int, 1024, "cached positions per layer after a compression", min=1),
    Param("sink", int, 4, "first tokens of the conversation always kept (attention sink)", min=0),
    Param("window", int, None, "most recent tokens always kept", min=0, derived="budget/4"),
    Param("slack", int, None, "compression starts when the cache reaches budget + slack and brings it back to the "
          "budget; the cache never holds more than budget + slack positions", min=1, derived="max(64, budget/8)"),
    Param("groups", str, "token", "eviction unit: single tokens, whole sentences or whole turns",
          choices=GROUP_MODES),
    Param("positions", str, "rerotate", "re-rotate kept keys to contiguous positions 0..n-1, or keep the "
          "absolute positions they were computed at", choices=POSITION_MODES),
    Param("aggregate", str, "mean", "how token scores become a group score", choices=AGGREGATES),
    Param("recall", str, "on", "before each reply, bring evicted sentences the new message needs back into the "
          "cache (scored by the model's own attention over their digests, read again from their tokens)",
          choices=RECALL_MODES),
    Param("recall_groups", int, 6, "most sentence groups recalled per user message", min=1, max=64),
    Param("recall_tokens", int, None, "most positions recalled per user message (they count toward the budget)",
          min=1, derived="budget/4"),
    Param("recall_threshold", float, 0.0, "least relevance a group needs to come back (its mean attention share, "
          "0-1)", min=0.0, max=1.0),
    Param("recall_rerank", int, None, "best candidates the model re-reads before the message, to bring back those "
          "that make it likeliest (0 = off; costs a forward over about 30 tokens each)", min=0, max=256,
          derived="16 on a GPU, 0 on a CPU"),
    Param("archive_mb", float, 1024.0, "recall's archive per conversation at most, in MB (about 1.1 KB per token "
          "for the default model); past it the oldest sentences are forgotten first", min=1.0),
)

SAMPLING_SETTINGS: tuple[Param, ...] = (
    Param("max_new_tokens", int, 256, "longest reply in tokens", min=1),
    Param("temperature", float, 0.7, "sampling temperature (0 = greedy: every other sampling setting is then off)",
          min=0.0),
    Param("top_p", float, 0.9, "nucleus sampling: smallest set of tokens whose probability reaches top_p (1 = off)",
          min=1e-6, max=1.0),
    Param("top_k", int, 0, "sample among the k most likely tokens only (0 = off)", min=0),
    Param("min_p", float, 0.0, "drop tokens less likely than min_p times the most likely one (0 = off)",
          min=0.0, max=1.0),
    Param("repetition_penalty", float, 1.0, "divide the logit of every token the model can see (cache and reply "
          "so far) by this (1 = off)", min=1.0, max=10.0),
    Param("no_repeat_ngram_size", int, 0, "never repeat an n-gram of this size from what the model can see "
          "(0 = off)", min=0, max=64),
)
SETTINGS = {p.name: p for p in (*CACHE_SETTINGS, *SAMPLING_SETTINGS)}  # every setting by name


@dataclass(frozen=True)
class Settings:
    policy: str = SETTINGS["policy"].default
    params: dict = field(default_factory=dict)  # the policy's own parameters (declared by its class)
    budget: int = SETTINGS["budget"].default
    sink: int = SETTINGS["sink"].default
    window: int | None = SETTINGS["window"].default  # None: derived (budget // 4)
    slack: int | None = SETTINGS["slack"].default  # None: derived (max(64, budget/8))
    groups: str = SETTINGS["groups"].default
    positions: str = SETTINGS["positions"].default
    aggregate: str = SETTINGS["aggregate"].default
    recall: str = SETTINGS["recall"].default
    recall_groups: int = SETTINGS["recall_groups"].default
    recall_tokens: int | None = SETTINGS["recall_tokens"].default  # None: derived (budget // 4)
    recall_threshold: float = SETTINGS["recall_threshold"].default
    recall_rerank: int | None = SETTINGS["recall_rerank"].default  # None: derived (16 on a GPU, 0 on a CPU)
    archive_mb: float = SETTINGS["archive_mb"].default

    def __post_init__(self) -> None:
        # The policy's parameters as its declarations parse them ("40" typed after /policy is 40), those at their
        # default left out, so that the same settings compare equal however they were given (a new observer for an
        # equal policy would drop H2O's accumulated attention); ValueError on a bad value, as ``validate`` gives.
        declared = {p.name: p for p in POLICIES[self.policy].params} if self.policy in POLICIES else {}
        params = {k: declared[k].parse(v) if k in declared else v for k, v in self.params.items()}
        object.__setattr__(self, "params", {k: v for k, v in params.items()
                                            if k not in declared or v != declared[k].default})

    # -- derived ----------------------------------------------------------------------------------------------
    @property
    def window_tokens(self) -> int:
        return self.budget // 4 if self.window is None else self.window

    @property
    def slack_tokens(self) -> int:
        return max_slack(self.budget) if self.slack is None else self.slack

    @property
    def recall_limit(self) -> int:
        """Positions recalled per user message at most: what the settings allow, and never more than the budget
        leaves beside the sink, the window and one evictable position."""
        wanted = self.budget // 4 if self.recall_tokens is None else self.recall_tokens
        return max(0, min(wanted, self.budget - self.sink - self.window_tokens - 1))

    @property
    def capacity(self) -> int:
        return self.budget + self.slack_tokens

    @property
    def bounded(self) -> bool:
        """Whether the policy evicts (a bounded cache); ``full`` grows up to the model's positions."""
        return policy_class(self.policy).bounded

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["window"] = self.window_tokens
        d["slack"] = self.slack_tokens
        return d

    @classmethod
    def from_dict(cls, stored: dict) -> "Settings":
        """Settings as stored with a conversation (keys this version does not know are ignored)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in stored.items() if k in known})

    def changed(self, **changes: Any) -> "Settings":
        """A copy with ``changes`` applied. Parameters given for the running policy change those named and keep its
        others (``/set heavy=64``, ``/policy h2o heavy=64`` under h2o, ``--resume --heavy 64``); a new policy starts
        from its defaults and the parameters given with it."""
        if changes.get("policy", self.policy) == self.policy:
            changes["params"] = {**self.params, **changes.get("params", {})}
        else:
            changes.setdefault("params", {})
        return replace(self, **changes)

    def changes_to(self, other: "Settings") -> dict[str, Any]:
        """The changes that make these settings ``other`` (``changed(**changes_to(other)) == other``), the policy's
        parameters given whole where they differ."""
        out = {f.name: getattr(other, f.name) for f in fields(self)
               if f.name != "params" and getattr(self, f.name) != getattr(other, f.name)}
        if (self.policy, self.params) != (other.policy, other.params):
            out["params"] = {p.name: other.params.get(p.name, p.default) for p in POLICIES[other.policy].params}
        return out

    def validate(self, max_positions: int, rotary_error: str | None = None) -> None:
        """ValueError with a one-line reason if this combination cannot run."""
        cls = policy_class(self.policy)
        make_policy(self.policy, **self.params)
        for p in CACHE_SETTINGS[1:]:
            p.parse(getattr(self, p.name))
        if self.positions == "rerotate" and rotary_error:
            raise ValueError(rotary_error)
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


@dataclass(frozen=True)
class Sampling:
    """How a reply is generated; every field is declared in ``SAMPLING_SETTINGS``."""

    max_new_tokens: int = SETTINGS["max_new_tokens"].default
    temperature: float = SETTINGS["temperature"].default
    top_p: float = SETTINGS["top_p"].default
    top_k: int = SETTINGS["top_k"].default
    min_p: float = SETTINGS["min_p"].default
    repetition_penalty: float = SETTINGS["repetition_penalty"].default
    no_repeat_ngram_size: int = SETTINGS["no_repeat_ngram_size"].default

    @classmethod
    def for_model(cls, model, **overrides: Any) -> "Sampling":
        """The model's sampling defaults (its generation config where it sets them, else ``MODEL_SAMPLING``,
        else the declared defaults) with ``overrides`` (None values ignored) applied and validated."""
        defaults = dict(getattr(model, "sampling_defaults", None) or {})
        return cls(**defaults).changed(**overrides)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def validate(self) -> "Sampling":
        """The same settings, each converted and checked by its declaration (ValueError naming the bad one)."""
        return Sampling(**{p.name: p.parse(getattr(self, p.name)) for p in SAMPLING_SETTINGS})

    def changed(self, **changes: Any) -> "Sampling":
        """A validated copy with the given (non-None) changes applied."""
        unknown = set(changes) - {p.name for p in SAMPLING_SETTINGS}
        if unknown:
            raise ValueError(f"unknown sampling setting {', '.join(sorted(unknown))}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None}).validate()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
