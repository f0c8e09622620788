"""The one-token decode step: which one runs where (``build``).

* ``eager.DecodeStep`` (``--decode auto``): Llama-family models layer by layer without transformers' dispatch; on
  the CPU with ``--weights half`` one of kvchat's C++ operators per layer (core/ops);
* ``compiled.CompiledStep`` (``--decode compiled`` on the CPU): that step as one ``torch.compile`` graph (fp32);
* ``graph.GraphStep`` (``--decode graph``): the whole step captured once as a CUDA graph over the cache's
  fixed-capacity buffers and replayed per token (on the CPU it runs uncaptured: tests); with ``--decode compiled`` on
  CUDA each layer compiled by ``torch.compile`` first (fused kernels), then captured; with ``--decode triton``, and
  ``auto`` on CUDA, each layer in kvchat's own Triton kernels (``graph_triton``), then captured;
* ``None`` (``--decode model``, or a model the steps do not serve): every step through the model's forward.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from torch import nn

from .parts import DECODE, check

if TYPE_CHECKING:
    from .eager import DecodeStep

log = logging.getLogger(__name__)

__all__ = ["DECODE", "CompiledStep", "DecodeStep", "GraphStep", "build", "check"]
# the steps are imported when first named: ``torch.compile``'s and transformers' imports take seconds, which the
# commands that decode nothing (``kvchat --help``, ``policies``, ``conversations``) need not wait for
_STEPS = {"CompiledStep": "compiled", "DecodeStep": "eager", "GraphStep": "graph"}


def __getattr__(name: str):
    if name in _STEPS:
        return getattr(importlib.import_module(f"{__name__}.{_STEPS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build(model: nn.Module, decode: str = "auto") -> DecodeStep | None:
    """The step that decodes ``model`` for ``decode`` (``DECODE``), None where the model's forward does."""
    from .compiled import CompiledStep
    from .eager import DecodeStep
    from .graph import GraphStep

    if check(decode) == "model" or DecodeStep.unsupported(model) is not None:
        return None
    on_cuda = next(model.parameters()).device.type == "cuda"
    if decode == "triton" and not on_cuda:
        log.warning("--decode triton: Triton's kernels run on a CUDA GPU; kvchat's eager step instead")
    elif decode == "graph" or (decode in ("auto", "compiled", "triton") and on_cuda):
        why = GraphStep.unsupported(model)
        if why is None:
            # auto on CUDA: the Triton kernels, the fastest measured (docs/gpu.md); the step as written where they
            # cannot serve the model or fail to compile
            return GraphStep(model, compiled=decode == "compiled", triton=decode in ("triton", "auto"))
        log.warning("--decode %s: %s; kvchat's eager step instead", decode, why)
    if decode == "compiled":
        why = CompiledStep.unsupported(model)
        if why is None:
            return CompiledStep(model)
        log.warning("--decode compiled: %s; kvchat's eager step instead", why)
    return DecodeStep(model)
