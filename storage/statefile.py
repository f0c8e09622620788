"""The cache state a turn leaves, on disk: ``state-<turn>.safetensors`` beside the conversation's archive, written
atomically (a temporary file, fsync, rename, the folder fsync'd), so a crash leaves either the old file or the new
one, never half of one. What the tensors and metadata hold is the engine's (core/engine/persist.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .files import fsync_dir


def path(folder: Path, turn: int) -> Path:
    return Path(folder) / f"state-{turn}.safetensors"


def write(folder: Path, turn: int, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
    """Write turn ``turn``'s state atomically and durably."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = path(folder, turn)
    tmp = target.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)
    fsync_dir(folder)
    return target


def metadata(folder: Path, turn: int) -> dict[str, str] | None:
    """Turn ``turn``'s state metadata, None when there is no such file."""
    p = path(folder, turn)
    if not p.is_file():
        return None
    with safe_open(p, "pt") as f:
        return f.metadata() or {}


def read(folder: Path, turn: int) -> dict[str, torch.Tensor]:
    return load_file(path(folder, turn))


def remove_others(folder: Path, keep: int) -> None:
    """Remove every state file but turn ``keep``'s."""
    for p in Path(folder).glob("state-*.safetensors"):
        if p.name != path(folder, keep).name:
            p.unlink(missing_ok=True)
