"""The kvpress half of ``kvchat bench kvpress``. Runs in kvpress's own virtual environment (kvpress pins
transformers < 5.3) and never imports kvchat: reads a JSON job on stdin, prints one JSON line of results.

Two protocols per task:

* ``oneshot``: prefill the prefix under the press (compressing it to ``keep`` positions), then score the
  continuation in one forward with the compressed cache at its original positions;
* ``decoding``: kvpress's DecodingPress around the press: prefill the prefix uncompressed, then feed the
  continuation one token per step (teacher forcing); every ``interval`` steps the cache is compressed to ``keep``;
  with ``in_order``, the kept tokens are put back in position order after each compression (see
  ``kept_in_position_order``).
"""

import contextlib
import json
import math
import sys
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache


def oneshot(kvpress, model, task, ids):
    prefix, cont = ids[: task["prefix"]], ids[task["prefix"]: task["prefix"] + task["cont"]]
    press = getattr(kvpress, task["class"])(compression_ratio=1 - task["keep"] / task["prefix"], **task["args"])
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), press(model):
        out = model(input_ids=prefix[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
    kept = cache.get_seq_length()
    positions = torch.arange(len(prefix), len(prefix) + len(cont))[None]
    t = time.perf_counter()
    with torch.no_grad():
        out2 = model(input_ids=cont[None], past_key_values=cache, position_ids=positions, use_cache=True)
    ms = 1000 * (time.perf_counter() - t) / len(cont)
    logits = torch.cat([out.logits[0, -1:], out2.logits[0, :-1]]).float()
    nll = -torch.log_softmax(logits, -1).gather(1, cont[:, None])[:, 0]
    return {"ppl": math.exp(float(nll.mean())), "kept": kept, "ms_per_token": ms}


@contextlib.contextmanager
def kept_in_position_order():
    """kvpress's ScorerPress gathers the kept tokens in top-k (score) order, so after a compression the cache is no
    longer in position order (kvpress issue #173). A press that scores by slot (StreamingLLMPress: the first n_sink
    slots are sinks, the slots after them the oldest) then evicts other tokens than its rule names from the second
    compression on. Within this context the kept indices come back in position order (on the path of the presses
    this bench runs, DecodingPress around StreamingLLM, SnapKV, TOVA or ObservedAttention, ScorerPress.compress is
    the only top-k call; other kvpress presses call top-k for other ends), so that a task can measure the press with
    and without kvpress's ordering."""
    topk = torch.Tensor.topk

    def in_order(self, k, dim=-1, *args, **kwargs):
        idx = topk(self, k, dim, *args, **kwargs).indices.sort(dim=dim).values
        return torch.return_types.topk((self.gather(dim, idx), idx))

    torch.Tensor.topk = in_order
    try:
        yield
    finally:
        torch.Tensor.topk = topk


def decoding(kvpress, model, task, ids):
    prefix, cont = ids[: task["prefix"]], ids[task["prefix"]: task["prefix"] + task["cont"]]
    base = getattr(kvpress, task["class"])(**task["args"])
    press = kvpress.DecodingPress(base_press=base, compression_interval=task["interval"], target_size=task["keep"])
    cache = DynamicCache(config=model.config)
    nll, times, peak = [], [], 0
    order = kept_in_position_order() if task.get("in_order") else contextlib.nullcontext()
    with torch.no_grad(), press(model), order:
        out = model(input_ids=prefix[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()
        for i, tok in enumerate(cont.tolist()):
            nll.append(-float(torch.log_softmax(logits, -1)[tok]))
            t = time.perf_counter()
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[len(prefix) + i]]), logits_to_keep=1)
            times.append(time.perf_counter() - t)
            logits = out.logits[0, -1].float()
            peak = max(peak, cache.get_seq_length())
    return {"ppl": math.exp(sum(nll) / len(nll)), "kept": cache.get_seq_length(), "max_cache": peak,
            "ms_per_token": 1000 * sum(times) / len(times)}


def warm_up(model, ids):
    """First calls pay one-time costs; keep them out of the timings."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[None, :64], past_key_values=cache, use_cache=True, logits_to_keep=1)
        for i in range(4):
            model(input_ids=ids[None, 64 + i: 65 + i], past_key_values=cache, use_cache=True, logits_to_keep=1)


def main() -> None:
    job = json.load(sys.stdin)
    import kvpress

    torch.manual_seed(0)
    torch.set_num_threads(job.get("threads") or torch.get_num_threads())
    ids = torch.tensor(job["ids"])
    models, results = {}, {}
    for task in job["tasks"]:
        attn = "eager" if task["class"] == "ObservedAttentionPress" else "sdpa"
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32,
                                                                attn_implementation=attn).eval()
            warm_up(models[attn], ids)
        try:
            run = oneshot if task["mode"] == "oneshot" else decoding
            results[task["id"]] = run(kvpress, models[attn], task, ids)
        except Exception as exc:  # reported per task: a press kvpress cannot run this way
            results[task["id"]] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"kvpress {task['id']}: {results[task['id']]}", file=sys.stderr, flush=True)
    version = getattr(kvpress, "__version__", None)
    if version is None:
        from importlib.metadata import version as _v
        version = _v("kvpress")
    import transformers
    print(json.dumps({"kvpress": version, "transformers": transformers.__version__, "torch": torch.__version__,
                      "results": results}))


if __name__ == "__main__":
    main()
