"""Replaying scripted conversations headless: a script's steps run on a session (``run_step``, a set line's through
``switched``), its set lines checked first in the settings they meet (``check_switches``), a resumed replay's stored
prefix matched (``stored_prefix``), and what ``--json`` prints of each turn and in all (``turn_line``, ``Summary``).
The script formats are ``app/scripts.py``'s."""

from __future__ import annotations

import time

from ..core.engine.session import Session, TurnResult, peak_rss_mb
from ..core.engine.settings import Sampling, Settings
from ..policies import POLICIES
from .args import apply_settings
from .scripts import Script, ScriptError, Step


def check_switches(script: Script, settings: Settings, max_positions: int, rotary_error: str | None,
                   compared: bool = False, start: int = 0) -> None:
    """Check every set line of ``script`` from step ``start`` on in the settings it meets, from ``settings`` there
    (the script's start, or where a resumed replay goes on): ScriptError naming the first line whose settings
    cannot run (a parameter of another policy than the one running, a budget below sink + window, ...). Under
    ``--compare`` (each policy listed runs the whole script) a set line may not change the policy or its
    parameters."""
    for step in script.steps[start:]:
        if step.kind != "set":
            continue
        if compared and (step.cache.keys() & {"policy", "params"}):
            raise ScriptError(f"{step.where}: --compare runs each policy it lists through the whole script, so a set "
                              "line there changes no policy or policy parameter (leave the line out, or replay "
                              "without --compare)")
        settings = _checked(settings, step)
        try:
            settings.validate(max_positions, rotary_error)
        except ValueError as exc:
            raise ScriptError(f"{step.where}: {exc}") from None


def _checked(settings: Settings, step: Step) -> Settings:
    """``settings`` changed by set step ``step`` (ScriptError where it gives a parameter the policy it applies to
    does not take)."""
    policy = step.cache.get("policy", settings.policy)
    foreign = sorted(set(step.cache.get("params", {})) - {p.name for p in POLICIES[policy].params})
    if foreign:
        raise ScriptError(f"{step.where}: policy {policy} (running there) has no parameter {foreign[0]}")
    try:
        return settings.changed(**step.cache)
    except ValueError as exc:
        raise ScriptError(f"{step.where}: {exc}") from None


def replayed_settings(script: Script, done: int, settings: Settings, sampling: Sampling) -> tuple[Settings, Sampling]:
    """The settings and sampling a replay of ``script`` had after its first ``done`` steps, from ``settings`` and
    ``sampling`` at its start: what a resumed replay goes on with."""
    for step in script.steps[:done]:
        if step.kind == "set":
            settings, sampling = _checked(settings, step), sampling.changed(**step.sampling)
    return settings, sampling


def switched(session: Session, step: Step) -> dict:
    """Set step ``step`` applied to ``session`` as ``/set`` applies a change; what changed."""
    return apply_settings(session, step.cache, step.sampling)


def run_step(session: Session, step: Step, sampling: dict) -> TurnResult:
    """A turn step run on ``session`` (a set step goes through ``switched``)."""
    if step.kind == "exchange":
        return session.exchange(step.user, step.text)
    if step.kind == "probe":
        return session.probe(step.user, step.text, step.expect)
    if step.kind == "add":
        return session.add(step.role, step.text)
    res = session.chat(step.user, **sampling)
    if step.expect is not None:
        res.expect = step.expect
        res.hit = step.expect.lower() in (res.answer or "").lower()
    return res


def stored_prefix(script: Script, store, conversation_id: int, default_system: str | None) -> int:
    """How many of ``script``'s steps conversation ``conversation_id`` already holds: its turns must be the script's
    first ones (a reply step matches whatever reply was generated; set lines are no turns), and the count ends at
    the last of them, so that set lines after it run again. ScriptError naming the first difference."""
    store.conversation(conversation_id)  # ValueError, "no conversation N in DB", before comparing with nothing
    turns: dict[int, list[dict]] = {}
    for m in store.messages(conversation_id):
        turns.setdefault(m["turn"], []).append(m)
    stored = [turns[t] for t in sorted(turns)]
    system = script.system if script.system is not None else default_system
    where = f"conversation {conversation_id}"
    if stored and stored[0][0]["role"] == "system":
        if system is None or stored[0][0]["text"] != system:
            raise ScriptError(f"{where} opens with another system prompt than the script's")
        stored = stored[1:]
    elif system is not None:
        raise ScriptError(f"{where} has no system prompt; the script has one")
    turns = [(i, step) for i, step in enumerate(script.steps) if step.turn]
    if len(stored) > len(turns):
        raise ScriptError(f"{where} holds {len(stored)} turns, more than the script's {len(turns)}")
    for (i, step), messages in zip(turns, stored):
        if step.kind == "add":
            expected = [(step.role, step.text)]
        else:
            expected = [("user", step.user), ("assistant", None if step.kind == "reply" else step.text)]
        got = [(m["role"], m["text"]) for m in messages]
        if len(got) != len(expected) or any(r != er or (et is not None and t != et)
                                            for (r, t), (er, et) in zip(got, expected)):
            shown = " / ".join(f"{r}: {t[:40]!r}" for r, t in got)
            raise ScriptError(f"{where}, turn {messages[0]['turn']}: stored {shown} differs from the script's step "
                              f"{i + 1} ({step.kind})")
    return turns[len(stored) - 1][0] + 1 if stored else 0


TURN_FIELDS = ("turn", "role", "prompt_tokens", "new_tokens", "cache_tokens", "cache_bytes", "peak_cache_tokens",
               "evicted_tokens", "evicted_groups", "prefill_ms", "decode_ms_per_token", "stopped", "answer",
               "expect", "hit", "expect_nll", "recalled_tokens", "recalled_groups", "recall_ms", "recall_gain",
               "recall_declined")


def turn_line(script: Script, res: TurnResult, **first) -> dict:
    """A turn's line of ``--json`` output: ``first`` (``--compare``'s policy and label), the script, the turn."""
    return {**first, "script": script.name, **{k: getattr(res, k) for k in TURN_FIELDS}}


class Summary:
    """Totals over turns (one script, or all of them)."""

    def __init__(self):
        self.results: list[TurnResult] = []
        self.total_tokens = 0
        self.start = time.perf_counter()

    def add(self, res: TurnResult) -> None:
        self.results.append(res)

    def as_dict(self, session: Session) -> dict:
        rs = self.results
        nlls = [r.expect_nll for r in rs if r.expect_nll is not None]
        return {
            "policy": session.settings.policy,
            "params": {**session.policy.values, **{k: v for k, v in session.settings.as_dict().items()
                                                   if k not in ("policy", "params")}},
            "turns": len(rs),
            "total_tokens": self.total_tokens,
            "max_cache_tokens": max((r.peak_cache_tokens for r in rs), default=0),
            "max_cache_bytes": max((r.cache_bytes for r in rs), default=0),
            "evicted_tokens": sum(r.evicted_tokens for r in rs),
            "hits": sum(1 for r in rs if r.hit),
            "expected": sum(1 for r in rs if r.expect is not None),
            "mean_expect_nll": sum(nlls) / len(nlls) if nlls else None,
            "recalled_tokens": sum(r.recalled_tokens or 0 for r in rs),
            "recalled_groups": sum(r.recalled_groups or 0 for r in rs),
            "recall_declined_groups": sum(len(r.recall_declined) for r in rs),
            "mean_recall_ms": (sum(ms) / len(ms)) if (ms := [r.recall_ms for r in rs if r.recall_ms is not None])
            else None,
            "wall_s": round(time.perf_counter() - self.start, 3),
            "peak_rss_mb": round(peak_rss_mb(), 1),
        }
