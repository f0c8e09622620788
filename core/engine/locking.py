"""One lock per object for what several threads share (a session, the store): ``@locked`` methods run one at a time."""

from __future__ import annotations

import functools


def locked(method):
    """Run ``method`` holding ``self._lock`` (an ``RLock``, so locked methods may call each other)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper
