"""Constants and small helpers the tests share (conftest.py holds fixtures only)."""

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the repository root
SHARED = REPO.parent / "shared" / "data"  # the shared data directory beside the repository


def data_file(*parts: str) -> Path:
    """A file (or, with no parts, the folder) of the evaluation data in ../shared/data (WikiText-2, the Gutenberg
    novel, MT-Bench, FastChat conversations); the test is skipped, saying why, where a clone has none beside it."""
    import pytest

    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"no evaluation data at {path} (a clone without ../shared/data; README, Data: where it comes "
                    "from)")
    return path


def write_jsonl(path: Path, lines: list) -> Path:
    """``lines`` written to ``path`` as JSONL (a replay script); the path."""
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path
