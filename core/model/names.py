"""A model's name as a conversation stores it (``conversations.model``), from the ``--model`` that loads it: known
before the model loads, so that ``--resume`` can take a conversation's own model, or refuse another, in a second.
Imports nothing (``loading`` imports torch and transformers)."""

from __future__ import annotations

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def model_name(spec) -> str:
    """The name ``--model spec`` is stored under: the default model's name for it, else ``spec`` as given."""
    return DEFAULT_MODEL_NAME if str(spec) in (DEFAULT_MODEL, DEFAULT_MODEL_NAME) else str(spec)
