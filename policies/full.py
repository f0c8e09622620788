"""full: never evicts. The reference every other policy is compared with; stops before the model's max positions."""

from .registry import register
from .base import Policy


@register
class Full(Policy):
    name = "full"
    summary = "Never evicts; the cache grows with the chat up to the model's max positions."
    bounded = False

    def score(self, view):
        raise RuntimeError("the full policy never evicts")
