"""``kvchat bench NAME``: run a benchmark, write its JSON, plots and the regenerated docs/RESULTS.md.

Names: ppl, recall, speed, memory, headaware, kvpress, chat, durability, ``all`` (each in turn, one model load)
and ``report`` (regenerate RESULTS.md and plots from the JSON present). ``--quick`` runs CI's small sizes and
asserts only the sanity checks; a failed sanity check ends the command with status 1 and a one-line message.

Full runs write under ``docs/`` (the committed results) unless ``--out`` says otherwise; quick runs write under
``$KVCHAT_HOME/bench-quick`` unless ``--out`` is given, so they never overwrite the committed results.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from ..core.decode.compiled import CompiledStep
from ..core.decode.parts import DECODE
from ..core.decode.weights import WEIGHTS
from ..policies import POLICIES
from . import HELP

ORDER = ("ppl", "recall", "speed", "memory", "headaware", "kvpress", "chat", "durability")
REPORTED = ORDER + ("speed_cuda",)  # speed on a GPU: ``kvchat bench speed --device cuda``, its own results
EXIT_SANITY = 1
NON_NEGATIVE = ("sinks", "margin", "recompute_lengths", "seed")  # integer options where 0 is meaningful
DOCS = "docs"  # full runs' default output: the committed results
QUICK_DIR = "bench-quick"  # quick runs' default output, under $KVCHAT_HOME


def _module(name: str):
    return importlib.import_module(f"{__package__}.{name}")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="CI sizes: a few minutes in all, sanity checks asserted")
    p.add_argument("--out", default=None,
                   help=f"output folder: results/*.json, plots/*.png, RESULTS.md (default: {DOCS}; with --quick "
                        f"$KVCHAT_HOME/{QUICK_DIR}, leaving the committed results alone)")
    p.add_argument("--json", action="store_true", help="also print the result JSON on stdout (one line per bench)")
    p.add_argument("--model", default="default", help="Hugging Face id, local directory or .gguf file")
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="linear weights as kvchat chat --weights (default auto: half for an fp32 model on the CPU)")
    p.add_argument("--decode", default="auto", choices=DECODE,
                   help="one-token steps as kvchat chat --decode (default auto: kvchat's step for Llama-family models)")


def add_parser(sub) -> None:
    """Add the ``bench`` subcommand to kvchat's subparsers."""
    bench = sub.add_parser("bench", help=HELP,
                           description="Run a benchmark; write its JSON, plots and the regenerated RESULTS.md.")
    names = bench.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name in ORDER:
        mod = _module(name)
        p = names.add_parser(name, help=mod.TITLE, description=mod.__doc__.strip().splitlines()[0])
        _common(p)
        mod.add_arguments(p)
    _common(names.add_parser("all", help="every benchmark in turn (one model load), then the report"))
    p = names.add_parser("report", help="regenerate RESULTS.md and the plots from the JSON present")
    p.add_argument("--out", default=DOCS)


def output_dir(args) -> Path:
    """Where a run writes: ``--out`` when given; else ``$KVCHAT_HOME/bench-quick`` for a quick run (never the
    committed ``docs/``) and ``docs`` for a full one."""
    if args.out is not None:
        return Path(args.out)
    if getattr(args, "quick", False):
        from ..storage.files import kvchat_home

        return kvchat_home() / QUICK_DIR
    return Path(DOCS)


def _defaults(mod) -> dict:
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    return vars(p.parse_args([]))


def _resolve(mod, args) -> argparse.Namespace:
    """The module's options: its defaults, quick sizes where left at the default, then validated."""
    defaults = _defaults(mod)
    ns = argparse.Namespace(**{**defaults, **{k: getattr(args, k) for k in defaults if hasattr(args, k)}})
    for k in ("quick", "out", "json", "model", "weights", "decode"):
        setattr(ns, k, getattr(args, k))
    if args.quick:
        for k, v in mod.QUICK.items():
            if getattr(ns, k) == defaults[k]:
                setattr(ns, k, v)
    _validate(ns)
    return ns


def _validate(ns) -> None:
    for name in ("policies", "long_policies"):
        for p in getattr(ns, name, None) or []:
            if p not in POLICIES:
                raise ValueError(f"unknown policy {p!r}; choose from {', '.join(POLICIES)}")
            if not POLICIES[p].bounded:
                raise ValueError(f"--{name.replace('_', '-')}: {p} is not a bounded policy (the full cache is "
                                 "always measured as the reference)")
    for name, value in vars(ns).items():  # every integer option is a size or a count
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            continue
        if name in NON_NEGATIVE:
            if any(v < 0 for v in values):
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        elif any(v < 1 for v in values):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if getattr(ns, "budgets", None) == []:
        raise ValueError("--budgets needs at least one budget")


def _on_gpu(mod, ns):
    """``kvchat bench speed --device cuda`` is its own bench (bench/speed_cuda.py: models built on the GPU, its own
    result file), with its larger defaults where the options were left at the CPU bench's."""
    if mod.NAME != "speed" or ns.device != "cuda":
        return mod, ns
    gpu = _module("speed_cuda")
    defaults = _defaults(mod)
    for k, v in gpu.GPU_DEFAULTS.items():
        if getattr(ns, k) == defaults[k]:
            setattr(ns, k, v)
    return gpu, ns


def command_line(name: str, args, ns=None, mod=None) -> str:
    """The command that reproduces this run: the bench, --quick, and every option not at its default."""
    parts = ["kvchat", "bench", name] + (["--quick"] if args.quick else [])
    if args.model != "default":
        parts += ["--model", args.model]
    if getattr(args, "weights", "auto") != "auto":
        parts += ["--weights", args.weights]
    if getattr(args, "decode", "auto") != "auto":
        parts += ["--decode", args.decode]
    if ns is not None and name != "all":
        for k, default in _defaults(mod).items():
            value = getattr(ns, k)
            if value != default and not (args.quick and value == mod.QUICK.get(k)):
                flag = "--" + k.replace("_", "-")
                if isinstance(value, bool):  # a switch (store_true): the flag alone
                    parts += [flag] if value else []
                    continue
                parts += [flag] + ([str(v) for v in value] if isinstance(value, list) else [str(value)])
    if args.out is not None and not (args.out == DOCS and not args.quick):
        parts += ["--out", str(args.out)]
    return " ".join(parts)


def run(args) -> int:
    from . import report
    from .common import Run, SanityError, load_model, log

    out = output_dir(args)
    modules = [_module(n) for n in REPORTED]
    if args.bench == "report":
        if not (out / "results").is_dir():
            raise ValueError(f"no results under {out}/results; run a bench first")
        print(report.write(out, modules))
        return 0
    chosen = [_module(n) for n in ORDER] if args.bench == "all" else [_module(args.bench)]
    plans = [(mod, _resolve(mod, args)) for mod in chosen]  # every option checked before the model loads
    plans = [_on_gpu(mod, ns) for mod, ns in plans]
    if args.quick and args.out is None:
        log(f"quick run: writing to {out} (the committed {DOCS}/ is left alone; --out {DOCS} to replace it)")
    cm = None
    if any(not getattr(mod, "BUILDS_MODELS", False) for mod, _ in plans):
        cm = load_model(args.model, weights=args.weights, decode=args.decode)
    failed = []
    for mod, ns in plans:
        config = {k: v for k, v in vars(ns).items() if k not in ("json", "out")}
        builds = getattr(mod, "BUILDS_MODELS", False)
        if not builds:
            decode = "model" if cm.step is None else "compiled" if isinstance(cm.step, CompiledStep) else "kvchat"
            config.update(weights=cm.weights, decode=decode)
        options = _module(args.bench) if builds else mod  # the options' defaults: the bench named
        model = (args.model if args.model != "default" else ", ".join(ns.shapes)) if builds else cm.name
        bench = Run(mod.NAME, args.quick, config, model=model, command=command_line(args.bench, args, ns, options))
        log(f"== bench {mod.NAME}{' (quick)' if args.quick else ''}")
        try:
            mod.run(ns, bench, cm)
        except SanityError as exc:
            bench.check("completed", False, str(exc))
        res, path = bench.write(out)
        log(f"== {mod.NAME}: {res['wall_s']:.0f} s -> {path}")
        if args.json:
            print(json.dumps(res), flush=True)
        failed += [f"{mod.NAME}: {f}" for f in bench.failed()]
        report.write(out, modules)
    log(f"report: {out / 'RESULTS.md'}")
    if failed:
        print(f"kvchat: error: sanity check failed: {'; '.join(failed)}", file=sys.stderr)
        return EXIT_SANITY
    return 0
