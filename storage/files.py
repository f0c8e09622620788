"""Durable file operations the storage modules share."""

from __future__ import annotations

import os
from pathlib import Path


def kvchat_home() -> Path:
    """Where kvchat keeps its files (the database, converted models, quick benchmarks): ``$KVCHAT_HOME``, else
    ``~/.cache/kvchat``."""
    return Path(os.environ.get("KVCHAT_HOME") or Path.home() / ".cache" / "kvchat")


def fsync_dir(folder: Path) -> None:
    """Make a folder's entries (files created, renamed or removed in it) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Make a file's contents and size durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def size(path: Path) -> int:
    """Bytes of a file, 0 when there is none."""
    return path.stat().st_size if path.is_file() else 0


def tree_size(folder: Path) -> int:
    """Bytes of the files in a folder and below it, 0 when there is none; a file or folder removed while it is
    counted (a commit's old state file, a conversation deleted from another tab) counts as nothing."""
    total = 0
    for root, _, names in os.walk(folder):  # (os.walk passes over folders it cannot list)
        for name in names:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total
