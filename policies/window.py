"""window: keep only the most recent tokens (no sink, no protected system prompt).

The plain sliding window StreamingLLM compares against: once the first tokens leave, attention has nowhere to
dump its mass and quality collapses, which is exactly what this baseline is for.
"""

from . import register
from .base import Policy


@register
class Window(Policy):
    name = "window"
    summary = "Most recent tokens only (no sink): the baseline StreamingLLM improves on."
    protect_start = False
    layer_independent = True

    def score(self, view):
        return view.recency
