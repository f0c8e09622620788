"""The decode step's products (core/decode/) as small C++ operators (the sources: ``csrc/*.cpp``): attention's two,
the products with the fp16 weights, the two parts of a layer around its cache write built from them (which the
compiled step's graph calls inside it, and the eager step where a cache layer must resize first), and a whole layer
with its cache write, which the eager step calls once per layer.

A decode step multiplies one token's vector with every weight matrix and a few queries per KV head (GQA's groups: 3
for the default model) with ~1,000 cached keys and values per head. Both are reads of memory with little arithmetic,
and the library kernels for these shapes read at well under this machine's memory bandwidth. Ad hoc, with buffers
cycled so that they come from memory as in a step (docs/speed.md): attention over 30 layers of 1,088 slots took 1.85
ms (scores) and 2.14 ms (values) as ``torch.bmm``; 1.19 and 1.21 with the last version's plain loops, 1.10 and 1.16
with the current ones (medians of 15 rounds in one run); the values 1.11 against 1.24 once the blocks' sums were
added inside the operator instead of by a ``sum`` call (another run). Weights shaped like the default model's (30
layers' seven projections and the output layer, 276 MB of fp16; q/k/v with 1,152 rows where the model's have 960),
medians of 12 rounds in one run: ``matvec`` 10.2 ms (27.1 GB/s), inductor's reduction kernel for ``(x *
w.float()).sum(-1)`` 13.6 (20.3), an fp16 ``F.linear`` 11.5 (23.9), a plain sum of the same bytes 9.5 (29.0). The
operators:

* ``kvchat::scores(q [H, G, D], k [H, C, D]) -> [H, G, C]``: ``q @ k.transpose(1, 2)``, one dot product per query
  and slot;
* ``kvchat::values(p [H, G, C], v [H, C, D]) -> [H, G, D]``: ``p @ v``, each block's weighted rows summed, then the
  blocks' sums;
* ``kvchat::matvec(x [..., K] fp32, w [N, K] fp16) -> [..., N] fp32``: ``x @ w.T`` with ``w`` widened to fp32 in
  registers, fp32 sums; the rows of ``w`` shared out over ATen's threads, each read once;
* ``kvchat::project(x, n, eps, w, bias, cos, sin, rotated) -> [..., N]``: a layer's part before its cache write —
  the RMS norm of one token's x, its product with w (q/k/v concatenated; ``matvec``), the bias if any, and the rotary
  embedding of the first ``rotated`` outputs (queries and keys) head by head — in one call where the eager step made
  six or more; with ``rotated`` 0, the output layer's norm and product;
* ``kvchat::block(q, k, v, lens, x, o_w, n2, eps, gu_w, down_w) -> (x', probs)``: the rest of a Llama-family layer
  once its new key and value are in the cache — the scores, the softmax over each head's slots up to ``lens[h]``
  (later ones 0), the weighted values, the output projection added to ``x``, the RMS norm, gate and up, SiLU(gate) *
  up, the down projection added — with the three above inside and the norm, the softmax's and SiLU's exponentials
  (eight lanes at a time with AVX2) and the adds in between, so that the graph makes one operator call per layer
  where it made eight operator and kernel calls. Alternating with those in blocks of 8 tokens (ad hoc,
  ``streaming``, budget 1024, six replies of 96 tokens): 9.68-10.17 ms per token against 9.99-10.29;
* ``kvchat::layer(x, n1, eps1, qkv_w, qkv_b, cos, sin, nq, keys, values, cap, n, scaling, o_w, n2, eps2, gu_w,
  down_w, sums=None) -> (x', q, k, v, probs)``: a whole layer of the eager step where every head of the cache layer
  has a free slot n: ``project``, the new key and value written at slot n of each head of the layer's buffers
  ([heads * cap, D], head after head), the queries times ``scaling`` and ``block`` over slots [0, n], and with
  ``sums`` (H2O's per-slot statistic) each slot's probability averaged over its head's queries added to it; the
  eager step's Python around its three parts (views, the cache write, the scaling, H2O's sums) in C++. The bits of
  the three parts (tests/test_step.py); not registered for ``torch.compile`` (the compiled step writes the cache
  inside its graph).

Attention reads each head's slots in place: a cache buffer's heads may lie any distance apart (the eager step hands
the first n slots of each, a view), its rows of one head one after the other. It streams them in blocks of ``BLOCK``
slots shared out over ATen's threads. With AVX, FMA and F16C (x86-64 since about 2013) the three products are
written with their intrinsics (for attention, head sizes that are multiples of 8; a key of up to 64 values stays in
registers while every query meets it); elsewhere as plain loops the compiler vectorizes. All are float32 arithmetic
in another summation order than the library's (tests/test_step.py compares them with ``torch.bmm``, a widened
product and the separate operations). They are built once per machine and install with
``torch.utils.cpp_extension`` (g++; ninja, a kvchat dependency; ``-march=native``) into torch's extension cache, and
registered as torch operators so that ``torch.compile`` calls them inside its graph. ``load()`` says why they cannot
be had; the eager step then runs without them and the compiled step uses ``torch.bmm`` and inductor's own products.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BLOCK = 128  # slots per block of work

#: The C++ sources, built together into one extension (``load``).
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("attention.cpp", "products.cpp", "layer.cpp",
                                                              "register.cpp")]

_lock = threading.Lock()
_state: dict[str, object] = {}


def load() -> str | None:
    """Build (once per machine and install) and register the operators; None when ``torch.ops.kvchat`` has them,
    else why not (said once in the log)."""
    with _lock:
        if "why" in _state:
            return _state["why"]
        why = None
        try:
            from torch.utils.cpp_extension import load as build

            _find_ninja()

            name = extension_name()
            # Loading a build takes a fraction of a second; building takes ~30 s on a 2-core machine, once: said
            # when it is taking that long.
            notice = threading.Timer(3.0, log.warning, ("building kvchat's decode operators (core/ops/kernels.py; once "
                                                        "per machine and version, about half a minute on 2 cores)",))
            notice.daemon = True
            notice.start()
            folder = build_directory(name)
            try:
                with _held(folder / "kvchat.lock"):
                    _clear_stale_baton(folder)
                    build(name, sources=[str(p) for p in SOURCES], is_python_module=False, build_directory=str(folder),
                          extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DKVCHAT_BLOCK={BLOCK}"],
                          extra_include_paths=[str(SOURCES[0].parent)], extra_ldflags=["-fopenmp"])
            finally:
                notice.cancel()
            _register_fakes()
        except Exception as exc:  # noqa: BLE001 — no compiler, no ninja, a build error: torch.bmm instead
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            why = f"{type(exc).__name__}: {first}"
            log.warning("kvchat's operators could not be built (%s); the compiled step uses torch.bmm and inductor's "
                        "products", why)
        _state["why"] = why
        return why


def extension_name() -> str:
    """One build per CPU kind (-march=native; torch's extension cache is keyed by the name, not the CPU) and per
    folder the sources lie in: torch rebuilds an extension whose sources or include path differ from its last build's,
    so two kvchat installs on one machine under one name rebuilt it (~30 s) for every process of the other."""
    where = hashlib.sha1(str(SOURCES[0].parent.resolve()).encode()).hexdigest()[:8]
    return f"kvchat_decode_ops_{torch.backends.cpu.get_cpu_capability().lower()}_{where}"


def build_directory(name: str) -> Path:
    """Where torch builds the extension ``name`` (its own choice, ``$TORCH_EXTENSIONS_DIR`` or its cache; a
    folder of kvchat's own under its cache should torch's private helper go)."""
    from torch.utils import cpp_extension

    helper = getattr(cpp_extension, "_get_build_directory", None)
    if helper is not None:
        return Path(helper(name, False))
    folder = Path(cpp_extension.get_default_build_root()) / "kvchat" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def _held(path: Path):
    """An exclusive lock on ``path`` for the block, which the system releases when its process dies however it
    dies (``flock``; where there is none, no lock)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _clear_stale_baton(folder: Path) -> None:
    """torch marks a build or load of an extension in progress by a file (``lock``, its ``FileBaton``) that it
    removes when done, and every later load waits for that file to go: a process killed in between (``kill -9``
    while kvchat starts) left it, and every kvchat after it waited forever. Every kvchat takes ``_held``'s lock
    before torch's file, so a file found while holding it was left by a process that died."""
    baton = folder / "lock"
    if baton.exists():
        log.warning("removing %s, left by a process killed while it built or loaded kvchat's operators", baton)
        baton.unlink(missing_ok=True)


def _find_ninja() -> None:
    """torch runs ``ninja`` from PATH; the ``ninja`` package (a kvchat dependency) installs it beside the venv's
    Python, which is not on PATH when that Python is run by its path (``.venv/bin/python -m pytest``)."""
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing (fake tensors)."""

    @torch.library.register_fake("kvchat::scores")
    def _(q, k):
        return q.new_empty(q.shape[0], q.shape[1], k.shape[1])

    @torch.library.register_fake("kvchat::values")
    def _(p, v):
        return v.new_empty(v.shape[0], p.shape[1], v.shape[2])

    @torch.library.register_fake("kvchat::matvec")
    def _(x, w):
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @torch.library.register_fake("kvchat::project")
    def _(x, n, eps, w, bias, cos, sin, rotated):
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @torch.library.register_fake("kvchat::block")
    def _(q, k, v, lens, x, o_w, n2, eps, gu_w, down_w):
        return x.new_empty(x.shape), q.new_empty(q.shape[0], q.shape[1], k.shape[1])
