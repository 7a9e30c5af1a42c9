"""The split-K merge of a decode step's attention: the programs that share one (request, KV
head) each attend a chunk of its keys, publish their partial results, and the program that
counts last merges them.

Each program stores its partial (running max, sum, unnormalised output) and counts itself on
the pair's counter: a barrier, then one acq_rel atomic (its release covers every thread's
stores). The program that counts last reads the partials back past L1 (.cg: the other SMs'
stores are in L2), merges them in split order, so the result does not depend on which came
last, and sets the counter back to 0 for the next layer or step.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def publish_partial(
    part_ml_ptr, part_acc_ptr, counter, part, m_i, l_i, acc, rows, tile_offsets, active,
    BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    """Store partial number `part` and count it on `counter`; True for the program that
    counts last (of `active`), which must merge."""
    ml = part_ml_ptr + part * 2 * BLOCK_M + rows
    tl.store(ml, m_i)
    tl.store(ml + BLOCK_M, l_i)
    tl.store(part_acc_ptr + part * BLOCK_M * HEAD_PAD + tile_offsets, acc)
    tl.debug_barrier()  # every thread's stores, then one release (the atomic's)
    return tl.atomic_add(counter, 1, sem="acq_rel") == active - 1


@triton.jit
def merge_partials(
    part_ml_ptr, part_acc_ptr, counter, first, active, rows, tile_offsets,
    BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    """(max, sum, unnormalised output) of partials first .. first + active - 1, merged in
    order; `counter` is set back to 0."""
    tl.atomic_xchg(counter, 0, sem="relaxed")  # ready for the next step or layer
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for part in range(first, first + active):
        ml = part_ml_ptr + part * 2 * BLOCK_M + rows
        m_s = tl.load(ml, cache_modifier=".cg")
        l_s = tl.load(ml + BLOCK_M, cache_modifier=".cg")
        acc_s = tl.load(
            part_acc_ptr + part * BLOCK_M * HEAD_PAD + tile_offsets, cache_modifier=".cg"
        )
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        beta = tl.exp2(m_s - m_safe)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new
    return m_i, l_i, acc
