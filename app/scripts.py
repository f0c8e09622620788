"""Replay scripts: the formats ``kvchat replay`` reads, parsed completely before anything runs, so that a malformed
line fails (naming the line) before the model loads or the database is touched (``app/replay.py`` runs them).

* kvchat JSONL: ``{"system": t}`` (first line only), ``{"user": t}``, ``{"assistant": t}``,
  ``{"user": t, "expect": s}``, ``{"user": t, "reference": r, "expect": s}``, ``{"set": {setting: value, ...}}``.
  A user line followed by an assistant line is appended as is; a user line alone gets a generated reply. A set line
  changes settings where it stands, as the chat's ``/policy`` and ``/set`` do.
* FastChat/ShareGPT JSON: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": t}, ...]}`` or a list of
  such objects (each its own conversation).
* MT-Bench JSONL: ``{"turns": [q1, q2, ...]}`` per line; the whole file is one conversation, every turn in order.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..core.engine.session import check_text
from ..core.engine.settings import CACHE_SETTINGS, SETTINGS, Settings
from ..core.model.names import DEFAULT_MODEL_NAME
from ..policies import POLICIES, declared_params
from .args import parse_setting, sort_settings


class ScriptError(ValueError):
    pass


@dataclass
class Step:
    kind: str  # "reply", "exchange", "probe", "add", "set"
    user: str | None = None
    text: str | None = None  # the assistant text (exchange/add) or the reference (probe)
    role: str | None = None  # for "add"
    expect: str | None = None
    cache: dict | None = None  # for "set": changes for Session.configure (a policy's parameters under "params")
    sampling: dict | None = None  # for "set": changes to the sampling settings
    where: str | None = None  # for "set": its line, named in errors

    @property
    def turn(self) -> bool:
        """Whether the step is a turn of the conversation (a set line is not)."""
        return self.kind != "set"


@dataclass
class Script:
    name: str
    system: str | None = None  # None: the template's default system prompt
    steps: list[Step] = field(default_factory=list)


_KVCHAT_KEYS = {"system", "user", "assistant", "expect", "reference", "set"}
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
        elif "set" in obj:
            if len(obj) > 1:
                raise ScriptError(f"{at}: a set line has only \"set\"")
            turns.append((at, "set", _switch(obj["set"], at)))
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
            if len(turns) > 1 and turns[-1][1] == "set" and turns[-2][1] == "user":
                raise ScriptError(f"{turns[-1][0]}: a set line parts a user line from its assistant line; put it "
                                  "before the user line")
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
        elif kind == "set":
            steps.append(Step("set", cache=value[0], sampling=value[1], where=at))
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
    if not any(step.turn for step in steps):
        raise ScriptError(f"{path}: the script has no turns")
    script.steps = steps
    return script


def _switch(value, at: str) -> tuple[dict, dict]:
    """A set line's settings as (changes for ``Session.configure``, changes to the sampling settings), each value
    parsed by its declaration. A policy's parameter must be declared by the policy the line names, or, where it
    names none, by some policy (``check_switches`` checks it against the one running there)."""
    if not isinstance(value, dict) or not value:
        raise ScriptError(f"{at}: \"set\" takes an object of settings, e.g. {{\"policy\": \"h2o\", \"budget\": 256}}")
    owners = declared_params()
    try:
        policy = parse_setting(SETTINGS["policy"], value["policy"]) if "policy" in value else None

        def param(k: str):
            if k not in owners:
                raise ValueError(f"unknown setting {_short(k)!r} (kvchat replay --help lists them)")
            if policy is not None and policy not in owners[k][1]:
                raise ValueError(f"{k} is a parameter of {', '.join(owners[k][1])}, not of {policy}")
            return owners[k][0]

        cache, sampling, params = sort_settings(value.items(), param)  # every bad one, in one line
    except ValueError as exc:
        raise ScriptError(f"{at}: {exc}") from None
    if policy is not None:
        cache["policy"] = policy
    if params:
        cache["params"] = params
    return cache, sampling


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


def export_script(store, conversation_id: int) -> list[dict]:
    """Stored conversation ``conversation_id`` as replay-script lines: its messages (``{"system"|"user"|"assistant":
    text}``) and, where the chat changed its cache settings (``/policy``, ``/set``, the settings panel), a set line
    before the turn it came before, with the settings as they resolved, so that the script replays those changes
    where they were made (the replay's flags are the chat's starting settings). ValueError where there is no such
    conversation (not an empty script)."""
    store.conversation(conversation_id)
    changes = store.settings_changes(conversation_id)  # in the order they were made
    lines = []
    for m in store.messages(conversation_id):
        while changes and m["role"] != "system" and changes[0]["turn"] <= m["turn"]:
            lines.append({"set": _set_line(changes.pop(0))})
        lines.append({m["role"]: m["text"]})
    return lines + [{"set": _set_line(change)} for change in changes]


def _set_line(change: dict) -> dict:
    """A stored settings change as a set line's settings: the cache settings it changed, and where the policy or its
    parameters changed, the policy with its parameters (every one the policy declares where the policy stayed: a
    parameter set back to its default is stored as left out)."""
    names = {p.name for p in CACHE_SETTINGS}
    line = {k: v for k, v in change["changes"].items() if k in names}
    if "policy" in change["changes"] or "params" in change["changes"]:
        policy, params = change["settings"]["policy"], change["settings"].get("params", {})
        line["policy"] = policy
        stayed = "policy" not in change["changes"] and policy in POLICIES  # (a policy this version lacks: as stored)
        line.update({p.name: params.get(p.name, p.default) for p in POLICIES[policy].params} if stayed else params)
    return line


def replay_command(store, conversation_id: int, path) -> str:
    """The ``kvchat replay`` command that replays stored conversation ``conversation_id``, exported to ``path``
    (``export_script``), as it began: its model where it is not the default, and the cache settings and policy
    parameters it started with where they are not the defaults (``started_with``; its changes are the script's set
    lines). Sampling settings are not stored with a conversation: the replay samples with the model's defaults."""
    conv = store.conversation(conversation_id)
    start = started_with(store, conversation_id)
    words = ["kvchat", "replay", str(path)]
    if conv["model"] != DEFAULT_MODEL_NAME:
        words += ["--model", conv["model"]]
    params = POLICIES[start.policy].params if start.policy in POLICIES else ()
    for p, value in [(p, getattr(start, p.name)) for p in CACHE_SETTINGS] + \
            [(p, start.params.get(p.name, p.default)) for p in params]:
        if value != p.default:
            words += [p.flag, str(value)]
    return " ".join(map(shlex.quote, words))


def started_with(store, conversation_id: int) -> Settings:
    """The settings stored conversation ``conversation_id`` began under: as set, where it never changed them; else
    those its turns before its first change ran under, or (a change before its first turn) those that change left,
    which the script's set line before the first turn makes again. A turn's settings are stored with the window and
    slack resolved: each is left to its default where that replays the chat alike (``_explicit``)."""
    conv = store.conversation(conversation_id)
    changes = store.settings_changes(conversation_id)
    if not changes:
        return Settings.from_dict(conv["settings"])
    before = [t["settings"] for t in store.turn_stats(conversation_id) if t["turn"] < changes[0]["turn"]]
    start = Settings.from_dict(before[0] if before else changes[0]["settings"])
    derived = {"window": lambda budget: Settings(budget=budget).window_tokens,
               "slack": lambda budget: Settings(budget=budget).slack_tokens}
    return start.changed(**{name: None for name, rule in derived.items() if getattr(start, name) == rule(start.budget)
                            and not _explicit(start, changes, name, rule)})


def _explicit(start: Settings, changes: list[dict], name: str, rule) -> bool:
    """Whether the window or slack (``name``, by default ``rule(budget)``) the chat began with must be given as it
    was: where a budget change moved its default before any set line gives it, and the chat's did not move it (set
    explicitly, to what the default happened to be)."""
    budget = start.budget
    for change in changes:
        if name in change["changes"]:
            return False  # the set lines give it from here on
        if "budget" in change["changes"]:
            if rule(change["changes"]["budget"]) != rule(budget):
                return True
            budget = change["changes"]["budget"]
    return False
