"""The policies by name: each policy module registers its class here (``@register``); the engine, the CLI and the
web UI look them up (``make_policy``, ``policy_class``) and list their declared parameters."""

from __future__ import annotations

from typing import Any

from .base import Param, Policy

POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    if not cls.name or cls.name in POLICIES:
        raise ValueError(f"policy name {cls.name!r} is empty or taken")
    POLICIES[cls.name] = cls
    return cls


def policy_class(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (choose from: {', '.join(POLICIES)})") from None


def make_policy(name: str, **params: Any) -> Policy:
    return policy_class(name)(**params)


def declared_params() -> dict[str, tuple[Param, list[str]]]:
    """Each declared policy parameter once: name -> (Param, [policies declaring it]); for generated CLI flags and
    settings panels."""
    out: dict[str, tuple[Param, list[str]]] = {}
    for pname, cls in POLICIES.items():
        for p in cls.params:
            out.setdefault(p.name, (p, []))[1].append(pname)
    return out
