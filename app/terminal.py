"""``kvchat chat``: the terminal chat, streamed, with /commands that change the live session."""

from __future__ import annotations

import shlex
import signal
import sys
import threading
import time

from ..core.engine.settings import CACHE_SETTINGS, SAMPLING_SETTINGS, SETTINGS
from ..core.engine.turns import ReadStopped, TurnResult
from ..policies import POLICIES, declared_params
from .args import (CLIError, apply_settings, check_resume, db_path, prepare, resumed_changes, settings_text,
                   sort_settings)


class Reading:
    """While a long message is read before its reply, a line on a terminal's stderr that says how far the read got
    (``session.reading``, every ``EVERY_S``), wiped when the reply begins (``done``)."""

    EVERY_S = 0.5

    def __init__(self, session):
        self.session, self.out = session, sys.stderr
        self._done, self._shown = threading.Event(), False
        self._thread = threading.Thread(target=self._run, name="kvchat-reading", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.EVERY_S):
            if (reading := self.session.reading) is not None:
                self.out.write(f"\r\033[K[reading your message: {reading[0]:,} of {reading[1]:,} tokens; Ctrl-C "
                               "stops it]")
                self.out.flush()
                self._shown = True

    def done(self, prompt: bool = True) -> None:
        """Stop; the line wiped where it was shown (and the reply's ``prompt`` written again)."""
        if not self._done.is_set():
            self._done.set()
            self._thread.join()
            if self._shown:
                self.out.write("\r\033[K")
                self.out.flush()
                print("bot> " if prompt else "", end="", flush=True)


def stream(session, gen) -> TurnResult:
    """Print a reply as it streams and return its turn. Ctrl-C stops it between two tokens (``session.cancel``), so
    the partial reply is kept and its turn closed and saved: a KeyboardInterrupt raised inside a model step would
    leave the step half done and the turn open. While a long message is still read (a terminal shows how far:
    ``Reading``), Ctrl-C stops the read between two chunks (``ReadStopped``: nothing of the message is kept). A second
    Ctrl-C interrupts at once (the turn in progress is lost, as in a crash; every turn before it is saved)."""
    previous = None

    def stop(signum, frame):
        session.cancel()
        signal.signal(signal.SIGINT, previous)

    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, stop)
    reading = Reading(session) if sys.stderr.isatty() else None
    try:
        for delta in gen:
            if reading is not None:
                reading.done()
                reading = None
            print(delta, end="", flush=True)
    finally:
        if reading is not None:  # the read stopped, or the reply ended without a token
            reading.done(prompt=False)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return session.history[-1]


BLOCK = '"""'  # opens and closes a message over several lines (``read_message``)


def _chat_help() -> str:
    lines = ["commands:",
             "  /policy NAME [key=value ...]   switch policy (parameters optional)",
             "  /budget N                      change the budget (a smaller one compresses now)",
             "  /set key=value ...             change settings (below) or the running policy's parameters, e.g.",
             "                                 /set temperature=0.3 top_k=40",
             "  /undo                          take back the last exchange (the cache as it was before it)",
             "  /retry                         take it back and answer its message again",
             "  /stats                         cache and conversation statistics",
             "  /help, /quit                   (a line ending in \\ continues on the next line; Ctrl-C stops a reply)",
             f"  {BLOCK + ' ... ' + BLOCK:30s} a message typed over several lines (a paste is one as it is)",
             "settings for /set (cache, then sampling):"]
    for p in (*CACHE_SETTINGS, *SAMPLING_SETTINGS):
        key = f"{p.name}={p.kind}"
        lines.append(f"  {key:30s} {p.help} (default {p.shown_default})")
    return "\n".join(lines)


CHAT_HELP = _chat_help()


def read_message(read) -> str:
    """One message from the terminal (``read``: ``input``): a line (in a terminal, a paste as one: ``_line_editing``);
    a line ending in \\ goes on on the next; one opened with \"\"\" runs over lines, blank ones too, until a line
    that ends with \"\"\" (a text piped in, or typed, over several lines)."""
    line = read("you> ")
    if line.lstrip().startswith(BLOCK):
        rest, lines = line.lstrip()[len(BLOCK):], []
        while not rest.rstrip().endswith(BLOCK):
            lines.append(rest)
            try:
                rest = read("...> ")
            except EOFError:
                raise CLIError(f"the input ended inside a message opened with {BLOCK} (close it with {BLOCK})") \
                    from None
        lines.append(rest.rstrip()[: -len(BLOCK)])
        return "\n".join(lines).strip("\n")
    while line.endswith("\\"):
        line = line[:-1] + "\n" + read("...> ")
    return line


def _set(session, pairs: list[str]) -> dict:
    """``/set key=value ...``: every value parsed first, then the cache settings and the running policy's own
    parameters (``configure``, which checks the combination) and the sampling settings applied; ValueError and
    nothing applied on any bad value (every bad one named, in one line)."""
    if not pairs:
        raise CLIError("/set takes key=value ... (/help lists the settings)")
    bare = [kv for kv in pairs if "=" not in kv]
    if bare:
        raise CLIError(f"/set takes key=value, got {bare[0]!r}")
    own = {p.name: p for p in POLICIES[session.settings.policy].params}

    def param(k: str):
        if k in own:
            return own[k]
        owners = declared_params().get(k, (None, []))[1]
        hint = (f"; a parameter of {', '.join(owners)}: /policy {owners[0]} {k}=VALUE" if owners
                else " (/help lists the settings)")
        raise CLIError(f"/set cannot change {k!r}{hint}")

    cache, sampling, params = sort_settings((kv.split("=", 1) for kv in pairs), param)
    if params:
        cache["params"] = params
    return apply_settings(session, cache, sampling)


def _no_param(policy: str, k: str):
    raise CLIError(f"policy {policy} has no parameter {k}")


def _stat(key: str, value) -> str:
    """One ``/stats`` value as a person reads it: sizes in MiB (and bytes), counts with separators, settings and
    parameters as key=value."""
    if isinstance(value, dict):
        return settings_text(value) or "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("_bytes"):
        return f"{value / 2**20:,.1f} MiB ({value:,} bytes)"
    return f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"


def _chat_command(session, line: str) -> bool | str:
    """Run a /command: False to quit, the message to answer again for ``/retry``, else True."""
    parts = shlex.split(line[1:])
    if not parts:
        return True
    cmd, rest = parts[0], parts[1:]
    if cmd in ("quit", "exit", "q"):
        return False
    if cmd in ("undo", "retry"):
        if rest:
            raise CLIError(f"/{cmd} takes nothing after it")
        if not session.undo_enabled:
            raise CLIError(f"nothing to {cmd}: this chat keeps no undo copy (--no-undo)")
        message = session.undo_reply(cmd)  # the cache, token log and stored conversation as before the exchange
        if cmd == "retry":
            return message
        shown = message if len(message) <= 300 else message[:300] + " …"
        print(f"  taken back: your message and its reply; the cache is as it was before them. It was:\n  {shown}")
    elif cmd == "help":
        print(CHAT_HELP)
    elif cmd == "stats":
        for k, v in session.stats().items():
            print(f"  {k}: {_stat(k, v)}")
    elif cmd in ("policy", "budget", "set"):
        if cmd == "policy":
            if not rest:
                raise CLIError(f"/policy needs a name: {', '.join(POLICIES)}")
            bare = [kv for kv in rest[1:] if "=" not in kv]
            if bare:
                raise CLIError(f"/policy takes its parameters as key=value, got {bare[0]!r}")
            given = dict(kv.split("=", 1) for kv in rest[1:])
            if rest[0] in POLICIES:  # (an unknown name: configure lists the policies)
                own = {p.name: p for p in POLICIES[rest[0]].params}
                # a setting given as a parameter (it said "policy h2o has no parameter groups")
                settings = sorted((given.keys() & SETTINGS.keys()) - own.keys())
                if settings:
                    k = settings[0]
                    raise CLIError(f"{k} is a setting, not a parameter of {rest[0]}: /set {k}={given[k]}")
                # every bad one named; the parameters as parsed
                _, _, given = sort_settings(given.items(), lambda k: own.get(k) or _no_param(rest[0], k))
            applied = session.configure(policy=rest[0], params=given)
        elif cmd == "budget":
            if len(rest) != 1:
                raise CLIError("/budget needs one number")
            applied = _set(session, [f"budget={rest[0]}"])  # parsed by its declaration: "-5" is not a budget
        else:
            applied = _set(session, rest)
        print(f"  applied: {settings_text(applied)}" if applied else "  no change")
    else:
        raise CLIError(f"unknown command /{cmd} (/help lists them)")
    return True


def _line_editing() -> None:
    """In a terminal, input through readline: the arrow keys edit the line and go through earlier messages, and a
    text pasted with its line breaks is one message (readline 8.1+ asks the terminal to mark a paste: bracketed
    paste); without it each pasted line was a message of its own, each answered."""
    try:
        import readline  # noqa: F401  (input() uses it once imported)
    except ImportError:  # a Python built without it: plain lines, and \"\"\" for a message over lines
        pass


def cmd_chat(args) -> int:
    if args.resume is not None and args.system is not None:
        raise CLIError("--system starts a new conversation; a resumed one keeps its own system prompt")
    check_resume(args)
    from ..core.engine.session import Session
    from ..storage.db import Store

    # A resumed conversation keeps its stored settings but for the cache flags given, applied to them once it is
    # open (as /policy and /set would): they are checked then, against the model, in that combination.
    settings, sampling, model = prepare(args, check_settings=args.resume is None)
    store = Store(db_path(args.db))
    if args.resume is not None:
        session = Session.resume(model, store, args.resume, sampling=sampling, undo=not args.no_undo)
        print(f"resumed conversation {args.resume} ({len(session.messages)} messages, cache restored from "
              f"{session.restored_from}, {session.cache_tokens} tokens)", file=sys.stderr)
    else:
        session = Session(model, settings, system=args.system or "default", store=store, sampling=sampling,
                          seed=args.seed, undo=not args.no_undo)
    try:
        if args.resume is not None and (applied := session.configure(**resumed_changes(args, session.settings))):
            print(f"changed from its stored settings: {settings_text(applied)}", file=sys.stderr)
        s = session.settings
        print(f"{model.name} | policy {s.policy} | budget {s.budget} | groups {s.groups} | positions {s.positions} "
              "| /help for commands", file=sys.stderr)
        if sys.stdin.isatty():
            _line_editing()
        while True:
            try:
                line = read_message(input)
            except EOFError:
                print()
                break
            if not line.strip():
                continue
            try:
                if line.startswith("/"):
                    if (done := _chat_command(session, line)) is False:
                        break
                    if done is True:
                        continue
                    line = done  # /retry: its message answered again
                gen = session.reply(line)
            except ValueError as exc:
                print(f"kvchat: error: {exc}", file=sys.stderr)
                continue
            print("bot> ", end="", flush=True)
            t = time.perf_counter()
            try:
                res = stream(session, gen)
            except ReadStopped as exc:  # Ctrl-C while a long message was read: as if it had not been sent
                print(f"\nkvchat: {exc}", file=sys.stderr)
                continue
            except KeyboardInterrupt:
                print("\nkvchat: interrupted; the reply in progress is not saved (every turn before it is)",
                      file=sys.stderr)
                raise
            except Exception as exc:  # noqa: BLE001 — a model step raised (out of GPU memory, say): the turn is lost
                session = session.reopened()
                print(f"\nkvchat: error: the reply failed ({type(exc).__name__}: {exc}); the conversation was "
                      "reopened at its last saved turn", file=sys.stderr)
                continue
            if res.stopped == "cancelled":
                print(" [stopped]", end="")
            print(f"\n  [{res.new_tokens} tokens, {time.perf_counter() - t:.1f} s, cache {res.cache_tokens} "
                  f"tokens / {res.cache_bytes / 2**20:.1f} MiB, evicted {res.evicted_tokens}"
                  + (f"; {note}" if (note := res.recall_note()) else "")
                  + "]", file=sys.stderr)
            for w in res.warnings:
                print(f"warning: {w}", file=sys.stderr)
    finally:
        session.close()
    return 0
