"""kvchat: a local chat whose KV cache stays bounded, compressed by a live-selectable eviction policy."""

__version__ = "0.1.0"
