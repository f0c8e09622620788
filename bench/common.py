"""What every benchmark shares: data paths, the model, result files with their provenance, sanity checks.

A result is one JSON file per benchmark (``<out>/results/<name>.json``) holding the command line, the machine,
the model, the date, the wall time, the configuration, the rows measured and the sanity checks with their
outcome. Plots go to ``<out>/plots/<name>*.png`` and ``<out>/RESULTS.md`` is regenerated from every JSON present.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.model.loading import load_model  # noqa: F401  (the one model loader, shared with the CLI)

#: ../shared/data beside the repository (override with --data or KVCHAT_DATA).
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CHAPTER_ONE = "It is a truth universally acknowledged"


class SanityError(RuntimeError):
    """A sanity check of a benchmark failed (the numbers cannot mean what they claim)."""


def data_dir(arg: str | None) -> Path:
    path = Path(arg or os.environ.get("KVCHAT_DATA") or DEFAULT_DATA).expanduser()
    if not path.is_dir():
        raise ValueError(f"no data directory at {path} (pass --data or set KVCHAT_DATA)")
    return path


def read_text(data: Path, name: str) -> str:
    """``pg19``: Pride and Prejudice from Chapter I (the PG19 stand-in); ``wikitext``: WikiText-2 raw test."""
    if name == "pg19":
        text = (data / "gutenberg" / "pg1342_pride_and_prejudice.txt").read_text(encoding="utf-8")
        return text[text.index(CHAPTER_ONE):]
    if name == "wikitext":
        return (data / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    raise ValueError(f"unknown text {name!r}: pg19 or wikitext")


def fastchat_pairs(data: Path) -> list[tuple[str, str]]:
    """(user, assistant) exchanges of the shared FastChat dummy conversations, in order."""
    pairs = []
    for c in json.loads((data / "fastchat" / "dummy_conversation.json").read_text(encoding="utf-8")):
        turns = c["conversations"]
        pairs += [(a["value"], b["value"]) for a, b in zip(turns[::2], turns[1::2])
                  if a["from"] == "human" and b["from"] == "gpt" and a["value"].strip() and b["value"].strip()]
    return pairs


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def save_figure(fig, path: Path, plt) -> Path:
    """Lay out, write (PNG, 110 dpi) and close a matplotlib figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Run:
    """One benchmark run: collects rows and sanity checks, then writes its JSON."""

    name: str
    quick: bool
    config: dict
    model: str = ""
    command: str = ""
    rows: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        log(f"sanity {'ok  ' if ok else 'FAIL'} {name}: {detail}")

    def result(self) -> dict:
        return {
            "bench": self.name, "quick": self.quick, "command": self.command,
            "machine": machine(), "model": self.model,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(time.perf_counter() - self.started, 1), "config": self.config,
            "results": self.rows, "sanity": self.checks,
        }

    def write(self, out: Path) -> tuple[dict, Path]:
        res = self.result()
        path = out / "results" / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
        return res, path

    def failed(self) -> list[str]:
        return [f"{c['check']} ({c['detail']})" for c in self.checks if not c["ok"]]


def _bytes(*paths: Path) -> int:
    return sum(f.stat().st_size for p in paths for f in ([p] if p.is_file() else p.rglob("*") if p.is_dir() else [])
               if f.is_file())


DISK = ("sqlite", "rows", "state", "digests")  # what a stored conversation keeps, sampled after every turn


def disk(store, session) -> tuple[int, ...]:
    """Bytes on disk: SQLite (with its WAL), the cache's rows, the state file(s), recall's digests."""
    if store is None:
        return (0,) * len(DISK)
    folder = session.files.folder
    return (_bytes(store.path, Path(f"{store.path}-wal")), _bytes(folder / "rows.bin"),
            _bytes(*folder.glob("state-*")), _bytes(folder / "digests"))
