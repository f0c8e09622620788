"""A chat session: one conversation, one KV cache that stays bounded however long the chat runs.

Each new message is rendered by the chat template as the text it adds, tokenized, and prefilled on top of the
existing cache (never the history). Before a forward would take the cache past budget + slack, the session
compresses it to the budget: the policy scores the cached positions, ``select_keep`` turns scores into the slots
to keep (protecting sink, system prompt and recent window, evicting whole groups), and each layer gathers them,
re-rotating the kept keys in ``rerotate`` mode. The engine never knows which policy it runs.

Per absolute position the session keeps the token id, role, turn, message and sentence (``TokenLog``), so group
ids, the "what the cache still sees" view, and a rebuild of the cache from the kept tokens need nothing else.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import resource
import threading
import time
from collections.abc import Generator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..policies import LayerView, make_policy
from .cache import KVCache
from .groups import select_keep, sentence_ids
from .models import ChatModel
from .observe import Observer
from .settings import Settings

ROLES = ("system", "user", "assistant")
MAX_CHUNK = 512  # longest prefill forward
CLOSING_RESERVE = 8  # positions kept free at a hard position limit for the tokens that close a reply


class ContextFullError(ValueError):
    """The conversation cannot take more tokens without passing the model's position limit."""


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def check_text(text: Any, what: str = "message") -> str:
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


@dataclass
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 0.7  # 0 = greedy
    top_p: float = 0.9

    def validate(self) -> "Sampling":
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        return self


@dataclass
class TurnResult:
    turn: int
    role: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    cache_tokens: int = 0  # positions per layer and head, averaged (cache.mean_length), at the turn's end
    cache_bytes: int = 0
    peak_cache_tokens: int = 0  # the same measure at its highest during the turn (before each compression)
    evicted_tokens: int = 0
    evicted_groups: int = 0
    prefill_ms: float = 0.0
    decode_ms_per_token: float | None = None
    answer: str | None = None
    stopped: str | None = None
    expect: str | None = None
    hit: bool | None = None
    expect_nll: float | None = None
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


class TokenLog:
    """Metadata of every token fed to the model, indexed by absolute position (int32 columns, grown by doubling)."""

    COLUMNS = ("token", "role", "turn", "message", "sentence")

    def __init__(self):
        self.n = 0
        self._data = torch.zeros(len(self.COLUMNS), 1024, dtype=torch.int32)

    def append(self, rows: dict[str, list[int]]) -> torch.Tensor:
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

    def column(self, name: str) -> torch.Tensor:
        return self._data[self.COLUMNS.index(name), : self.n]


class _Detokenizer:
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


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


class Session:
    def __init__(self, model: ChatModel, settings: Settings | None = None, system: str | None = "default",
                 store=None, sampling: Sampling | None = None, seed: int = 0, title: str | None = None,
                 undo: bool = False):
        """``system``: the system prompt; "default" uses the template's own default (if it has one), None none.
        ``undo``: keep a copy of the state before each turn so ``undo()`` can take the last one back."""
        self.cm = model
        settings = settings or Settings()
        settings.validate(model.max_positions, model.rotary_error)
        self.settings = settings
        self.policy = make_policy(settings.policy, **settings.params)
        self.sampling = (sampling or Sampling()).validate()
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.cache = KVCache(model.num_layers, settings.capacity if self.policy.bounded else None,
                             model.max_positions)
        self.log = TokenLog()
        self.messages: list[dict] = []  # {"role", "content"} as the template sees them
        self.turn = 0
        self.store = store
        self.conversation_id: int | None = None
        self.title = title
        self.history: list[TurnResult] = []
        self.system_tokens = 0
        self.evicted_total = 0
        self.observer = self._make_observer(self.policy)
        self._cancel = threading.Event()
        self._lock = threading.RLock()  # a reply streams in one thread; settings / undo / views come from others
        self.undo_enabled = undo
        self._undo: dict | None = None
        self._pending: list[dict] = []  # turn records not yet written (the system turn waits for the first exchange)
        self._pending_settings: list[dict] = []
        self._events: list[dict] = []
        self._warnings: list[str] = []
        self._warned: set[str] = set()
        self._sentence = (0, True)  # (last sentence id, next token starts a new one)
        self._peak = 0
        self.restored_from: str | None = None
        self._last_logits: torch.Tensor | None = None
        if system == "default":
            system = model.chat.default_system
        if system is not None:
            self.add("system", system)

    # ------------------------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------------------------
    @property
    def cache_tokens(self) -> int:
        """Cached positions per layer (averaged over layers and heads when budgets differ)."""
        return self.cache.mean_length

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes

    @property
    def total_tokens(self) -> int:
        return self.log.n

    def cancel(self) -> None:
        """Stop the reply being generated (from another thread); the partial reply is kept."""
        self._cancel.set()

    def configure(self, **changes: Any) -> dict:
        """Change cache settings on the live session; they apply at the next step, without re-prefilling.

        A smaller budget compresses at once. Returns the changes applied (ValueError and nothing applied if the
        new combination is invalid). Safe to call from another thread while a reply streams.
        """
        with self._lock:
            new = self.settings.changed(**changes)
            new.validate(self.cm.max_positions, self.cm.rotary_error)
            applied = {k: v for k, v in new.as_dict().items() if self.settings.as_dict().get(k) != v}
            if not applied:
                return {}
            self._apply_settings(new)
            record = {"turn": self.turn, "changes": applied, "settings": new.as_dict(), "created_at": now_iso()}
            if self.store is not None and self.conversation_id is not None:
                self.store.record_settings(self.conversation_id, record)
            else:
                self._pending_settings.append(record)
            return applied

    def _apply_settings(self, new: Settings) -> None:
        policy = make_policy(new.policy, **new.params)
        old, was_bounded = self.settings, self.policy.bounded
        self.settings, self.policy = new, policy
        if (old.policy, old.params) != (new.policy, new.params):
            self.observer = self._make_observer(policy)
        if old.positions != new.positions:
            self._convert_positions(old.positions, new.positions)
        if policy.bounded:
            shrunk = not was_bounded or new.budget < old.budget
            if shrunk and self.cache.mean_length > new.budget:
                self._compress(new.budget, "settings")
            self.cache.set_capacity(new.capacity)
        else:
            self.cache.set_capacity(None)

    @property
    def can_undo(self) -> bool:
        return self._undo is not None

    def undo(self) -> list[dict]:
        """Take back the last turn: the cache, token log and stored conversation return to their state before it
        (the current settings stay). Needs ``undo=True`` at construction; one level. Returns the messages removed."""
        with self._lock:
            cp = self._undo
            if cp is None:
                raise ValueError("nothing to undo (only the last turn made in this session can be taken back)")
            self._undo = None
            current = self.settings
            removed = self.messages[len(cp["messages"]):]
            self.settings, self.policy = cp["settings"], make_policy(cp["settings"].policy, **cp["settings"].params)
            self.policy.set_state(cp["policy_state"])
            self.cache = KVCache(self.cm.num_layers, cp["capacity"], self.cm.max_positions)
            if cp["cache"]:
                self.cache.load_state_tensors(cp["cache"], self.cm.device, self.cm.dtype)
            self.observer = self._make_observer(self.policy)
            if self.observer is not None and cp["observer"]:
                self.observer.load_state_tensors(cp["observer"], self.cm.device)
            self.log.n, self.messages, self.turn = cp["log_n"], cp["messages"], cp["turn"]
            del self.history[cp["history"]:]
            for name in ("evicted_total", "system_tokens", "_sentence", "_last_logits", "_events", "_warned",
                         "_pending", "_pending_settings", "title"):
                setattr(self, name, cp[name])
            self.generator.set_state(cp["generator"])
            if current != self.settings:
                self._apply_settings(current)
            if self.store is not None and self.conversation_id is not None:
                if cp["conversation_id"] is None:  # the undone turn created the conversation: it goes
                    self.store.delete(self.conversation_id)
                    self.conversation_id = None
                else:
                    self.store.truncate(self.conversation_id, self.turn, self._conversation_row())
            return removed

    def _mark_undo(self) -> None:
        if self.undo_enabled:
            self._checkpoint()

    def _checkpoint(self) -> None:
        """Remember the state before a turn (``undo``): a copy of the kept KV and everything that indexes it."""
        cache = {k: t.clone() for k, t in self.cache.state_tensors().items()}
        observer = {k: t.clone() for k, t in self.observer.state_tensors().items()} if self.observer else {}
        self._undo = {
            "settings": self.settings, "policy_state": self.policy.get_state(), "capacity": self.cache.capacity,
            "cache": cache, "observer": observer, "log_n": self.log.n,
            "messages": [dict(m) for m in self.messages], "turn": self.turn, "history": len(self.history),
            "evicted_total": self.evicted_total, "system_tokens": self.system_tokens, "_sentence": self._sentence,
            "_last_logits": self._last_logits, "_events": list(self._events), "_warned": set(self._warned),
            "_pending": list(self._pending), "_pending_settings": list(self._pending_settings),
            "title": self.title, "conversation_id": self.conversation_id,
            "generator": self.generator.get_state(),
        }

    @_locked
    def add(self, role: str, text: str) -> TurnResult:
        """Append one message without generating (teacher forcing)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        text = check_text(text, f"{role} message")
        if role == "system" and self.messages:
            raise ValueError("a system message can only open a conversation")
        ids = self._encode(self.cm.chat.segment(self.messages, {"role": role, "content": text}))
        res = self._begin(role)
        self._check_fits(len(ids))
        if role != "system":
            self._mark_undo()
        idx = self._new_message(role, text)
        t0 = time.perf_counter()
        self._feed([(ids, idx)])
        res.prefill_ms = 1000 * (time.perf_counter() - t0)
        res.prompt_tokens = len(ids)
        if role == "system":
            self.system_tokens = len(ids)
        if role == "assistant":
            res.answer = text
        return self._end(res, [(idx, ids)])

    @_locked
    def exchange(self, user: str, assistant: str) -> TurnResult:
        """Append a user message and its assistant reply as given (importing or replaying a transcript)."""
        user = check_text(user, "user message")
        assistant = check_text(assistant, "assistant message")
        u = {"role": "user", "content": user}
        user_ids = self._encode(self.cm.chat.segment(self.messages, u))
        asst_ids = self._encode(self.cm.chat.segment(self.messages + [u], {"role": "assistant", "content": assistant}))
        res = self._begin("assistant")
        self._check_fits(len(user_ids) + len(asst_ids))
        self._mark_undo()
        mu, ma = self._new_message("user", user), self._new_message("assistant", assistant)
        t0 = time.perf_counter()
        self._feed([(user_ids, mu), (asst_ids, ma)])
        res.prefill_ms = 1000 * (time.perf_counter() - t0)
        res.prompt_tokens, res.answer = len(user_ids) + len(asst_ids), assistant
        return self._end(res, [(mu, user_ids), (ma, asst_ids)])

    @_locked
    def probe(self, user: str, reference: str, expect: str) -> TurnResult:
        """Ask ``user``, teacher-force ``reference`` as the answer, and measure how well the cache predicts the
        tokens covering ``expect`` inside it: mean NLL, and hit = each of them was the model's top choice."""
        user = check_text(user, "user message")
        reference = check_text(reference, "reference")
        expect = check_text(expect, "expect")
        at = reference.lower().find(expect.lower())
        if at < 0:
            raise ValueError(f"expect text {expect!r} does not occur in the reference answer")
        u = {"role": "user", "content": user}
        user_ids = self._encode(self.cm.chat.segment(self.messages, u))
        header = self.cm.chat.generation_header(self.messages + [u])
        seg = self.cm.chat.segment(self.messages + [u], {"role": "assistant", "content": reference})
        ref_start = seg.find(reference, len(header) if seg.startswith(header) else 0)
        if ref_start < 0:
            raise ValueError("the chat template altered the reference answer; cannot locate the expected text")
        asst_ids, offsets = self._encode_with_offsets(seg)
        lo, hi = ref_start + at, ref_start + at + len(expect)
        cover = [j for j, (a, b) in enumerate(offsets) if b > lo and a < hi]
        res = self._begin("assistant")
        self._check_fits(len(user_ids) + len(asst_ids))
        self._mark_undo()
        mu, ma = self._new_message("user", user), self._new_message("assistant", reference)
        t0 = time.perf_counter()
        _, logprobs, top1 = self._feed([(user_ids, mu), (asst_ids, ma)], want_logprobs=True)
        res.prefill_ms = 1000 * (time.perf_counter() - t0)
        rows = [len(user_ids) + j - 1 for j in cover]  # the logits that predict each covering token
        res.expect_nll = float(-logprobs[rows].mean())
        res.hit = bool(top1[rows].all())
        res.prompt_tokens, res.answer, res.expect = len(user_ids) + len(asst_ids), reference, expect
        return self._end(res, [(mu, user_ids), (ma, asst_ids)])

    @_locked
    def reply(self, user: str, max_new_tokens: int | None = None, temperature: float | None = None,
              top_p: float | None = None) -> Generator[str, None, TurnResult]:
        """Add a user message and generate the reply; returns a generator yielding text as it is decoded.

        Bad input raises here, before anything is fed.

        The generator's return value (``StopIteration.value``; also ``self.history[-1]``) is the TurnResult.
        ``cancel()`` or closing the generator stops the reply; what was generated is kept and committed.
        """
        smp = replace(self.sampling, **{k: v for k, v in (("max_new_tokens", max_new_tokens),
                                                          ("temperature", temperature), ("top_p", top_p))
                                        if v is not None}).validate()
        user = check_text(user, "user message")
        u = {"role": "user", "content": user}
        user_ids = self._encode(self.cm.chat.segment(self.messages, u))
        header = self.cm.chat.generation_header(self.messages + [u])
        header_ids = self._encode(header)
        res = self._begin("assistant")
        self._check_fits(len(user_ids) + len(header_ids) + CLOSING_RESERVE)
        self._mark_undo()
        return self._generate(res, u, user_ids, header, header_ids, smp)

    def _generate(self, res, u, user_ids, header, header_ids, smp) -> Generator[str, None, TurnResult]:
        # The lock is held for each model step, never across a yield: settings changes, views and cancel() from
        # other threads land between steps.
        history = self.messages + [u]
        with self._lock:
            mu, ma = self._new_message("user", u["content"]), self._new_message("assistant", "")
            self._cancel.clear()
            t0 = time.perf_counter()
            logits = self._feed([(user_ids, mu), (header_ids, ma)])[0]
            res.prefill_ms = 1000 * (time.perf_counter() - t0)
        res.prompt_tokens = len(user_ids) + len(header_ids)
        generated: list[int] = []
        detok = _Detokenizer(self.cm.tokenizer)
        decode_s, steps, stopped = 0.0, 0, None
        try:
            while True:
                with self._lock:
                    token = self._sample(logits, smp)
                    generated.append(token)
                    if token in self.cm.stop_ids:
                        stopped = "eos"
                        break
                    delta = detok.push(token)
                if delta:
                    yield delta
                with self._lock:
                    if self._cancel.is_set():
                        stopped = "cancelled"
                    elif len(generated) >= smp.max_new_tokens:
                        stopped = "max_tokens"
                    elif self._hard_limit_reached(1 + CLOSING_RESERVE):
                        stopped = "context_full"
                    if stopped:
                        break
                    t = time.perf_counter()
                    logits = self._feed([([token], ma)], continue_message=True)[0]
                    decode_s += time.perf_counter() - t
                    steps += 1
        except GeneratorExit:
            with self._lock:
                self._finish_reply(res, history, header, header_ids, user_ids, mu, ma, generated, "cancelled",
                                   decode_s, steps)
            raise
        with self._lock:
            return self._finish_reply(res, history, header, header_ids, user_ids, mu, ma, generated, stopped,
                                      decode_s, steps)

    @_locked
    def feed_raw(self, ids: list[int], score: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Feed tokens as plain text, without the chat template (long-text measurements such as perplexity).

        With ``score``, returns the log-probability the model gave each fed token and whether it was the top
        choice; the first token is scored by the logits that ended the previous feed (NaN / False when there were
        none). Without, only the last position's logits are computed."""
        if not ids:
            raise ValueError("nothing to feed")
        res = self._begin("user")
        self._check_fits(len(ids))
        self._mark_undo()
        idx = self._new_message("user", self.cm.tokenizer.decode(ids))
        previous = self._last_logits
        _, logprobs, top1 = self._feed([(list(ids), idx)], want_logprobs=score)
        self._end(res, [(idx, list(ids))])
        if not score:
            return None
        first = torch.log_softmax(previous.float().cpu(), -1)[ids[0]] if previous is not None else torch.tensor(
            float("nan"))
        first_top = bool(previous is not None and int(previous.argmax()) == ids[0])
        return torch.cat([first[None], logprobs]), torch.cat([torch.tensor([first_top]), top1])

    def chat(self, user: str, **sampling) -> TurnResult:
        """``reply`` run to the end; returns the TurnResult (its ``answer`` holds the reply)."""
        gen = self.reply(user, **sampling)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value

    @_locked
    def kept_positions(self) -> torch.Tensor:
        """Absolute positions held by at least one layer/head, ascending."""
        held = [layer.positions().flatten() for layer in self.cache.layers if layer.is_initialized]
        if not held:
            return torch.zeros(0, dtype=torch.long)
        held = torch.unique(torch.cat(held))
        return held[held >= 0].cpu()

    @_locked
    def held_fraction(self) -> torch.Tensor:
        """Per absolute position, the fraction of (layer, KV head) pairs whose cache still holds it."""
        counts = torch.zeros(self.log.n, dtype=torch.float32)
        heads = 0
        for layer in self.cache.layers:
            if layer.is_initialized:
                pos = layer.positions().flatten().cpu().long()
                counts += torch.bincount(pos[pos >= 0], minlength=self.log.n)[: self.log.n].float()
                heads += layer.heads
        return counts / max(heads, 1)

    @_locked
    def stats(self) -> dict:
        s = self.settings
        return {
            "policy": s.policy, "params": dict(self.policy.values), "settings": s.as_dict(), "turns": self.turn,
            "total_tokens": self.log.n, "cache_tokens": self.cache.length, "cache_bytes": self.cache.nbytes,
            "capacity": s.capacity if self.policy.bounded else None, "evicted_tokens": self.evicted_total,
            "max_positions": self.cm.max_positions, "peak_rss_mb": peak_rss_mb(),
            "observer_bytes": self.observer.nbytes if self.observer is not None else 0,
            **self.policy.report(),
        }

    # ------------------------------------------------------------------------------------------------------------
    # Persistence: snapshots and resuming
    # ------------------------------------------------------------------------------------------------------------
    @_locked
    def save_snapshot(self) -> Path | None:
        """Write the kept KV and its positions next to the database (safetensors) and reference it from the
        conversation. Returns the path, or None when nothing has been stored yet."""
        if self.store is None or self.conversation_id is None or self._pending:
            return None
        folder = self.store.path.parent / "snapshots"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"conversation-{self.conversation_id}.safetensors"
        tmp = path.with_suffix(".tmp")
        meta = {"turn": str(self.turn), "model": self.cm.name, "total_tokens": str(self.log.n),
                "positions": self.settings.positions, "policy": self.settings.policy,
                "policy_state": json.dumps(self.policy.get_state())}
        tensors = self.cache.state_tensors()
        if self.observer is not None:
            tensors.update(self.observer.state_tensors())
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
        self.store.set_snapshot(self.conversation_id, str(path), self.turn)
        return path

    @classmethod
    def resume(cls, model: ChatModel, store, conversation_id: int, use_snapshot: bool = True,
               sampling: Sampling | None = None, undo: bool = False) -> "Session":
        """Reopen a stored conversation. The cache is restored exactly from its snapshot when the snapshot is
        current, else rebuilt by prefilling the kept tokens (``restored_from`` says which)."""
        conv = store.conversation(conversation_id)
        if conv["model"] != model.name:
            raise ValueError(f"conversation {conversation_id} was held by model {conv['model']}, not {model.name}")
        known = {f.name for f in fields(Settings)}
        settings = Settings(**{k: v for k, v in conv["settings"].items() if k in known})
        self = cls(model, settings, system=None, store=store, sampling=sampling, seed=conv["seed"] or 0,
                   title=conv["title"], undo=undo)
        self.conversation_id = conversation_id
        for m in store.messages(conversation_id):
            idx = self._new_message(m["role"], m["text"])
            self.turn = m["turn"]
            self._log_tokens([(m["tokens"], idx)], continue_message=False)
            if idx == 0 and m["role"] == "system":
                self.system_tokens = len(m["tokens"])
        self.turn = conv["next_turn"]
        self.generator.manual_seed(self.seed + self.turn)
        stat_fields = {f.name for f in fields(TurnResult)}
        for row in store.turn_stats(conversation_id):
            self.history.append(TurnResult(**{k: v for k, v in row.items() if k in stat_fields}))
        self.evicted_total = sum(r.evicted_tokens for r in self.history)
        snap = conv.get("snapshot_path")
        if use_snapshot and snap and conv.get("snapshot_turn") == self.turn and Path(snap).is_file():
            with safe_open(snap, "pt") as f:
                meta = f.metadata() or {}
            if int(meta.get("total_tokens", -1)) == self.log.n and meta.get("positions") == settings.positions:
                tensors = load_file(snap)
                self.cache.load_state_tensors(tensors, model.device, model.dtype)
                if self.observer is not None:
                    self.observer.load_state_tensors(tensors, model.device)
                if meta.get("policy") == settings.policy and meta.get("policy_state"):
                    self.policy.set_state(json.loads(meta["policy_state"]))
                self.restored_from = "snapshot"
                return self
        kept = [p for a, b in conv["kept"] or [] for p in range(a, b)]
        self._rebuild(torch.tensor(kept, dtype=torch.long))
        self.restored_from = "tokens"
        return self

    def _rebuild(self, positions: torch.Tensor) -> None:
        """Prefill the tokens at ``positions`` (absolute, ascending) into an empty cache."""
        tokens = self.log.column("token")[positions].long()
        evicted, i = self.evicted_total, 0
        while i < positions.numel():  # per-head policies keep a union of positions that may pass the budget
            c = self._make_room(positions.numel() - i)
            self._forward(tokens[i: i + c], positions[i: i + c])
            i += c
        self._events, self.evicted_total = [], evicted  # a rebuild's own compressions are not the chat's

    # ------------------------------------------------------------------------------------------------------------
    # Turns
    # ------------------------------------------------------------------------------------------------------------
    def _begin(self, role: str) -> TurnResult:
        # Eviction events are not reset: those of a live settings change are committed with the next turn.
        self._warnings = []
        self._peak = self.cache.mean_length
        return TurnResult(turn=self.turn, role=role)

    def _new_message(self, role: str, text: str) -> int:
        self.messages.append({"role": role, "content": text})
        return len(self.messages) - 1

    def _end(self, res: TurnResult, messages: list[tuple[int, list[int]]]) -> TurnResult:
        res.cache_tokens, res.cache_bytes = self.cache.mean_length, self.cache.nbytes
        res.peak_cache_tokens = max(self._peak, res.cache_tokens)
        res.evicted_tokens = sum(e["evicted_tokens"] for e in self._events)
        res.evicted_groups = sum(e["evicted_groups"] for e in self._events)
        res.warnings = list(self._warnings)
        self.history.append(res)
        stamp = now_iso()
        record = {
            "turn": self.turn,
            "messages": [{"idx": i, "role": self.messages[i]["role"], "text": self.messages[i]["content"],
                          "tokens": ids, "turn": self.turn, "created_at": stamp} for i, ids in messages],
            "stats": {**res.as_dict(), "policy": self.settings.policy, "settings": self.settings.as_dict(),
                      "created_at": stamp},
            "events": list(self._events),
        }
        self._events = []
        self.turn += 1
        self._commit(record)
        return res

    def _commit(self, record: dict) -> None:
        self._pending.append(record)
        if self.store is None:
            self._pending.clear()
            return
        if self.conversation_id is None and all(m["role"] == "system" for r in self._pending for m in r["messages"]):
            return  # a conversation is created with its first exchange, not by opening a session
        if self.title is None:
            first = next((m["text"] for r in self._pending for m in r["messages"] if m["role"] == "user"), "")
            self.title = " ".join(first.split())[:60] or "conversation"
        self.conversation_id = self.store.commit_turns(self.conversation_id, self._conversation_row(),
                                                       self._pending, self._pending_settings)
        self._pending, self._pending_settings = [], []

    def _conversation_row(self) -> dict:
        kept = self.kept_positions().tolist()
        ranges, start = [], None
        for a, b in zip(kept, kept[1:] + [None]):
            start = a if start is None else start
            if b != a + 1:
                ranges.append([start, a + 1])
                start = None
        return {"title": self.title, "model": self.cm.name, "settings": asdict(self.settings),
                "next_turn": self.turn, "total_tokens": self.log.n, "kept": ranges, "seed": self.seed,
                "updated_at": now_iso()}

    def _finish_reply(self, res, history, header, header_ids, user_ids, mu, ma, generated, stopped, decode_s,
                      steps) -> TurnResult:
        tok = self.cm.tokenizer
        eos_last = stopped == "eos"
        content = tok.decode(generated[:-1] if eos_last else generated, skip_special_tokens=True)
        self.messages[ma]["content"] = content
        # Close the assistant turn the way the template renders it; the last sampled token is not cached yet.
        seg = self.cm.chat.segment(history, {"role": "assistant", "content": content})
        raw = header + tok.decode(generated, skip_special_tokens=False)
        if seg.startswith(raw):
            closing = seg[len(raw):]
        else:
            closing, eos_text = self.cm.chat.closing, tok.decode(generated[-1:]) if eos_last else ""
            closing = closing[len(eos_text):] if eos_last and closing.startswith(eos_text) else closing
        tail = generated[-1:] + self._encode(closing)
        if tail:
            self._feed([(tail, ma)], continue_message=True)
        res.new_tokens = len(generated)
        res.answer, res.stopped = content, stopped
        res.decode_ms_per_token = 1000 * decode_s / steps if steps else None
        return self._end(res, [(mu, user_ids), (ma, header_ids + generated[:-1] + tail)])

    # ------------------------------------------------------------------------------------------------------------
    # Feeding tokens
    # ------------------------------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.cm.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        tok = self.cm.tokenizer
        if getattr(tok, "is_fast", False):
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
        ids = self._encode(text)
        ends = [len(tok.decode(ids[: j + 1])) for j in range(len(ids))]
        return ids, list(zip([0] + ends[:-1], ends))

    def _log_tokens(self, segments, continue_message: bool) -> torch.Tensor:
        rows = {name: [] for name in TokenLog.COLUMNS}
        last, start_new = self._sentence
        for n, (ids, msg) in enumerate(segments):
            pieces = self.cm.tokenizer.batch_decode([[i] for i in ids])
            sids, last, start_new = sentence_ids(pieces, last, start_new or not (continue_message and n == 0))
            role = ROLES.index(self.messages[msg]["role"])
            rows["token"] += ids
            rows["sentence"] += sids
            rows["role"] += [role] * len(ids)
            rows["turn"] += [self.turn] * len(ids)
            rows["message"] += [msg] * len(ids)
        self._sentence = (last, start_new)
        return self.log.append(rows)

    def _feed(self, segments: list[tuple[list[int], int]], want_logprobs: bool = False,
              continue_message: bool = False):
        """Feed tokens ([(ids, message index)]) through the model on top of the cache, compressing as needed.

        Returns (last logits, next-token log-probs, top-1 flags); the latter two only with ``want_logprobs``
        (entry j scores token j+1 of the fed sequence).
        """
        positions = self._log_tokens(segments, continue_message)
        ids = torch.tensor([i for seg, _ in segments for i in seg], dtype=torch.long)
        total = ids.numel()
        logprobs, top1, i, logits = [], [], 0, None
        while i < total:
            c = self._make_room(total - i)
            logits = self._forward(ids[i: i + c], positions[i: i + c], all_logits=want_logprobs)
            if want_logprobs:
                targets = ids[i + 1: i + c + 1]
                lp = torch.log_softmax(logits[: targets.numel()].float(), dim=-1).cpu()
                logprobs.append(lp.gather(1, targets[:, None])[:, 0])
                top1.append(lp.argmax(-1) == targets)
            i += c
        last = logits[-1]
        self._last_logits = last
        if want_logprobs:
            return last, torch.cat(logprobs), torch.cat(top1)
        return last, None, None

    def _forward(self, ids: torch.Tensor, abs_pos: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        if self.settings.positions == "original":
            pos = abs_pos
        else:
            pos = torch.arange(self.cache.length, self.cache.length + ids.numel())
        device = self.cm.device
        self.cache.incoming_abs = abs_pos.to(device=device, dtype=torch.int32)
        extra = {}
        if self.observer is not None:
            self.observer.positions = pos.to(device)
            extra["kvchat_observer"] = self.observer
        with torch.no_grad():
            out = self.cm.model(input_ids=ids[None].to(device), position_ids=pos[None].to(device),
                                past_key_values=self.cache, use_cache=True,
                                logits_to_keep=0 if all_logits else 1, **extra)
        return out.logits[0]

    def _make_observer(self, policy) -> Observer | None:
        accumulate, window = "acc" in policy.observes, policy.obs_window
        return Observer(self.cache, accumulate, window) if accumulate or window else None

    def _sample(self, logits: torch.Tensor, smp: Sampling) -> int:
        if smp.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / smp.temperature, dim=-1)
        if smp.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            drop = torch.cumsum(sorted_p, 0) - sorted_p > smp.top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    # ------------------------------------------------------------------------------------------------------------
    # Positions and limits
    # ------------------------------------------------------------------------------------------------------------
    def _next_position(self) -> int:
        return self.log.n if self.settings.positions == "original" else self.cache.length

    def _hard_limit(self) -> bool:
        """Whether the model cannot go past its max positions at all (rather than degrade)."""
        return not self.policy.bounded or (self.settings.positions == "original" and not self.cm.uses_rope)

    def _hard_limit_reached(self, more: int) -> bool:
        return self._hard_limit() and self._next_position() + more > self.cm.max_positions

    def _check_fits(self, m: int) -> None:
        limit = self.cm.max_positions
        nxt = self._next_position()
        if self._hard_limit() and nxt + m > limit:
            raise ContextFullError(
                f"this message needs {m} more positions but only {max(limit - nxt, 0)} of the model's {limit} are "
                f"left; switch to a bounded policy (e.g. streaming) to go on"
            )
        if self.settings.positions == "original" and nxt + m > limit and "positions" not in self._warned:
            self._warn("positions", f"original positions now pass the model's {limit} trained positions; "
                                    "quality will degrade (use --positions rerotate to stay within them)")

    def _warn(self, key: str, text: str) -> None:
        self._warnings.append(text)
        self._warned.add(key)

    def _convert_positions(self, old: str, new: str) -> None:
        layers = [layer for layer in self.cache.layers if layer.is_initialized]
        if new == "rerotate":  # kept keys end right before the next position, as after a compression
            for layer in layers:
                layer.pos_off = [self.cache.length - n for n in layer.lens]
        if self.cm.rotary is not None:
            for layer in layers:
                layer.shift_positions(self.cm.rotary, to_original=new == "original")

    # ------------------------------------------------------------------------------------------------------------
    # Compression
    # ------------------------------------------------------------------------------------------------------------
    def _make_room(self, m: int) -> int:
        """How many of the next ``m`` tokens to feed now, compressing first if the cache has no room for them."""
        c = min(m, MAX_CHUNK)
        if not self.policy.bounded:
            return c
        s = self.settings
        if c > self.cache.room:
            c = min(c, s.slack_tokens)
            if c > self.cache.room:
                self._compress(s.budget, "prefill" if m > 1 else "decode")
        return c

    def _protected(self, positions: torch.Tensor, lens: list[int], keep: int) -> torch.Tensor:
        s = self.settings
        window = min(s.window_tokens, keep)
        slots = torch.arange(positions.shape[1], device=positions.device)[None, :]
        lens_t = torch.tensor(lens, device=positions.device)[:, None]
        protected = (slots >= lens_t - window) & (slots < lens_t)
        if self.policy.protect_start:
            start = s.sink
            if self.system_tokens > start:
                if self.system_tokens + window <= keep:
                    start = self.system_tokens
                elif "system" not in self._warned:
                    self._warn("system", f"the system prompt ({self.system_tokens} tokens) does not fit the budget "
                                         "beside the window; it is no longer protected from eviction")
            protected |= (positions < start) & (positions >= 0)
        return protected

    def _groups(self, positions: torch.Tensor) -> torch.Tensor | None:
        mode = self.settings.groups
        if mode == "token":
            return None
        column = self.log.column("sentence" if mode == "sentence" else "message")
        ids = column[positions.clamp(min=0).cpu()].to(positions.device).long()
        return ids.masked_fill(positions < 0, -1)

    def _view(self, li: int, layer) -> LayerView:
        rerotate = self.settings.positions == "rerotate"
        positions = layer.positions()
        view = LayerView(li, positions, layer.valid(), layer.keys_dense(), groups=self._groups(positions),
                         now=self.log.n)
        if "acc" in self.policy.observes and "acc" in layer.stats:
            view.acc = layer.padded(layer.stats["acc"])
        if "window" in self.policy.observes and self.observer is not None:
            view.window = self.observer.window_attention(li, self.cm.rotary if rerotate else None,
                                                         self.cache.length if rerotate else None)
        return view

    def _compress(self, keep: int, reason: str) -> None:
        s = self.settings
        before = self.cache.mean_length
        self._peak = max(self._peak, before)  # the cache is at its fullest just before a compression or a turn's end
        layers = [(li, layer) for li, layer in enumerate(self.cache.layers) if layer.is_initialized]
        views = [self._view(li, layer) for li, layer in layers]
        minimum = s.window_tokens + (s.sink if self.policy.protect_start else 0) + 1
        alloc = self.policy.allocate(views, keep, minimum)
        shared: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        plans, evicted_groups = [], 0
        # In rerotate mode the next position is the largest kept count: keep it inside the trained positions.
        ceiling = self.cm.max_positions - s.slack_tokens if s.positions == "rerotate" else None
        for pos, ((li, layer), view) in enumerate(zip(layers, views)):
            counts = alloc[pos] if alloc is not None else [keep] * layer.heads
            if ceiling is not None:
                counts = [min(c, ceiling) for c in counts]
            if shared is not None and alloc is None and torch.equal(shared[0], view.positions):
                index = shared[1]
            else:
                scores = self.policy.score(view)
                if scores.dim() == 1:
                    scores = scores.expand(layer.heads, -1)
                protected = self._protected(view.positions, layer.lens, min(counts))
                index = select_keep(scores, counts, protected, view.groups, s.aggregate, view.valid)
                if self.policy.layer_independent:
                    shared = (view.positions, index)
            if li == 0:
                held = view.positions[0][view.valid[0]]
                g = held if view.groups is None else view.groups[0][view.valid[0]]
                evicted_groups = torch.unique(g).numel() - torch.unique(g[index[0].to(g.device)]).numel()
            plans.append((layer, index, [c + s.slack_tokens for c in counts] if alloc is not None else None))
        next_pos = max(int(i.numel()) for _, index, _ in plans for i in index)
        rotary = self.cm.rotary if s.positions == "rerotate" else None
        for layer, index, caps in plans:
            layer.keep(index, rotary, next_pos, caps or [s.capacity] * layer.heads)
        after = self.cache.mean_length
        self.evicted_total += before - after
        self._events.append({"turn": self.turn, "reason": reason, "before": before, "after": after,
                             "evicted_tokens": before - after, "evicted_groups": evicted_groups,
                             "total_tokens": self.log.n, "created_at": now_iso()})


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    """The process's resident memory now (Linux /proc; elsewhere the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return peak_rss_mb()
