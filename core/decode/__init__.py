"""The one-token decode step: which one runs where (``build``).

* ``eager.DecodeStep`` (``--decode auto``): Llama-family models layer by layer without transformers' dispatch; on
  the CPU with ``--weights half`` one of kvchat's C++ operators per layer (core/ops);
* ``compiled.CompiledStep`` (``--decode compiled``): that step as one ``torch.compile`` graph (fp32 on the CPU);
* ``None`` (``--decode model``, or a model the steps do not serve): every step through the model's forward.
"""

from __future__ import annotations

import logging

from torch import nn

from .compiled import CompiledStep
from .eager import DecodeStep
from .parts import DECODE, check

log = logging.getLogger(__name__)

__all__ = ["DECODE", "CompiledStep", "DecodeStep", "build", "check"]


def build(model: nn.Module, decode: str = "auto") -> DecodeStep | None:
    """The step that decodes ``model`` for ``decode`` (``DECODE``), None where the model's forward does."""
    if check(decode) == "model" or DecodeStep.unsupported(model) is not None:
        return None
    if decode == "compiled":
        why = CompiledStep.unsupported(model)
        if why is None:
            return CompiledStep(model)
        log.warning("--decode compiled: %s; kvchat's eager step instead", why)
    return DecodeStep(model)
