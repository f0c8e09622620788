#!/usr/bin/env bash
# Prepare, on this machine, what scripts/gpu_check.sh needs on a lent GPU machine (the device tool; docs/gpu.md):
# wheels of the pure-Python packages its image lacks, and the default model's tokenizer and chat template (no
# weights). Both go to .gpu/, which git ignores and the device call carries (carry: [".gpu"]).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl .gpu/tokenizer
PY=${PYTHON:-.venv/bin/python}
# The image has torch, transformers, accelerate, safetensors, numpy, click, tabulate, python-dateutil, pluggy, psutil,
# tqdm, pytest (its package list in the device tool's KINDS.md); kvchat's imports need sqlite-utils besides.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .gpu/whl \
    sqlite-utils==4.2.1 sqlite-fts4==1.0.3 click-default-group==1.2.4
MODEL=$("$PY" -c "from kvchat.core.model.loading import default_model_dir; print(default_model_dir())")
for f in tokenizer.json tokenizer_config.json chat_template.jinja config.json generation_config.json; do
    [ -f "$MODEL/$f" ] && cp "$MODEL/$f" .gpu/tokenizer/
done
du -sh .gpu
