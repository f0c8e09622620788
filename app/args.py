"""The command line's arguments, generated from the declared settings (core/engine/settings.py) and the policies'
declared parameters, and what chat, replay and serve do with them first (``prepare``: check, load the model)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import __version__
from ..bench import HELP as BENCH_HELP
from ..core.decode.parts import DECODE
from ..core.decode.weights import WEIGHTS
from ..core.engine.settings import CACHE_SETTINGS, SAMPLING_SETTINGS, SETTINGS, Sampling, Settings
from ..policies import POLICIES, Param, declared_params, policy_class


class CLIError(ValueError):
    pass


def _model_args(parser: argparse.ArgumentParser, resumes: bool = True) -> None:
    g = parser.add_argument_group("model")
    default = "with --resume, the model that held the conversation; else " if resumes else ""
    g.add_argument("--model", default=None,
                   help=f"Hugging Face id, local directory or .gguf file (default: {default}SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    g.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="linear weights: half (an fp16 copy for one-token decode steps; prefill, activations and cache "
                        "as loaded), model (as loaded), auto (half for an fp32 model on the CPU; default auto)")
    g.add_argument("--decode", default="auto", choices=DECODE,
                   help="one-token steps: auto (on CUDA the graph step in Triton's kernels; on the CPU kvchat's "
                        "step for Llama-family models, core/decode, on kvchat's operators where they build; others "
                        "through the model's forward), graph (the whole step as one CUDA graph, replayed per token), "
                        "compiled (the CPU step as one torch.compile graph: a minute or two to compile the first "
                        "time; on CUDA the graph step's layers compiled first), triton (CUDA: the graph step's layers "
                        "in kvchat's Triton kernels), model (every step through the model's forward; default auto)")
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


def given_settings(args) -> dict:
    """The cache settings given on the command line, each parsed by its declaration (the policy's parameters apart:
    ``given_params``)."""
    return {p.name: parse_setting(p, getattr(args, p.name)) for p in CACHE_SETTINGS
            if getattr(args, p.name) is not None}


def given_params(args) -> dict:
    """The policy parameters given on the command line, each checked by its declaration (a huge int; the policy
    parses it again), whichever policy takes them."""
    params = {}
    for name, (p, _) in declared_params().items():
        value = getattr(args, f"param_{name}", None)
        if value is not None:
            parse_setting(p, value)
            params[name] = value
    return params


def _params(args, policy: str) -> dict:
    """The policy parameters given on the command line, each one ``policy`` must take (CLIError otherwise)."""
    cls_params = {p.name for p in POLICIES[policy].params} if policy in POLICIES else set()
    params = given_params(args)
    for name in params:
        if name not in cls_params:
            raise CLIError(f"--{name.replace('_', '-')} does not apply to policy {policy}")
    return params


def settings_from_args(args) -> Settings:
    """The cache settings given on the command line (each parsed by its declaration), defaults for the rest. With
    ``--resume`` the policy parameters are checked against the resumed conversation's policy (``resumed_changes``)."""
    given = given_settings(args)
    if getattr(args, "resume", None) is not None and "policy" not in given:
        return Settings(**given)
    return Settings(params=_params(args, given.get("policy", Settings.policy)), **given)


def settings_text(values: dict) -> str:
    """Settings, or changes to them, as key=value, a policy's parameters (``params``) among them: what the terminal
    and replay print of a change."""
    items = []
    for k, v in values.items():
        items.extend(v.items() if k == "params" and isinstance(v, dict) else [(k, v)])
    return ", ".join(f"{k}={v}" for k, v in items)


def sort_settings(items, param) -> tuple[dict, dict, dict]:
    """``(key, value)`` items as (cache settings, sampling settings, policy parameters), each value parsed by its
    declaration; a key that names no setting is a policy parameter, ``param(key)`` its declaration (ValueError with
    the reason where it has none). ValueError naming every bad item, in one line: what ``/set``, ``/policy`` and a
    replay's set line refuse."""
    cache, sampling, params, errors = {}, {}, {}, []
    for k, v in items:
        try:
            if k in SETTINGS:
                (cache if SETTINGS[k] in CACHE_SETTINGS else sampling)[k] = parse_setting(SETTINGS[k], v)
            else:
                params[k] = parse_setting(param(k), v)
        except ValueError as exc:
            errors.append(str(exc))
    if errors:
        raise CLIError("; ".join(errors))
    return cache, sampling, params


def apply_settings(session, cache: dict, sampling: dict) -> dict:
    """Cache changes (``Session.configure``'s, which checks the combination) and sampling changes applied to a live
    session, as ``/set`` and a replay's set line make them; nothing applied if either is bad (ValueError). What
    changed."""
    new_sampling = session.sampling.changed(**sampling)
    applied = session.configure(**cache) if cache else {}
    before, session.sampling = session.sampling, new_sampling
    return {**applied, **{k: v for k, v in new_sampling.as_dict().items() if getattr(before, k) != v}}


def resumed_changes(args, settings: Settings) -> dict:
    """The cache flags given with ``--resume``, as changes to the resumed conversation's ``settings`` for
    ``Session.configure`` (as ``/policy`` and ``/set`` make them; its policy's parameters kept unless the policy
    changes: ``Settings.changed``), a given parameter checked against the policy it will apply to. Empty when none
    is given."""
    changes = given_settings(args)
    policy = changes.get("policy", settings.policy)
    params = _params(args, policy)
    if params:
        changes["params"] = params
    return changes


def sampling_from_args(args) -> dict:
    """The sampling settings given on the command line, parsed by their declarations (the rest left out)."""
    return {p.name: parse_setting(p, getattr(args, p.name)) for p in SAMPLING_SETTINGS
            if getattr(args, p.name) is not None}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """kvchat's parser. ``bench``'s own parsers (each benchmark's options) are built only where ``argv`` (default
    ``sys.argv[1:]``) names it: they import the engine and transformers, seconds that the other commands, and
    ``kvchat --help``, need not wait for."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvchat", description="Chat with a local LLM whose KV cache stays bounded.")
    parser.add_argument("--version", action="version", version=f"kvchat {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="chat in the terminal (streamed; /help for commands)")
    _model_args(chat)
    _cache_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt (default: the model's own)")
    chat.add_argument("--resume", type=int, default=None, metavar="ID",
                      help="continue a saved conversation, cache restored, with its stored settings changed by the "
                           "cache flags given (as /policy and /set change them)")
    chat.add_argument("--no-undo", action="store_true",
                      help="keep no copy of the cache from before the last exchange: /undo and /retry refuse, and the "
                           "chat holds less memory (60-210 MB less peak RSS at budget 1024 with the default model)")

    replay = sub.add_parser("replay", help="replay scripted conversations headless")
    replay.add_argument("scripts", nargs="+", help="kvchat JSONL, ShareGPT JSON or MT-Bench JSONL files")
    _model_args(replay)
    _cache_args(replay)
    _sampling_args(replay)
    replay.add_argument("--json", action="store_true", help="JSONL on stdout: one line per turn, then summaries")
    replay.add_argument("--no-save", action="store_true", help="do not store the conversations in the database")
    replay.add_argument("--resume", type=int, default=None, metavar="ID",
                        help="continue stored conversation ID with the script: its turns must be the script's first "
                             "ones; the rest is replayed on its restored cache with its stored cache settings, changed "
                             "by the cache flags given")
    replay.add_argument("--compare", default=None, metavar="POLICY[:BUDGET],...",
                        help="replay the scripts under each policy listed (comma-separated, each at the budget given "
                             "after it or --budget; the cache flags apply to each, a policy's parameters to the "
                             "policies that take them) and print them side by side: hits, cache, evictions, replies "
                             "the same as the first entry's, speed; nothing is stored")

    serve = sub.add_parser("serve", help="the web UI (Gradio) on http://127.0.0.1:7860")
    _model_args(serve, resumes=False)
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
    conv.add_argument("--search", default="", metavar="TEXT",
                      help="list only the conversations whose title or any message contains TEXT")
    conv.add_argument("--output", "-o", default=None, help="export to this file instead of stdout")
    conv.add_argument("--json", action="store_true")

    if "bench" in argv:
        from ..bench.cli import add_parser as add_bench_parser

        add_bench_parser(sub)
    else:
        sub.add_parser("bench", help=BENCH_HELP)
    return parser


def db_path(arg: str | None) -> Path:
    from ..storage.files import kvchat_home

    return Path(arg).expanduser() if arg else kvchat_home() / "kvchat.db"


def check_installed(distribution: str = "kvchat") -> None:
    """CLIError naming a package installed outside the range kvchat declares for it (an environment installed with
    ``--no-deps``, or a package changed after kvchat): an older transformers fails only at the first cache, with a
    TypeError from deep in its cache classes. The ranges are read from kvchat's installed metadata (pyproject.toml);
    a source tree run without installing has none, and is not checked."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version

    try:
        declared = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return
    for line in declared:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):  # an extra's (tests), another platform's
            continue
        bounds = sorted(map(str, req.specifier), key=lambda b: not b.startswith(">"))  # the lower bound first
        wanted = req.name + ",".join(bounds)
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            raise CLIError(f"kvchat needs {wanted}, which is not installed: pip install '{wanted}'") from None
        try:
            version = Version(have)
        except InvalidVersion:  # a version string that is not PEP 440 (a local build's): not judged
            continue
        if not req.specifier.contains(version, prereleases=True):
            raise CLIError(f"kvchat needs {wanted}, but {req.name} {have} is installed: pip install '{wanted}'")


def check_resume(args) -> None:
    """A ``--resume`` that cannot open, refused before the model loads (seconds): no such conversation in the
    database, one another process has open, or a ``--model`` other than the one that held it. Without ``--model`` it
    takes that model. Opening it checks all three again."""
    if args.resume is None:
        return
    from ..core.model.names import check_held_by
    from ..storage.db import Store

    path = db_path(args.db)
    if not path.is_file():  # not made here: a typo in --db leaves no empty database behind
        raise CLIError(f"no conversation {args.resume} in {path}")
    own = Store(path).check_openable(args.resume)["model"]
    if args.model is None:
        args.model = own
    else:
        check_held_by(args.resume, own, args.model)


def prepare(args, check_settings: bool = True):
    """What chat, replay and serve do first: check the cache and sampling flags (what can be checked before the
    model loads), load the model (``load``) and, with ``check_settings``, check the cache settings against it.
    Returns (settings, sampling, model)."""
    settings = settings_from_args(args)
    if check_settings:  # else a resumed conversation's: its own settings changed by the flags, checked when applied
        settings.validate(max_positions=1 << 30)
    sampling, model = load(args)
    if check_settings:
        settings.validate(model.max_positions, model.rotary_error)
    return settings, sampling, model


def load(args):
    """Check the sampling flags, load the model, and resolve the sampling settings against the model's own
    defaults. Returns (sampling, model)."""
    given = sampling_from_args(args)
    Sampling().changed(**given)
    from ..core.model.names import DEFAULT_MODEL

    spec = DEFAULT_MODEL if args.model is None else args.model
    print(f"loading {spec} ...", file=sys.stderr, flush=True)
    from ..core.model.loading import load_model

    model = load_model(spec, device=args.device, dtype=args.dtype, device_map=args.device_map,
                       chat_template=args.chat_template, weights=args.weights,
                       decode=args.decode)
    return Sampling.for_model(model, **given), model
