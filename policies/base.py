"""What a policy is: a small class that scores cached positions; the engine does everything else.

A policy declares its parameters (``params``), so the CLI flags, ``kvchat policies`` and the UI settings panel
are generated from one place. At each compression the engine calls ``score(view)`` for a layer and keeps the
highest-scoring positions (after protecting the sink, the system prompt and the recent window, and after
aggregating scores per group in sentence/turn mode). The engine gathers, counts and re-positions; a policy never
touches the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


_KINDS = {int: "a whole number", float: "a finite number", bool: "true or false", str: "text"}


@dataclass(frozen=True)
class Param:
    """A declared setting: a policy's parameter, or one of the engine's (core/engine/settings.py).

    The CLI flags, the chat's /set help, the web UI's settings panel, ``kvchat policies`` and the tables of README.md
    and docs/usage.md are generated from these declarations."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    #: The default in words when it is derived from other settings (``default`` is then None, and so is "unset").
    derived: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def shown_default(self) -> str:
        return self.derived if self.derived is not None else str(self.default)

    @property
    def kind(self) -> str:
        """The value's kind for help texts: the choices, or the type's name."""
        return "|".join(map(str, self.choices)) if self.choices else self.type.__name__

    def parse(self, value: Any) -> Any:
        """Convert and validate ``value`` (from a CLI string, JSON or a UI widget); ValueError if invalid.

        A derived setting (``derived`` set) takes None or an empty string as "unset"."""
        if self.derived is not None and (value is None or (isinstance(value, str) and not value.strip())):
            return None
        try:
            if self.type is int and isinstance(value, float):
                if value != int(value):
                    raise ValueError
                value = int(value)
            if self.type is bool and isinstance(value, str):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError
                value = value.lower() in ("1", "true", "yes", "on")
            elif self.type is int and isinstance(value, str):
                value = int(value.strip())
            else:
                value = self.type(value)
            if self.type is float and not math.isfinite(value):
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            kind = _KINDS.get(self.type, self.type.__name__)
            raise ValueError(f"{self.name} must be {kind}, got {value!r}") from None
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.name} must be one of {', '.join(map(str, self.choices))}, got {value!r}")
        if self.min is not None and value < self.min:
            raise ValueError(f"{self.name} must be >= {self.min}, got {value}")
        if self.max is not None and value > self.max:
            raise ValueError(f"{self.name} must be <= {self.max}, got {value}")
        return value


#: The observation window of the policies that read the latest queries' attention (snapkv, cake, headaware).
OBS_WINDOW = Param("obs_window", int, 32, "latest queries whose attention is observed", min=1, max=1024)


@dataclass
class LayerView:
    """What a policy may look at when scoring one layer's cached positions.

    Per KV head, slots are in time order. Heads may hold different numbers of positions (per-head budgets), and
    layers too (per-layer budgets): tensors are padded to the fullest head of any layer the compression scores
    and ``valid`` says which slots hold a position.
    """

    layer: int
    positions: torch.Tensor  # [heads, n] absolute positions (-1 where a head holds fewer)
    valid: torch.Tensor  # [heads, n] bool
    held_keys: torch.Tensor  # [1, heads, m, head_dim]: the layer's own, m <= n its fullest head (``keys``: padded)
    acc: torch.Tensor | None = None  # [heads, n] attention received so far (policies observing "acc")
    since: torch.Tensor | None = None  # [heads, n] where ``acc`` began to count, where later than the position
    window: torch.Tensor | None = None  # [heads, rows, n] attention of the last queries (observing "window")
    groups: torch.Tensor | None = None  # [heads, n] group id of each slot in sentence/turn mode
    fed: int = 0  # tokens fed so far and the chunk the compression makes room for (the absolute position after it)

    @property
    def keys(self) -> torch.Tensor:
        """[1, heads, n, head_dim], zeros past the layer's fullest head (a copy where the view is wider)."""
        pad = self.positions.shape[1] - self.held_keys.shape[2]
        return self.held_keys if not pad else torch.nn.functional.pad(self.held_keys, (0, 0, 0, pad))

    @property
    def recency(self) -> torch.Tensor:
        """[heads, n] scores that rank newer tokens higher."""
        return self.positions.float()

    @property
    def seen(self) -> torch.Tensor:
        """[heads, n] the queries ``acc`` has counted for each slot (at least 1): those from its own position on, or
        from where its attention began to count when later: recall read it again unobserved, or a policy that
        observes ``acc`` was switched in over one that did not (core/cache/observe.py ``Observer.restart``). An
        average over them does not rank a slot low for attention given while nothing counted it."""
        start = self.positions if self.since is None else torch.maximum(self.positions, self.since)
        return (self.fed - start).clamp(min=1)


class Policy:
    """Base class. Subclasses set ``name``, ``summary``, ``params`` and implement ``score``."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    params: ClassVar[tuple[Param, ...]] = ()
    #: False for a policy that never evicts (``full``): the cache then grows up to the model's max positions.
    bounded: ClassVar[bool] = True
    #: Whether the sink tokens and the system prompt are protected from eviction.
    protect_start: ClassVar[bool] = True
    #: True when scores depend only on positions (same for every layer and head): scored once per compression.
    layer_independent: ClassVar[bool] = False
    #: Attention statistics the policy reads: "acc" (attention each slot received so far) and/or "window"
    #: (attention of the last ``obs_window`` queries at compression time). See core/cache/observe.py.
    observes: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, **values: Any):
        known = {p.name: p for p in self.params}
        unknown = set(values) - set(known)
        if unknown:
            raise ValueError(f"policy {self.name} has no parameter {', '.join(sorted(unknown))}")
        self.values = {name: p.parse(values.get(name, p.default)) for name, p in known.items()}

    def __getattr__(self, item: str) -> Any:
        values = self.__dict__.get("values", {})
        if item in values:
            return values[item]
        raise AttributeError(item)

    @property
    def obs_window(self) -> int:
        """How many of the latest queries the observer keeps for ``window`` statistics."""
        return int(self.values.get("obs_window", 32)) if "window" in self.observes else 0

    def score(self, view: LayerView) -> torch.Tensor:
        """Scores [heads, n] or [n] for the cached positions of one layer; higher means keep."""
        raise NotImplementedError

    def allocate(self, views: list[LayerView], budget: int, minimum: int) -> list[list[int]] | None:
        """Positions to keep per layer and KV head, summing to layers x heads x ``budget``, none below
        ``minimum`` — or None for the uniform ``budget`` everywhere (the default)."""
        return None

    def get_state(self) -> dict:
        """What the policy learned during the chat (JSON-able), saved with cache snapshots."""
        return {}

    def set_state(self, state: dict) -> None:
        """Restore ``get_state()``'s result."""

    def report(self) -> dict:
        """Policy state worth showing (per-layer budgets, head classes); part of the session stats."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.values.items())
        return f"{self.name}({args})"


def window_batches(views: list[LayerView], most: int = 1 << 22):
    """The layers' observation windows and valid masks stacked, for what a policy computes for several layers at once
    (fewer launches and reads back on a GPU than layer by layer): yields (layer indices, windows [B, heads, rows, n],
    valid [B, heads, n]), the layers of one head and row count together, zero-padded to the longest (padding is not
    valid and holds no attention), at most ``most`` elements of windows a batch (one layer at least), so that their
    temporaries stay some tens of MB."""
    alike: dict[tuple, list[int]] = {}
    for i, view in enumerate(views):
        alike.setdefault((tuple(view.window.shape[:2]), view.window.device, view.window.dtype), []).append(i)
    for (shape, device, dtype), layers in alike.items():
        n = max(views[i].window.shape[-1] for i in layers)
        size = max(1, most // (shape[0] * shape[1] * max(n, 1)))
        for at in range(0, len(layers), size):
            batch = layers[at: at + size]
            if all(views[i].window.shape[-1] == n for i in batch):  # as wide (a compression pads them alike)
                yield batch, torch.stack([views[i].window for i in batch]), torch.stack([views[i].valid for i in batch])
                continue
            windows = torch.zeros(len(batch), *shape, n, dtype=dtype, device=device)
            valid = torch.zeros(len(batch), shape[0], n, dtype=torch.bool, device=device)
            for b, i in enumerate(batch):
                m = views[i].window.shape[-1]
                windows[b, ..., :m], valid[b, :, :m] = views[i].window, views[i].valid
            yield batch, windows, valid


def split_budget(weights: list[float], total: int, minimum: int) -> list[int]:
    """Integers summing to ``total``, each at least ``minimum`` (when the total allows), the rest shared in
    proportion to ``weights`` (largest remainders get the leftover units). On the host: a few float operations a
    weight, torch only for the sum and the order of the remainders."""
    n = len(weights)
    floor = min(minimum, total // n)
    rest = total - floor * n
    w = [max(float(x), 0.0) for x in weights]
    norm = float(torch.tensor(w, dtype=torch.float64).sum())
    share = [x / norm * rest for x in w] if norm > 0 else [1.0 / n * rest] * n
    out = [math.floor(x) for x in share]
    leftover = rest - sum(out)
    if leftover:
        remainders = torch.tensor([x - o for x, o in zip(share, out)], dtype=torch.float64)
        for i in torch.argsort(remainders, descending=True)[:leftover].tolist():
            out[i] += 1
    return [floor + v for v in out]
