"""Tokens of a conversation: checking message text, encoding it, decoding a reply as it streams, and the log of
every token ever fed (``TokenLog``), by absolute position.

Per position the log keeps the token id, role, turn, message and sentence, so group ids, the "what the cache
still sees" view, and a rebuild of the cache from the kept tokens need nothing else.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..cache.groups import sentence_ids

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


def _plain(plain: bool) -> dict:
    """The tokenizer's keyword for reading special tokens' text as characters, passed only where asked for."""
    return {"split_special_tokens": True} if plain else {}


def encode(tokenizer, text: str, plain: bool = False) -> list[int]:
    """Token ids of ``text``; ``plain``: special tokens' text read as characters (a message's content)."""
    if not text:
        return []
    return tokenizer(text, add_special_tokens=False, **_plain(plain))["input_ids"]


def encode_with_offsets(tokenizer, text: str, plain: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and the (start, end) character span of each."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, **_plain(plain))
        return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
    ids = encode(tokenizer, text, plain)
    ends = [len(tokenizer.decode(ids[: j + 1])) for j in range(len(ids))]
    return ids, list(zip([0] + ends[:-1], ends))


def encode_parts(tokenizer, parts: list[tuple[str, bool]], offsets: bool = False):
    """Token ids of a segment's (text, plain) parts (``ChatFormat.segment_parts``), each part read on its own; with
    ``offsets``, (ids, each token's (start, end) in the parts' joined text)."""
    ids, spans, at = [], [], 0
    for text, plain in parts:
        if offsets:
            part_ids, part_spans = encode_with_offsets(tokenizer, text, plain) if text else ([], [])
            spans += [(a + at, b + at) for a, b in part_spans]
        else:
            part_ids = encode(tokenizer, text, plain)
        ids += part_ids
        at += len(text)
    return (ids, spans) if offsets else ids


_PIECES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> {token id: its text alone}


def pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text of each token alone (what tells where sentences end), each id decoded once per tokenizer: a
    reopened conversation logs every token it ever fed, and a decode call per message was most of a reopen (2.7 s
    for 6,000 messages, ad hoc)."""
    known = _PIECES.setdefault(tokenizer, {})
    missing = [i for i in set(ids) if i not in known]  # (the memo is shared by the web UI's sessions' threads)
    if missing:
        known.update(zip(missing, tokenizer.batch_decode([[i] for i in missing])))
    return [known[i] for i in ids]


class Detokenizer:
    """Incremental detokenization: emits text only once it no longer ends in a partial character. Each token decodes
    a short window, not the whole reply (the window starts at the tokens before the last emitted text, so that
    spaces and characters spanning tokens come out as the whole decode has them): the cost per token stays flat
    however long the reply."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # the window's first token
        self.read = 0  # the tokens whose text was emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix: self.read], skip_special_tokens=True)
        text = decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


class _Grown:
    """A 1-D tensor appended to in place (its storage grown by doubling)."""

    def __init__(self, dtype: torch.dtype):
        self.n = 0
        self._data = torch.zeros(256, dtype=dtype)

    def extend(self, values: torch.Tensor) -> None:
        m = values.numel()
        if self.n + m > self._data.numel():
            grown = torch.zeros(max(2 * self._data.numel(), self.n + m), dtype=self._data.dtype)
            grown[: self.n] = self._data[: self.n]
            self._data = grown
        self._data[self.n: self.n + m] = values
        self.n += m

    def cut(self, n: int) -> None:
        self.n = min(self.n, n)

    @property
    def values(self) -> torch.Tensor:
        return self._data[: self.n]

    @property
    def nbytes(self) -> int:
        return self._data.numel() * self._data.element_size()


class _Runs:
    """A per-position column kept as runs of equal values: the position each run starts at, and its value. The role,
    turn and message of a token change once per message and its sentence once per sentence, so a run costs a few
    bytes per message or sentence instead of four per token."""

    def __init__(self):
        self.starts, self.ids = _Grown(torch.int64), _Grown(torch.int32)
        self.last: int | None = None  # the last run's value (None when there is none)

    def extend(self, first: int, values: list[int]) -> None:
        if values[0] == values[-1] == self.last and (len(values) == 1 or min(values) == max(values)):
            return  # the last run goes on (a reply decoded token by token): nothing to record
        vals, counts = torch.unique_consecutive(torch.tensor(values, dtype=torch.int32), return_counts=True)
        starts = first + torch.cumsum(counts, 0) - counts
        if int(vals[0]) == self.last:  # continues the last run
            vals, starts = vals[1:], starts[1:]
        self.starts.extend(starts)
        self.ids.extend(vals)
        self.last = values[-1]

    def cut(self, n: int) -> None:
        """Forget positions ``n`` and later."""
        keep = int(torch.searchsorted(self.starts.values, torch.tensor(n, dtype=torch.int64)))
        self.starts.cut(keep)
        self.ids.cut(keep)
        self.last = int(self.ids.values[-1]) if keep else None

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        run = torch.searchsorted(self.starts.values, positions.to(torch.int64).contiguous(), right=True) - 1
        return self.ids.values[run]

    @property
    def nbytes(self) -> int:
        return self.starts.nbytes + self.ids.nbytes


class TokenLog:
    """Metadata of every token fed to the model, by absolute position: the token id (4 bytes a token, the only
    per-token cost), and its role, turn, message and sentence (kept as runs, a few bytes per message and sentence).

    ``sentence`` is the state of sentence numbering: (last sentence id, whether the next token opens a new one)."""

    COLUMNS = ("token", "role", "turn", "message", "sentence")

    def __init__(self):
        self.n = 0
        self.sentence = (0, True)
        self._tokens = _Grown(torch.int32)
        self._runs = {name: _Runs() for name in self.COLUMNS[1:]}

    def append(self, rows: dict[str, list[int]]) -> torch.Tensor:
        """Append rows (one list per column); returns their absolute positions."""
        m = len(rows["token"])
        if m:
            self._tokens.extend(torch.tensor(rows["token"], dtype=torch.int32))
            for name, runs in self._runs.items():
                runs.extend(self.n, rows[name])
        positions = torch.arange(self.n, self.n + m)
        self.n += m
        return positions

    def append_messages(self, tokenizer, segments: list[tuple[list[int], int, str]], turn: int | list[int],
                        continue_message: bool = False) -> torch.Tensor:
        """Log ``segments`` [(ids, message index, role)] fed in turn ``turn`` (or each in its own: a list),
        numbering sentences as they go; ``continue_message``: the first segment continues the message fed last (a
        reply being decoded)."""
        rows = {name: [] for name in self.COLUMNS}
        last, start_new = self.sentence
        turns = turn if isinstance(turn, list) else [turn] * len(segments)
        for n, ((ids, msg, role), turn) in enumerate(zip(segments, turns, strict=True)):
            opens = start_new or not (continue_message and n == 0)
            sids, last, start_new = sentence_ids(pieces(tokenizer, ids), last, opens)
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
        self._tokens.cut(n)
        for runs in self._runs.values():
            runs.cut(n)

    def column(self, name: str, start: int = 0) -> torch.Tensor:
        """Column ``name`` for positions ``start`` to the end (int32; the token column is a view, the others are
        built on each call)."""
        if name == "token":
            return self._tokens.values[start:]
        return self.at(name, torch.arange(min(start, self.n), self.n))

    def at(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        """Column ``name`` at ``positions`` (any shape, each in 0 .. n-1)."""
        if name == "token":
            return self._tokens.values[positions]
        return self._runs[name].at(positions.reshape(-1)).view(positions.shape)

    def runs(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Column ``name`` (not the token column) as runs: the value of each run and its length in positions."""
        runs = self._runs[name]
        starts = runs.starts.values
        return runs.ids.values, torch.diff(starts, append=torch.tensor([self.n], dtype=starts.dtype))

    @property
    def nbytes(self) -> int:
        """Bytes the log holds."""
        return self._tokens.nbytes + sum(runs.nbytes for runs in self._runs.values())
