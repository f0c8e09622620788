"""The speed bench's plot and RESULTS.md section (bench/speed.py measures)."""

from __future__ import annotations

import statistics

from .common import save_figure

EAGER = " (eager step)"  # with --decode compiled: the policy's rows on the eager step, beside the compiled ones
TRANSFORMERS = {"transformers": "transformers, same weights",
                "transformers_model_weights": "transformers, fp32 weights"}


def plot(result: dict, plots, plt) -> list:
    rows = result["results"]["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for p in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "recompute"):
        rs = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["length"])
        style = ({"color": "black", "ls": "--"} if p == "full" else {"color": "grey", "ls": ":"}
                 if p == "transformers" else {"color": "grey", "ls": "-."} if p in TRANSFORMERS else {})
        axes[0].plot([r["length"] for r in rs], [r["decode_ms_per_token"] for r in rs], marker="o",
                     label=TRANSFORMERS.get(p, p), **style)
        if p in TRANSFORMERS:
            continue
        axes[1].plot([r["length"] for r in rs], [r["prefill_ms"] for r in rs], marker="o", label=p, **style)
    rec = [r for r in rows if r["policy"] == "recompute"]
    if rec:
        axes[0].plot([r["length"] for r in rec], [r["decode_ms_per_token"] for r in rec], marker="x", color="red",
                     label=f"window + recomputation ({rec[0]['window']})")
        axes[0].set_yscale("log")
    axes[0].set_xlabel("tokens of history")
    axes[0].set_ylabel("decode ms/token")
    axes[1].set_xlabel("tokens of history")
    axes[1].set_ylabel("prefill ms of the user turn")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Decode and prefill cost, budget {result['config']['budget']}")
    return [save_figure(fig, plots / "speed.png", plt)]


def markdown(result: dict) -> str:
    res, cfg = result["results"], result["config"]
    rows = res["rows"]
    own = [r for r in rows if r["policy"] != "recompute" and r["policy"] not in TRANSFORMERS]
    lengths = sorted({r["length"] for r in own})
    both = res.get("bandwidth_gbs_measured")
    measured = f" (the larger of {both[0]:.1f} at the start and {both[1]:.1f} at the end)" if both else ""
    lines = [f"Budget {cfg['budget']}, {cfg['steps']} decoded tokens per measurement (decode ms/token: the median "
             f"step), a {cfg['prompt']}-token user turn; `--weights {res.get('weights', 'model')}`; memory bandwidth "
             f"measured {res['bandwidth_gbs']:.1f} GB/s{measured}; a decode step reads "
             f"{res['weight_bytes'] / 2**20:.0f} MiB of weights. Roofline = (weight bytes a step reads + the cache's "
             "key and value buffers, budget + slack) / bandwidth; the ratios are the lowest-highest over the "
             "histories, the last column's at the bandwidth measured beside the policy's steps (copies between blocks "
             "of the transformers loop's).",
             "", "| policy | " + " | ".join(f"decode ms/token @ {n}" for n in lengths)
             + " | prefill ms @ " + " | prefill ms @ ".join(map(str, lengths))
             + " | bookkeeping | roofline ms | measured / roofline | at the bandwidth beside it |",
             "| --- " * (2 * len(lengths) + 5) + "|"]
    for p in dict.fromkeys(r["policy"] for r in own):
        cells = {r["length"]: r for r in own if r["policy"] == p}
        last = cells[max(cells)]
        dec = " | ".join(f"{cells[n]['decode_ms_per_token']:.1f}" if n in cells else "–" for n in lengths)
        pre = " | ".join(f"{cells[n]['prefill_ms']:.0f}" if n in cells else "–" for n in lengths)
        book = statistics.mean(r["bookkeeping"] for r in cells.values())
        ratios = [r["roofline_ratio"] for r in cells.values()]
        near = [r["roofline_ratio_beside"] for r in cells.values() if "roofline_ratio_beside" in r]
        lines.append(f"| {p} | {dec} | {pre} | {100 * book:.1f}% | {last['roofline_ms']:.1f} | "
                     f"{min(ratios):.2f}-{max(ratios):.2f} | "
                     + (f"{min(near):.2f}-{max(near):.2f} |" if near else "– |"))
    if res.get("eager_step"):
        lines += ["", f"The eager decode step (`--decode auto`) ran on {res['eager_step']}."]
    if res.get("compile_s") is not None:
        steps = res.get("compiled_steps") or {}
        lines += ["", f"`--decode compiled`: the step's graph compiled in {res['compile_s']:.1f} s (its first step); "
                  f"{steps.get('graph', '?')} steps ran in the graph, {steps.get('eager', '?')} on the eager step. "
                  f"Rows marked{EAGER} are the same policy on the eager step, timed right after it."
                  + (f" The graph's products: {steps['products']}." if steps.get("products") else "")]
    beside = [r for r in own if "speedup" in r]
    if beside:
        blengths = sorted({r["length"] for r in beside})
        held = beside[0]["reference_tokens"]
        lines += ["", f"Beside transformers at the same cache length (a bare loop holding {held} positions, "
                  "DynamicCache, SDPA, the same weights; blocks of its steps timed between blocks of the policy's): "
                  "kvchat ms/token / transformers ms/token = speedup.", "",
                  "| policy | " + " | ".join(f"@ {n}" for n in blengths) + " |", "| --- " * (len(blengths) + 1) + "|"]
        for p in dict.fromkeys(r["policy"] for r in beside):
            cells = {r["length"]: r for r in beside if r["policy"] == p}
            lines.append(f"| {p} | " + " | ".join(
                f"{cells[n]['decode_ms_per_token']:.1f} / {cells[n]['reference_ms']:.1f} = "
                f"{cells[n]['speedup']:.2f}x" if n in cells else "–" for n in blengths) + " |")
    for name, label in TRANSFORMERS.items():
        bare = [r for r in rows if r["policy"] == name]
        if not bare:
            continue
        parts = []
        for r in bare:
            mine = [c["decode_ms_per_token"] for c in own if c["length"] == r["length"] and c["policy"] != "full"]
            ratio = (f" (kvchat's policies {r['decode_ms_per_token'] / max(mine):.2f}-"
                     f"{r['decode_ms_per_token'] / min(mine):.2f}x faster)" if mine else "")
            parts.append(f"{r['decode_ms_per_token']:.1f} ms/token at {r['length']}{ratio}")
        lines += ["", f"A bare transformers loop ({label}: `--weights {bare[0].get('weights', 'model')}`; "
                  "DynamicCache, SDPA, no compression) at the same history: " + ", ".join(parts) + "."]
    rec = [r for r in rows if r["policy"] == "recompute"]
    if rec:
        lines += ["", "Sliding window with recomputation (re-encoding the last "
                  f"{rec[0]['window']} tokens per generated token): "
                  + ", ".join(f"{r['decode_ms_per_token']:.0f} ms/token at {r['length']}" for r in rec) + "."]
    if any(n + 300 > res["max_positions"] for n in lengths):
        lines += ["", f"`full` stops at the model's {res['max_positions']} positions, so it has no cells beyond."]
    ttft = res.get("ttft") or []
    if ttft:
        sizes = sorted({r["prompt_tokens"] for r in ttft})
        lines += ["", f"TTFT (`streaming` at budget {cfg['budget']}, a chat of FastChat exchanges; ms from the user "
                  "message to the first token's logits):", "",
                  "| turn | tokens of chat | " + " | ".join(f"{n}-token message" for n in sizes) + " |",
                  "| --- " * (len(sizes) + 2) + "|"]
        for turn in sorted({r["turn"] for r in ttft}):
            cells = {r["prompt_tokens"]: r for r in ttft if r["turn"] == turn}
            first = next(iter(cells.values()))
            lines.append(f"| {turn} | {first['history_tokens']} | "
                         + " | ".join(f"{cells[n]['ttft_ms']:.0f}" if n in cells else "–" for n in sizes) + " |")
    return "\n".join(lines)
