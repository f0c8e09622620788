"""Constants the tests share (conftest.py holds fixtures only)."""

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
