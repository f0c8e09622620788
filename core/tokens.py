"""Tokens of a conversation: checking message text, encoding it, decoding a reply as it streams, and the log of
every token ever fed (``TokenLog``), by absolute position.

Per position the log keeps the token id, role, turn, message and sentence, so group ids, the "what the cache
still sees" view, and a rebuild of the cache from the kept tokens need nothing else.
"""

from __future__ import annotations

from typing import Any

import torch

from .groups import sentence_ids

ROLES = ("system", "user", "assistant")


def check_text(text: Any, what: str = "message") -> str:
    """``text`` if it is a non-empty string of valid Unicode without NUL; ValueError naming ``what`` otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"{what} must be text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode text (it holds unpaired surrogates)") from None
    if "\x00" in text:
        raise ValueError(f"{what} holds a NUL character")
    if not text.strip():
        raise ValueError(f"{what} is empty")
    return text


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and the (start, end) character span of each."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
    ids = encode(tokenizer, text)
    ends = [len(tokenizer.decode(ids[: j + 1])) for j in range(len(ids))]
    return ids, list(zip([0] + ends[:-1], ends))


class Detokenizer:
    """Incremental detokenization: emits text only once it no longer ends in a partial character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[self.emitted :], len(text)
        return delta


class TokenLog:
    """Metadata of every token fed to the model, indexed by absolute position (int32 columns, grown by doubling).

    ``sentence`` is the state of sentence numbering: (last sentence id, whether the next token opens a new one)."""

    COLUMNS = ("token", "role", "turn", "message", "sentence")

    def __init__(self):
        self.n = 0
        self.sentence = (0, True)
        self._data = torch.zeros(len(self.COLUMNS), 1024, dtype=torch.int32)

    def append(self, rows: dict[str, list[int]]) -> torch.Tensor:
        """Append rows (one list per column); returns their absolute positions."""
        m = len(rows["token"])
        if self.n + m > self._data.shape[1]:
            grown = torch.zeros(len(self.COLUMNS), max(2 * self._data.shape[1], self.n + m), dtype=torch.int32)
            grown[:, : self.n] = self._data[:, : self.n]
            self._data = grown
        for i, name in enumerate(self.COLUMNS):
            self._data[i, self.n : self.n + m] = torch.tensor(rows[name], dtype=torch.int32)
        positions = torch.arange(self.n, self.n + m)
        self.n += m
        return positions

    def append_messages(self, tokenizer, segments: list[tuple[list[int], int, str]], turn: int,
                        continue_message: bool = False) -> torch.Tensor:
        """Log ``segments`` [(ids, message index, role)] fed in turn ``turn``, numbering sentences as they go;
        ``continue_message``: the first segment continues the message fed last (a reply being decoded)."""
        rows = {name: [] for name in self.COLUMNS}
        last, start_new = self.sentence
        for n, (ids, msg, role) in enumerate(segments):
            pieces = tokenizer.batch_decode([[i] for i in ids])
            sids, last, start_new = sentence_ids(pieces, last, start_new or not (continue_message and n == 0))
            rows["token"] += ids
            rows["sentence"] += sids
            rows["role"] += [ROLES.index(role)] * len(ids)
            rows["turn"] += [turn] * len(ids)
            rows["message"] += [msg] * len(ids)
        self.sentence = (last, start_new)
        return self.append(rows)

    def truncate(self, n: int, sentence: tuple[int, bool]) -> None:
        """Forget every position from ``n`` on (undo), restoring the sentence state as it was at ``n``."""
        self.n, self.sentence = n, sentence

    def column(self, name: str) -> torch.Tensor:
        return self._data[self.COLUMNS.index(name), : self.n]
