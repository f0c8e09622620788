"""What other threads may read of a session (the web UI's views, while a reply streams): each method is one
consistent, locked reading, so nothing outside the engine takes the session's lock or walks its cache."""

from __future__ import annotations

import torch

from .locking import locked
from .procinfo import peak_rss_mb
from .tokens import ROLES


class SessionReads:
    """Mixed into ``Session``; reads ``log``, ``messages``, ``cache``, ``policy`` and ``settings``."""

    @locked
    def read_messages(self, in_progress: bool = True) -> list[dict]:
        """The messages ({"role", "content", "tokens"}: tokens as the template rendered them); without
        ``in_progress``, a reply being generated is left out."""
        ids, lengths = self.log.runs("message")
        counts = (torch.bincount(ids.long(), lengths, minlength=len(self.messages)).long().tolist()
                  if ids.numel() else [])
        out = [{**m, "tokens": counts[i] if i < len(counts) else 0} for i, m in enumerate(self.messages)]
        if not in_progress and self._streaming is not None:
            del out[self._streaming:]
        return out

    @locked
    def token_rows(self, last: int | None = None) -> dict:
        """The last ``last`` tokens (None: all), from absolute position ``start`` on: token id, role name, message
        index, the fraction of (layer, KV head) pairs whose cache still holds it, and whether recall brought it back
        (in any turn); with the chat's ``total`` tokens and counts over all of them (``_held_counts``: "seen",
        "full", "recalled_held"). One reading; its cost is the tokens asked for and the cache's, but for where recall
        brought text back: a flag per token of the chat, set from every turn's recalled spans."""
        start = 0 if last is None else max(0, self.log.n - last)
        recalled = self._recalled()
        return {"start": start, "total": self.log.n, "token": self.log.column("token", start).tolist(),
                "role": [ROLES[r] for r in self.log.column("role", start).tolist()],
                "message": self.log.column("message", start).tolist(),
                "held": self.held_fraction(start).tolist(), "recalled": recalled[start:].tolist(),
                **self._held_counts(recalled)}

    def _recalled(self) -> torch.Tensor:
        """Per absolute position, whether recall brought it back in any turn."""
        recalled = torch.zeros(self.log.n, dtype=torch.bool)
        for res in self.history:
            for a, b in res.recalled or []:
                recalled[a:b] = True
        return recalled

    def _held_counts(self, recalled: torch.Tensor) -> dict[str, int]:
        """The tokens some (layer, KV head) pair's cache holds ("seen"), those every pair holds ("full"), and those
        of the seen that recall brought back (``recalled``, per position), counted over what the cache holds."""
        held, counts, pairs = self._held()
        return {"seen": held.numel(), "full": int((counts == pairs).sum()),
                "recalled_held": int(recalled[held.long()].sum())}

    def _held(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The absolute positions some (layer, KV head) pair's cache holds, ascending, how many pairs hold each, and
        how many pairs there are."""
        layers = [layer for layer in self.cache.layers if layer.is_initialized]
        if not layers:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 0
        held, counts = torch.unique(torch.cat([layer.positions().flatten() for layer in layers]), return_counts=True)
        keep = held >= 0
        return held[keep].cpu(), counts[keep].cpu(), sum(layer.heads for layer in layers)

    @locked
    def kept_positions(self) -> torch.Tensor:
        """Absolute positions held by at least one layer/head, ascending."""
        return self._held()[0]

    @locked
    def held_fraction(self, start: int = 0) -> torch.Tensor:
        """Per absolute position from ``start`` on, the fraction of (layer, KV head) pairs whose cache still holds
        it."""
        n = self.log.n - start
        counts = torch.zeros(max(n, 0), dtype=torch.float32)
        heads = 0
        for layer in self.cache.layers:
            if layer.is_initialized:
                pos = layer.positions().flatten().cpu().long() - start
                counts += torch.bincount(pos[pos >= 0], minlength=n)[:n].float()
                heads += layer.heads
        return counts / max(heads, 1)

    @locked
    def group_count(self) -> int:
        """Sentence groups fed so far (the unit recall brings back)."""
        return int(torch.unique(self.log.runs("sentence")[0]).numel())

    @locked
    def layer_lengths(self) -> list[float]:
        """Positions held per layer now (the mean over its KV heads)."""
        return [sum(layer.lens) / layer.heads if layer.is_initialized else 0.0 for layer in self.cache.layers]

    @locked
    def policy_report(self) -> dict:
        return self.policy.report()

    @locked
    def cache_now(self) -> dict:
        """The cache at this moment: turn in progress, positions per layer and head (mean), bytes allocated (all,
        and keys and values alone), positions held by the fullest head."""
        return {"turn": self.turn, "cache_tokens": self.cache.mean_length, "cache_bytes": self.cache.nbytes,
                "kv_bytes": self.cache.kv_bytes, "length": self.cache.length}

    @locked
    def stats(self) -> dict:
        s = self.settings
        return {
            "policy": s.policy, "params": dict(self.policy.values), "settings": s.as_dict(), "turns": self.turn,
            "total_tokens": self.log.n, "token_log_bytes": self.log.nbytes,
            # positions per layer and head, averaged, as turns and charts say (cake's and headaware's layers and heads
            # hold different numbers; the fullest may hold more than budget + slack, the average never)
            "cache_tokens": self.cache.mean_length, "fullest_head_tokens": self.cache.length,
            "cache_bytes": self.cache.nbytes,
            "capacity": s.capacity if self.policy.bounded else None, "evicted_tokens": self.evictions.total,
            "max_positions": self.model.max_positions, "peak_rss_mb": peak_rss_mb(),
            "observer_bytes": self.observer.nbytes if self.observer is not None else 0,
            "archive_bytes": self.archive_bytes, "disk_bytes": self.disk_bytes,
            **self.policy.report(),
        }
