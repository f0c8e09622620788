"""Constants the tests share (conftest.py holds fixtures only)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the repository root
SHARED = REPO.parent / "shared" / "data"  # the shared data directory beside the repository
