"""window: keep only the most recent tokens (no sink, no protected system prompt).

The plain sliding window StreamingLLM compares against: once the first tokens leave, attention has nowhere to
dump its mass and quality collapses, which is exactly what this baseline is for. It is StreamingLLM's rule without
the protected start.
"""

from .registry import register
from .streaming import Streaming


@register
class Window(Streaming):
    name = "window"
    summary = "Most recent tokens only (no sink): the baseline StreamingLLM improves on."
    protect_start = False
