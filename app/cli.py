"""The ``kvchat`` command: chat in the terminal, replay scripts headless, list policies and conversations.

Bad input gets one line on stderr (``kvchat: error: ...``) and exit status 2; nothing is half-written.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sqlite3
import sys
import time
from pathlib import Path

from .. import __version__
from ..core.settings import CACHE_SETTINGS, SAMPLING_SETTINGS, Sampling, Settings
from ..core.step import DECODE
from ..core.weights import WEIGHTS
from ..policies import POLICIES, Param, declared_params, policy_class

EXIT_USAGE = 2


class CLIError(ValueError):
    pass


# ------------------------------------------------------------------------------------------------------------------
# Arguments, generated from the declared settings (core/settings.py) and the policies' declared parameters
# ------------------------------------------------------------------------------------------------------------------
def _model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model", default="default",
                   help="Hugging Face id, local directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    g.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="linear weights: half (an fp16 copy for one-token decode steps; prefill, activations and cache "
                        "as loaded), model (as loaded), auto (half for an fp32 model on the CPU; default auto)")
    g.add_argument("--decode", default="auto", choices=DECODE,
                   help="one-token steps: auto (kvchat's step for Llama-family models, core/step.py, on kvchat's "
                        "operators where they build; others through the model's forward), compiled (that step as one "
                        "torch.compile graph: a minute or two to compile the first time), model (every step through "
                        "the model's forward; default auto)")
    g.add_argument("--device-map", default=None, help="e.g. auto: spread a large model over devices (accelerate)")
    g.add_argument("--chat-template", default=None, help="'plain' or a Jinja file, for models without a template")
    g.add_argument("--db", default=None, help="SQLite database (default: $KVCHAT_HOME/kvchat.db)")


def metavar(p: Param) -> str:
    """How a flag's value is shown in --help: its choices ({a,b}) or its type (INT, FLOAT, STR, BOOL)."""
    return "{" + ",".join(map(str, p.choices)) + "}" if p.choices else p.type.__name__.upper()


def _add_flag(group, p: Param, dest: str, note: str = "", default: str | None = None) -> None:
    """One flag from its declaration. The value stays a string (default None: not given); ``Param.parse`` checks
    it later, so a bad value is one ``kvchat: error:`` line like every other input error."""
    group.add_argument(p.flag, dest=dest, default=None, metavar=metavar(p),
                       help=f"{p.help} ({note}default {p.shown_default if default is None else default})")


def _cache_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cache")
    for p in CACHE_SETTINGS:
        _add_flag(g, p, p.name)
    for name, (p, users) in declared_params().items():
        _add_flag(g, p, f"param_{name}", note=f"policies: {', '.join(users)}; ")


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling flags default to None: the model's own defaults apply to what is not given (``_prepare``)."""
    g = parser.add_argument_group("generation")
    for p in SAMPLING_SETTINGS:
        _add_flag(g, p, p.name, default=f"{p.shown_default} unless the model sets its own")
    g.add_argument("--seed", type=int, default=0, metavar="INT", help="seed of the sampler (default 0)")


def parse_setting(p: Param, value):
    """A cache or sampling setting's value converted and checked by its declaration (ValueError, one line). The
    policy is looked up among the registered ones (its declared choices are those known when it was declared)."""
    if p.name == "policy":
        return policy_class(str(value)).name
    if p.type is bool and not isinstance(value, (bool, str)):  # a checkbox sends a bool: -1, NaN or 1e30 is junk
        raise ValueError(f"{p.name} must be true or false, got {value!r}")
    value = p.parse(value)
    if p.type is int and value is not None and abs(value) > INT_LIMIT:  # 10**100 would overflow a tensor later
        raise ValueError(f"{p.name} must be at most {INT_LIMIT}, got {_short_number(value)}")
    return value


INT_LIMIT = 2**31 - 1


def _short_number(value: int) -> str:
    text = str(value)
    return text if len(text) <= 20 else f"{text[:8]}... ({len(text)} digits)"


def settings_from_args(args) -> Settings:
    """The cache settings given on the command line (each parsed by its declaration), defaults for the rest."""
    given = {p.name: parse_setting(p, getattr(args, p.name)) for p in CACHE_SETTINGS
             if getattr(args, p.name) is not None}
    policy = given.get("policy", Settings.policy)
    cls_params = {p.name for p in POLICIES[policy].params} if policy in POLICIES else set()
    params = {}
    for name in declared_params():
        value = getattr(args, f"param_{name}", None)
        if value is None:
            continue
        if name not in cls_params:
            raise CLIError(f"--{name.replace('_', '-')} does not apply to policy {policy}")
        parse_setting(declared_params()[name][0], value)  # checked here (a huge int); the policy parses it again
        params[name] = value
    return Settings(params=params, **given)


def sampling_from_args(args) -> dict:
    """The sampling settings given on the command line, parsed by their declarations (the rest left out)."""
    return {p.name: parse_setting(p, getattr(args, p.name)) for p in SAMPLING_SETTINGS
            if getattr(args, p.name) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvchat", description="Chat with a local LLM whose KV cache stays bounded.")
    parser.add_argument("--version", action="version", version=f"kvchat {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="chat in the terminal (streamed; /help for commands)")
    _model_args(chat)
    _cache_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt (default: the model's own)")
    chat.add_argument("--resume", type=int, default=None, metavar="ID", help="continue a saved conversation")

    replay = sub.add_parser("replay", help="replay scripted conversations headless")
    replay.add_argument("scripts", nargs="+", help="kvchat JSONL, ShareGPT JSON or MT-Bench JSONL files")
    _model_args(replay)
    _cache_args(replay)
    _sampling_args(replay)
    replay.add_argument("--json", action="store_true", help="JSONL on stdout: one line per turn, then summaries")
    replay.add_argument("--no-save", action="store_true", help="do not store the conversations in the database")
    replay.add_argument("--resume", type=int, default=None, metavar="ID",
                        help="continue stored conversation ID with the script: its turns must be the script's first "
                             "ones; the rest is replayed on its restored cache with its stored cache settings")

    serve = sub.add_parser("serve", help="the web UI (Gradio) on http://127.0.0.1:7860")
    _model_args(serve)
    _cache_args(serve)
    _sampling_args(serve)
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


def load_model(spec: str = "default", device: str = "auto", dtype: str = "auto", device_map: str | None = None,
               chat_template: str | None = None, weights: str = "auto", decode: str = "auto"):
    """Load a chat model with transformers' own logging and progress bars silenced (the CLI and the benches)."""
    from transformers.utils import logging as hf_logging

    from ..core import models

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return models.load(spec, device=device, dtype=dtype, device_map=device_map, chat_template=chat_template,
                       weights=weights, decode=decode)


def _prepare(args, check_settings: bool = True):
    """What chat, replay and serve do first: check the cache and sampling flags (what can be checked before the
    model loads), load the model, then resolve the sampling settings against the model's own defaults and, with
    ``check_settings``, check the cache settings against the model. Returns (settings, sampling, model)."""
    settings = settings_from_args(args)
    settings.validate(max_positions=1 << 30)
    given = sampling_from_args(args)
    Sampling().changed(**given)
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    model = load_model(args.model, device=args.device, dtype=args.dtype, device_map=args.device_map,
                       chat_template=args.chat_template, weights=args.weights,
                       decode=args.decode)
    sampling = Sampling.for_model(model, **given)
    if check_settings:
        settings.validate(model.max_positions, model.rotary_error)
    return settings, sampling, model


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
    nll += f" recalled={r.recalled_tokens}" if r.recalled_tokens else ""
    return (f"{script_i:3d} {r.turn:5d} {r.prompt_tokens:6d} {r.new_tokens:5d} {r.peak_cache_tokens:6d} "
            f"{r.cache_bytes / 2**20:8.1f} {r.evicted_tokens:6d} {r.prefill_ms:8.0f} {dms}  {ans}{hit}{nll}")


def cmd_replay(args) -> int:
    from tqdm import tqdm

    from ..core.session import Session
    from ..storage.db import Store
    from .replay import TURN_FIELDS, Summary, load_scripts, run_step, stored_prefix

    scripts = [s for path in args.scripts for s in load_scripts(path)]
    if args.resume is not None and (len(scripts) != 1 or args.no_save):
        raise CLIError("--resume continues one stored conversation: give one script of one conversation, "
                       "without --no-save")
    settings, sampling, model = _prepare(args)
    store = None if args.no_save else Store(_db_path(args.db))
    done = 0
    if args.resume is not None:
        done = stored_prefix(scripts[0], store, args.resume, model.chat.default_system)
    overall = Summary()
    n_steps = sum(len(s.steps) for s in scripts) - done
    bar = tqdm(total=n_steps, disable=args.json, file=sys.stderr, unit="turn")
    if not args.json:
        tqdm.write("  # turn prompt   new  cache  cache_MB evicted prefill  ms/tok  answer", file=sys.stderr)
    session = None
    for si, script in enumerate(scripts):
        if args.resume is not None:
            session = Session.resume(model, store, args.resume, sampling=sampling)
        else:
            session = Session(model, settings, system=script.system or "default", store=store, sampling=sampling,
                              seed=args.seed, title=Path(script.name).name)
        summary = Summary()
        try:
            for step in script.steps[done:]:
                res = run_step(session, step, {})
                summary.add(res)
                overall.add(res)
                for w in res.warnings:
                    tqdm.write(f"warning: {w}", file=sys.stderr)
                if args.json:
                    print(json.dumps({"script": script.name, **{k: getattr(res, k) for k in TURN_FIELDS}}),
                          flush=True)
                else:
                    tqdm.write(_fmt_row(si, res), file=sys.stderr)
                    bar.update(1)
        except BaseException:
            bar.close()
            session.close()  # its archive goes if no turn of it was stored; the stored turns stay
            raise
        summary.total_tokens = session.total_tokens
        overall.total_tokens += session.total_tokens
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
            f"hits {s['hits']}/{s['expected']}{nll}, recalled {s['recalled_tokens']}, {s['wall_s']:.1f} s, "
            f"peak RSS {s['peak_rss_mb']:.0f} MB")


def _chat_help() -> str:
    lines = ["commands:",
             "  /policy NAME [key=value ...]   switch policy (parameters optional)",
             "  /budget N                      change the budget (a smaller one compresses now)",
             "  /set key=value ...             change settings (below), e.g. /set temperature=0.3 top_k=40",
             "  /stats                         cache and conversation statistics",
             "  /help, /quit                   (a line ending in \\ continues on the next line; Ctrl-C stops a reply)",
             "settings for /set (cache, then sampling):"]
    for p in (*CACHE_SETTINGS, *SAMPLING_SETTINGS):
        key = f"{p.name}={p.kind}"
        lines.append(f"  {key:30s} {p.help} (default {p.shown_default})")
    return "\n".join(lines)


CHAT_HELP = _chat_help()
SETTABLE = {p.name: p for p in (*CACHE_SETTINGS, *SAMPLING_SETTINGS)}


def _set(session, pairs: list[str]) -> dict:
    """``/set key=value ...``: every value parsed first, then the cache settings (``configure``, which checks the
    combination) and the sampling settings applied; ValueError and nothing applied on any bad value."""
    cache, sampling = {}, {}
    for kv in pairs:
        if "=" not in kv:
            raise CLIError(f"/set takes key=value, got {kv!r}")
        k, v = kv.split("=", 1)
        if k not in SETTABLE:
            raise CLIError(f"/set cannot change {k!r} (/help lists the settings)")
        p = SETTABLE[k]
        (cache if p in CACHE_SETTINGS else sampling)[k] = parse_setting(p, v)
    new_sampling = session.sampling.changed(**sampling)
    applied = session.configure(**cache) if cache else {}
    before = session.sampling
    session.sampling = new_sampling
    return {**applied, **{k: v for k, v in new_sampling.as_dict().items() if getattr(before, k) != v}}


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
    elif cmd in ("policy", "budget", "set"):
        if cmd == "policy":
            if not rest:
                raise CLIError(f"/policy needs a name: {', '.join(POLICIES)}")
            applied = session.configure(policy=rest[0], params=dict(kv.split("=", 1) for kv in rest[1:] if "=" in kv))
        elif cmd == "budget":
            if len(rest) != 1 or not rest[0].isdigit():
                raise CLIError("/budget needs one number")
            applied = session.configure(budget=int(rest[0]))
        else:
            applied = _set(session, rest)
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
    settings, sampling, model = _prepare(args)
    from .sessions import SessionManager
    from .web import serve

    manager = SessionManager(model, Store(_db_path(args.db)), settings, sampling, system=args.system or "default",
                             max_sessions=args.max_sessions, max_cache_bytes=int(args.max_cache_mb * 2**20))
    serve(manager, model.name, host=args.host, port=args.port, auth=logins, share=args.share)
    return 0


def cmd_chat(args) -> int:
    from ..core.session import Session
    from ..storage.db import Store

    # A resumed conversation keeps its stored settings: the cache flags are then checked only on their own.
    settings, sampling, model = _prepare(args, check_settings=args.resume is None)
    store = Store(_db_path(args.db))
    if args.resume is not None:
        session = Session.resume(model, store, args.resume, sampling=sampling)
        print(f"resumed conversation {args.resume} ({len(session.messages)} messages, cache restored from "
              f"{session.restored_from}, {session.cache_tokens} tokens)", file=sys.stderr)
    else:
        session = Session(model, settings, system=args.system or "default", store=store, sampling=sampling,
                          seed=args.seed)
    s = session.settings
    print(f"{model.name} | policy {s.policy} | budget {s.budget} | groups {s.groups} | positions {s.positions} | "
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
                  f"tokens / {res.cache_bytes / 2**20:.1f} MiB, evicted {res.evicted_tokens}"
                  + (f", recalled {res.recalled_tokens} in {res.recall_ms:.0f} ms" if res.recalled_tokens else "")
                  + "]", file=sys.stderr)
            for w in res.warnings:
                print(f"warning: {w}", file=sys.stderr)
    finally:
        session.close()
    return 0


def _run_bench(args) -> int:
    from ..bench.cli import run

    return run(args)


def one_line(text: str, limit: int = 500) -> str:
    """An error message as one printable line of at most ``limit`` characters: control characters (a newline in
    an echoed key, an escape sequence) and unpaired surrogates are shown escaped, a long message is cut."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    from ..core.models import ModelError
    from ..core.procinfo import tune_malloc

    tune_malloc()

    commands = {"serve": cmd_serve, "chat": cmd_chat, "replay": cmd_replay, "policies": cmd_policies,
                "conversations": cmd_conversations}
    commands["bench"] = _run_bench
    try:
        return commands[args.command](args)
    except (ValueError, ModelError, OSError, sqlite3.Error) as exc:
        print(f"kvchat: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
