"""Durable file operations the storage modules share."""

from __future__ import annotations

import os
from pathlib import Path


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
    """Bytes of the files in a folder and below it, 0 when there is none."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0
