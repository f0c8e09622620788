"""kvchat's attention function, registered with transformers' AttentionInterface.

Models load with ``attn_implementation="kvchat"``. The function runs SDPA exactly as transformers' ``sdpa``
does. When the engine passes an ``kvchat_observer`` keyword to the model's forward (transformers forwards extra
keyword arguments down to the attention function), the observer is first given the layer's query and key
states, from which attention-reading policies compute only the scores they need (no eager attention, no N x N
matrices kept). Policies that need no attention pass no observer and pay nothing.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTN_IMPLEMENTATION = "kvchat"


def kvchat_attention(module, query, key, value, attention_mask, kvchat_observer=None, **kwargs):
    if kvchat_observer is not None:
        kvchat_observer(module, query, key, attention_mask)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Register the attention and mask functions (idempotent); returns the implementation name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvchat_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
