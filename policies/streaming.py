"""streaming: StreamingLLM (Xiao et al., 2023). Keep the attention sink and the most recent tokens.

The sink (the first ``--sink`` tokens) and the system prompt are protected by the engine; this policy only says
"newer is better", so the rest of the budget is the most recent window.
"""

from .registry import register
from .base import Policy


@register
class Streaming(Policy):
    name = "streaming"
    summary = "StreamingLLM: attention sink + the most recent tokens."
    layer_independent = True

    def score(self, view):
        return view.recency
