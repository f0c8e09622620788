"""A model's name as a conversation stores it (``conversations.model``), from the ``--model`` that loads it, and the
one check of it when a conversation is opened: known before the model loads, so that ``--resume`` can take a
conversation's own model, or refuse another, in a second. Imports nothing heavy (``loading`` imports torch and
transformers)."""

from __future__ import annotations

import os

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def model_name(spec) -> str:
    """The name ``--model spec`` is stored under: the default model's name for it; the absolute path of a local
    file or directory it names (``./m.gguf`` resumes from any folder); else ``spec`` as given (a hub id)."""
    spec = str(spec)
    if spec in (DEFAULT_MODEL, DEFAULT_MODEL_NAME):
        return DEFAULT_MODEL_NAME
    path = os.path.expanduser(spec)
    return os.path.abspath(path) if os.path.exists(path) else spec


def local_model(spec) -> str | None:
    """The local ``.gguf`` file or model directory ``--model spec`` names, checked (ValueError, in one line: none
    there, or a directory without config.json); None for the default model or a Hugging Face hub id."""
    spec = str(spec)
    if spec in (DEFAULT_MODEL, DEFAULT_MODEL_NAME):
        return None
    path = os.path.expanduser(spec)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"no such GGUF file: {spec}")
        return path
    if os.path.exists(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{spec} is not a model directory (no config.json)")
        return path
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ValueError(f"no such model directory: {spec}")
    return None  # a Hugging Face hub id


def check_held_by(conversation_id: int, held_by: str, spec) -> None:
    """ValueError if conversation ``conversation_id``, held by model ``held_by``, is opened by ``--model spec``. A
    name stored as typed (before names were made absolute) matches the path it names from this folder."""
    if model_name(spec) not in (held_by, model_name(held_by)):
        raise ValueError(f"conversation {conversation_id} was held by model {held_by}, not {model_name(spec)}")
