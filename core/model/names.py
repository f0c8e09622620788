"""A model's name as a conversation stores it (``conversations.model``), from the ``--model`` that loads it, and the
one check of it when a conversation is opened: known before the model loads, so that ``--resume`` can take a
conversation's own model, or refuse another, in a second. Imports nothing (``loading`` imports torch and
transformers)."""

from __future__ import annotations

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def model_name(spec) -> str:
    """The name ``--model spec`` is stored under: the default model's name for it, else ``spec`` as given."""
    return DEFAULT_MODEL_NAME if str(spec) in (DEFAULT_MODEL, DEFAULT_MODEL_NAME) else str(spec)


def check_held_by(conversation_id: int, held_by: str, spec) -> None:
    """ValueError if conversation ``conversation_id``, held by model ``held_by``, is opened by ``--model spec``."""
    if model_name(spec) != held_by:
        raise ValueError(f"conversation {conversation_id} was held by model {held_by}, not {model_name(spec)}")
