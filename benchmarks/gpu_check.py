"""kvflow on one GPU in one command: the Triton kernel, greedy parity with transformers, timings.

    python benchmarks/gpu_check.py --out gpu_check.json          # one GPU, about 5 minutes at most
    python benchmarks/gpu_check.py --smoke --out /tmp/smoke.json # tiny shapes, CPU or GPU, seconds

Needs only torch, triton, transformers and numpy (kvflow runs from this checkout's src/, nothing
is installed). Random-weight checkpoints are written to a temporary directory at run time.

(a) kernel   `triton_paged_attention` against the torch reference (`torch_ref.paged_attention`
             in float32 on float32 copies of the same inputs: the oracle) on fresh random
             decode, prefill, chunked and mixed batches at the served shapes, contexts crossing
             block boundaries (15/16/17, 4095/4096/4097 ...). Cache slots outside every context
             are NaN and the kernel's output buffer starts as NaN, so an output element it never
             writes, or a masked slot it reads, shows up as NaN. Criteria: no NaN; relative error
             max|out - ref| / max|ref| <= 2e-2 in bfloat16 (bf16 keeps 8 significant bits, 0.4%
             per rounding: P is rounded before P.V and the output once more; 2e-2 leaves room for
             the accumulation), 1e-4 in float32; the cache changed only at the step's slots.
(b) parity   random-weight checkpoints of the SmolLM2-135M shape and the Llama-3.2-1B shape
             (weights bfloat16-exact, so float32 and bfloat16 runs see the same model), 4 prompts
             of 7..130 tokens, 16 greedy tokens each.
             float32: kvflow's engine (CUDA graphs on) must produce transformers' tokens (true
             float32 on both sides, TF32 off; the random weights give top-2 logit gaps near 0.5,
             far above float32 rounding, so a flip is a bug unless it happens at a real tie:
             a divergence passes only where transformers' own top-2 gap is below 1e-3).
             bfloat16: greedy sequences may legitimately part at a near-tie, so the criterion is
             on logits, teacher-forced along transformers' float32 greedy sequence: kvflow's
             bf16 deviation from the float32 logits (prefill, then one decode step per token)
             must be at most twice transformers' own bf16 deviation (+1e-3). Matching greedy
             tokens in bf16 are reported, not required. The first shape's (the 1B's) float32
             engine is sized by --gpu-memory-utilization (the profiled path) and checked to stay
             within it.
             Graph replay, on the float32 model and the bf16 one: capturing writes only the
             null block; decode batches of 1, 3, 5, 9, 16 replay to within 1e-5 (relative) of
             the same padded forward run eagerly and 1e-3 (bf16: 5e-2) of the plain unpadded
             forward. bf16 batch 1 runs Triton's one-row kernels where they beat cuBLAS, so
             the teacher-forced decode steps and this replay check them.
(c) timing   bfloat16 decode steps at batch 1, 8, 64, 256 (128-token prompts): kvflow engine
             steps with CUDA graphs and eagerly (the same engine with its graphs switched off),
             transformers `generate` per new token at the same batch, and the floor: bytes a
             decode step must read (weights, and weights + this batch's KV) over the device-to-
             device copy bandwidth measured here; prefill throughput of both (16 x 1024 tokens).
             "graph replay alone" is the decode graph (the forward, the logits head and the
             greedy argmax) replayed back to back (CUDA events): the device's share of a step. Step less replay is the host's share; replay against
             the floor is the kernels' (bytes moved against bytes counted). "no async
             scheduling": the graphs engine scheduling each step after the previous one ended
             (--no-async-scheduling), so the host's work is not overlapped with the device's.
             Rows still to run after --budget-s seconds are skipped (and say so).

Prints a verdict line per check and ONE markdown table; `--out` gets everything as JSON (written
after each section, so a run cut short still leaves what it did). Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

import numpy as np  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.attention import AttentionMetadata, paged_attention, token_positions  # noqa: E402
from kvflow.worker.cuda_graphs import DecodeGraphs, pack_inputs  # noqa: E402
from kvflow.worker.kv_cache import allocate_kv_caches  # noqa: E402

GIB = 1 << 30
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
BF16_FACTOR, BF16_SLACK = 2.0, 1e-3
FP32_TIE = 1e-3  # a float32 greedy divergence passes only at a top-2 gap below this

SMOL = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
LLAMA_1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=8192,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
# --smoke: the same structure (GQA, tied, llama3 rope on the second) at toy size
SMOKE_SHAPES = {
    "smollm2-shape": dict(
        SMOL,
        hidden_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
    ),
    "llama-1b-shape": dict(
        LLAMA_1B,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=192,
        vocab_size=512,
    ),
}
# the 1B shape first: its timings are the targets, and it must not fall past the budget
FULL_SHAPES = {"llama-1b-shape": LLAMA_1B, "smollm2-shape": SMOL}


def log(msg: str) -> None:
    print(f"[{time.monotonic() - START:7.1f}s] {msg}", flush=True)


START = time.monotonic()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- (a) the Triton kernel -------------------------------------------------------------------


@contextlib.contextmanager
def nan_filled_outputs():
    """While active, `torch.empty` inside triton_attn returns NaN-filled tensors, so an output
    element the kernel never writes stays NaN (fresh CUDA memory is usually finite garbage)."""
    import kvflow.attention.triton_attn as module

    real = module.torch

    class NaNEmpty:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = real.empty(*args, **kwargs)
            return out.fill_(float("nan")) if out.is_floating_point() else out

    module.torch = NaNEmpty()
    try:
        yield
    finally:
        module.torch = real


def kernel_cases(smoke: bool) -> list[tuple]:
    """(name, num_computed, query_lens, Hq, Hkv, head_dim, block_size, window, dtype)."""
    bf16, fp32 = torch.bfloat16, torch.float32
    if smoke:
        return [
            ("decode-gqa3-bs16", [14, 15, 16, 31], [1, 1, 1, 1], 6, 2, 64, 16, None, bf16),
            ("mixed-bs4", [0, 5, 7], [6, 3, 1], 4, 2, 64, 4, None, fp32),
            ("window-mixed-bs8", [9, 0], [4, 5], 4, 1, 32, 8, 6, fp32),
        ]
    gen = np.random.default_rng(0)
    boundary = [0, 1, 14, 15, 16, 31, 32, 33, 63, 64, 65, 4094, 4095, 4096]
    decode_ctx = boundary + gen.integers(1, 2100, 64 - len(boundary)).tolist()
    long_ctx = [4095, 4096, 4097, 8191, 8192, 8193, 12000, 1]
    return [
        # SmolLM2 shape: 9 query heads over 3 KV heads, 64 requests decoding
        ("decode-smol-b64", decode_ctx, [1] * 64, 9, 3, 64, 16, None, bf16),
        # Llama-1B shape: 32 over 8, 256 requests decoding
        ("decode-1b-b256", (decode_ctx * 4)[:256], [1] * 256, 32, 8, 64, 16, None, bf16),
        ("decode-1b-long", long_ctx, [1] * 8, 32, 8, 64, 16, None, bf16),
        # batch 1 and 2: the keys split among 16 programs per KV head (with a window too)
        ("decode-1b-b1-long", [12000], [1], 32, 8, 64, 16, None, bf16),
        ("decode-window-b2", [5000, 300], [1, 1], 32, 8, 128, 16, 4096, bf16),
        ("prefill-1b", [0, 0, 0, 0], [512, 300, 17, 1], 32, 8, 64, 16, None, bf16),
        (
            "chunked-mixed-1b",
            [1000, 0, 33, 4097, 15],
            [64, 200, 1, 1, 17],
            32,
            8,
            64,
            16,
            None,
            bf16,
        ),
        ("prefill-smol", [0, 0, 130], [130, 33, 7], 9, 3, 64, 16, None, bf16),
        # other geometries: group 7 at head_dim 128, MHA at block 32, block 1, head_dim 256
        ("mixed-g7-d128", [100, 0, 2000], [50, 77, 1], 28, 4, 128, 16, None, bf16),
        ("mixed-mha-bs32", [31, 0, 65], [2, 96, 1], 16, 16, 128, 32, None, bf16),
        ("mixed-bs1", [3, 0, 40], [5, 9, 1], 8, 2, 64, 1, None, bf16),
        ("decode-d256", [17, 300, 1], [1, 1, 1], 8, 2, 256, 16, None, bf16),
        ("window-mistral", [5000, 3000, 0], [100, 1, 300], 32, 8, 128, 16, 4096, bf16),
        ("fp32-mixed-1b", [40, 0, 16], [1, 70, 16], 32, 8, 64, 16, None, fp32),
    ]


def kernel_inputs(case: tuple, device: str, seed: int) -> dict:
    """Random q/k/v, metadata with shuffled block ids (never 0, some requests with a spare
    block), the cache with finite garbage (for the oracle) and with NaN (for the kernel) in every
    slot outside a context, and the mask of the slots this step writes."""
    _, computed, q_lens, hq, hkv, dim, block_size, _, dtype = case
    gen = torch.Generator().manual_seed(seed)  # block layout, on the host
    draws = torch.Generator(device=device).manual_seed(seed)  # values, on the device
    seq_lens = [c + q for c, q in zip(computed, q_lens, strict=True)]
    need = [-(-n // block_size) + (b % 3 == 1) for b, n in enumerate(seq_lens)]
    num_blocks = sum(need) + 4
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).numpy()
    cuts = np.cumsum([0, *need])
    blocks = [order[cuts[b] : cuts[b + 1]].tolist() for b in range(len(need))]
    table = np.zeros((len(blocks), max(need)), dtype=np.int64)
    for b, ids in enumerate(blocks):
        table[b, : len(ids)] = ids
    # slots holding context (positions < seq_len) and slots written now (the last q positions)
    req = np.repeat(np.arange(len(seq_lens)), seq_lens)
    pos = np.arange(len(req)) - np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
    slots = table[req, pos // block_size] * block_size + pos % block_size
    fresh = pos >= np.repeat(np.asarray(computed), seq_lens)
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    used[torch.from_numpy(slots)] = True
    written = torch.zeros_like(used)
    written[torch.from_numpy(slots[fresh])] = True
    shape = (2, num_blocks, block_size, hkv, dim)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=draws, device=device).to(dtype)

    garbage = randn(*shape)
    unused = ~used.to(device).view(1, num_blocks, block_size, 1, 1).expand(shape)
    tokens = sum(q_lens)
    return dict(
        q=randn(tokens, hq, dim),
        k=randn(tokens, hkv, dim),
        v=randn(tokens, hkv, dim),
        meta=AttentionMetadata.build(q_lens, computed, blocks, block_size, device),
        garbage=garbage,
        poisoned=garbage.masked_fill(unused, float("nan")),
        written=written.view(num_blocks, block_size).to(device),
    )


def check_kernel_case(case: tuple, device: str, seed: int) -> dict:
    from kvflow.attention.triton_attn import triton_paged_attention

    name, *_, window, dtype = case
    x = kernel_inputs(case, device, seed)
    q, k, v, meta = x["q"], x["k"], x["v"], x["meta"]
    scale = q.shape[-1] ** -0.5
    kw = {} if window is None else {"sliding_window": window}
    oracle_cache = x["garbage"].float()
    oracle = paged_attention(q.float(), k.float(), v.float(), oracle_cache, meta, scale, **kw)
    same_dtype = paged_attention(q, k, v, x["garbage"].clone(), meta, scale, **kw)  # calibration
    cache = x["poisoned"]
    before = cache.clone()
    with nan_filled_outputs():
        out = triton_paged_attention(q, k, v, cache, meta, scale, **kw)
    sync(device)
    nan = int(torch.isnan(out).sum())
    peak = float(oracle.abs().max())
    err = float((out.float() - oracle).abs().max()) / peak
    ref_err = float((same_dtype.float() - oracle).abs().max()) / peak
    # the cache: this step's slots hold k/v, every other slot is bit-for-bit what it was
    flat = cache.view(2, -1, *cache.shape[3:])
    slots = x["written"].view(-1).nonzero().flatten()
    stored = torch.equal(flat[0, slots], k.to(cache.dtype)[_slot_order(meta, slots)]) and (
        torch.equal(flat[1, slots], v.to(cache.dtype)[_slot_order(meta, slots)])
    )
    others = ~x["written"].view(1, *x["written"].shape, 1, 1).expand_as(cache)
    untouched = torch.equal(
        torch.nan_to_num(cache[others], nan=7.0), torch.nan_to_num(before[others], nan=7.0)
    )
    ok = nan == 0 and err <= TOLERANCE[dtype] and stored and untouched
    return dict(
        name=name,
        dtype=str(dtype).removeprefix("torch."),
        tokens=int(q.shape[0]),
        requests=meta.num_reqs,
        max_context=meta.max_seq_len,
        rel_err=err,
        torch_ref_same_dtype_rel_err=ref_err,
        tolerance=TOLERANCE[dtype],
        nan_outputs=nan,
        kv_stored=stored,
        rest_of_cache_untouched=untouched,
        ok=ok,
    )


def _slot_order(meta: AttentionMetadata, slots: torch.Tensor) -> torch.Tensor:
    """Token index (into k/v) of each written slot, in the ascending order of `slots`."""
    order = torch.argsort(meta.slot_mapping)
    assert torch.equal(meta.slot_mapping[order], slots)
    return order


def section_kernel(args, device: str, report: dict) -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        report["kernel"] = {"skipped": "triton is not installed"}
        log("kernel: skipped (no triton)")
        return
    if os.environ.get("TRITON_INTERPRET") == "1":  # --smoke on a CPU: as the tests patch it
        sys.path.insert(0, str(SRC.parent / "tests"))
        from support.triton_interpreter import patch_interpreter

        patch_interpreter()
    rows = []
    for i, case in enumerate(kernel_cases(args.smoke)):
        try:
            row = check_kernel_case(case, device, seed=1000 + i)
        except Exception:
            row = dict(name=case[0], ok=False, error=traceback.format_exc())
            log(f"kernel {case[0]}: ERROR\n{row['error']}")
            rows.append(row)
            continue
        rows.append(row)
        log(
            f"kernel {row['name']:<20} {row['dtype']:<8} rel err {row['rel_err']:.2e} "
            f"(torch ref same dtype {row['torch_ref_same_dtype_rel_err']:.2e}) "
            f"nan {row['nan_outputs']} {'ok' if row['ok'] else 'FAIL'}"
        )
        free_memory()
    for row in check_small_ops(device, args.smoke):
        rows.append(row)
        log(
            f"kernel {row['name']:<20} {row['dtype']:<8} {row['max_ulps']} ulps from torch, "
            f"{100 * row['equal_frac']:.1f}% equal {'ok' if row['ok'] else 'FAIL'}"
        )
    report["kernel"] = {"cases": rows, "ok": all(r["ok"] for r in rows)}


def check_small_ops(device: str, smoke: bool) -> list[dict]:
    """The fused small ops (kernels/triton/ops.py) against torch's ops on fresh random inputs
    of the models' shapes: at most 1 bf16 step apart and >= 99 % equal (they round where torch
    rounds), at most 8 float32 steps (sums in another order). RMSNorm may be 2 bf16 steps off:
    its sum of squares is added in another order, which can move the normalised value by a
    step before the bf16 product with the weight rounds again."""
    from kvflow.kernels.triton import ops as fused

    tokens = [1, 3] if smoke else [1, 256]
    hidden, heads, inter = (96, 6, 128) if smoke else (2048, 40, 8192)  # 1B: 32 + 8 heads of 64
    gen = torch.Generator(device=device).manual_seed(7)
    rows = []

    def randn(dtype: torch.dtype, *size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dtype)

    for dtype, limit in ((torch.bfloat16, 1), (torch.float32, 8)):
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        rand = functools.partial(randn, dtype)
        for t in tokens:
            x, res, w = rand(t, hidden), rand(t, hidden), rand(hidden).abs() + 0.5
            stream = res.clone()
            summed = x + res
            f = summed.float()
            norm_ref = w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
            qkv = rand(t, (heads + 8) * 64)
            qk = qkv[:, : heads * 64].view(t, heads, 64)
            angle = torch.rand(t, 1, 32, generator=gen, device=device) * 6
            cos = torch.cat((angle.cos(), angle.cos()), -1).to(dtype)
            sin = torch.cat((angle.sin(), angle.sin()), -1).to(dtype)
            rot_ref = qk * cos + torch.cat((-qk[..., 32:], qk[..., :32]), -1) * sin
            gate_up = rand(t, 2 * inter, scale=4.0)
            gate, up = gate_up.split(inter, dim=-1)
            pairs = {
                "rms_norm+residual": (fused.rms_norm(x, w, 1e-5, stream), norm_ref),
                "residual stream": (stream, summed),
                "rotary": (fused.rotary_(qk.clone(), cos, sin), rot_ref),
                "silu_mul": (fused.silu_mul(gate_up), torch.nn.functional.silu(gate) * up),
            }
            for name, (got, want) in pairs.items():
                ulps = int((got.view(bits).long() - want.view(bits).long()).abs().max())
                equal = float((got == want).float().mean())
                bf16 = dtype == torch.bfloat16
                allowed = limit + (bf16 and name == "rms_norm+residual")
                rows.append(
                    dict(
                        name=f"{name}-t{t}",
                        dtype=str(dtype).removeprefix("torch."),
                        max_ulps=ulps,
                        equal_frac=equal,
                        ok=ulps <= allowed
                        and (not bf16 or equal >= 0.99)
                        and bool(got.isfinite().all()),
                    )
                )
    return rows


# ---- (b) parity with transformers ------------------------------------------------------------


def word_tokenizer(vocab_size: int):
    """Token i is the word `t{i}`: kvflow needs a tokenizer; prompts are token ids anyway."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1")


def build_checkpoint(shape: dict, path: Path, device: str, seed: int):
    """A random-weight Llama checkpoint at `path` (bfloat16 safetensors + config + tokenizer);
    returns transformers' float32 model of the same (bfloat16-exact) weights, on `device`."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **shape,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,  # generate() runs every token: no early stop, no EOS masking
        pad_token_id=0,
    )
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        # Order-one activations (as tests/model/test_models.py), but small embeddings: with
        # tied embeddings of order one the current token's own logit dominates and greedy
        # output repeats its input. At 0.1 logits have a std of 0.1 * sqrt(hidden) (2.4 for
        # SmolLM2's shape, 4.5 for 1B): top-2 gaps near 0.5, far above float32 rounding.
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen, device=device)
            if param.ndim == 1:
                value = 1.0 + 0.2 * noise if "norm" in name else 0.2 * noise
            elif "embed" in name:
                value = 0.1 * noise
            else:
                value = noise / math.sqrt(param.shape[1])
            param.copy_(value.to(torch.bfloat16))  # bfloat16-exact float32 weights
    hf.eval()
    state = {
        name: t.detach().to(torch.bfloat16).contiguous().cpu()
        for name, t in hf.state_dict().items()
        if name != "lm_head.weight"  # tied to the embeddings
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.dtype = "bfloat16"
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    word_tokenizer(shape["vocab_size"]).save_pretrained(path)
    del state
    return hf


def make_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


@torch.inference_mode()
def hf_greedy(hf, prompts: list[list[int]], new_tokens: int, device: str) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        seq = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
        )
        out.append(seq[0, len(prompt) :].tolist())
    return out


@torch.inference_mode()
def hf_teacher_forced(hf, seqs: list[list[int]], new_tokens: int, device: str) -> list:
    """float32 logits [new_tokens + 1, V] per sequence at the positions that predict its last
    new_tokens + 1 tokens' successors (the last prompt token onwards)."""
    rows = []
    for seq in seqs:
        logits = hf(torch.tensor([seq], device=device)).logits[0].float()
        rows.append(logits[len(seq) - new_tokens - 1 :])
    return rows


@torch.inference_mode()
def kvflow_teacher_forced(model, hf_config, seqs, new_tokens, dtype, device) -> list:
    """The same logits from kvflow's model as the engine computes them: the prompt in one
    prefill, then one decode step per token (Triton kernels on CUDA, eager)."""
    block = 16
    rows = []
    for seq in seqs:
        prompt_len = len(seq) - new_tokens
        blocks = list(range(1, 2 + len(seq) // block))
        caches = allocate_kv_caches(hf_config, len(blocks) + 1, block, dtype, device)
        out = []
        steps = [(0, prompt_len)] + [(p, 1) for p in range(prompt_len, len(seq))]
        for start, n in steps:
            meta = AttentionMetadata.build([n], [start], [blocks], block, device)
            ids = torch.tensor(seq[start : start + n], device=device)
            pos = torch.from_numpy(token_positions([n], [start])).to(device)
            hidden = model(ids, pos, caches, meta)
            out.append(model.compute_logits(hidden[-1:]))
        rows.append(torch.cat(out).float())
    return rows


@torch.inference_mode()
def graph_replay_check(model, hf_config, dtype, device: str, seed: int) -> dict:
    """DecodeGraphs on fresh caches (captured on CUDA; eager elsewhere): capture writes only
    the null block, and each decode batch (1, 3, 5, 9, 16 requests: buckets 1, 4, 8, 16, 16)
    replays
    to the padded forward run eagerly from the same state and to the plain unpadded forward."""
    block, max_model_len = 16, 1024
    gen = torch.Generator().manual_seed(seed)
    vocab = hf_config.vocab_size
    lens = [1, 15, 16, 17, 31, 33, 64, 100, 130, 7, 2, 48, 90, 5, 40, 77]
    need = [-(-(n + 8) // block) for n in lens]
    num_blocks = sum(need) + 8
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    blocks = [pool[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(lens))]
    caches = allocate_kv_caches(hf_config, num_blocks, block, dtype, device)
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lens]
    plain_forward(model, caches, prompts, [0] * len(lens), blocks)
    graphs = DecodeGraphs(model, caches, block, max_model_len, 16, device)
    before = [c[:, 1:].clone() for c in caches]
    graphs.capture()
    capture_clean = all(torch.equal(c[:, 1:], b) for c, b in zip(caches, before, strict=True))
    del before
    vs_eager = vs_plain = 0.0
    greedy_equal = True  # the graph's greedy tokens (logits and argmax in it) are eager's
    for rows in ([0], [0, 1, 2], [3, 4, 5, 6, 7], [*range(7, 16)], [*range(16)]):
        ids = [torch.randint(2, vocab, (1,), generator=gen).item() for _ in rows]
        positions = [lens[r] for r in rows]
        row_blocks = [blocks[r] for r in rows]
        state = [c.clone() for c in caches]
        plain_state = [c.clone() for c in caches]
        out = graphs.run(*pack_inputs(ids, positions, row_blocks))
        replayed, greedy = out.hidden.float().clone(), out.raw[0].tolist()
        eager = DecodeGraphs(model, state, block, max_model_len, 16, device, capture=False)
        eager_out = eager.run(*pack_inputs(ids, positions, row_blocks))
        padded = eager_out.hidden.float()
        greedy_equal = greedy_equal and greedy == eager_out.raw[0].tolist()
        plain = plain_forward(model, plain_state, [[t] for t in ids], positions, row_blocks)
        scale = float(plain.abs().max())
        vs_eager = max(vs_eager, float((replayed - padded).abs().max()) / scale)
        vs_plain = max(vs_plain, float((replayed - plain.float()).abs().max()) / scale)
        for r in rows:
            lens[r] += 1
        del state, plain_state
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    ok = capture_clean and vs_eager <= 1e-5 and vs_plain <= tol and greedy_equal
    steps = dict(graphs.steps)
    log(
        f"graph replay ({'captured' if graphs.use_graphs else 'eager, no CUDA'}): capture "
        f"{'clean' if capture_clean else 'WROTE REAL BLOCKS'}, rel diff vs padded eager "
        f"{vs_eager:.1e}, vs plain {vs_plain:.1e}, greedy tokens "
        f"{'equal' if greedy_equal else 'DIFFER'}, buckets {steps} {'ok' if ok else 'FAIL'}"
    )
    return dict(
        captured=graphs.use_graphs,
        capture_clean=capture_clean,
        rel_diff_vs_padded_eager=vs_eager,
        rel_diff_vs_plain=vs_plain,
        greedy_equal=greedy_equal,
        buckets=steps,
        ok=ok,
    )


def plain_forward(model, caches, tokens, computed, blocks) -> torch.Tensor:
    """The runner's eager path: one packed forward of every request's `tokens`."""
    device = caches[0].device
    q_lens = [len(t) for t in tokens]
    meta = AttentionMetadata.build(q_lens, computed, blocks, 16, device)
    ids = torch.tensor([t for row in tokens for t in row], device=device)
    positions = torch.from_numpy(token_positions(q_lens, computed)).to(device)
    return model(ids, positions, caches, meta)


def logit_error(rows: list, oracle: list) -> tuple[float, float]:
    """(max over sequences of max|x - oracle| / max|oracle|, argmax agreement with the oracle)."""
    errs, agree, total = [], 0, 0
    for x, ref in zip(rows, oracle, strict=True):
        errs.append(float((x - ref).abs().max()) / float(ref.abs().max()))
        agree += int((x.argmax(-1) == ref.argmax(-1)).sum())
        total += ref.shape[0]
    return max(errs), agree / total


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def kvflow_greedy(llm: LLM, prompts, new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def engine_kwargs(device: str) -> dict:
    return dict(device=device, block_size=16, max_num_batched_tokens=2048)


def attach_padded_path(llm: LLM) -> str:
    """The engine's decode path label. CPU engines have no graphs: give them an eager
    DecodeGraphs (and async scheduling) so --smoke runs the code a GPU engine runs."""
    runner = llm.engine.core.runner
    if runner.decode_graphs is not None:
        return "cuda graphs"
    llm.engine.core.async_scheduling = True
    runner.decode_graphs = DecodeGraphs(
        runner.model,
        runner.kv_caches,
        runner.block_size,
        llm.engine.max_model_len,
        llm.engine.config.scheduler.max_num_seqs,
        runner.device,
        capture=False,
    )
    return "padded eager (no CUDA)"


def section_parity_and_timing(
    args, device: str, report: dict, workdir: Path, save: Callable[[], None]
) -> None:
    """(b) and (c) per model; the report is saved after each model and each timing row, so a
    run cut short keeps what it did."""
    shapes = SMOKE_SHAPES if args.smoke else FULL_SHAPES
    report.setdefault("parity", [])
    report.setdefault("timing", [])
    for index, (name, shape) in enumerate(shapes.items()):
        if args.models and name not in args.models.split(","):
            continue
        parity: dict[str, Any] = {"model": name, "ok": False}
        report["parity"].append(parity)
        if time.monotonic() - START > args.budget_s:
            parity["skipped"] = "time budget"
            log(f"{name}: skipped (past --budget-s)")
            continue
        try:  # one model's failure must not cost the other's results
            check_model(args, device, index, name, shape, workdir, parity, report, save)
        except Exception:
            parity["error"] = traceback.format_exc()
            log(f"{name}: ERROR\n{parity['error']}")
        free_memory()
        save()


def check_model(args, device, index, name, shape, workdir, parity, report, save) -> None:
    """(b) for one model shape, then (c) on its bfloat16 engine. A failure in the float32 part
    is recorded and does not stop the bfloat16 part or the timings."""
    new_tokens = 4 if args.smoke else 16
    lengths = [7, 17] if args.smoke else [7, 33, 64, 130]
    parity.update(new_tokens=new_tokens, prompt_lens=lengths)
    log(f"{name}: building the random checkpoint")
    path = workdir / name
    hf = build_checkpoint(shape, path, device, seed=index)
    prompts = make_prompts(shape["vocab_size"], lengths, seed=index)
    ref = hf_greedy(hf, prompts, new_tokens, device)
    seqs = [p + r for p, r in zip(prompts, ref, strict=True)]
    oracle = hf_teacher_forced(hf, seqs, new_tokens, device)
    try:
        check_fp32(args, device, index, path, hf.config, prompts, ref, oracle, new_tokens, parity)
    except Exception:
        parity["fp32_error"] = traceback.format_exc()
        log(f"parity {name} float32: ERROR\n{parity['fp32_error']}")
    free_memory()
    save()

    # bfloat16: teacher-forced logits against the float32 oracle; greedy tokens reported
    hf.to(torch.bfloat16)
    bf16_kw = engine_kwargs(device) | dict(dtype="bfloat16", max_num_seqs=256)
    bf16_kw["num_blocks"] = 64 if args.smoke else 4096
    llm = timed_engine(str(path), bf16_kw, parity, "bf16_engine_start_s")
    parity["bf16_decode_path"] = attach_padded_path(llm)
    try:
        check_bf16(hf, llm, prompts, seqs, oracle, new_tokens, device, parity)
    except Exception:
        parity["bf16_error"] = traceback.format_exc()
        log(f"parity {name} bfloat16: ERROR\n{parity['bf16_error']}")
    parity["ok"] = (
        parity.get("fp32_tokens_equal", False)
        and parity.get("graph_replay", {}).get("ok", False)
        and parity.get("bf16_logits_ok", False)
        and parity.get("bf16_graph_replay", {}).get("ok", False)
        and parity.get("sizing", {}).get("ok", True)
    )
    del oracle
    save()
    if args.skip_timing:
        return
    try:  # timings inform; a failure here is reported but fails no check
        timing_rows(args, device, name, llm, hf, report, save)
    except Exception:
        report["timing"].append({"model": name, "error": traceback.format_exc()})
        log(f"timing {name}: ERROR\n{report['timing'][-1]['error']}")


def check_fp32(
    args, device, index, path, hf_config, prompts, ref, oracle, new_tokens, parity
) -> None:
    """Exact greedy tokens from the float32 engine with graphs (the first model's engine is
    sized by --gpu-memory-utilization, the profiled path, and checked to stay within it), and
    the graph replay check on its model."""
    fp32_kw = engine_kwargs(device) | dict(dtype="float32", max_num_seqs=8)
    sized = index == 0 and device == "cuda"
    if sized:
        fp32_kw["gpu_memory_utilization"] = 0.3
    else:
        lengths = parity["prompt_lens"]
        fp32_kw["num_blocks"] = 64 + 4 * sum(-(-(n + new_tokens) // 16) for n in lengths)
    llm = timed_engine(str(path), fp32_kw, parity, "fp32_engine_start_s")
    parity["fp32_decode_path"] = attach_padded_path(llm)
    if sized:
        parity["sizing"] = sizing_report(llm, 0.3)
    got = kvflow_greedy(llm, prompts, new_tokens)
    div = [first_divergence(g, r) for g, r in zip(got, ref, strict=True)]
    # transformers' top-2 gap where a sequence parts (the contexts agree up to there)
    gaps = [None if d is None else top2_gap(rows[d]) for d, rows in zip(div, oracle, strict=True)]
    parity["fp32_tokens_equal"] = all(g is None or g < FP32_TIE for g in gaps)
    parity["fp32_first_divergence"] = div
    parity["fp32_divergence_gaps"] = gaps
    log(f"parity float32: tokens {'equal' if parity['fp32_tokens_equal'] else 'DIFFER'} {div}")
    model = llm.engine.core.runner.model
    parity["graph_replay"] = graph_replay_check(model, hf_config, torch.float32, device, index)


def check_bf16(hf, llm, prompts, seqs, oracle, new_tokens, device, parity) -> None:
    """kvflow's bf16 deviation from the float32 logits against transformers' own."""
    hf_rows = hf_teacher_forced(hf, seqs, new_tokens, device)
    hf_tokens = hf_greedy(hf, prompts, new_tokens, device)
    model = llm.engine.core.runner.model
    kv_rows = kvflow_teacher_forced(model, hf.config, seqs, new_tokens, torch.bfloat16, device)
    kv_err, kv_agree = logit_error(kv_rows, oracle)
    hf_err, hf_agree = logit_error(hf_rows, oracle)
    got = kvflow_greedy(llm, prompts, new_tokens)
    # bf16 batch 1 runs Triton's one-row kernels (norm or silu inside) where they beat cuBLAS:
    # its graph replays the eager forward; the teacher-forced decode steps above are batch 1
    parity["bf16_graph_replay"] = graph_replay_check(model, hf.config, torch.bfloat16, device, 7)
    parity.update(
        bf16_rel_err_kvflow=kv_err,
        bf16_rel_err_transformers=hf_err,
        bf16_argmax_agreement_kvflow=kv_agree,
        bf16_argmax_agreement_transformers=hf_agree,
        bf16_logits_ok=kv_err <= BF16_FACTOR * hf_err + BF16_SLACK,
        bf16_greedy_first_divergence=[
            first_divergence(g, r) for g, r in zip(got, hf_tokens, strict=True)
        ],
    )
    log(
        f"parity bfloat16: rel err kvflow {kv_err:.2e} vs transformers {hf_err:.2e} "
        f"({'ok' if parity['bf16_logits_ok'] else 'FAIL'}); greedy divergence "
        f"{parity['bf16_greedy_first_divergence']}"
    )


def timed_engine(path: str, kwargs: dict, parity: dict, key: str) -> LLM:
    """LLM(path, **kwargs), its start-up time (load, profile, graph capture) noted in parity."""
    t0 = time.monotonic()
    llm = LLM(path, **kwargs)
    parity[key] = time.monotonic() - t0
    log(f"engine {kwargs.get('dtype')} up in {parity[key]:.1f} s")
    return llm


def sizing_report(llm: LLM, utilization: float) -> dict:
    """The profiled KV sizing kept the process within total x utilization (graphs included,
    with 1 GiB of slack for what the profile cannot see)."""
    free, total = torch.cuda.mem_get_info()
    used = total - free
    bound = total * utilization
    cache = llm.engine.config.cache
    ok = used <= bound + GIB and cache.num_blocks > 1
    log(
        f"sizing: {cache.num_blocks} blocks; device use {used / GIB:.2f} GiB of "
        f"{bound / GIB:.2f} GiB ({utilization} x {total / GIB:.1f}) {'ok' if ok else 'FAIL'}"
    )
    return dict(num_blocks=cache.num_blocks, used_gib=used / GIB, bound_gib=bound / GIB, ok=ok)


# ---- (c) timing ------------------------------------------------------------------------------


def copy_bandwidth(device: str, smoke: bool) -> float:
    """Bytes per second moved by a device-to-device copy (read + write both counted)."""
    size = (64 << 20) if smoke or device != "cuda" else GIB
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    reps = 3 if smoke else 20
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * size * reps / (time.perf_counter() - t0)


class StepTimer:
    """Wraps the runner's `launch` to time the model + sampler part of each engine step: the
    launch and the wait for its sampled ids, not what the engine does in between."""

    def __init__(self, runner) -> None:
        self.runner, self.times = runner, []
        self.inner = runner.launch

    def __enter__(self):
        def timed(sched):
            t0 = time.perf_counter()
            wait = self.inner(sched)
            launched = time.perf_counter() - t0

            def timed_wait():
                t1 = time.perf_counter()
                try:
                    return wait()
                finally:
                    self.times.append(launched + time.perf_counter() - t1)

            return timed_wait

        self.runner.launch = timed
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.launch  # back to the class's method


def engine_decode_ms(llm: LLM, batch: int, prompt_len: int, warm: int, steps: int, seed: int):
    """(median engine step ms, median runner ms) over `steps` decode-only steps of `batch`."""
    engine = llm.engine
    vocab = engine.core.runner.vocab_size
    prompts = make_prompts(vocab, [prompt_len] * batch, seed)
    max_tokens = min(engine.max_model_len - prompt_len, warm + steps + 64)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"bench-{seed}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked); requests start decoding as they finish it
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    for _ in range(warm):
        engine.step()
    step_times, other_steps = [], 0
    with StepTimer(engine.core.runner) as timer:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t0)
            other_steps += engine.core.last_step_tokens != batch  # should stay 0
    device_ms = graph_device_ms(engine.core.runner.decode_graphs, batch)
    engine.abort_request(ids)
    return (
        1e3 * statistics.median(step_times),
        1e3 * statistics.median(timer.times),
        other_steps,
        device_ms,
    )


def graph_device_ms(graphs: DecodeGraphs | None, batch: int, reps: int = 20) -> float | None:
    """Device time of one decode step up to the sampler (forward, logits head, greedy argmax):
    the bucket's graph replayed back to back, timed with CUDA events, so no host work sits
    between replays. A step's time less this is what the host adds (scheduler, inputs, the
    copy of the ids, update, detokenization).

    Replays repeat the last step's inputs: they rewrite its K/V slots with the same values."""
    if graphs is None or not graphs.use_graphs:
        return None
    graph, _ = graphs._graphs[graphs.bucket_for(batch)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def profile_decode(
    llm: LLM, batch: int, prompt_len: int, seed: int, path: Path, device: str
) -> dict:
    """Eight engine decode steps of `batch` under torch.profiler (CPU + CUDA): the Chrome trace
    goes to `path` (gzipped), the kernels' share is summarised from it: per step, the kernels
    launched, the sum of their durations (device busy) and the span from the first kernel's
    start to the last one's end; the rest of the span is gaps between kernels."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    prompts = make_prompts(engine.core.runner.vocab_size, [prompt_len] * batch, seed)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ids = [f"profile-{seed}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    for _ in range(3):
        engine.step()
    steps = 8
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        wall = time.perf_counter() - t0
    engine.abort_request(ids)
    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    path.write_bytes(gzip.compress(raw.read_bytes()))
    raw.unlink()
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
    busy = sum(e["dur"] for e in kernels)
    span = (
        (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) if kernels else 0
    )
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e["name"][:90], []).append(e["dur"])
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:15]
    summary = dict(
        batch=batch,
        steps=steps,
        wall_ms_per_step=1e3 * wall / steps,
        kernels_per_step=len(kernels) / steps,
        kernel_busy_ms_per_step=busy / 1e3 / steps,
        kernel_span_ms_per_step=span / 1e3 / steps,
        top_kernels=[
            dict(name=n, count=len(d) / steps, us_per_step=sum(d) / steps) for n, d in top
        ],
        trace=path.name,
    )
    log(
        f"profile batch {batch}: {summary['wall_ms_per_step']:.3f} ms/step under the profiler, "
        f"{summary['kernels_per_step']:.0f} kernels/step busy "
        f"{summary['kernel_busy_ms_per_step']:.3f} ms of a {summary['kernel_span_ms_per_step']:.3f}"
        " ms span; top: "
        + ", ".join(
            f"{k['name'][:40]} {k['us_per_step']:.0f}us" for k in summary["top_kernels"][:6]
        )
    )
    return summary


def engine_prefill_tps(llm: LLM, num: int, length: int, seed: int) -> float:
    engine = llm.engine
    prompts = make_prompts(engine.core.runner.vocab_size, [length] * num, seed)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"prefill-{seed}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return num * length / (time.perf_counter() - t0)


@torch.inference_mode()
def hf_decode_ms(hf, batch: int, prompt_len: int, steps: int, device: str, seed: int) -> float:
    """transformers' greedy generate: (time for 1 + steps new tokens - time for 1) / steps."""
    vocab = hf.config.vocab_size
    ids = torch.tensor(make_prompts(vocab, [prompt_len] * batch, seed), device=device)
    mask = torch.ones_like(ids)

    def generate(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
        sync(device)
        return time.perf_counter() - t0

    generate(2)  # warm-up
    longer = min(generate(1 + steps) for _ in range(2))
    return 1e3 * (longer - min(generate(1) for _ in range(2))) / steps


@torch.inference_mode()
def hf_prefill_tps(hf, num: int, length: int, device: str, seed: int) -> float:
    ids = torch.tensor(make_prompts(hf.config.vocab_size, [length] * num, seed), device=device)
    hf(ids[:1, :64], logits_to_keep=1)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    hf(ids, logits_to_keep=1)
    sync(device)
    return num * length / (time.perf_counter() - t0)


def timing_rows(
    args, device: str, name: str, llm: LLM, hf, report: dict, save: Callable[[], None]
) -> None:
    smoke = args.smoke
    batches = [1, 4] if smoke else [1, 8, 64, 256]
    prompt_len, warm, steps = (8, 1, 3) if smoke else (128, 3, 20)
    prefill = (2, 32) if smoke else (16, 1024)
    runner = llm.engine.core.runner
    graphs = runner.decode_graphs
    if "copy_bandwidth_gbs" not in report:
        report["copy_bandwidth_gbs"] = copy_bandwidth(device, smoke) / 1e9
    bandwidth = report["copy_bandwidth_gbs"] * 1e9
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in runner.model.parameters()}
    weight_bytes = sum(weights.values())
    per_token_kv = sum(c[:, 0, 0].numel() * c.element_size() for c in runner.kv_caches)
    for i, batch in enumerate(batches):
        if time.monotonic() - START > args.budget_s:
            skipped = {"model": name, "workload": f"decode batch {batch}", "batch": batch}
            report["timing"].append(skipped | {"skipped": "time budget"})
            log(f"timing {name} batch {batch}: skipped (past --budget-s)")
            continue
        context = prompt_len + warm + steps // 2  # mean context while timed
        kv_bytes = batch * context * per_token_kv
        row: dict[str, Any] = dict(
            model=name,
            workload=f"decode batch {batch}",
            batch=batch,
            unit="ms/step",
            floor_weights_ms=1e3 * weight_bytes / bandwidth,
            floor_ms=1e3 * (weight_bytes + kv_bytes) / bandwidth,
        )
        runner.decode_graphs = graphs
        before = sum(graphs.steps.values())
        timed = engine_decode_ms(llm, batch, prompt_len, warm, steps, seed=10 * i)
        row["kvflow_graphs"], row["kvflow_graphs_runner"], row["non_decode_steps"] = timed[:3]
        row["graph_device_ms"] = timed[3]
        row["graph_steps"] = sum(graphs.steps.values()) - before
        core = llm.engine.core
        overlap, core.async_scheduling = core.async_scheduling, False
        try:  # each step scheduled after the previous one ended
            timed = engine_decode_ms(llm, batch, prompt_len, warm, steps, seed=10 * i + 3)
        finally:
            core.async_scheduling = overlap
        row["kvflow_graphs_sync"] = timed[0]
        runner.decode_graphs = None  # the same engine, every step eager
        try:
            timed = engine_decode_ms(llm, batch, prompt_len, warm, steps, seed=10 * i + 1)
        finally:
            runner.decode_graphs = graphs
        row["kvflow_eager"], row["kvflow_eager_runner"], eager_other, _ = timed
        row["non_decode_steps"] += eager_other
        row["transformers"] = hf_decode_ms(hf, batch, prompt_len, steps, device, seed=10 * i + 2)
        row["kvflow_graphs_tok_s"] = 1e3 * batch / row["kvflow_graphs"]
        report["timing"].append(row)
        save()
        log(
            f"timing {name} batch {batch}: graphs {row['kvflow_graphs']:.2f} ms, eager "
            f"{row['kvflow_eager']:.2f} ms, transformers {row['transformers']:.2f} ms, "
            f"floor {row['floor_ms']:.3f} ms"
        )
    if device == "cuda" and time.monotonic() - START < args.budget_s:
        without_pdl(llm, [r for r in report["timing"] if r.get("model") == name], prompt_len)
        save()
    if args.trace_dir and device == "cuda" and time.monotonic() - START < args.budget_s:
        for batch in (1, 256):
            try:
                path = Path(args.trace_dir) / f"trace_{name}_b{batch}.json.gz"
                summary = profile_decode(llm, batch, prompt_len, 500 + batch, path, device)
                report.setdefault("profile", []).append(dict(model=name) | summary)
            except Exception:
                report.setdefault("profile", []).append(
                    dict(model=name, batch=batch, error=traceback.format_exc())
                )
                log(f"profile {name} batch {batch}: ERROR\n{report['profile'][-1]['error']}")
            save()
    num, length = prefill
    if time.monotonic() - START > args.budget_s:
        report["timing"].append({"model": name, "workload": "prefill", "skipped": "time budget"})
        return
    engine_prefill_tps(llm, 2, min(length, 256), seed=99)  # warm-up: the prefill kernels
    row = dict(
        model=name,
        workload=f"prefill {num} x {length}",
        unit="k tok/s",
        kvflow_graphs=engine_prefill_tps(llm, num, length, seed=98) / 1e3,
        kvflow_eager=None,  # prefill steps are always eager
        transformers=hf_prefill_tps(hf, num, length, device, seed=97) / 1e3,
        floor_ms=None,
    )
    report["timing"].append(row)
    log(
        f"timing {name} prefill: kvflow {row['kvflow_graphs']:.1f}k tok/s, "
        f"transformers {row['transformers']:.1f}k tok/s"
    )


def without_pdl(llm: LLM, rows: list[dict], prompt_len: int) -> None:
    """The same decode rows with programmatic dependent launch off (`kernels.triton.pdl.pdl_args`):
    the graphs are captured again without it, timed, and captured again with it."""
    from kvflow.kernels.triton import pdl as pdl_module

    graphs = llm.engine.core.runner.decode_graphs
    if graphs is None or not graphs.use_graphs:
        return

    def recapture(on: bool) -> None:
        pdl_module.PDL_ENABLED = on
        graphs._graphs.clear()
        graphs.capture()

    if not pdl_module.pdl_args()["PDL"]:
        return  # no PDL on this card: nothing to compare
    recapture(False)
    try:
        for i, row in enumerate(r for r in rows if "batch" in r and "kvflow_graphs" in r):
            timed = engine_decode_ms(llm, row["batch"], prompt_len, 3, 20, seed=700 + i)
            row["kvflow_graphs_no_pdl"], row["graph_device_ms_no_pdl"] = timed[0], timed[3]
            log(
                f"timing batch {row['batch']} without PDL: {timed[0]:.2f} ms "
                f"(graph {timed[3]:.3f} ms), with: {row['kvflow_graphs']:.2f} ms "
                f"(graph {row['graph_device_ms']:.3f} ms)"
            )
    finally:
        recapture(True)


def one_row_kernel_report() -> list[dict]:
    """Each batch-1 projection's choice (`kernels.tuning.gemv_wins`): Triton's one-row kernel
    (plain, or with the norm / silu made inside) against what it replaces, as timed at warm-up,
    with the weight bytes over the kernel's time, and the tile the tuner picked."""
    from kvflow.kernels import tuning
    from kvflow.kernels.triton import gemv

    rows = []
    for (what, n, k, dtype, _), (ours, theirs) in tuning._GEMV_TIMES.items():
        row = dict(what=what, n=n, k=k, dtype=str(dtype), ours_us=ours, theirs_us=theirs)
        row["ours_tb_s"] = n * k * 2 / (ours * 1e-6) / 1e12 if ours > 0 else None
        rows.append(row)
        log(
            f"one-row {what:<6} {n:>6} x {k:<5}: Triton {row['ours_us']:.1f} us "
            f"({row['ours_tb_s'] or 0:.2f} TB/s) vs {row['theirs_us']:.1f} us "
            f"{'(Triton)' if ours < theirs else '(cuBLAS)'}"
        )
    tuned = {str(key): str(config) for key, config in gemv._gemv_tuned.cache.items()}
    return rows + [dict(tuned=tuned)]


def attention_tile_report(device: str) -> list[dict]:
    """Device time of one decode attention call (the 1B shape's heads: 32 query, 8 KV, dim 64,
    bf16, block size 16) as the engine runs it (its key tile and split), and per key tile
    (BLOCK_N, warps) with one program per (request, KV head), at batch 1 and 8 and three
    contexts, timed as `kernels.tuning.gemv_wins` times the projections (a CUDA graph, K/V
    from HBM)."""
    from kvflow.attention.triton_attn import _decode_splits, _key_tile, triton_paged_attention
    from kvflow.kernels.tuning import graph_us as _graph_us

    rows = []
    for batch, context in itertools.product((1, 8), (150, 1024, 8192)):
        blocks_per = context // 16 + 1
        blocks = [list(range(1 + b * blocks_per, 1 + (b + 1) * blocks_per)) for b in range(batch)]
        meta = AttentionMetadata.build([1] * batch, [context] * batch, blocks, 16, device)
        cache = torch.randn(2, 1 + batch * blocks_per, 16, 8, 64, device=device).bfloat16()
        q = torch.randn(batch, 32, 64, device=device).bfloat16()
        k, v = (torch.randn(batch, 8, 64, device=device).bfloat16() for _ in "kv")
        default = _key_tile(q.device, True, batch * 8, 64)
        splits = _decode_splits(q.device, batch * 8)
        row: dict[str, Any] = dict(batch=batch, context=context, tile=default, splits=splits)
        args = (q, k, v, cache, meta, 0.125)
        row["default_us"] = _graph_us(functools.partial(triton_paged_attention, *args))
        for tile in ((64, 4), (128, 4), (256, 4), (256, 8)):  # one program per pair
            row[f"{tile[0]}x{tile[1]}_us"] = _graph_us(
                functools.partial(triton_paged_attention, *args, tile=tile, splits=1)
            )
        rows.append(row)
        log(f"attention tiles {row}")
    return rows


def markdown_table(report: dict) -> str:
    def cell(value: Any, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        "| model | workload | kvflow (graphs) | no async scheduling | graph replay alone "
        "| without PDL (step / graph) | kvflow (eager) | transformers | floor | unit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report.get("timing", []):
        if "skipped" in row or "error" in row:
            what = "skipped" if "skipped" in row else "error (see JSON)"
            lines.append(f"| {row['model']} | {row.get('workload', '')} | {what} | | | | | | | |")
            continue
        floor = cell(row.get("floor_ms"), 3)
        no_pdl = "-"
        if row.get("kvflow_graphs_no_pdl") is not None:
            no_pdl = f"{row['kvflow_graphs_no_pdl']:.2f} / {row['graph_device_ms_no_pdl']:.3f}"
        if row.get("floor_weights_ms") is not None:
            floor = f"{row['floor_weights_ms']:.3f} / {row['floor_ms']:.3f}"
        lines.append(
            f"| {row['model']} | {row['workload']} | {cell(row['kvflow_graphs'])} | "
            f"{cell(row.get('kvflow_graphs_sync'))} | {cell(row.get('graph_device_ms'), 3)} | "
            f"{no_pdl} | {cell(row['kvflow_eager'])} | "
            f"{cell(row['transformers'])} | {floor} | {row['unit']} |"
        )
    return "\n".join(lines)


# ---- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; timings mean nothing")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    parser.add_argument("--skip-kernel", action="store_true")
    parser.add_argument("--skip-parity", action="store_true", help="also skips the timing")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-fp8", action="store_true", help="skip --quantization fp8's section")
    parser.add_argument(
        "--models", default=None, help="comma-separated subset: smollm2-shape,llama-1b-shape"
    )
    parser.add_argument(
        "--trace-dir", default=None, help="CUDA only: profiler traces of decode steps go here"
    )
    parser.add_argument(
        "--budget-s", type=float, default=270.0, help="skip remaining timing rows after this"
    )
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity means true float32
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    import transformers

    report: dict[str, Any] = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        smoke=args.smoke,
        torch=torch.__version__,
        transformers=transformers.__version__,
        triton_interpreter=os.environ.get("TRITON_INTERPRET") == "1",
    )
    with contextlib.suppress(ImportError):
        import triton

        report["triton"] = triton.__version__
    log(f"device {report['device']}, torch {torch.__version__}")

    def save() -> None:
        report["elapsed_s"] = time.monotonic() - START
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")

    def stopped(signum: int, _frame: Any) -> None:  # `timeout` ran out: keep what was done
        report["stopped_by_signal"] = signum
        save()
        print(markdown_table(report), flush=True)
        sys.exit(124)

    signal.signal(signal.SIGTERM, stopped)

    if not args.skip_kernel:
        section_kernel(args, device, report)
        save()
    if not args.skip_parity:
        with tempfile.TemporaryDirectory(prefix="kvflow-gpu-check-") as tmp:
            section_parity_and_timing(args, device, report, Path(tmp), save)
        save()
    if not args.skip_fp8 and device == "cuda":
        from fp8_check import section_fp8  # benchmarks/, next to this file

        shapes = SMOKE_SHAPES if args.smoke else FULL_SHAPES
        try:
            with tempfile.TemporaryDirectory(prefix="kvflow-fp8-check-") as tmp:
                section_fp8(args, device, report, Path(tmp), build_checkpoint, shapes,
                            engine_decode_ms, kvflow_greedy, log)  # fmt: skip
        except Exception:
            report["fp8"] = {"error": traceback.format_exc()}
            log(f"fp8: ERROR\n{report['fp8']['error']}")
        save()
    if device == "cuda":
        section_tp(report)
        save()
        from kvflow.kernels.triton import pdl

        report["pdl"] = pdl.pdl_args()["PDL"]  # on, where the card's probe passed
        log(f"programmatic dependent launch: {'on' if report['pdl'] else 'off'}")
        report["one_row_kernels"] = one_row_kernel_report()
        try:  # informs the next change; fails no check
            report["attention_tiles"] = attention_tile_report(device)
        except Exception:
            report["attention_tiles"] = {"error": traceback.format_exc()}
            log(f"attention tiles: ERROR\n{report['attention_tiles']['error']}")
        save()
    table = markdown_table(report)
    report["table"] = table
    checks = [report.get("kernel", {}).get("ok", True)]
    checks += [p["ok"] for p in report.get("parity", [])]
    report["ok"] = all(checks)
    save()
    print()
    print(f"kernel: {verdict(report.get('kernel', {}).get('ok'))}")
    for p in report.get("parity", []):
        print(f"parity {p['model']}: {verdict(p['ok'])}")
    print()
    print(table)
    return 0 if report["ok"] else 1


def section_tp(report: dict) -> None:
    """Tensor parallelism at 2 ranks over NCCL (benchmarks/tp_bench.py), on the SmolLM2 shape
    (9 heads: 6 + 3 per rank); needs two cards, and says so where there is one."""
    if torch.cuda.device_count() < 2:
        report["tp"] = {"skipped": "one visible GPU: TP over NCCL has not run"}
        log("tensor parallel: skipped (one visible GPU; NCCL has not run)")
        return
    from tp_bench import tp_gpu_section

    with tempfile.TemporaryDirectory(prefix="kvflow-tp-check-") as tmp:
        build_checkpoint(SMOL, Path(tmp), "cpu", seed=5)
        try:
            report["tp"] = tp_gpu_section(tmp)
        except Exception:
            report["tp"] = {"error": traceback.format_exc()}
    log(f"tensor parallel: {json.dumps(report['tp'], default=str)[:2000]}")


def verdict(ok: bool | None) -> str:
    return "skipped" if ok is None else ("PASS" if ok else "FAIL")


if __name__ == "__main__":
    sys.exit(main())
