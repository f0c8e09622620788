"""The ``kvchat`` command: chat in the terminal, replay scripts headless, list policies and conversations.

Bad input gets one line on stderr (``kvchat: error: ...``) and exit status 2; nothing is half-written.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path

from .. import __version__
from ..core.settings import Settings
from ..policies import POLICIES, declared_params

EXIT_USAGE = 2


class CLIError(ValueError):
    pass


# ------------------------------------------------------------------------------------------------------------------
# Arguments, generated from the settings and the policies' declared parameters
# ------------------------------------------------------------------------------------------------------------------
def _model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model", default="default",
                   help="Hugging Face id, local directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    g.add_argument("--device-map", default=None, help="e.g. auto: spread a large model over devices (accelerate)")
    g.add_argument("--chat-template", default=None, help="'plain' or a Jinja file, for models without a template")
    g.add_argument("--db", default=None, help="SQLite database (default: $KVCHAT_HOME/kvchat.db)")


def _cache_args(parser: argparse.ArgumentParser) -> None:
    d = Settings()
    g = parser.add_argument_group("cache")
    g.add_argument("--policy", default=d.policy, help=f"eviction policy: {', '.join(POLICIES)}")
    g.add_argument("--budget", type=int, default=d.budget, help="cached positions per layer")
    g.add_argument("--sink", type=int, default=d.sink, help="first tokens always kept (attention sink)")
    g.add_argument("--window", type=int, default=None, help="most recent tokens always kept (default budget/4)")
    g.add_argument("--slack", type=int, default=None,
                   help="compress when the cache reaches budget+slack (default and max: max(64, budget/8))")
    g.add_argument("--groups", default=d.groups, choices=["token", "sentence", "turn"], help="eviction unit")
    g.add_argument("--positions", default=d.positions, choices=["rerotate", "original"],
                   help="re-rotate kept keys to 0..n-1, or keep absolute positions")
    g.add_argument("--aggregate", default=d.aggregate, choices=["mean", "max", "sum"],
                   help="how token scores become a group score")
    for name, (p, users) in declared_params().items():
        g.add_argument(f"--{name.replace('_', '-')}", dest=f"param_{name}", default=None,
                       help=f"{p.help} (policies: {', '.join(users)}; default {p.default})")


def _sampling_args(parser: argparse.ArgumentParser, temperature: float) -> None:
    g = parser.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.9)
    g.add_argument("--seed", type=int, default=0)


def settings_from_args(args) -> Settings:
    cls_params = {p.name for p in POLICIES[args.policy].params} if args.policy in POLICIES else set()
    params = {}
    for name in declared_params():
        value = getattr(args, f"param_{name}", None)
        if value is None:
            continue
        if name not in cls_params:
            raise CLIError(f"--{name.replace('_', '-')} does not apply to policy {args.policy}")
        params[name] = value
    return Settings(policy=args.policy, params=params, budget=args.budget, sink=args.sink, window=args.window,
                    slack=args.slack, groups=args.groups, positions=args.positions, aggregate=args.aggregate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvchat", description="Chat with a local LLM whose KV cache stays bounded.")
    parser.add_argument("--version", action="version", version=f"kvchat {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="chat in the terminal (streamed; /help for commands)")
    _model_args(chat)
    _cache_args(chat)
    _sampling_args(chat, temperature=0.7)
    chat.add_argument("--system", default=None, help="system prompt (default: the model's own)")
    chat.add_argument("--resume", type=int, default=None, metavar="ID", help="continue a saved conversation")

    replay = sub.add_parser("replay", help="replay scripted conversations headless")
    replay.add_argument("scripts", nargs="+", help="kvchat JSONL, ShareGPT JSON or MT-Bench JSONL files")
    _model_args(replay)
    _cache_args(replay)
    _sampling_args(replay, temperature=0.0)
    replay.add_argument("--json", action="store_true", help="JSONL on stdout: one line per turn, then summaries")
    replay.add_argument("--no-save", action="store_true", help="do not store the conversations in the database")

    serve = sub.add_parser("serve", help="the web UI (Gradio) on http://127.0.0.1:7860")
    _model_args(serve)
    _cache_args(serve)
    _sampling_args(serve, temperature=0.7)
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; any other needs --auth or --auth-file)")
    g.add_argument("--port", type=int, default=7860)
    g.add_argument("--auth", default=None, metavar="USER:PASSWORD", help="require this login")
    g.add_argument("--auth-file", default=None, help="file of USER:PASSWORD lines, one login each")
    g.add_argument("--share", action="store_true", help="also open a public Gradio share link (needs --auth)")
    g.add_argument("--max-sessions", type=int, default=8, help="browser sessions with a chat open at once")
    g.add_argument("--max-cache-mb", type=float, default=2048,
                   help="cache memory all sessions may reserve together (MB)")
    serve.add_argument("--system", default=None, help="system prompt of new conversations (default: the model's)")

    pol = sub.add_parser("policies", help="list eviction policies and their parameters")
    pol.add_argument("--json", action="store_true")

    conv = sub.add_parser("conversations", help="list, show, export, rename or delete saved conversations")
    conv.add_argument("action", nargs="?", default="list", choices=["list", "show", "export", "rename", "delete"])
    conv.add_argument("id", nargs="?", type=int)
    conv.add_argument("title", nargs="?", help="new title (rename)")
    conv.add_argument("--db", default=None)
    conv.add_argument("--output", "-o", default=None, help="export to this file instead of stdout")
    conv.add_argument("--json", action="store_true")

    from ..bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    return parser


# ------------------------------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------------------------------
def _db_path(arg: str | None) -> Path:
    from ..core.models import kvchat_home

    return Path(arg).expanduser() if arg else kvchat_home() / "kvchat.db"


def _load_model(args):
    from transformers.utils import logging as hf_logging

    from ..core import models

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    return models.load(args.model, device=args.device, dtype=args.dtype, device_map=args.device_map,
                       chat_template=args.chat_template)


def cmd_policies(args) -> int:
    d = Settings()
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
    print(f"\ncache flags (every policy): --budget {d.budget} --sink {d.sink} --window budget/4 "
          f"--slack max(64,budget/8) --groups token|sentence|turn --positions rerotate|original")
    return 0


def cmd_conversations(args) -> int:
    from ..storage.db import Store

    path = _db_path(args.db)
    if not path.exists():
        raise CLIError(f"no database at {path}")
    store = Store(path)
    if args.action == "list":
        rows = store.conversations()
        if args.json:
            print(json.dumps(rows))
            return 0
        if not rows:
            print("no conversations")
        for r in rows:
            s = r["settings"] or {}
            print(f"{r['id']:5d}  {r['updated_at'][:19]}  {r['messages']:4d} msgs {r['total_tokens']:7d} tok  "
                  f"{s.get('policy', '?'):10s} {r['title']}")
        return 0
    if args.id is None:
        raise CLIError(f"conversations {args.action} needs a conversation id")
    if args.action == "export":
        lines = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in store.export_replay(args.id))
        if args.output:
            Path(args.output).write_text(lines, encoding="utf-8")
        else:
            sys.stdout.write(lines)
    elif args.action == "show":
        conv = store.conversation(args.id)
        if args.json:
            print(json.dumps({"conversation": conv, "messages": store.messages(args.id),
                              "turn_stats": store.turn_stats(args.id)}))
            return 0
        print(f"# {conv['title']} ({conv['model']}, {conv['settings'].get('policy')})")
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
    return (f"{script_i:3d} {r.turn:5d} {r.prompt_tokens:6d} {r.new_tokens:5d} {r.peak_cache_tokens:6d} "
            f"{r.cache_bytes / 2**20:8.1f} {r.evicted_tokens:6d} {r.prefill_ms:8.0f} {dms}  {ans}{hit}{nll}")


def cmd_replay(args) -> int:
    from tqdm import tqdm

    from ..core.session import Sampling, Session
    from ..storage.db import Store
    from .replay import TURN_FIELDS, Summary, load_scripts, run_step

    scripts = [s for path in args.scripts for s in load_scripts(path)]
    settings = settings_from_args(args)
    settings.validate(max_positions=1 << 30)  # what can be checked before the model loads
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p).validate()
    cm = _load_model(args)
    settings.validate(cm.max_positions, cm.rotary_error)
    store = None if args.no_save else Store(_db_path(args.db))
    overall = Summary()
    n_steps = sum(len(s.steps) for s in scripts)
    bar = tqdm(total=n_steps, disable=args.json, file=sys.stderr, unit="turn")
    if not args.json:
        tqdm.write("  # turn prompt   new  cache  cache_MB evicted prefill  ms/tok  answer", file=sys.stderr)
    session = None
    for si, script in enumerate(scripts):
        session = Session(cm, settings, system=script.system or "default", store=store, sampling=sampling,
                          seed=args.seed, title=Path(script.name).name)
        summary = Summary()
        for step in script.steps:
            res = run_step(session, step, {})
            summary.add(res)
            overall.add(res)
            for w in res.warnings:
                tqdm.write(f"warning: {w}", file=sys.stderr)
            if args.json:
                print(json.dumps({"script": script.name, **{k: getattr(res, k) for k in TURN_FIELDS}}), flush=True)
            else:
                tqdm.write(_fmt_row(si, res), file=sys.stderr)
                bar.update(1)
        summary.total_tokens = session.total_tokens
        overall.total_tokens += session.total_tokens
        session.save_snapshot()
        if len(scripts) > 1:
            line = {"script_summary": {"script": script.name, **summary.as_dict(session)}}
            print(json.dumps(line) if args.json else _human_summary(line["script_summary"]), flush=True)
    bar.close()
    final = {"summary": overall.as_dict(session)}
    print(json.dumps(final) if args.json else _human_summary(final["summary"]), flush=True)
    return 0


def _human_summary(s: dict) -> str:
    head = f"script {s['script']}: " if "script" in s else "summary: "
    nll = f", mean expect NLL {s['mean_expect_nll']:.3f}" if s["mean_expect_nll"] is not None else ""
    return (f"{head}{s['policy']} {s['turns']} turns, {s['total_tokens']} tokens, max cache {s['max_cache_tokens']} "
            f"tokens / {s['max_cache_bytes'] / 2**20:.1f} MiB, evicted {s['evicted_tokens']}, "
            f"hits {s['hits']}/{s['expected']}{nll}, {s['wall_s']:.1f} s, peak RSS {s['peak_rss_mb']:.0f} MB")


CHAT_HELP = """commands:
  /policy NAME [key=value ...]   switch policy (parameters optional)
  /budget N                      change the budget (a smaller one compresses now)
  /set key=value ...             change sink, window, slack, groups, positions, aggregate
  /stats                         cache and conversation statistics
  /save                          write a cache snapshot now
  /help, /quit                   (a line ending in \\ continues on the next line; Ctrl-C stops a reply)"""


def _chat_command(session, line: str) -> bool:
    """Run a /command; False to quit."""
    parts = shlex.split(line[1:])
    if not parts:
        return True
    cmd, rest = parts[0], parts[1:]
    if cmd in ("quit", "exit", "q"):
        return False
    if cmd == "help":
        print(CHAT_HELP)
    elif cmd == "stats":
        for k, v in session.stats().items():
            print(f"  {k}: {v}")
    elif cmd == "save":
        path = session.save_snapshot()
        print(f"  snapshot: {path}" if path else "  nothing to save yet")
    elif cmd in ("policy", "budget", "set"):
        changes: dict = {}
        if cmd == "policy":
            if not rest:
                raise CLIError(f"/policy needs a name: {', '.join(POLICIES)}")
            changes["policy"] = rest[0]
            changes["params"] = dict(kv.split("=", 1) for kv in rest[1:] if "=" in kv)
        elif cmd == "budget":
            if len(rest) != 1 or not rest[0].isdigit():
                raise CLIError("/budget needs one number")
            changes["budget"] = int(rest[0])
        else:
            for kv in rest:
                if "=" not in kv:
                    raise CLIError(f"/set takes key=value, got {kv!r}")
                k, v = kv.split("=", 1)
                if k not in ("sink", "window", "slack", "groups", "positions", "aggregate"):
                    raise CLIError(f"/set cannot change {k!r}")
                changes[k] = int(v) if k in ("sink", "window", "slack") else v
        applied = session.configure(**changes)
        print(f"  applied: {applied}" if applied else "  no change")
    else:
        raise CLIError(f"unknown command /{cmd} (/help lists them)")
    return True


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
    from ..core.session import Sampling
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
    settings = settings_from_args(args)
    settings.validate(max_positions=1 << 30)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p).validate()
    cm = _load_model(args)
    settings.validate(cm.max_positions, cm.rotary_error)
    from .sessions import SessionManager
    from .web import serve

    manager = SessionManager(cm, Store(_db_path(args.db)), settings, sampling, system=args.system or "default",
                             max_sessions=args.max_sessions, max_cache_bytes=int(args.max_cache_mb * 2**20))
    serve(manager, cm.name, host=args.host, port=args.port, auth=logins, share=args.share)
    return 0


def cmd_chat(args) -> int:
    from ..core.session import Sampling, Session
    from ..storage.db import Store

    settings = settings_from_args(args)
    settings.validate(max_positions=1 << 30)  # what can be checked before the model loads
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p).validate()
    cm = _load_model(args)
    store = Store(_db_path(args.db))
    if args.resume is not None:
        session = Session.resume(cm, store, args.resume, sampling=sampling)
        print(f"resumed conversation {args.resume} ({len(session.messages)} messages, cache restored from "
              f"{session.restored_from}, {session.cache_tokens} tokens)", file=sys.stderr)
    else:
        settings.validate(cm.max_positions, cm.rotary_error)
        session = Session(cm, settings, system=args.system or "default", store=store, sampling=sampling,
                          seed=args.seed)
    s = session.settings
    print(f"{cm.name} | policy {s.policy} | budget {s.budget} | groups {s.groups} | positions {s.positions} | "
          "/help for commands", file=sys.stderr)
    try:
        while True:
            try:
                line = input("you> ")
                while line.endswith("\\"):
                    line = line[:-1] + "\n" + input("...> ")
            except EOFError:
                print()
                break
            if not line.strip():
                continue
            try:
                if line.startswith("/"):
                    if not _chat_command(session, line):
                        break
                    continue
                gen = session.reply(line)
            except ValueError as exc:
                print(f"kvchat: error: {exc}", file=sys.stderr)
                continue
            print("bot> ", end="", flush=True)
            t = time.perf_counter()
            try:
                for delta in gen:
                    print(delta, end="", flush=True)
            except KeyboardInterrupt:
                gen.close()
                print(" [stopped]", end="")
            res = session.history[-1]
            print(f"\n  [{res.new_tokens} tokens, {time.perf_counter() - t:.1f} s, cache {res.cache_tokens} "
                  f"tokens / {res.cache_bytes / 2**20:.1f} MiB, evicted {res.evicted_tokens}]", file=sys.stderr)
            for w in res.warnings:
                print(f"warning: {w}", file=sys.stderr)
            session.save_snapshot()
    finally:
        session.save_snapshot()
    return 0


def _run_bench(args) -> int:
    from ..bench.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    from ..core.models import ModelError

    commands = {"serve": cmd_serve, "chat": cmd_chat, "replay": cmd_replay, "policies": cmd_policies,
                "conversations": cmd_conversations}
    commands["bench"] = _run_bench
    try:
        return commands[args.command](args)
    except (ValueError, ModelError, OSError) as exc:
        print(f"kvchat: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
