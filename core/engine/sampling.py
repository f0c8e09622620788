"""Choosing the next token: transformers' logits processors over the logits of the last position, then greedy or a
draw from the session's generator.

The processors are built once per reply from ``Sampling`` (through a ``GenerationConfig``, so each setting means
what it means in ``generate``). Repetition penalties see only what the model can see: the tokens the cache holds
when the reply starts (the user's message included) and the reply so far, not the whole history.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation import (LogitsProcessorList, MinPLogitsWarper, NoRepeatNGramLogitsProcessor,
                                     RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                                     TopPLogitsWarper)

from .settings import Sampling


def generation_config(sampling: Sampling) -> GenerationConfig:
    """The same settings as transformers' ``GenerationConfig`` (off values left at transformers' defaults)."""
    s = sampling
    return GenerationConfig(
        do_sample=not s.greedy, max_new_tokens=s.max_new_tokens,
        temperature=s.temperature if not s.greedy else None,
        top_k=s.top_k or None, top_p=s.top_p if s.top_p < 1 else None, min_p=s.min_p or None,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty != 1 else None,
        no_repeat_ngram_size=s.no_repeat_ngram_size or None,
    )


def logits_processors(sampling: Sampling) -> LogitsProcessorList:
    """The processors ``generate`` would apply for ``sampling``, in its order: penalties, then (sampling only)
    temperature, top-k, top-p, min-p."""
    cfg = generation_config(sampling)
    out = LogitsProcessorList()
    if cfg.repetition_penalty is not None:
        out.append(RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty))
    if cfg.no_repeat_ngram_size:
        out.append(NoRepeatNGramLogitsProcessor(cfg.no_repeat_ngram_size))
    if cfg.do_sample:
        if cfg.temperature != 1.0:
            out.append(TemperatureLogitsWarper(cfg.temperature))
        if cfg.top_k:
            out.append(TopKLogitsWarper(cfg.top_k))
        if cfg.top_p is not None:
            out.append(TopPLogitsWarper(cfg.top_p))
        if cfg.min_p:
            out.append(MinPLogitsWarper(cfg.min_p))
    return out


class Sampler:
    """The next-token rule of one reply. ``visible``: the token ids the cache holds as the reply starts.

    Logits on the CPU are processed there and drawn with ``torch.multinomial``. Logits on a GPU stay there: the
    processors run on the device, greedy is one argmax, and a draw is the inverse of the distribution's cumulative
    sum at one uniform number from the session's generator (``draw``), so only the token id leaves the device and
    the session's generator (saved with every turn) stays the one source of randomness. ``pick`` leaves the token
    where it was chosen (a GPU step can take it there before the host has it) and ``read`` brings it to the host."""

    def __init__(self, sampling: Sampling, generator: torch.Generator, visible: torch.Tensor | None = None):
        self.sampling, self.generator = sampling, generator
        self.processors = logits_processors(sampling)
        self.needs_ids = sampling.repetition_penalty != 1 or sampling.no_repeat_ngram_size > 0
        self.ids = visible.long().view(1, -1) if self.needs_ids and visible is not None else torch.zeros(
            1, 0, dtype=torch.long)
        self._picked: torch.Tensor | None = None  # the last token chosen, [1] on the logits' device
        self._host: torch.Tensor | None = None  # its copy on the host (pinned beside a GPU)
        self._copied = None  # CUDA: the event after that copy

    def __call__(self, logits: torch.Tensor) -> int:
        self.pick(logits)
        return self.read()

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Choose the next token from ``logits`` without waiting for it: the token id as a tensor [1] on the logits'
        device, which the next decode step may read there (``Generation``'s run-ahead); ``read`` gives it to the
        host. On a GPU its copy to the host is queued behind the choice, so ``read`` waits for this step alone, not
        for a decode step queued after it."""
        on_device = logits.device.type != "cpu"
        scores = logits.float()[None] if on_device else logits.float().cpu()[None]
        if self.processors:
            if self.ids.device != scores.device:
                self.ids = self.ids.to(scores.device)
            scores = self.processors(self.ids, scores)
        if self.sampling.greedy:
            token = torch.argmax(scores[0]).view(1)
        elif on_device:
            token = draw(torch.softmax(scores[0], dim=-1), float(torch.rand((), generator=self.generator)))
        else:
            token = torch.multinomial(torch.softmax(scores[0], dim=-1), 1, generator=self.generator)
        if self.needs_ids:
            self.ids = torch.cat([self.ids, token.view(1, 1).to(self.ids.device)], dim=1)
        self._picked = token
        if token.device.type == "cuda":
            if self._host is None:
                self._host, self._copied = torch.zeros(1, dtype=torch.int64).pin_memory(), torch.cuda.Event()
            self._host.copy_(token, non_blocking=True)
            self._copied.record(torch.cuda.current_stream(token.device))  # the copy's stream, on any GPU
        return token

    def read(self) -> int:
        """The token ``pick`` chose last, on the host (on a GPU: once its copy has landed)."""
        if self._picked.device.type != "cuda":
            return int(self._picked[0])
        self._copied.synchronize()
        return int(self._host[0])


def draw(probs: torch.Tensor, u: float) -> torch.Tensor:
    """The token whose share of the cumulative distribution ``probs`` ([vocab], on any device) holds ``u`` in [0, 1):
    token i with probability probs[i]; its id as a tensor [1] on ``probs``' device (nothing leaves the device)."""
    cdf = probs.cumsum(0)
    at = torch.searchsorted(cdf, cdf[-1:] * u, right=True)  # u of the total the sums reach: never a zero-share token
    return at.clamp(max=probs.numel() - 1).view(1)
