"""Eviction policies, registered by name. One module per policy; the engine never knows which one runs."""

from __future__ import annotations

from .base import LayerView, Param, Policy
from .registry import POLICIES, declared_params, make_policy, policy_class, register

# Importing the modules registers them.
from . import full, window, streaming, h2o, tova, snapkv, cake, headaware  # noqa: E402,F401

__all__ = ["POLICIES", "LayerView", "Param", "Policy", "declared_params", "make_policy", "policy_class", "register"]
