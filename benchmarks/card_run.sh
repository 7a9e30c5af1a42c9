#!/usr/bin/env bash
# One run on a card answers every question issues 6 and 22 ask (benchmarks/README.md, "On a
# GPU"): the card's name, gpu_check.py's table and JSON, then the CUDA tests, the ones a card run
# has not confirmed yet first, then gpu_serve.py (a real `kvflow serve` on the card beside the
# offline engine; the 8B shape's decode step). Every part has its own time limit, so a slow part
# cannot starve the next; what each wrote is under $OUT. From the repository root:
#
#     OUT=/tmp/card benchmarks/card_run.sh [check seconds] [test seconds] [serve seconds]
#
# PARTS picks parts (default "check,tests,serve"). The server's packages the card's image lacks
# travel as wheels in .whl/ (benchmarks/card_wheels.sh makes them here; name .whl in carry).
set -u
OUT=${OUT:-card_out}
PARTS=${PARTS:-check,tests,serve}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
PYTEST=(python3 -m pytest --noconftest -q -p no:cacheprovider -rfE)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/card.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    >>"$OUT/card.txt" 2>&1
cat "$OUT/card.txt"
[[ $PARTS == *check* ]] && timeout "${1:-240}" python3 benchmarks/gpu_check.py --out "$OUT/gpu_check.json" \
    --trace-dir "$OUT" 2>&1 | tee "$OUT/gpu_check.log" | tail -60
half=$(( ${2:-240} / 2 ))
[[ $PARTS == *tests* ]] && timeout "$half" "${PYTEST[@]}" -k "split or decode or rotary or greedy or programmatic" \
    tests/attention/test_triton_attn.py tests/gpu/test_cuda.py 2>&1 | tee "$OUT/tests_first.log" | tail -15
[[ $PARTS == *tests* ]] && timeout "$half" "${PYTEST[@]}" -k "not (split or decode or rotary or greedy or programmatic)" \
    tests/gpu/test_cuda.py tests/model/test_triton_kernels.py tests/attention/test_triton_attn.py \
    2>&1 | tee "$OUT/tests_rest.log" | tail -15
[[ $PARTS == *serve* ]] && timeout "${3:-420}" python3 benchmarks/gpu_serve.py \
    --out "$OUT/gpu_serve.json" 2>&1 | tee "$OUT/gpu_serve.log" | tail -40
exit 0
