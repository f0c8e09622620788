"""What a captured decode step spends its time on (``kvchat bench speed --device cuda``): the kernels of one replay,
from PyTorch's profiler, against the replay's time.

The first GPU run found the step ~100 µs a layer over the bytes it reads and put it down to many small kernels
(docs/gpu.md): this says how many kernels a step launches, how long they run, and how much of a replay is neither
(the gaps between them). On a GPU it profiles replays of the captured graph, or where the profiler sees no kernels
inside one, the same step run uncaptured (``source`` says which); on the CPU (the tests) the step's operators.
``profile_compression`` does the same for one compression, whose 14-95 ms on an H100 the operations it launches do
not explain: its kernels' device time against its wall time, and the host's waits for the device; ``profile_call``
for anything else (the long chat's profiled turn: bench/speed_cuda_chat.py)."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from ..core.cache import compress
from ..core.engine.turns import STAGES

from .speed_cuda_baselines import sync

TOP = 8  # kernels listed per profile, the longest first


def replay_ms(step, cache, times: int = 50) -> float | None:
    """The device's time for one replay of ``cache``'s captured step on ``step`` (a ``GraphStep``; CUDA events around
    ``times`` replays), None without a capture. Each replay writes the last token's slot again: after a reply."""
    replay = step.stepper(cache, captured=True) if step.capture else None
    if not isinstance(getattr(replay, "__self__", None), torch.cuda.CUDAGraph):  # no plan, or none captured
        return None
    replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(times):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / times


def profile_step(step, cache, layers: int, times: int = 20) -> dict | None:
    """The kernels of one step of ``cache``'s plan on ``step`` (a ``GraphStep``), averaged over ``times`` steps:
    their count and time a step, per layer, and the longest ``TOP`` by name. None without a plan. Like
    ``replay_ms``, each step writes the last token's slot again: for benches, after a reply."""
    from torch.profiler import ProfilerActivity, profile

    if step.stepper(cache) is None:
        return None
    cuda = step.capture  # on CUDA a plan that took a step has its graph
    device = "cuda" if cuda else "cpu"
    for source in (("graph", "uncaptured") if cuda else ("uncaptured",)):
        run = step.stepper(cache, captured=source == "graph")
        with torch.no_grad():
            run()
            sync(device)
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                for _ in range(times):
                    run()
                sync(device)
        kernels = _kernels(prof, cuda)
        if kernels:
            break
    else:
        return {"source": source, "kernels": 0}
    count = sum(n for n, _ in kernels.values()) / times
    us = sum(t for _, t in kernels.values()) / times
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TOP]
    return {"source": source, "kernels": count, "kernels_per_layer": count / layers, "kernel_us": us,
            "top": [{"name": name[:90], "per_step": n / times, "us": t / times} for name, (n, t) in top]}


def _kernels(prof, cuda: bool) -> dict[str, tuple[int, float]]:
    """name -> (launches, µs of device time) of the profile's kernels; on the CPU its operators' own time."""
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA or "memcpy" in e.key.lower():
                continue
            own = e.self_device_time_total
        else:
            own = e.self_cpu_time_total
            if own <= 0:
                continue
        out[e.key][0] += e.count
        out[e.key][1] += own
    return {k: (n, t) for k, (n, t) in out.items()}


def line(name: str, label: str, row: dict) -> str:
    """One line of the report for a bench row's profile (``row["kernels"]``, beside its replay time)."""
    prof, replay_ms = row["kernels"], row.get("graph_ms")
    if not prof.get("kernels"):
        return f"{name} {label}: the profiler saw no kernels ({prof.get('source')})."
    gap = ""
    if replay_ms is not None and prof["source"] == "graph":
        gap = f" in a {replay_ms * 1000:.0f} µs replay ({replay_ms * 1000 - prof['kernel_us']:.0f} µs between them)"
    top = ", ".join(f"{k['name'][:40]} {k['us']:.0f} µs ×{k['per_step']:.0f}" for k in prof["top"][:5])
    return (f"{name} {label} ({prof['source']}): {prof['kernels']:.0f} kernels a step "
            f"({prof['kernels_per_layer']:.1f} a layer), {prof['kernel_us']:.0f} µs of them{gap}; the longest: {top}.")


WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def profile_compression(session, budget: int) -> dict:
    """One compression of ``session``'s cache to ``budget`` under PyTorch's profiler (``profile_call``): whether a
    compression is bound by the device, by waits, or by the host's Python. It compresses the session: for benches,
    after a reply."""
    return profile_call(lambda: compress.compress(session, budget, "bench"), session.model.device.type)


def profile_call(fn, device: str) -> dict:
    """``fn()`` under PyTorch's profiler, host and device: its wall time, its kernels (count, device time), the
    host's waits for the device (``WAITS``) and the host operators that took longest (their own time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with torch.no_grad(), profile(activities=activities) as prof:
        t = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t
    kernels = _kernels(prof, True) if device == "cuda" else {}
    host = defaultdict(lambda: [0, 0.0])
    waits, stages = 0, {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CPU:
            waits += e.count if e.key in WAITS else 0
            if e.key.startswith("aten::") and e.self_cpu_time_total > 0:
                host[e.key][0] += e.count
                host[e.key][1] += e.self_cpu_time_total
            if e.key in STAGES:  # the turn's stages (core/engine/turns.py): their host time, waits included,
                # and on a GPU the device time of the kernels PyTorch's operators launched inside them (a graph's
                # replay is no operator: its kernels may be left out)
                stages[e.key] = {"count": e.count, "ms": e.cpu_time_total / 1000}
                if kernels:
                    stages[e.key]["device_ms"] = e.device_time_total / 1000
    top = sorted(host.items(), key=lambda kv: -kv[1][1])[:TOP]
    out = {"wall_ms": 1000 * wall, "kernels": sum(n for n, _ in kernels.values()),
           "kernel_us": sum(t for _, t in kernels.values()), "waits": waits,
           "host_ops": sum(n for n, _ in host.values()), "host_us": sum(t for _, t in host.values()),
           "top_host": [{"name": k, "count": n, "us": t} for k, (n, t) in top],
           "stages": dict(sorted(stages.items(), key=lambda kv: -kv[1]["ms"]))}
    if kernels:  # the kernels that took the device longest, in all
        out["top_kernels"] = [{"name": k[:90], "count": n, "us": t}
                              for k, (n, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TOP]]
    return out


def profile_line(name: str, label: str, prof: dict, what: str = "a compression") -> str:
    """One line of the report for a ``profile_call``'s result (``what`` it profiled: a row's ``compress_profile``, the
    chat's ``turn_profile``)."""
    top = ", ".join(f"{k['name'][6:]} {k['us']:.0f} µs ×{k['count']}" for k in prof["top_host"][:5])
    stages = ", ".join(f"{k[7:]} {v['ms']:.1f} ms" + (f" ({v['device_ms']:.1f} on the device)" if "device_ms" in v
                                                      else "") + (f" ×{v['count']}" if v["count"] > 1 else "")
                       for k, v in prof.get("stages", {}).items())
    kernels = ", ".join(f"{k['name'][:40]} {k['us'] / 1000:.1f} ms ×{k['count']}"
                        for k in prof.get("top_kernels", [])[:5])
    return (f"{name} {label}: {what} {prof['wall_ms']:.1f} ms, {prof['kernels']} kernels "
            f"{prof['kernel_us'] / 1000:.2f} ms on the device, {prof['waits']} waits for it, {prof['host_ops']} host "
            f"operators {prof['host_us'] / 1000:.2f} ms of their own; the longest: {top}."
            + (f" The longest kernels: {kernels}." if kernels else "") + (f" Its stages: {stages}." if stages else ""))
