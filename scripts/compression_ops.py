"""Count the torch operations and host syncs of one compression (or of recall's put-back, or of an undo copy taken
and put back, or of a whole turn) on a tiny random Llama, at several numbers of layers: what it launches on a GPU,
counted on any machine (docs/gpu.md, compressions in slabs).

    .venv/bin/python scripts/compression_ops.py --layers 2 4 8 --policies streaming h2o snapkv tova cake headaware
    .venv/bin/python scripts/compression_ops.py --reorder --policies h2o
    .venv/bin/python scripts/compression_ops.py --undo --layers 2 8 16
    .venv/bin/python scripts/compression_ops.py --turn --recall on --layers 2 8 16 --policies streaming

    .venv/bin/python scripts/compression_ops.py --after 2 --policies cake headaware   # after two more turns

Operations are aten calls without views; syncs are the calls that wait for a GPU (``equal``, ``item``, ``tolist``,
``unique``, indexing by a boolean mask; host tensors' ``item`` and ``tolist`` are counted too, though they wait for
nothing). ``--after N`` counts the compression after N more turns, when ``cake``'s layers and ``headaware``'s heads
hold different numbers of positions. Needs the default model's tokenizer (``kvchat`` converts it on first use).
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from kvchat.core.cache import compress
from kvchat.core.engine.checkpoint import Checkpoint
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.core.model import loading

VIEWS = {"view", "_unsafe_view", "as_strided", "expand", "slice", "select", "t", "detach", "alias", "unsqueeze",
         "squeeze", "permute", "transpose", "reshape"}
SYNCS = {"_local_scalar_dense", "nonzero", "equal", "_unique2", "unique_dim", "unique_consecutive", "masked_select",
         "is_nonzero"}


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.syncs = collections.Counter(), 0
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        def tolist(tensor):  # a read back that dispatches nothing on the CPU
            self.syncs += 1
            return self._tolist(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in VIEWS:
            self.ops[name] += 1
        masks = args[1] if name == "index" and len(args) > 1 else ()
        if name in SYNCS or any(isinstance(m, torch.Tensor) and m.dtype == torch.bool for m in masks):
            self.syncs += 1
        return func(*args, **(kwargs or {}))


#: ``--turn``'s message: about 260 tokens, read in pieces of the slack with a compression before each
MESSAGE = "The quick brown fox jumps over the lazy dog near the river bank. " * 20


def count(tokenizer, layers: int, policy: str, reorder: bool, undo: bool = False, turn: bool = False,
          recall: str = "off", after: int = 0) -> Counter:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    model = loading.ChatModel.from_pretrained_model(AutoModelForCausalLM.from_config(config).eval(), tokenizer,
                                                    name="tiny", decode="graph")
    session = Session(model, Settings(policy=policy, budget=64, window=16, slack=16, recall=recall),
                      sampling=Sampling(max_new_tokens=8, temperature=0.0))
    session.chat("Hello there. Tell me about the sea! And more about mountains, rivers, lakes. " * 3)
    for _ in range(after):
        session.chat("Another sentence about the hills and the sea, and more. " * 2)
    if reorder:  # what recall does before its put-back: room made, the positions read again at the cache's end
        held = set(session.kept_positions().tolist())
        bring = torch.tensor([p for p in range(0, 60, 7) if p not in held])
        compress.compress(session, 64, "recall", drop=bring, room=bring.numel())
        session.read_again(bring)
    counter = Counter()
    with counter:
        if turn:  # a user message of MESSAGE and its 8-token reply: pieces, compressions, recall, the turn's close
            session.chat(MESSAGE)
        elif undo:  # the copy every turn takes for undo, and recall takes when its gate declines, put back
            Checkpoint.capture(session).restore(session)
        elif reorder:
            compress.reorder(session)
        else:
            compress.compress(session, 64, "decode")
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--policies", nargs="+", default=["streaming", "h2o", "snapkv", "tova", "cake", "headaware"])
    parser.add_argument("--reorder", action="store_true", help="count recall's put-back instead of a compression")
    parser.add_argument("--undo", action="store_true", help="count an undo copy taken and put back instead")
    parser.add_argument("--turn", action="store_true",
                        help="count a whole turn instead: a message of about 260 tokens and an 8-token reply")
    parser.add_argument("--recall", choices=["off", "on"], default="off")
    parser.add_argument("--after", type=int, default=0, help="count the compression after this many more turns")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(loading.default_model_dir())
    for policy in args.policies:
        counts = [count(tokenizer, n, policy, args.reorder, args.undo, args.turn, args.recall, args.after)
                  for n in args.layers]
        ops = " / ".join(str(sum(c.ops.values())) for c in counts)
        syncs = " / ".join(str(c.syncs) for c in counts)
        print(f"{policy:10s} layers {' / '.join(map(str, args.layers))}: operations {ops}, syncs {syncs}")


if __name__ == "__main__":
    main()
