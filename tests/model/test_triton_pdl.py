"""Programmatic dependent launch (`kernels.triton.pdl.pdl_args`): every CUDA kernel of a decode step,
compiled for sm_90 by Triton's real compiler (no GPU needed: PTX is checked, not run).

A kernel launched with PDL may start while the kernel before it is still running, so before
its `griddepcontrol.wait` it must store nothing and read only what no kernel of the forward
writes. The compiled kernel shows it: no store before the wait, and no load either except the
one-row projection's weight rows and a decode attention's metadata and cached keys (their
prefetch, which is the point), each load traced to the argument it reads in Triton's IR.
Compiled without the flag, the kernels hold no PDL instruction (what runs before sm_90 and
under the interpreter). The split decode's merge is checked for its memory ordering too."""

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
import json, re, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kvflow.kernels.triton import attention_decode, attention_prefill, kv_write
from kvflow.kernels.triton import argmax, gemv, ops

P16, P32, I32 = "*bf16", "*i32", "i32"
CASES = {
    "rms_norm": (ops._rms_norm_kernel, dict(x_ptr=P16, res_ptr=P16, w_ptr=P16, out_ptr=P16,
        eps="fp32", dim=I32, stride_x=I32, stride_res=I32, stride_out=I32),
        dict(HAS_RESIDUAL=True, BLOCK=2048)),
    "rotary": (ops._rotary_kernel, dict(x_ptr=P16, cos_ptr=P16, sin_ptr=P16, heads=I32,
        stride_xt=I32, stride_xh=I32, stride_ct=I32, stride_st=I32),
        dict(HEAD_DIM=64, HEAD_PAD=64, BLOCK_H=16)),
    "silu_mul": (ops._silu_mul_kernel, dict(gate_up_ptr=P16, out_ptr=P16, inner=I32,
        stride_in=I32, stride_out=I32), dict(BLOCK=1024)),
    "argmax chunks": (argmax._chunk_argmax_kernel, dict(logits_ptr="*fp32", max_ptr="*fp32",
        idx_ptr=P32, V=I32, stride_row=I32, chunks=I32), dict(CHUNK=2048)),
    "argmax rows": (argmax._rows_argmax_kernel, dict(max_ptr="*fp32", idx_ptr=P32,
        out_ptr="*i64", chunks=I32, batch=I32), dict(BLOCK_C=64)),
}
WRITE = dict(k_ptr=P16, v_ptr=P16, k_cache_ptr=P16, v_cache_ptr=P16, slot_ptr="*i64",
    cos_ptr=P16, sin_ptr=P16, stride_kt=I32, stride_kh=I32, stride_vt=I32, stride_vh=I32,
    stride_cache_slot=I32, stride_cache_head=I32, stride_ct=I32, stride_st=I32)
for rotary in (False, True):
    CASES[f"write_kv rotary={rotary}"] = (kv_write._write_kv_kernel, WRITE, dict(
        HEADS=8, HEADS_PAD=8, HEAD_DIM=64, HEAD_PAD=64, ROTARY=rotary))
COMMON = dict(q_ptr=P16, out_ptr=P16, k_cache_ptr=P16, v_cache_ptr=P16, block_tables_ptr=P32,
    seq_lens_ptr=P32)
STRIDES = dict(qk_scale="fp32", window=I32, stride_qt=I32, stride_qh=I32, stride_ot=I32,
    stride_oh=I32, stride_cache_block=I32, stride_cache_offset=I32, stride_cache_head=I32,
    stride_table=I32)
TILE = dict(GROUP=4, GROUP_PAD=4, BLOCK_M=16, BLOCK_N=256, HEAD_DIM=64, HEAD_PAD=64,
    BLOCK_SIZE=16, HAS_WINDOW=False)
PREFILL = dict(COMMON, query_start_loc_ptr=P32, tile_req_ptr=P32, tile_start_ptr=P32, **STRIDES)
CASES["attention decode=False rotary=False splits=1"] = (
    attention_prefill._varlen_attention_kernel, PREFILL, dict(TILE, BLOCK_Q=4))
DECODE = dict(COMMON, k_ptr=P16, v_ptr=P16, slot_ptr="*i64", cos_ptr=P16, sin_ptr=P16,
    counter_ptr=P32, part_ml_ptr="*fp32", part_acc_ptr="*fp32", **STRIDES, stride_kt=I32,
    stride_kh=I32, stride_vt=I32, stride_vh=I32, stride_ct=I32, stride_st=I32)
for rotary, splits in ((False, 1), (True, 1), (True, 16)):
    CASES[f"attention decode=True rotary={rotary} splits={splits}"] = (
        attention_decode._decode_attention_kernel, DECODE,
        dict(TILE, ROTARY=rotary, SPLITS=splits))
GEMV = dict(x_ptr=P16, w_ptr=P16, bias_ptr=P16, out_ptr=P16, res_ptr=P16, res_out_ptr=P16,
    norm_w_ptr=P16, eps="fp32", N=I32, K=I32, stride_w=I32)
for one_pass, gated, per_sm in ((True, False, 0), (True, True, 0), (True, True, 4),
                                (False, False, 0)):
    CASES[f"gemv one_pass={one_pass} gated={gated} per_sm={per_sm}"] = (gemv._gemv_kernel, GEMV,
        dict(HAS_BIAS=False, NORM=True, HAS_RESIDUAL=True, GATED=gated, BLOCK_N=4,
             BLOCK_K=2048, ONE_PASS=one_pass, PER_SM=per_sm))

def before_wait(ptx):
    # (loads, stores) of global memory before the first griddepcontrol.wait (all: no wait)
    head = ptx.split("griddepcontrol.wait")[0]
    lines = [line.strip() for line in head.splitlines()]
    return (sum(line.startswith(("ld.global", "@%p")) and "ld.global" in line for line in lines),
            sum("st.global" in line for line in lines))

def read_before_wait(ttir):
    # the kernel arguments whose memory is loaded before the wait, from Triton's IR: each
    # load's pointer is followed back (splat, addptr, broadcast, expand_dims) to its base
    head = ttir.split("griddepcontrol.wait")[0]
    defs = dict(re.findall(r"^\s*(%[\w.]+) = (tt\.\w+ %[\w.]+)", head, re.M))
    args = set(re.findall(r"(%\w+): !tt\.ptr", head))
    bases = set()
    for pointer in re.findall(r"tt\.load (%[\w.]+)", head):
        while pointer in defs and defs[pointer].split()[0] in (
                "tt.splat", "tt.addptr", "tt.broadcast", "tt.expand_dims"):
            pointer = defs[pointer].split()[1]
        bases.add(pointer[1:] if pointer in args else "?" + pointer)
    return sorted(bases)

def merge_order(ptx):
    # split decode: every partial stored, a barrier, the release (acq_rel atomic on the pair's
    # counter), a barrier, then the partials read back from L2 (.cg), never from a stale L1
    lines = [line.strip() for line in ptx.splitlines()]
    atom = next(i for i, line in enumerate(lines) if "atom.global.gpu.acq_rel.add" in line)
    last_store = max(i for i, line in enumerate(lines[:atom]) if "st.global" in line)
    after = lines[atom + 1:]
    loads = [i for i, line in enumerate(after) if "ld.global" in line]
    return dict(
        barrier_before=any("bar.sync" in line for line in lines[last_store:atom]),
        barrier_after=any("bar.sync" in line for line in after[:loads[0]]),
        loads_after=len(loads),
        cg_loads_after=sum("ld.global.cg" in after[i] for i in loads))

out = {}
for name, (kernel, sig, consts) in CASES.items():
    for pdl in (True, False):
        constexprs = dict(consts, PDL=pdl)
        signature = dict(sig) | {k: "constexpr" for k in constexprs}
        src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        asm = compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": pdl}).asm
        loads, stores = before_wait(asm["ptx"])
        out[f"{name} pdl={pdl}"] = dict(
            wait=asm["ptx"].count("griddepcontrol.wait"),
            launch=asm["ptx"].count("griddepcontrol.launch_dependents"),
            loads=loads, stores=stores, reads=read_before_wait(asm["ttir"]))
        if "splits=16" in name:
            out[f"{name} pdl={pdl}"]["merge"] = merge_order(asm["ptx"])
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


# What a kernel may read before its wait: what was written before the forward's first PDL
# launch (the forward starts with the embedding, a torch kernel launched without PDL). Weights;
# and for a decode's attention the step's metadata and the cache's keys of earlier steps (its
# own token's k/v it takes from the projection, after the wait).
MAY_READ_FIRST = {
    "gemv one_pass=True": ["w_ptr"],
    "attention decode=True": ["block_tables_ptr", "k_cache_ptr", "seq_lens_ptr", "v_cache_ptr"],
}


def test_every_kernel_waits_before_it_stores_or_reads_what_a_kernel_wrote(compiled) -> None:
    with_pdl = {name: r for name, r in compiled.items() if name.endswith("pdl=True")}
    assert len(with_pdl) == 15
    for name, r in with_pdl.items():
        assert r["wait"] >= 1 and r["launch"] >= 1, name
        assert r["stores"] == 0, name
        allowed = next((v for k, v in MAY_READ_FIRST.items() if name.startswith(k)), [])
        assert r["reads"] == allowed, (name, r)  # in Triton's IR, by base pointer
        assert (r["loads"] > 0) == bool(allowed), (name, r)  # and still so in the PTX


def test_split_decode_releases_its_partials_and_reads_them_back_past_l1(compiled) -> None:
    """The memory ordering of the split merge, which the interpreter (one program at a time)
    cannot show: each program's threads store their partials, meet at a barrier, then one
    thread counts with an acq_rel atomic at GPU scope (its release covers the barrier's
    stores); the last program's threads meet again after that acquire and read every partial
    with .cg loads (from L2, where the other SMs' stores are; L1 is not coherent)."""
    for pdl in (True, False):
        merge = compiled[f"attention decode=True rotary=True splits=16 pdl={pdl}"]["merge"]
        assert merge["barrier_before"] and merge["barrier_after"], merge
        assert merge["loads_after"] > 0 and merge["cg_loads_after"] == merge["loads_after"], merge


def test_without_the_flag_no_kernel_holds_a_pdl_instruction(compiled) -> None:
    without = {name: r for name, r in compiled.items() if name.endswith("pdl=False")}
    assert len(without) == 15
    for name, r in without.items():
        assert r["wait"] == 0 and r["launch"] == 0, name
