"""What ``kvchat bench speed --device cuda`` measures kvchat against: the roofline (the bytes a step reads, the
device's copy bandwidth) and, at the same context length, transformers' ``generate`` with a DynamicCache and a static
cache with the forward compiled with CUDA graphs."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA), before a host clock is read."""
    if device == "cuda":
        torch.cuda.synchronize()


def generate_ms(cm, ids: list[int], steps: int, device: str) -> float:
    """transformers' ``generate`` with a DynamicCache and SDPA: ms per token beyond the first (greedy)."""
    model = cm.model
    model.set_attn_implementation("sdpa")
    x = torch.tensor([ids], device=device)
    kwargs = dict(do_sample=False, cache_implementation="dynamic", pad_token_id=0)
    try:
        with torch.no_grad():
            model.generate(x, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm up
            times = []
            for n in (1, steps):
                sync(device)
                t = time.perf_counter()
                model.generate(x, max_new_tokens=n, min_new_tokens=n, **kwargs)
                sync(device)
                times.append(time.perf_counter() - t)
    finally:
        model.set_attn_implementation("kvchat")
    return 1000 * (times[1] - times[0]) / (steps - 1)


def compiled_ms(cm, ids: list[int], steps: int, device: str) -> dict:
    """A static cache and the forward compiled with CUDA graphs (``mode="reduce-overhead"``), stepped by hand:
    ms per token (the token's id read back each step, as streaming needs), and the compile's seconds."""
    from transformers import StaticCache

    model = cm.model
    model.set_attn_implementation("sdpa")
    cache = StaticCache(config=model.config, max_cache_len=len(ids) + steps + 8)
    arg = {cm.cache_arg: cache}
    compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    try:
        with torch.no_grad():
            x = torch.tensor([ids], device=device)
            out = model(input_ids=x, cache_position=torch.arange(len(ids), device=device), use_cache=True,
                        logits_to_keep=1, **arg)
            token = out.logits[:, -1:].argmax(-1)
            times, t0 = [], time.perf_counter()
            for i in range(steps + 3):
                at = torch.tensor([len(ids) + i], device=device)
                t = time.perf_counter()
                torch.compiler.cudagraph_mark_step_begin()
                out = compiled(input_ids=token, position_ids=at[None], cache_position=at, use_cache=True, **arg)
                token = out.logits[:, -1:].argmax(-1).clone()
                int(token)
                times.append(time.perf_counter() - t)
                if i == 2:
                    compile_s = time.perf_counter() - t0
    finally:
        model.set_attn_implementation("kvchat")
    return {"ms": 1000 * statistics.median(times[3:]), "compile_s": compile_s}


def bandwidth_gbs(device: str, mb: int = 1024, repeats: int = 10) -> float:
    """Device memory bandwidth: the best of ``repeats`` copies of a ``mb`` MB tensor, bytes read + written."""
    src = torch.randn(mb * 2**18, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads: every linear layer's and norm's (one row of the embedding)."""
    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            total += m.weight[0].numel() * m.weight.element_size()
        elif not list(m.children()):
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total
