"""Positions of cached keys.

Two modes (``--positions``):

* ``rerotate`` (default): after every eviction the kept keys are rotated so that they sit at contiguous
  positions 0..n-1, and new tokens continue at n (StreamingLLM's "positions within the cache"). The model
  therefore never sees a position >= budget + slack, however long the chat runs.
* ``original``: keys keep the absolute position they were computed at; new tokens continue at absolute
  positions. Past the model's trained positions quality degrades, so the session warns before that.

RoPE keys are rotated in place by a position *delta* using the model's own rotary embedding: its
``inv_freq`` (which already carries linear, Llama-3 and YaRN scaling) and its rotary dimension (partial rotary
for GPT-NeoX). Rotating a key computed at p by (q - p) gives the key computed at q, because rotations compose;
the embedding's ``attention_scaling`` is already inside the stored key and must not be applied twice.
Models without RoPE (GPT-2's learned absolute positions) need no rotation: their new tokens are indexed by the
cache length in ``rerotate`` mode.
"""

from __future__ import annotations

import torch

POSITION_MODES = ("rerotate", "original")

# Model families whose attention rotates pairs (x[2i], x[2i+1]) instead of the two halves: the half-rotation
# used here would be wrong for them, so re-rotation is refused rather than silently corrupting keys.
_INTERLEAVED_ROPE = {"gptj", "cohere", "cohere2", "glm", "chatglm", "codegen"}
# RoPE variants whose frequencies change with the sequence length: a key rotated under one inv_freq cannot be
# moved exactly under another.
_LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}


class Rotary:
    """Moves RoPE keys from one position to another with the model's frequencies."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.detach().float().clone()
        self.rotary_dim = 2 * self.inv_freq.numel()
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (delta, cos, sin) of the last call

    @classmethod
    def from_model(cls, model) -> "Rotary | None":
        """The model's rotary embedding, or None for models without RoPE (e.g. GPT-2)."""
        config = model.config
        found = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
        if not found:
            return None
        model_type = getattr(config, "model_type", "")
        if model_type in _INTERLEAVED_ROPE:
            raise ValueError(
                f"{model_type} uses interleaved RoPE, which kvchat cannot re-rotate; use --positions original"
            )
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise ValueError(
                f"{rope_type} RoPE changes its frequencies with the sequence length, so kept keys cannot be "
                "re-rotated exactly; use --positions original"
            )
        freqs = {tuple(m.inv_freq.shape) for m in found}
        if len(freqs) > 1:
            raise ValueError("the model has several rotary embeddings; use --positions original")
        return cls(found[0].inv_freq)

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Rotate ``keys`` [..., n, head_dim] by ``delta`` positions ([n] or broadcastable to keys[..., n])."""
        rd, half = self.rotary_dim, self.rotary_dim // 2
        cos, sin = self._trig(delta.to(keys.device))
        k = keys[..., :rd].float()
        x1, x2 = k[..., :half], k[..., half:]
        # the half-rotation as the model applies it, k * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin), written
        # into one output (the same roundings, op for op: x1 * cos - x2 * sin and x2 * cos + x1 * sin)
        out = torch.empty(*torch.broadcast_shapes(keys.shape[:-1], cos.shape[:-1]), keys.shape[-1],
                          dtype=torch.float32, device=keys.device)
        o1, o2 = out[..., :half], out[..., half:rd]
        torch.mul(x1, cos, out=o1).sub_(x2 * sin)
        torch.mul(x2, cos, out=o2).add_(x1 * sin)
        if rd < keys.shape[-1]:
            out[..., rd:] = keys[..., rd:]  # past the rotary dimensions (partial rotary): unchanged
        return out.to(keys.dtype)

    def _trig(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``delta`` times each frequency. On the CPU, a compression rotates every layer's keys by the
        same deltas when the layers keep the same positions (``streaming``, ``window``, recall's put-back): the last
        call's are reused when ``delta`` is equal, and many keys with few distinct deltas take them once per delta;
        either leaves the result bit for bit the same. A GPU computes every key's in microseconds, where comparing
        the deltas or reading their range back would wait for it."""
        inv_freq = self.inv_freq.to(delta.device)
        if delta.device.type != "cpu":
            freqs = delta.to(torch.float32)[..., None] * inv_freq
            return freqs.cos(), freqs.sin()
        last = self._last  # one read: sessions in other threads may replace it
        if last is not None and last[0].shape == delta.shape and last[0].device == delta.device and \
                last[0].dtype == delta.dtype and torch.equal(last[0], delta):
            return last[1], last[2]
        lo, hi = (int(x) for x in torch.aminmax(delta)) if delta.numel() > 1024 and not delta.is_floating_point() \
            else (0, delta.numel())
        if hi - lo + 1 < delta.numel() // 4:
            # many keys, few distinct deltas (a compression moves thousands of keys by at most the cache's length):
            # cos/sin once per distinct delta, then gathered; element-wise, so the same bits as computed in place
            freqs = torch.arange(lo, hi + 1, device=delta.device).to(torch.float32)[:, None] * inv_freq
            index = (delta - lo).reshape(-1)
            cos = freqs.cos().index_select(0, index).view(*delta.shape, -1)
            sin = freqs.sin().index_select(0, index).view(*delta.shape, -1)
        else:
            freqs = delta.to(torch.float32)[..., None] * inv_freq
            cos, sin = freqs.cos(), freqs.sin()
        self._last = (delta.clone(), cos, sin)
        return cos, sin


def convert_positions(cache, rotary: Rotary | None, new: str) -> None:
    """Switch a live cache's kept keys to positions mode ``new`` (``rerotate`` or ``original``)."""
    layers = [layer for layer in cache.layers if layer.is_initialized]
    if new == "rerotate":  # kept keys end right before the next position, as after a compression
        for layer in layers:
            layer.pos_off = [cache.length - n for n in layer.lens]
    if rotary is not None:
        for layer in layers:
            layer.shift_positions(rotary, to_original=new == "original")
