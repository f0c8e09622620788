"""Shared fixtures: tiny random-weight models from configs (fast, mechanical) and the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

# Without a GPU, Triton's kernels (``--decode triton``) run in its interpreter: Triton reads this when first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers.utils import logging as hf_logging  # noqa: E402

from kvchat.core.model import loading as models  # noqa: E402
from kvchat.core.model.loading import ChatModel  # noqa: E402
from tinymodels import build_tiny  # noqa: E402

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


@pytest.fixture(scope="session")
def default_dir() -> Path:
    """The default model converted into $KVCHAT_HOME (once per machine); with ``KVCHAT_TOKENIZER`` set, that folder:
    its tokenizer and chat template alone, for the tiny models of a GPU machine's run (scripts/gpu_check.sh)."""
    if os.environ.get("KVCHAT_TOKENIZER"):
        return Path(os.environ["KVCHAT_TOKENIZER"])
    try:
        return models.default_model_dir()
    except models.ModelError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tokenizer(default_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_dir)


@pytest.fixture(scope="session")
def tiny(tokenizer):
    """tiny(arch) -> ChatModel with random weights and the default model's tokenizer (and chat template)."""
    cache: dict[str, ChatModel] = {}

    def make(arch: str) -> ChatModel:
        if arch not in cache:
            template = "plain" if arch == "gpt2" else None
            cache[arch] = ChatModel.from_pretrained_model(build_tiny(arch, tokenizer), tokenizer, name=f"tiny-{arch}",
                                                          chat_template=template)
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def model_dir(tokenizer, tmp_path_factory):
    """A tiny random-weight Llama saved as a model directory, for the CLI (``--model DIR``) and subprocesses."""
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny("llama", tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smol(default_dir) -> ChatModel:
    """The real default model (SmolLM2-135M-Instruct, fp32 on CPU, with the default --weights: half)."""
    return models.load(str(default_dir))
