"""Programmatic dependent launch (`triton_kernels.pdl_args`): every CUDA kernel of a decode step,
compiled for sm_90 by Triton's real compiler (no GPU needed: PTX is checked, not run).

A kernel launched with PDL may start while the kernel before it is still running, so before
its `griddepcontrol.wait` it must store nothing and read only weights. The PTX shows it: no
store before the wait, no load before it either, except the one-row projection's weight rows
(its prefetch, which is the point). Compiled without the flag, the kernels hold no PDL
instruction (what runs before sm_90 and under the interpreter)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# Not imported here: the first import of triton in this process must see TRITON_INTERPRET,
# which the suite's other Triton tests set (they run the kernels under the interpreter).
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

# Runs in a subprocess: this suite's other modules switch Triton to its interpreter, under which
# kernels cannot be compiled.
PROBE = r"""
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kvflow.attention import triton_attn as ta
from kvflow.model import triton_kernels as tk

P16, P32, I32 = "*bf16", "*i32", "i32"
CASES = {
    "rms_norm": (tk._rms_norm_kernel, dict(x_ptr=P16, res_ptr=P16, w_ptr=P16, out_ptr=P16,
        eps="fp32", dim=I32, stride_x=I32, stride_res=I32, stride_out=I32),
        dict(HAS_RESIDUAL=True, BLOCK=2048)),
    "rotary": (tk._rotary_kernel, dict(x_ptr=P16, cos_ptr=P16, sin_ptr=P16, heads=I32,
        stride_xt=I32, stride_xh=I32, stride_ct=I32, stride_st=I32),
        dict(HEAD_DIM=64, HEAD_PAD=64, BLOCK_H=16)),
    "silu_mul": (tk._silu_mul_kernel, dict(gate_up_ptr=P16, out_ptr=P16, inner=I32,
        stride_in=I32, stride_out=I32), dict(BLOCK=1024)),
    "argmax chunks": (tk._chunk_argmax_kernel, dict(logits_ptr="*fp32", max_ptr="*fp32",
        idx_ptr=P32, V=I32, stride_row=I32, chunks=I32), dict(CHUNK=2048)),
    "argmax rows": (tk._rows_argmax_kernel, dict(max_ptr="*fp32", idx_ptr=P32,
        out_ptr="*i64", chunks=I32, batch=I32), dict(BLOCK_C=64)),
}
WRITE = dict(k_ptr=P16, v_ptr=P16, k_cache_ptr=P16, v_cache_ptr=P16, slot_ptr="*i64",
    cos_ptr=P16, sin_ptr=P16, stride_kt=I32, stride_kh=I32, stride_vt=I32, stride_vh=I32,
    stride_cache_slot=I32, stride_cache_head=I32, stride_ct=I32, stride_st=I32)
for rotary in (False, True):
    CASES[f"write_kv rotary={rotary}"] = (ta._write_kv_kernel, WRITE, dict(
        HEADS=8, HEADS_PAD=8, HEAD_DIM=64, HEAD_PAD=64, ROTARY=rotary))
ATTN = dict(q_ptr=P16, out_ptr=P16, k_cache_ptr=P16, v_cache_ptr=P16, block_tables_ptr=P32,
    query_start_loc_ptr=P32, seq_lens_ptr=P32, tile_req_ptr=P32, tile_start_ptr=P32,
    k_ptr=P16, v_ptr=P16, slot_ptr="*i64", cos_ptr=P16, sin_ptr=P16, counter_ptr=P32,
    part_ml_ptr="*fp32", part_acc_ptr="*fp32",
    qk_scale="fp32", window=I32, stride_qt=I32, stride_qh=I32, stride_ot=I32, stride_oh=I32,
    stride_cache_block=I32, stride_cache_offset=I32, stride_cache_head=I32, stride_table=I32,
    stride_kt=I32, stride_kh=I32, stride_vt=I32, stride_vh=I32, stride_ct=I32, stride_st=I32)
for decode, rotary, splits in ((True, False, 1), (False, False, 1), (True, True, 1),
                               (True, True, 16)):
    CASES[f"attention decode={decode} rotary={rotary} splits={splits}"] = (
        ta._paged_attention_kernel, ATTN,
        dict(GROUP=4, GROUP_PAD=4, BLOCK_Q=4, BLOCK_M=16, BLOCK_N=256, HEAD_DIM=64,
             HEAD_PAD=64, BLOCK_SIZE=16, HAS_WINDOW=False, DECODE=decode, ROTARY=rotary,
             SPLITS=splits))
GEMV = dict(x_ptr=P16, w_ptr=P16, bias_ptr=P16, out_ptr=P16, res_ptr=P16, res_out_ptr=P16,
    norm_w_ptr=P16, eps="fp32", N=I32, K=I32, stride_w=I32)
for one_pass, gated, per_sm in ((True, False, 0), (True, True, 0), (True, True, 4),
                                (False, False, 0)):
    CASES[f"gemv one_pass={one_pass} gated={gated} per_sm={per_sm}"] = (tk._gemv_kernel, GEMV,
        dict(HAS_BIAS=False, NORM=True, HAS_RESIDUAL=True, GATED=gated, BLOCK_N=4,
             BLOCK_K=2048, ONE_PASS=one_pass, PER_SM=per_sm))

def before_wait(ptx):
    # (loads, stores) of global memory before the first griddepcontrol.wait (all: no wait)
    head = ptx.split("griddepcontrol.wait")[0]
    lines = [line.strip() for line in head.splitlines()]
    return (sum(line.startswith(("ld.global", "@%p")) and "ld.global" in line for line in lines),
            sum("st.global" in line for line in lines))

out = {}
for name, (kernel, sig, consts) in CASES.items():
    for pdl in (True, False):
        constexprs = dict(consts, PDL=pdl)
        signature = dict(sig) | {k: "constexpr" for k in constexprs}
        src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        ptx = compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": pdl}).asm["ptx"]
        loads, stores = before_wait(ptx)
        out[f"{name} pdl={pdl}"] = dict(
            wait=ptx.count("griddepcontrol.wait"),
            launch=ptx.count("griddepcontrol.launch_dependents"),
            loads=loads, stores=stores)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_every_kernel_waits_before_it_stores_or_reads_what_a_kernel_wrote(compiled) -> None:
    with_pdl = {name: r for name, r in compiled.items() if name.endswith("pdl=True")}
    assert len(with_pdl) == 15
    for name, r in with_pdl.items():
        assert r["wait"] >= 1 and r["launch"] >= 1, name
        assert r["stores"] == 0, name
        prefetch = "one_pass=True" in name
        assert (r["loads"] > 0) if prefetch else (r["loads"] == 0), (name, r)


def test_without_the_flag_no_kernel_holds_a_pdl_instruction(compiled) -> None:
    without = {name: r for name, r in compiled.items() if name.endswith("pdl=False")}
    assert len(without) == 15
    for name, r in without.items():
        assert r["wait"] == 0 and r["launch"] == 0, name
