"""One kvchat process at a time per stored conversation.

Two processes with one conversation open (``kvchat chat --resume 3`` twice, or a terminal chat beside the web UI on
one database) would each write turns on top of the state they read: one's turn files were renamed or removed under
the other (seen: a reply failed at its commit, and was lost; a delete removed the folder under a running chat). So a
process that opens a stored conversation holds an exclusive lock on a file in its folder (``held``, the holder's pid
and kvchat command inside) until it closes it; the system releases the lock when the process dies, however it dies,
so a crash leaves nothing to clear. Another process's open, delete or rename of that conversation is refused in one
line, naming the holder. Within one process, opening the conversation again is not refused (the web UI moves a
conversation between tabs, and ``app/sessions.py`` keeps it to one tab): holds are counted per folder. ``check``
refuses alike before a slow start (``--resume``, before the model loads), holding nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # not a POSIX system: no locks, as before
    fcntl = None

NAME = "held"
log = logging.getLogger(__name__)

_lock = threading.Lock()
_held: dict[str, list[int]] = {}  # folder -> [file descriptor, holds in this process]


class HeldElsewhere(ValueError):
    """The conversation is open in another process."""


def hold(folder: Path, what: str) -> None:
    """Hold ``folder`` (a conversation's, named ``what`` in the error; it must exist) for this process;
    ``HeldElsewhere`` if another process holds it."""
    if fcntl is None:
        return
    key = str(Path(folder).resolve())
    with _lock:
        if key in _held:
            _held[key][1] += 1
            return
        fd = os.open(Path(folder) / NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _lock_waiting_out_checks(fd)
        except BlockingIOError:
            os.close(fd)
            raise HeldElsewhere(_refusal(folder, what)) from None
        except OSError as exc:  # a file system without locks (some network mounts): opened unguarded, as before
            os.close(fd)
            log.warning("cannot lock %s (%s): another kvchat process could open %s at the same time", folder,
                        exc.strerror or exc, what)
            _held[key] = [-1, 1]
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n{_command()}\n".encode())
        _held[key] = [fd, 1]


def check(folder: Path, what: str) -> None:
    """``HeldElsewhere`` if another process holds ``folder`` now, holding nothing and writing nothing: a refusal
    before a slow start (a model's load), which ``hold`` makes again. It takes a shared lock for a moment (two
    checks at once both pass), which ``hold`` waits out."""
    path = Path(folder) / NAME
    if fcntl is None or not path.is_file():
        return
    with _lock:
        if str(Path(folder).resolve()) in _held:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise HeldElsewhere(_refusal(folder, what)) from None
        except OSError:  # a file system without locks: ``hold`` warns
            pass
        finally:
            os.close(fd)  # and with it the lock


def _lock_waiting_out_checks(fd: int) -> None:
    """The exclusive lock on ``fd``, or BlockingIOError; another process's ``check`` holds it for microseconds."""
    for tries_left in (2, 1, 0):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not tries_left:
                raise
            time.sleep(0.05)


@contextlib.contextmanager
def held(folder: Path, what: str):
    """``hold`` for the block (a delete or rename from another command: refused while a process has it open)."""
    hold(folder, what)
    try:
        yield
    finally:
        release(folder)


def release(folder: Path) -> None:
    """Give back one hold of ``folder``; the lock goes with the last (the file stays: removing it would let two
    processes lock two different files of one name)."""
    if fcntl is None:
        return
    key = str(Path(folder).resolve())
    with _lock:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            if entry[0] >= 0:
                fcntl.flock(entry[0], fcntl.LOCK_UN)
                os.close(entry[0])


def _command() -> str:
    """The kvchat command this process runs (``kvchat serve``), or "" for another program."""
    argv = sys.argv
    if len(argv) > 1 and Path(argv[0]).name in ("kvchat", "cli.py") and argv[1].isidentifier():
        return f"kvchat {argv[1]}"
    return ""


def _refusal(folder: Path, what: str) -> str:
    try:
        pid, command = ((Path(folder) / NAME).read_text().splitlines() + ["", ""])[:2]
    except OSError:
        pid, command = "", ""
    by = f" (pid {pid}{f', `{command}`' if command else ''})" if pid.isdigit() else ""
    there = "open another conversation in its browser tab or close the tab" if command == "kvchat serve" else \
        "close it there first"
    return f"{what} is open in another kvchat process{by}; {there}"
