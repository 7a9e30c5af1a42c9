#!/usr/bin/env bash
# One run on a card answers every question issue 6 asks (benchmarks/README.md, "On a GPU"):
# the card's name, gpu_check.py's table and JSON, then the CUDA tests, the ones a card run has
# not confirmed yet first. Every part has its own time limit, so a slow part cannot starve the
# next; what each wrote is under $OUT. From the repository root:
#
#     OUT=/tmp/card benchmarks/card_run.sh [check seconds] [test seconds]
set -u
OUT=${OUT:-card_out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
PYTEST=(python3 -m pytest --noconftest -q -p no:cacheprovider -rfE)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/card.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    >>"$OUT/card.txt" 2>&1
cat "$OUT/card.txt"
timeout "${1:-240}" python3 benchmarks/gpu_check.py --out "$OUT/gpu_check.json" \
    --trace-dir "$OUT" 2>&1 | tee "$OUT/gpu_check.log" | tail -60
half=$(( ${2:-240} / 2 ))
timeout "$half" "${PYTEST[@]}" -k "split or decode or rotary or greedy or programmatic" \
    tests/attention/test_triton_attn.py tests/gpu/test_cuda.py 2>&1 | tee "$OUT/tests_first.log" | tail -15
timeout "$half" "${PYTEST[@]}" -k "not (split or decode or rotary or greedy or programmatic)" \
    tests/gpu/test_cuda.py tests/model/test_triton_kernels.py tests/attention/test_triton_attn.py \
    2>&1 | tee "$OUT/tests_rest.log" | tail -15
