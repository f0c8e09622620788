#!/usr/bin/env bash
# On a lent GPU machine (the device tool runs it in the repository's root; docs/gpu.md): the tests marked cuda, then
# `kvchat bench speed --device cuda`. Needs .gpu/ from scripts/gpu_prepare.sh (carry: [".gpu"]). Everything it
# writes goes to $OUT: gpu.txt, tests.log, bench.log, bench/results/speed-cuda.json (or .partial.json),
# bench/RESULTS.md.
#   TESTS_S: the tests' time limit (0: no tests; the compiled step's tests, the slowest to compile, run last);
#   TOTAL_S: both parts' (the bench gets what the tests left, seconds; none left: no bench);
#   BENCH_ARGS: more options for the bench.
set -uo pipefail
OUT=${OUT:-/tmp/kvchat-gpu}
START=$SECONDS
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    || { echo "gpu_check: the wheels in .gpu/whl did not install"; exit 1; }
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kvchat
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export KVCHAT_TOKENIZER="$PWD/.gpu/tokenizer" KVCHAT_HOME=/tmp/kvchat-home
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${TESTS_S:-180}" -gt 0 ]; then
    timeout "${TESTS_S:-180}" python3 -m pytest -q -p no:cacheprovider -m cuda --tb=short tests/test_graph_triton.py tests/test_run_ahead.py \
        tests/test_durability.py tests/test_graph.py tests/test_read.py 2>&1 \
        | tee "$OUT/tests.log" | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -30
fi
LEFT=$(( ${TOTAL_S:-550} - (SECONDS - START) ))
echo "gpu_check: ${LEFT} s left for the bench"
[ "$LEFT" -gt 0 ] || exit 0  # a tests-only call (TOTAL_S no more than TESTS_S); timeout 0 would mean no limit
timeout "$LEFT" python3 -m kvchat.app.cli bench speed --device cuda --out "$OUT/bench" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench.log" | grep -E "^(speed-cuda|sanity|kvchat)|Error|error"
[ -f "$OUT/bench/RESULTS.md" ] && sed -n '/## Speed on a GPU/,$p' "$OUT/bench/RESULTS.md"
exit 0
