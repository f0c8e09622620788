"""The documentation's generated tables: the policies in README.md, the flags in docs/usage.md.

Both are built from the declarations (the policies' classes and ``core/engine/settings.py``), so they cannot drift
from the code.

``python -m kvchat.app.docs`` prints both tables; ``--write`` puts each into its file between the marker comments
``<!-- generated: NAME -->`` and ``<!-- end -->``; ``--check`` exits with status 1 if either file differs.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

from ..core.engine.settings import CACHE_SETTINGS, SAMPLING_SETTINGS
from ..policies import POLICIES, Param

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
USAGE = ROOT / "docs" / "usage.md"

#: Flags of chat, replay and serve that are not engine settings: (flag, default, meaning).
OTHER_FLAGS = (
    ("`--seed`", "0", "seed of the sampler"),
    ("`--model`", "default",
     "Hugging Face id, local directory or `.gguf` file; with `--resume`, the model that held the conversation unless "
     "given"),
    ("`--device`, `--dtype`, `--device-map`", "auto",
     "cuda > mps > cpu; bf16 on CUDA, fp32 on CPU; `--device-map auto` spreads big models (accelerate)"),
    ("`--weights`", "auto",
     "`half`: an fp16 copy of the linear weights for one-token decode steps (prefill, activations and cache as "
     "loaded; +50% weight memory for fp32); `model`: as loaded; `auto`: `half` for an fp32 model on the CPU"),
    ("`--decode`", "auto",
     "`auto`: one-token steps of Llama-family models (Llama, Mistral, Qwen2) run in kvchat's step (`core/decode`: the "
     "model's computation without transformers' per-module dispatch; on CUDA the graph step in Triton's kernels, "
     "`triton` below; on the CPU with "
     "`--weights half` and a C++ compiler on kvchat's operators, `core/ops/kernels.py`: one call per layer), other "
     "models through their forward; `graph`: the whole step (every layer, the cache write, attention, the policy's "
     "statistics) captured once as a CUDA graph over the cache's fixed-capacity buffers and replayed per token "
     "(`core/decode/graph.py`; uncaptured on the CPU); `compiled`: on the CPU the eager step, every layer in one "
     "`torch.compile` graph (fp32 models; a minute or two to compile the first time, seconds once inductor's cache "
     "has it; eager step if compiling fails), on CUDA the graph step with each layer compiled by `torch.compile` "
     "into fused kernels before it is captured (the graph step uncompiled if compiling fails); `triton` (CUDA; "
     "`auto`'s there): the graph step with each layer in kvchat's own Triton kernels, 10 a layer, the fastest "
     "measured ([gpu.md](gpu.md#the-triton-kernels); "
     "the graph step as written if Triton fails or does not serve the model; on the CPU the eager step); `model`: "
     "every step through the model's forward"),
    ("`--chat-template`", "the model's",
     "`plain` or a Jinja file for models without one (GPT-2 gets `plain` automatically)"),
    ("`--db`", "`$KVCHAT_HOME/kvchat.db`", "SQLite database"),
)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(p: Param) -> str:
    if p.derived is not None:
        return p.derived
    return f"`{p.default}`" if p.choices else str(p.default)


def _meaning(p: Param) -> str:
    choices = f" (`{'`, `'.join(map(str, p.choices))}`)" if p.choices and p.name != "policy" else ""
    return p.help + choices


def _file(cls: type) -> str:
    """The file defining ``cls``, relative to the repository's root (README.md's folder)."""
    return Path(inspect.getfile(cls)).resolve().relative_to(ROOT).as_posix()


def policy_table() -> str:
    """One row per registered policy: its name, linked to the file that holds its rule, what it keeps (its summary),
    its parameters with defaults."""
    rows = ["| policy | keeps | parameters |", "| --- | --- | --- |"]
    for name, cls in POLICIES.items():
        params = ", ".join(f"`{p.flag} {p.shown_default}`" for p in cls.params) or "–"
        rows.append(f"| [`{name}`]({_file(cls)}) | {_cell(cls.summary)} | {_cell(params)} |")
    return "\n".join(rows)


def flag_table() -> str:
    """One row per engine setting (cache, then sampling), then the other flags of chat, replay and serve."""
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for p in (*CACHE_SETTINGS, *SAMPLING_SETTINGS):
        rows.append(f"| `{p.flag}` | {_cell(_default(p))} | {_cell(_meaning(p))} |")
    rows += [f"| {flag} | {default} | {_cell(meaning)} |" for flag, default, meaning in OTHER_FLAGS]
    return "\n".join(rows)


TABLES = {"policies": policy_table, "flags": flag_table}
#: Which generated tables each file holds: ``--readme`` holds the policies, ``--usage`` the flags.
PLACES = {"readme": ("policies",), "usage": ("flags",)}


def render(text: str, names: tuple[str, ...] = tuple(TABLES)) -> str:
    """``text`` with the generated blocks ``names`` replaced by the current tables (ValueError if a marker is
    missing)."""
    for name in names:
        table = TABLES[name]
        pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(\n<!-- end -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no '<!-- generated: {name} -->' ... '<!-- end -->' block")
        text = pattern.sub(lambda m, t=table(): m.group(1) + t + m.group(2), text, count=1)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvchat.app.docs", description=__doc__.strip().splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update README.md and docs/usage.md in place")
    parser.add_argument("--check", action="store_true", help="status 1 if a generated table is not current")
    parser.add_argument("--readme", type=Path, default=README, help="the file holding the policies table")
    parser.add_argument("--usage", type=Path, default=USAGE, help="the file holding the flags table")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        print(policy_table() + "\n\n" + flag_table())
        return 0
    rendered = []
    for key, names in PLACES.items():
        path = getattr(args, key)
        text = path.read_text(encoding="utf-8")
        try:
            rendered.append((path, names, text, render(text, names)))
        except ValueError as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 1
    if args.check:
        stale = [path for path, _, text, new in rendered if new != text]
        for path in stale:
            print(f"{path}: the generated tables are out of date (python -m kvchat.app.docs --write)",
                  file=sys.stderr)
        return 1 if stale else 0
    for path, names, text, new in rendered:
        if new != text:
            path.write_text(new, encoding="utf-8")
        print(f"{path}: {', '.join(names)} table {'updated' if new != text else 'already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
