#!/usr/bin/env bash
# The Python packages `kvflow serve` needs that the card machine's image lacks
# (/work/.library/device/KINDS.md lists what it has), as wheels for its Python 3.12, saved in
# .whl/ (git-ignored through .git/info/exclude). Run here once, where pip reaches PyPI; the
# card run carries .whl and card_run.sh installs it into /tmp/site before anything starts.
#
#     benchmarks/card_wheels.sh && du -sh .whl     # a few MiB
set -eu
# .whl/ is in .gitignore: the device tool carries it only when a call names it in carry
PY=${PYTHON:-python3}
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
    PLATFORMS+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 msgspec==0.23.0 pyzmq==27.3.0 \
    gguf==0.19.0 partial-json-parser==0.2.1.1.post7 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 \
    opentelemetry-api==1.45.2 typing-extensions==4.16.0  # fastapi imports opentelemetry
ls .whl
