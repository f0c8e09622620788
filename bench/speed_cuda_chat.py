"""The long chat of ``kvchat bench speed --device cuda``: TTFT at chosen turns, and the GPU memory, disk and time of a
turn over thousands of turns, in a conversation stored as the app stores one.

Each turn is a user message of 24 random tokens and a reply of ``CHAT_REPLY`` greedy tokens (``streaming`` at the
first budget, recall and the rest as the defaults have them). At turns ``--ttft-turns`` messages of
``--ttft-prompts`` tokens are timed instead (their replies one token). Turn 100, every ``WATCH``-th turn and the
last are watched: the peak GPU memory allocated over the ``PEAK_WINDOW`` ordinary turns up to it (a turn's own
passing work differs from turn to turn: whether recall read text back, whether a compression ran; the window's
peak is what the chat needs at that point, not one turn's luck) and what stayed allocated after it, the bytes the
conversation keeps on disk (database, rows, state, recall's digests) and the mean wall time of a turn since the last
watched one. Turn ``PROFILE_TURN`` (past the budget: recall at work) runs under PyTorch's profiler
(``turn_profile``, with the host time of each of the turn's stages: core/engine/turns.py), and so does the
``LATE``-th turn before the last (``late_profile``), before the last turn's window.

The conversation is stored (``chat.db`` and its archive folder) in ``--chat-store`` where given, with what was
measured so far in ``chat.json`` beside it: a run stopped by its time limit (a GPU lease's call) is continued by the
next run given the same folder, which reopens the conversation at its last saved turn, exactly, and adds its
measurements to the earlier ones (``runs``: where each run started and what was allocated before it opened the
conversation, with nothing cached or left over: the weights; memory is compared above that). Without it the
conversation lives in a temporary folder.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from ..core.cache import compress
from ..core.engine.procinfo import settled_gpu_mb
from ..core.engine.session import Sampling, Session
from ..core.engine.settings import Settings
from ..storage.db import Store
from . import speed_cuda_baselines as baselines
from . import speed_cuda_kernels as kernels
from .common import disk, log

CHAT_REPLY = 8  # tokens generated per turn of the chat
MESSAGE = 24  # tokens of a turn's user message
WATCH = 250  # every WATCH-th turn is watched (and turn 100, and the last)
PEAK_WINDOW = 20  # a watched turn's peak GPU memory is the highest over the ordinary turns of this many up to it
PROFILE_TURN = 260  # this turn runs under PyTorch's profiler: where a turn past the budget spends its time
LATE = 30  # and the LATE-th turn before the chat's last: where a turn of a long chat spends it
READ_ROUNDS = 3  # rounds of ``read_cell``, each way once a round
NOTES = "chat.json"  # beside the stored conversation: what was measured so far, and which conversation it is


def random_ids(cm, n: int, seed: int) -> list[int]:
    special = set(getattr(cm.tokenizer, "all_special_ids", []))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, min(len(cm.tokenizer), cm.model.config.vocab_size), (n * 2,), generator=gen).tolist()
    return [i for i in ids if i not in special][:n]


def text(cm, n: int, seed: int) -> str:
    """A user message of ``n`` random tokens (less what the engine refuses in a message: NUL characters)."""
    return cm.tokenizer.decode(random_ids(cm, n, seed)).replace("\x00", "")


def timing_compressions(device: str, out: list, count=lambda: 0):
    """``compress.compress`` timed, the device synchronised around each: (``count()`` at its start, seconds) into
    ``out``; a context manager."""
    plain = compress.compress

    def compressing(*args, **kwargs):
        baselines.sync(device)
        t = time.perf_counter()
        try:
            return plain(*args, **kwargs)
        finally:
            baselines.sync(device)
            out.append((count(), time.perf_counter() - t))

    return mock.patch.object(compress, "compress", compressing)


def open_chat(cm, budget: int, folder: Path, out: dict) -> Session:
    """The chat stored in ``folder``, reopened where ``chat.json`` names one (its measurements into ``out``), else a
    new one. A folder holding another model's chat, or one at another budget, is refused."""
    kept = stored_chat(folder, cm.name, budget)
    folder.mkdir(parents=True, exist_ok=True)
    store = Store(folder / "chat.db")
    greedy = Sampling(temperature=0.0)
    if kept is not None:
        for key in ("peak_mb", "held_mb", "peak_turns", "disk_mb", "turn_s"):
            kept["chat"][key] = {int(k): v for k, v in kept["chat"].get(key, {}).items()}
        out.update(kept["chat"])
        session = Session.resume(cm, store, kept["conversation_id"], sampling=greedy)
        log(f"speed-cuda {cm.name} chat: reopened at turn {session.turn} ({session.restored_from})")
        return session
    return Session(cm, Settings(policy="streaming", budget=budget), store=store, sampling=greedy)


def stored_chat(folder: Path, model: str, budget: int) -> dict | None:
    """What ``chat.json`` in ``folder`` says of the chat kept there (None: no chat yet); ValueError, one line, for a
    folder that is a file, unreadable notes, or another model's chat or another budget's."""
    folder, notes = Path(folder), Path(folder) / NOTES
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--chat-store {folder}: not a folder")
    if not notes.is_file():
        return None
    try:
        kept = json.loads(notes.read_text(encoding="utf-8"))
        where = (kept["model"], kept["budget"], kept["conversation_id"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--chat-store {folder}: {NOTES} cannot be read ({exc})") from None
    if where[:2] != (model, budget):
        raise ValueError(f"--chat-store {folder}: holds a chat of {where[0]} at budget {where[1]}, not {model} at "
                         f"{budget}")
    return kept


def save_notes(folder: Path, session: Session, budget: int, out: dict) -> None:
    """``chat.json``, written whole or not at all: which conversation, and what was measured of it."""
    if session.conversation_id is None:
        return
    notes = {"model": session.model.name, "budget": budget, "conversation_id": session.conversation_id, "chat": out}
    tmp = folder / (NOTES + ".tmp")
    tmp.write_text(json.dumps(notes, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, folder / NOTES)


def chat_cell(cm, budget: int, turns: list[int], prompts: list[int], replay_turns: int, device: str,
              out: dict, saved=lambda: None, store: str | None = None) -> None:
    """TTFT at turns ``turns``, and what turn 100, every ``WATCH``-th turn and turn ``replay_turns`` cost (peak GPU
    memory, disk, time), into ``out`` as they are measured (``saved()`` at each watched turn: a run stopped early
    keeps what it measured, the trend included). ``store``: the folder the chat is kept in, and continued from."""
    with tempfile.TemporaryDirectory(prefix="kvchat-chat-") as scratch:
        folder = Path(store) if store else Path(scratch)
        # The grids' steps and sessions freed first, not during the chat (seen: turn 100 below the base); read
        # before the conversation opens: a reopened one's cache is the chat's, as a new one's is.
        base = settled_gpu_mb() if device == "cuda" else 0.0
        session = open_chat(cm, budget, folder, out)
        out.setdefault("runs", []).append({"from_turn": session.turn, "base_mb": base})
        try:
            _chat(session, folder, budget, turns, prompts, replay_turns, device, out, saved)
        finally:
            session.close()
            session.store.close()


def watched(turn: int, last: int) -> bool:
    """Whether the chat's ``turn`` is watched (turn 100, every ``WATCH``-th, the last)."""
    return turn in (100, last) or turn % WATCH == 0


def in_window(turn: int, last: int) -> bool:
    """Whether ``turn`` counts in the peak of the next watched turn (one of the ``PEAK_WINDOW`` up to it)."""
    ahead = next(t for t in range(turn, last + 1) if watched(t, last))
    return ahead - turn < PEAK_WINDOW


def _chat(session: Session, folder: Path, budget: int, turns: list[int], prompts: list[int], replay_turns: int,
          device: str, out: dict, saved) -> None:
    cm = session.model
    ttft, peaks = out.setdefault("ttft", []), out.setdefault("peak_mb", {})
    on_disk, pace, held = out.setdefault("disk_mb", {}), out.setdefault("turn_s", {}), out.setdefault("held_mb", {})
    counted = out.setdefault("peak_turns", {})  # the turns each peak is over: fewer where a run began in a window
    out["peak_window"] = PEAK_WINDOW
    last = max(max(turns), replay_turns)
    since, t0 = session.turn, time.perf_counter()
    window = 0  # ordinary turns counted in the peak so far (0: the next turn in a window opens it)
    while session.turn < last:
        nxt = session.turn + 1
        seed = 10 + nxt  # the same messages whether the chat ran in one run or was continued
        if nxt in turns:
            for n in prompts:
                squeezes: list = []  # what of the TTFT is compressions (the device synchronised around each)
                with timing_compressions(device, squeezes):
                    res = session.chat(text(cm, n, seed), max_new_tokens=1)
                ttft.append({"turn": session.turn, "prompt_tokens": res.prompt_tokens, "ttft_ms": res.prefill_ms,
                             "recalled_tokens": res.recalled_tokens, "recall_ms": res.recall_ms,
                             "compressions": len(squeezes), "compress_ms": 1000 * sum(s for _, s in squeezes),
                             "history_tokens": session.total_tokens})
                log(f"speed-cuda {cm.name} TTFT turn {session.turn}: {res.prompt_tokens}-token message "
                    f"{res.prefill_ms:.1f} ms (recall {res.recall_ms or 0:.1f}, {len(squeezes)} compressions "
                    f"{ttft[-1]['compress_ms']:.1f})")
            out.update(turns=session.turn, tokens=session.total_tokens)
            since, t0 = session.turn, time.perf_counter()  # the pace is the ordinary turns'
            window = 0  # a long message's memory is not an ordinary turn's: the window opens again after it
            continue
        seen = watched(nxt, last)
        if in_window(nxt, last):
            if window == 0 and device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            window += 1
        profile = "turn_profile" if nxt == PROFILE_TURN else "late_profile" if nxt == last - LATE > PROFILE_TURN \
            else None
        if profile is not None and profile not in out:
            out[profile] = profiled_turn(session, text(cm, MESSAGE, seed), device)
            since, t0 = session.turn, time.perf_counter()  # the profiler's own cost is not a turn's
        else:
            session.chat(text(cm, MESSAGE, seed), max_new_tokens=CHAT_REPLY)
        out.update(turns=session.turn, tokens=session.total_tokens)
        if not seen:
            continue
        if device == "cuda":
            peaks[nxt] = torch.cuda.max_memory_allocated() / 2**20
            held[nxt] = torch.cuda.memory_allocated() / 2**20
        counted[nxt], window = window, 0
        on_disk[nxt] = sum(disk(session.store, session)) / 2**20
        if session.turn > since:  # the turns timed since the last watched one (not a TTFT's, not the profiled)
            pace[nxt] = (time.perf_counter() - t0) / (session.turn - since)
        since, t0 = session.turn, time.perf_counter()
        log(f"speed-cuda {cm.name} chat: turn {session.turn}, {session.total_tokens} tokens, "
            f"{1000 * pace.get(nxt, 0):.0f} ms a turn, {on_disk[nxt]:.1f} MB on disk"
            + (f", peak {peaks[nxt]:.0f} MiB" if nxt in peaks else ""))
        save_notes(folder, session, budget, out)
        saved()
    save_notes(folder, session, budget, out)


def profiled_turn(session: Session, message: str, device: str) -> dict:
    """One ordinary turn under PyTorch's profiler (``kernels.profile_call``: its kernels and their device time, the
    host's waits for the device, the host operators that took longest), with what the turn says of itself."""
    done = []
    prof = kernels.profile_call(lambda: done.append(session.chat(message, max_new_tokens=CHAT_REPLY)), device)
    res = done[0]
    return {"turn": session.turn, "ttft_ms": res.prefill_ms, "recall_ms": res.recall_ms,
            "recalled_tokens": res.recalled_tokens, "declined": bool(res.recall_declined), **prof}


def above_base(chat: dict, key: str = "peak_mb") -> dict[int, float]:
    """Each watched turn's peak GPU memory (``key``: or what stayed allocated after it, ``held_mb``) above what its
    run had allocated before the chat (the weights; ``runs`` in the order they ran; a chat measured before runs were
    kept has one ``base_mb``)."""
    runs = chat.get("runs") or [{"from_turn": 0, "base_mb": chat.get("base_mb", 0.0)}]
    return {int(turn): mb - next(r["base_mb"] for r in reversed(runs) if r["from_turn"] < int(turn))
            for turn, mb in chat.get(key, {}).items()}


def read_cell(cm, budget: int, prompts: list[int], device: str, rounds: int = READ_ROUNDS) -> dict:
    """Reads of several tokens through the step's layers (``DecodeStep.read``) against the model's forward: a message
    of each of ``prompts``' lengths read into a fresh session whose cache is full (``streaming`` at ``budget``, recall
    off: the message alone), its chunks with a compression before each, both ways in turn ``rounds`` times after a
    round that warms them up. {length: {way: median TTFT ms, and of it compressions' ms}} (docs/gpu.md)."""
    step, out = cm.step, {}
    if step is None:
        return out
    for n in prompts:
        took: dict[str, list] = {"step": [], "model": []}
        for r in range(rounds + 1):
            for way in took:
                step.reads = way == "step"
                session = Session(cm, Settings(policy="streaming", budget=budget, recall="off"), system=None,
                                  sampling=Sampling(temperature=0.0))
                try:
                    session.feed_raw(random_ids(cm, budget, 3), score=False)
                    squeezes: list = []
                    with timing_compressions(device, squeezes):
                        res = session.chat(text(cm, n, 4 + r), max_new_tokens=1)
                finally:
                    step.reads = True
                    session.close()
                if r:
                    took[way].append((res.prefill_ms, 1000 * sum(s for _, s in squeezes)))
        out[n] = {way: {"ttft_ms": statistics.median(t for t, _ in v), "prompt_tokens": res.prompt_tokens,
                        "compress_ms": statistics.median(c for _, c in v)} for way, v in took.items()}
    return out


def reads_line(reads: dict) -> str:
    """The report's line for ``read_cell``'s measurements."""
    return ("Reads of several tokens, a message into a full cache (TTFT, the median of "
            f"{READ_ROUNDS}), through the step's layers against the model's forward: "
            + "; ".join(f"{w['step']['prompt_tokens']} tokens {w['step']['ttft_ms']:.1f} against "
                        f"{w['model']['ttft_ms']:.1f} ms (compressions {w['step']['compress_ms']:.1f} and "
                        f"{w['model']['compress_ms']:.1f})" for w in reads.values()) + ".")
