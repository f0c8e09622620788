"""The process's memory: how glibc's allocator keeps it (``tune_malloc``), and its size for the UI's charts and the
benchmarks."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource

# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_malloc() -> bool:
    """Keep blocks of up to 32 MiB in the heap, and up to 256 MiB of freed heap in the process, instead of mapping
    each large block fresh and giving it back when freed: compressions and recall's put-back allocate temporaries of
    a few MiB (the kept keys gathered and rotated), and each fresh mapping is paid again in page faults. Measured on
    this project's machine when the put-back still read an archive of every token (h2o at budget 512, 14 put-backs
    per run, paired runs): its rotation 9.4-17.6 -> 5.3-6.5 ms in each of three pairs, the peak RSS within 30 MB.
    glibc only (elsewhere nothing is changed); returns whether it applied."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return False
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20) == 1 and ok
    return libc.mallopt(_M_TOP_PAD, 32 << 20) == 1 and ok


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_mb(device) -> tuple[str, float]:
    """The memory a session's chart shows: on a GPU what torch has allocated on it (the model, every session's
    cache), elsewhere the process's resident memory; (what it is, MB)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return "GPU memory (allocated, MB)", torch.cuda.memory_allocated(device) / 2**20
    return "process memory (RSS, MB)", rss_mb()


def rss_mb() -> float:
    """The process's resident memory now (Linux /proc; elsewhere the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return peak_rss_mb()


def settled_gpu_mb() -> float:
    """MiB allocated on the current GPU by live tensors alone: garbage collected, and cuBLAS's workspaces (one per
    stream that ran a product, kept for the process's life: 32 MiB each on Hopper) released, so that a process that
    made them earlier and one that makes them later count them alike (what the GPU bench's chat compares above).
    Only between sessions: a captured graph still to be replayed may use a workspace it was captured with."""
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    release = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # torch's own; no public name yet
    if release is not None:
        release()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2**20
