"""The kvpress half of benchmarks/kvpress_compare.py. Runs in kvpress's own virtual environment (kvpress pins
transformers < 5.3), never imports kvchat. Reads a JSON job on stdin, prints JSON results on stdout.

Protocol (one-shot, as kvpress is built for): prefill the prefix under the press (compressing it to the kept
fraction), then score the continuation with the compressed cache at its original positions.
"""

import json
import math
import sys
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache


def main() -> None:
    job = json.load(sys.stdin)
    import kvpress

    torch.manual_seed(0)
    ids = torch.tensor(job["ids"])
    prefix, cont = ids[: job["prefix"]], ids[job["prefix"]:]
    results = {}
    models = {}
    for name, spec in job["presses"].items():
        attn = "eager" if spec["class"] == "ObservedAttentionPress" else "sdpa"
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32,
                                                                attn_implementation=attn).eval()
        model = models[attn]
        press = getattr(kvpress, spec["class"])(compression_ratio=1 - job["keep"] / job["prefix"],
                                                **spec.get("args", {}))
        cache = DynamicCache(config=model.config)
        t = time.perf_counter()
        with torch.no_grad(), press(model):
            out = model(input_ids=prefix[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t
        kept = cache.get_seq_length()
        positions = torch.arange(len(prefix), len(ids))[None]
        t = time.perf_counter()
        with torch.no_grad():
            out2 = model(input_ids=cont[None], past_key_values=cache, position_ids=positions, use_cache=True)
        logits = torch.cat([out.logits[0, -1:], out2.logits[0, :-1]]).float()
        nll = -torch.log_softmax(logits, -1).gather(1, cont[:, None])[:, 0]
        results[name] = {"ppl": math.exp(float(nll.mean())), "kept": kept, "prefill_s": prefill_s,
                         "continuation_ms_per_token": 1000 * (time.perf_counter() - t) / len(cont)}
    print(json.dumps({"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "?",
                      "results": results}))


if __name__ == "__main__":
    main()
