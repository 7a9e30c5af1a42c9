#!/usr/bin/env bash
# The standing card run (issue 43): every GPU figure kvflow claims, in one call on a lent card,
# each part under its own time limit so a slow part cannot starve the next; everything it writes
# is under $OUT. From the repository root:
#
#     OUT=/tmp/card PACK=$OUT/card.tgz benchmarks/card_run.sh [check s] [serve s] [big s] [tests s]
#     OUT=/tmp/dry benchmarks/card_run.sh --dry-run      # every part on the CPU at toy sizes
#
# The default limits (240, 180, 90, 50 s) fit one call of the device tool on a cold card (Triton's
# cache empty: the first engines start in 20-40 s), about 9.5 minutes; RESULTS.md has each run.
# Parts (PARTS picks them; default all, in this order):
#   check  gpu_check.py: the Triton attention kernel against the torch oracle, greedy parity with
#          transformers, decode steps against the weight floor and transformers, prefill, FP8 at
#          the 1B shape, profiler traces (gpu_check.json, gpu_check.log, traces)
#   serve  gpu_serve.py: a real `kvflow serve` (engine process) at c = 1, 8, 64, 256 beside the
#          offline engine; each server then ends under load (SIGTERM, engine SIGKILL) and the
#          liveness contract is checked (gpu_serve.json)
#   big    gpu_serve.py: the Llama-3.1-8B shape's decode step at batch 1 and 64 against its
#          floor, then with FP8 weights, and FP8's greedy agreement (gpu_8b.json)
#   tests  the CUDA tests on the device (tests/gpu, the Triton kernel tests), those no card run
#          has confirmed yet first
#
# --dry-run runs every part on the CPU with tiny shapes (Triton under its interpreter; the
# tests part only collects, so a renamed test cannot fall out of the selection): `make test`
# runs it (tests/gpu/test_card_run.py), so the script cannot rot between cards.
# The server's packages the card's image lacks travel as wheels in .whl/
# (benchmarks/card_wheels.sh makes them here; name .whl in carry).
set -u
DRY=0
if [[ ${1:-} == --dry-run ]]; then
    DRY=1
    shift
fi
OUT=${OUT:-card_out}
PARTS=${PARTS:-check,serve,big,tests}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SMOKE=()
if ((DRY)); then
    SMOKE=(--smoke)
    export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} KVFLOW_NATIVE=0
elif ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
PYTEST=("$PY" -m pytest --noconftest -q -p no:cacheprovider -rfE)
((DRY)) && PYTEST+=(--collect-only)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/card.txt" 2>&1 \
    || echo "no card: dry run on $(uname -m)" >"$OUT/card.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    >>"$OUT/card.txt" 2>&1
"$PY" -c "import kvflow.server.api_server, kvflow.engine.core_proc, kvflow.bench.serve" \
    >>"$OUT/card.txt" 2>&1 && echo "the server's imports: ok" >>"$OUT/card.txt"
cat "$OUT/card.txt"
part() { [[ ,$PARTS, == *,$1,* ]]; }
# PACK=file.tgz: everything under $OUT packed again after each part (the device tool brings back
# 8 files at most; a call cut short still brings back what the finished parts wrote)
stamp() {
    [[ -n ${PACK:-} ]] && tar czf "$PACK" -C "$OUT" .
    echo "== $1 $(date +%T)"
}
if part check; then
    stamp check
    timeout "${1:-240}" "$PY" benchmarks/gpu_check.py "${SMOKE[@]}" --budget-s $(( ${1:-240} - 40 )) \
        --out "$OUT/gpu_check.json" --trace-dir "$OUT" 2>&1 | tee "$OUT/gpu_check.log" | tail -60
fi
if part serve; then
    stamp serve
    timeout "${2:-180}" "$PY" benchmarks/gpu_serve.py "${SMOKE[@]}" --skip-8b \
        --out "$OUT/gpu_serve.json" 2>&1 | tee "$OUT/gpu_serve.log" | tail -30
fi
if part big; then
    stamp big
    timeout "${3:-90}" "$PY" benchmarks/gpu_serve.py "${SMOKE[@]}" --skip-served \
        --out "$OUT/gpu_8b.json" 2>&1 | tee "$OUT/gpu_8b.log" | tail -20
fi
if part tests; then
    stamp tests
    half=$(( ${4:-50} / 2 ))
    first="split or decode or rotary or greedy or programmatic"
    timeout "$half" "${PYTEST[@]}" -k "$first" tests/attention/test_triton_attn.py \
        tests/gpu/test_cuda.py 2>&1 | tee "$OUT/tests_first.log" | tail -15
    timeout "$half" "${PYTEST[@]}" -k "not ($first)" tests/gpu/test_cuda.py \
        tests/model/test_triton_kernels.py tests/attention/test_triton_attn.py \
        tests/model/test_fp8_linear.py 2>&1 | tee "$OUT/tests_rest.log" | tail -15
fi
stamp done
exit 0
