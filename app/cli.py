"""The ``kvchat`` command: chat in the terminal, replay scripts headless, list policies and conversations.

Bad input gets one line on stderr (``kvchat: error: ...``) and exit status 2; nothing is half-written.
"""

from __future__ import annotations

import json
import logging
import signal
import sqlite3
import sys
import threading
from pathlib import Path

from ..core.engine.settings import CACHE_SETTINGS, SAMPLING_SETTINGS
from ..core.model.names import local_model
from ..policies import POLICIES, Param
from .args import (CLIError, build_parser, check_installed, check_resume, db_path, load, prepare, resumed_changes,
                   settings_text)

EXIT_USAGE = 2


def _setting_line(p: Param) -> str:
    return f"{p.flag} ({p.kind}, default {p.shown_default}): {p.help}"


def cmd_policies(args) -> int:
    if args.json:
        out = {name: {"summary": cls.summary, "bounded": cls.bounded,
                      "params": [{"name": p.name, "type": p.type.__name__, "default": p.default, "help": p.help,
                                  "choices": p.choices} for p in cls.params]}
               for name, cls in POLICIES.items()}
        print(json.dumps(out, indent=2))
        return 0
    for name, cls in POLICIES.items():
        print(f"{name:12s} {cls.summary}")
        for p in cls.params:
            print(f"{'':12s}   --{p.name.replace('_', '-')} ({p.type.__name__}, default {p.default}): {p.help}")
    print("\ncache settings (every policy; /set in the chat, the settings panel in the web UI):")
    for p in CACHE_SETTINGS:
        print(f"  {_setting_line(p)}")
    print("\nsampling settings:")
    for p in SAMPLING_SETTINGS:
        print(f"  {_setting_line(p)}")
    return 0


def cmd_conversations(args) -> int:
    from ..storage.db import Store

    path = db_path(args.db)
    if not path.exists() and (args.db is not None or args.action != "list"):  # (none stored yet: an empty list)
        raise CLIError(f"no database at {path}")
    if args.search and args.action != "list":
        raise CLIError(f"--search lists conversations: it goes with list, not {args.action}")
    if args.action == "list":
        rows = Store(path).conversations(args.search) if path.exists() else []
        if args.json:
            print(json.dumps(rows))
            return 0
        if not rows:
            print(f"no conversations with “{args.search.strip()}” in {path}" if args.search.strip() else
                  f"no conversations yet (kvchat stores them in {path})")
        for r in rows:
            s = r["settings"] or {}
            print(f"{r['id']:5d}  {r['updated_at'][:19]}  {r['messages']:4d} msgs {r['total_tokens']:7d} tok "
                  f"{r['disk_bytes'] / 2**20:7.1f} MB  {s.get('policy', '?'):10s} {r['title']}")
        return 0
    if args.id is None:
        raise CLIError(f"conversations {args.action} needs a conversation id")
    store = Store(path)
    if args.action == "export":
        from .scripts import export_script, replay_command

        lines = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in export_script(store, args.id))
        if args.output:
            Path(args.output).write_text(lines, encoding="utf-8")
        else:
            sys.stdout.write(lines)
        print(f"replay it as it began: {replay_command(store, args.id, args.output or 'FILE')}", file=sys.stderr)
    elif args.action == "show":
        conv = store.conversation(args.id)
        if args.json:
            print(json.dumps({"conversation": conv, "messages": store.messages(args.id),
                              "turn_stats": store.turn_stats(args.id)}))
            return 0
        settings = conv.get("live_settings") or conv["settings"]  # what a reopen takes (Store.record_live_settings)
        print(f"# {conv['title']} ({conv['model']}, {settings.get('policy')})")
        for m in store.messages(args.id):
            print(f"[{m['role']}] {m['text']}")
    elif args.action == "rename":
        if not args.title:
            raise CLIError("conversations rename needs a new title")
        store.rename(args.id, args.title)
    elif args.action == "delete":
        store.delete(args.id)
    return 0


def _fmt_row(script_i: int, r) -> str:
    dms = f"{r.decode_ms_per_token:7.1f}" if r.decode_ms_per_token else "      -"
    ans = (r.answer or "").replace("\n", " ")[:48]
    hit = "" if r.hit is None else (" HIT" if r.hit else " miss")
    nll = f" nll={r.expect_nll:.2f}" if r.expect_nll is not None else ""
    nll += f" recalled={r.recalled_tokens}" if r.recalled_tokens else ""
    return (f"{script_i:3d} {r.turn:5d} {r.prompt_tokens:6d} {r.new_tokens:5d} {r.peak_cache_tokens:6d} "
            f"{r.cache_bytes / 2**20:8.1f} {r.evicted_tokens:6d} {r.prefill_ms:8.0f} {dms}  {ans}{hit}{nll}")


def cmd_replay(args) -> int:
    from tqdm import tqdm

    from ..core.engine.session import Session
    from ..storage.db import Store
    from .replay import Summary, check_switches, run_step, stored_prefix, switched, turn_line
    from .scripts import load_scripts

    scripts = [s for path in args.scripts for s in load_scripts(path)]
    if args.compare is not None:
        from . import compare

        compared = compare.compared_settings(args)
        return compare.run(args, scripts, compared, *load(args))
    if args.resume is not None and (len(scripts) != 1 or args.no_save):
        raise CLIError("--resume continues one stored conversation: give one script of one conversation, "
                       "without --no-save")
    check_resume(args)
    settings, sampling, model = prepare(args, check_settings=args.resume is None)  # resumed: checked as applied
    if args.resume is None:
        for script in scripts:
            check_switches(script, settings, model.max_positions, model.rotary_error)
    store = None if args.no_save else Store(db_path(args.db))
    done = 0
    if args.resume is not None:
        done = stored_prefix(scripts[0], store, args.resume, model.chat.default_system)
    overall = Summary()
    bar = tqdm(total=sum(step.turn for s in scripts for step in s.steps[done:]), disable=args.json, file=sys.stderr,
               unit="turn")
    if not args.json:
        tqdm.write("  # turn prompt   new  cache  cache_MB evicted prefill  ms/tok  answer", file=sys.stderr)
    session = None
    for si, script in enumerate(scripts):
        if args.resume is not None:
            session = Session.resume(model, store, args.resume, sampling=sampling)
            try:
                _resumed_settings(args, session, script, done)
            except BaseException:
                session.close()
                raise
        else:
            session = Session(model, settings, system=script.system or "default", store=store, sampling=sampling,
                              seed=args.seed, title=Path(script.name).name)
        summary = Summary()
        try:
            for step in script.steps[done:]:
                if step.kind == "set":
                    applied = switched(session, step)
                    if args.json:
                        print(json.dumps({"script": script.name, "line": step.where, "set": applied}), flush=True)
                    else:
                        tqdm.write(f"  set at {step.where}: {settings_text(applied) or 'no change'}", file=sys.stderr)
                    continue
                res = run_step(session, step, {})
                summary.add(res)
                overall.add(res)
                for w in res.warnings:
                    tqdm.write(f"warning: {w}", file=sys.stderr)
                if args.json:
                    print(json.dumps(turn_line(script, res)), flush=True)
                else:
                    tqdm.write(_fmt_row(si, res), file=sys.stderr)
                    bar.update(1)
        except BaseException:
            bar.close()
            raise
        finally:
            session.close()  # its files go if no turn of it was stored (--no-save: recall's temporary digests)
        summary.total_tokens = session.total_tokens
        overall.total_tokens += session.total_tokens
        if len(scripts) > 1:
            line = {"script_summary": {"script": script.name, **summary.as_dict(session)}}
            print(json.dumps(line) if args.json else _human_summary(line["script_summary"]), flush=True)
    bar.close()
    final = {"summary": overall.as_dict(session)}
    print(json.dumps(final) if args.json else _human_summary(final["summary"]), flush=True)
    return 0


def _resumed_settings(args, session, script, done: int) -> None:
    """A resumed replay's settings: the cache flags given, changed by the script's set lines before where it goes
    on (so the command that was interrupted, ``--resume`` added, changes nothing), its set lines after that checked
    from there."""
    from tqdm import tqdm

    from .replay import check_switches, replayed_settings

    stored, model = session.settings, session.model
    target, sampling = replayed_settings(script, done, stored.changed(**resumed_changes(args, stored)),
                                         session.sampling)
    target.validate(model.max_positions, model.rotary_error)
    check_switches(script, target, model.max_positions, model.rotary_error, start=done)
    session.sampling = sampling
    if applied := session.configure(**stored.changes_to(target)):
        tqdm.write(f"changed from its stored settings: {settings_text(applied)}", file=sys.stderr)


def _human_summary(s: dict) -> str:
    head = f"script {s['script']}: " if "script" in s else "summary: "
    nll = f", mean expect NLL {s['mean_expect_nll']:.3f}" if s["mean_expect_nll"] is not None else ""
    return (f"{head}{s['policy']} {s['turns']} turns, {s['total_tokens']} tokens, max cache {s['max_cache_tokens']} "
            f"tokens / {s['max_cache_bytes'] / 2**20:.1f} MiB, evicted {s['evicted_tokens']}, "
            f"hits {s['hits']}/{s['expected']}{nll}, recalled {s['recalled_tokens']}, {s['wall_s']:.1f} s, "
            f"peak RSS {s['peak_rss_mb']:.0f} MB")


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_auth(auth: str | None, auth_file: str | None) -> list[tuple[str, str]]:
    """Logins from --auth USER:PASSWORD and/or an --auth-file of such lines (blank lines and # comments skipped)."""
    entries = []
    if auth is not None:
        entries.append(("--auth", auth))
    if auth_file is not None:
        path = Path(auth_file).expanduser()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise CLIError(f"cannot read auth file {path}: {exc.strerror}") from None
        entries += [(f"{path}:{i}", line.strip()) for i, line in enumerate(lines, 1)
                    if line.strip() and not line.lstrip().startswith("#")]
        if not any(where != "--auth" for where, _ in entries):
            raise CLIError(f"auth file {path} holds no USER:PASSWORD line")
    logins = []
    for where, item in entries:
        user, sep, password = item.partition(":")
        if not sep or not user.strip() or not password:
            raise CLIError(f"{where}: expected USER:PASSWORD")
        logins.append((user.strip(), password))
    return logins


def cmd_serve(args) -> int:
    from ..storage.db import Store

    logins = parse_auth(args.auth, args.auth_file)
    if args.host not in LOCAL_HOSTS and not logins:
        raise CLIError(f"binding {args.host} exposes the chat beyond this machine: give --auth USER:PASSWORD or "
                       "--auth-file")
    if args.share and not logins:
        raise CLIError("--share opens a public link: give --auth USER:PASSWORD or --auth-file")
    if not 0 < args.port < 65536:
        raise CLIError(f"--port must be between 1 and 65535, got {args.port}")
    if args.max_sessions < 1 or args.max_cache_mb <= 0:
        raise CLIError("--max-sessions and --max-cache-mb must be positive")
    _port_free(args.host, args.port)  # before the model loads (Gradio said so after it, naming its own settings)
    settings, sampling, model = prepare(args)
    from .sessions import SessionManager
    from .web import serve

    manager = SessionManager(model, Store(db_path(args.db)), settings, sampling, system=args.system or "default",
                             max_sessions=args.max_sessions, max_cache_bytes=int(args.max_cache_mb * 2**20))
    serve(manager, model.name, host=args.host, port=args.port, auth=logins, share=args.share)
    return 0


def _port_free(host: str, port: int) -> None:
    """CLIError if ``host``:``port`` cannot be served on (in use, or an address this machine does not have)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise CLIError(f"--host {host}: {exc.strerror or exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds, past a closed one's wait
        try:
            probe.bind(address)
        except OSError as exc:
            raise CLIError(f"cannot serve on {host}:{port} ({exc.strerror or exc}; another kvchat serve?): pick "
                           "another --port") from None


def _chat(args) -> int:
    from .terminal import cmd_chat

    return cmd_chat(args)


def _run_bench(args) -> int:
    from ..bench.cli import run

    return run(args)


def one_line(text: str, limit: int = 500) -> str:
    """An error message as one printable line of at most ``limit`` characters: control characters (a newline in
    an echoed key, an escape sequence) and unpaired surrogates are shown escaped, a long message is cut."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    from ..core.engine.procinfo import tune_malloc

    tune_malloc()
    commands = {"serve": cmd_serve, "chat": _chat, "replay": cmd_replay, "policies": cmd_policies,
                "conversations": cmd_conversations, "bench": _run_bench}
    # SIGTERM (kill, timeout, a service manager's stop) ends the command through its cleanup, as an exception: the
    # sessions close and temporary files go (the web UI shuts down as on Ctrl-C); it ended the process on the spot.
    # Every completed turn is stored either way.
    previous = signal.signal(signal.SIGTERM, _terminated) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        check_installed()  # before the imports that would fail on a package out of its range
        if getattr(args, "model", None) is not None and getattr(args, "resume", None) is None:
            local_model(args.model)  # a mistyped path, refused before the command's imports (seconds)
        return commands[args.command](args)
    except (ValueError, OSError, sqlite3.Error) as exc:  # a model that cannot load is a ValueError (ModelError)
        print(f"kvchat: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
