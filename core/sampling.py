"""Choosing the next token from the logits of the last position."""

from __future__ import annotations

import torch

from .settings import Sampling


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """Greedy at temperature 0; else temperature, then top-p (nucleus), then a draw from ``generator``."""
    if sampling.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, 0) - sorted_p > sampling.top_p
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
