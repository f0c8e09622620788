"""Makes the old-format conversation tests/test_durability.py reopens (its ``legacy_v1`` fixture runs this): a
conversation stored by kvchat as of commit db83950, whose archive kept every token's KV (kv.bin), reopened by that
version to record the cache it gave (expected.pt).

Run against that commit's code, not this one's; the fixture does it with ``git archive db83950``, the file placed
at that tree's root (it imports the tree's tests/tinymodels) and the tree on PYTHONPATH as ``kvchat``:
``python make.py OUT``."""
import shutil, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).parent / "tests"))
import os
os.environ["HF_HUB_OFFLINE"] = "1"
import kvchat
print("kvchat from", kvchat.__file__)
from transformers import AutoTokenizer
from kvchat.core.model import loading
from kvchat.core.model.loading import ChatModel
from kvchat.core.engine.session import Session, Sampling, Settings
from kvchat.storage.db import Store
from tinymodels import build_tiny

out = Path(sys.argv[1])
shutil.rmtree(out, ignore_errors=True)
out.mkdir(parents=True)
tok = AutoTokenizer.from_pretrained(loading.default_model_dir())
model = ChatModel.from_pretrained_model(build_tiny("llama", tok), tok, name="tiny-llama")
GREEDY = Sampling(max_new_tokens=12, temperature=0.0)
TURNS = [("Hello there. Tell me about the sea!", "The sea is wide. It is deep and blue."),
         ("And the mountains? Are they tall?", "Mountains are tall. Some have snow on top."),
         ("What about rivers in the north?", "Rivers run to the sea. They carve valleys."),
         ("Which do you like best, and why?", "I like the sea best. It never stays the same.")]
store = Store(out / "kv.db")
s = Session(model, Settings(policy="h2o", budget=40, window=8, slack=6, recall="on"), store=store, sampling=GREEDY,
            system="Be brief.")
s.exchange("My locker code is 4417. Please remember it.", "Noted: your locker code is 4417.")
for u, r in TURNS:
    s.exchange(u, r)
s.chat("Tell me one more thing about the sea.")
conv = s.conversation_id
s.close()
r = Session.resume(model, Store(out / "kv.db"), conv, sampling=GREEDY)
assert r.restored_from == "archive", r.restored_from
exp = {}
for i, layer in enumerate(r.cache.layers):
    exp[f"{i}.keys"] = layer.keys_dense().clone()
    exp[f"{i}.values"] = layer.padded(layer.values).clone()
    exp[f"{i}.positions"] = layer.positions().clone()
    for name, t in layer.stats.items():
        exp[f"{i}.stat.{name}"] = layer.padded(t).clone()
r.close()
torch.save(exp, out / "expected.pt")
print(sorted(p.relative_to(out).as_posix() for p in out.rglob("*")))
