"""Replaying scripted conversations headless.

A script is parsed completely before anything runs, so a malformed line fails (naming the line) before the model
loads or the database is touched. Formats:

* kvchat JSONL: ``{"system": t}`` (first line only), ``{"user": t}``, ``{"assistant": t}``,
  ``{"user": t, "expect": s}``, ``{"user": t, "reference": r, "expect": s}``. A user line followed by an
  assistant line is appended as is; a user line alone gets a generated reply.
* FastChat/ShareGPT JSON: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": t}, ...]}`` or a list of
  such objects (each its own conversation).
* MT-Bench JSONL: ``{"turns": [q1, q2, ...]}`` per line; the whole file is one conversation, every turn in order.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core.engine.session import Session, TurnResult, check_text, peak_rss_mb


class ScriptError(ValueError):
    pass


@dataclass
class Step:
    kind: str  # "reply", "exchange", "probe", "add"
    user: str | None = None
    text: str | None = None  # the assistant text (exchange/add) or the reference (probe)
    role: str | None = None  # for "add"
    expect: str | None = None


@dataclass
class Script:
    name: str
    system: str | None = None  # None: the template's default system prompt
    steps: list[Step] = field(default_factory=list)


_KVCHAT_KEYS = {"system", "user", "assistant", "expect", "reference"}
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}


def _text(value, where: str, what: str) -> str:
    try:
        return check_text(value, what)
    except ValueError as exc:
        raise ScriptError(f"{where}: {exc}") from None


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScriptError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise ScriptError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def _json(text: str, where) -> object:
    """``text`` parsed as JSON; ScriptError naming ``where`` (a callable of the error's line number, or None) if it
    is not JSON, nests too deeply for the parser or holds a number too long to convert."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScriptError(f"{where(exc.lineno)}: invalid JSON ({exc.msg})") from None
    except RecursionError:
        raise ScriptError(f"{where(None)}: JSON nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise ScriptError(f"{where(None)}: invalid JSON ({_short(str(exc))})") from None


def _short(text: str, limit: int = 60) -> str:
    """``text`` as one printable line of at most about ``limit`` characters (for echoing input in an error)."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit + 1])
    return text if len(text) <= limit else text[:limit] + "..."


def load_scripts(path: str | Path) -> list[Script]:
    path = Path(path)
    text = _read(path)
    if path.suffix == ".json":
        data = _json(text, lambda line: f"{path}:{line}" if line else str(path))
        items = data if isinstance(data, list) else [data]
        return [_sharegpt(item, f"{path}[{i}]" if isinstance(data, list) else str(path))
                for i, item in enumerate(items)]
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        obj = _json(line, lambda _, lineno=lineno: f"{path}:{lineno}")
        if not isinstance(obj, dict):
            raise ScriptError(f"{path}:{lineno}: expected a JSON object")
        rows.append((lineno, obj))
    if not rows:
        raise ScriptError(f"{path}: the script is empty")
    if "turns" in rows[0][1]:
        return [_mt_bench(path, rows)]
    return [_kvchat(path, rows)]


def _sharegpt(item, where: str) -> Script:
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        raise ScriptError(f"{where}: expected an object with a \"conversations\" list")
    script = Script(name=f"{where}#{item['id']}" if "id" in item else where)
    turns = []
    for j, turn in enumerate(item["conversations"]):
        at = f"{where}.conversations[{j}]"
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or turn["from"] not in _SHAREGPT_ROLES:
            raise ScriptError(f"{at}: expected {{\"from\": human|gpt|system, \"value\": text}}")
        role = _SHAREGPT_ROLES[turn["from"]]
        value = _text(turn.get("value"), at, "value")
        if role == "system":
            if turns or script.system is not None:
                raise ScriptError(f"{at}: a system turn can only open the conversation")
            script.system = value
        else:
            turns.append((at, role, value))
    script.steps = _pair(turns)
    if not script.steps:
        raise ScriptError(f"{where}: the conversation has no turns")
    return script


def _mt_bench(path: Path, rows) -> Script:
    turns = []
    for lineno, obj in rows:
        qs = obj.get("turns")
        if not isinstance(qs, list) or not qs:
            raise ScriptError(f"{path}:{lineno}: expected a non-empty \"turns\" list")
        turns += [(f"{path}:{lineno}", "user", _text(q, f"{path}:{lineno}", "turn")) for q in qs]
    return Script(name=str(path), steps=_pair(turns))


def _kvchat(path: Path, rows) -> Script:
    script = Script(name=str(path))
    turns = []
    for lineno, obj in rows:
        at = f"{path}:{lineno}"
        unknown = set(obj) - _KVCHAT_KEYS
        if unknown:
            raise ScriptError(f"{at}: unknown key {_short(', '.join(sorted(unknown)))}")
        if "system" in obj:
            if len(obj) > 1 or turns or script.system is not None:
                raise ScriptError(f"{at}: a system line stands alone, as the first line")
            script.system = _text(obj["system"], at, "system")
        elif "user" in obj:
            if "assistant" in obj:
                raise ScriptError(f"{at}: put the assistant reply on its own line")
            user = _text(obj["user"], at, "user")
            expect = _text(obj["expect"], at, "expect") if "expect" in obj else None
            if "reference" in obj:
                if expect is None:
                    raise ScriptError(f"{at}: a reference line needs \"expect\"")
                ref = _text(obj["reference"], at, "reference")
                if expect.lower() not in ref.lower():
                    raise ScriptError(f"{at}: expect {expect!r} does not occur in the reference")
                turns.append((at, "probe", (user, ref, expect)))
            else:
                turns.append((at, "user", (user, expect)))
        elif "assistant" in obj:
            if len(obj) > 1:
                raise ScriptError(f"{at}: an assistant line has only \"assistant\"")
            turns.append((at, "assistant", _text(obj["assistant"], at, "assistant")))
        else:
            raise ScriptError(f"{at}: a line needs one of system, user, assistant")
    steps = []
    i = 0
    while i < len(turns):
        at, kind, value = turns[i]
        nxt = turns[i + 1] if i + 1 < len(turns) else None
        if kind == "probe":
            steps.append(Step("probe", user=value[0], text=value[1], expect=value[2]))
        elif kind == "user" and nxt is not None and nxt[1] == "assistant":
            if value[1] is not None:
                raise ScriptError(f"{at}: \"expect\" scores a generated reply, but an assistant line follows")
            steps.append(Step("exchange", user=value[0], text=nxt[2]))
            i += 1
        elif kind == "user":
            steps.append(Step("reply", user=value[0], expect=value[1]))
        else:
            steps.append(Step("add", role="assistant", text=value))
        i += 1
    if not steps:
        raise ScriptError(f"{path}: the script has no turns")
    script.steps = steps
    return script


def _pair(turns) -> list[Step]:
    """User turns followed by assistant turns become exchanges; lone user turns get generated replies."""
    steps, i = [], 0
    while i < len(turns):
        _, role, value = turns[i]
        nxt = turns[i + 1] if i + 1 < len(turns) else None
        if role == "user" and nxt is not None and nxt[1] == "assistant":
            steps.append(Step("exchange", user=value, text=nxt[2]))
            i += 2
            continue
        steps.append(Step("reply", user=value) if role == "user" else Step("add", role="assistant", text=value))
        i += 1
    return steps


def run_step(session: Session, step: Step, sampling: dict) -> TurnResult:
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
    """How many of ``script``'s steps conversation ``conversation_id`` already holds (they must be its first
    turns; a reply step matches whatever reply was generated). ScriptError naming the first difference."""
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
    if len(stored) > len(script.steps):
        raise ScriptError(f"{where} holds {len(stored)} turns, more than the script's {len(script.steps)}")
    for i, (messages, step) in enumerate(zip(stored, script.steps)):
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
    return len(stored)


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
