"""Rows of logits that argmax reductions get wrong first: ties inside and across chunks, the
maximum at chunk edges, NaN (torch.argmax takes the first), +inf, all -inf, a -inf beside
finite values. Shared by the sampler's `row_argmax` test and the Triton `argmax_rows` test."""

from __future__ import annotations

import torch


def hard_rows(vocab: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Blocks of float32 rows [n, vocab] (each is also checked alone, at batch 1)."""
    rows = [torch.randn(5, vocab, generator=gen)]
    ties = torch.randint(0, 3, (6, vocab), generator=gen).float()  # many tied maxima per row
    ties[5] = -1.5  # every entry tied
    rows.append(ties)
    few = torch.full((4, vocab), -3.0)
    for r, cols in enumerate(([vocab - 1], [0, vocab - 1], [vocab // 2, vocab - 1], [0])):
        few[r, cols] = 2.0  # the maximum at the chunk edges, twice in different chunks
    rows.append(few)
    odd = torch.randn(6, vocab, generator=gen)
    odd[0, [vocab // 3, vocab - 1]] = float("nan")  # torch.argmax: the first NaN
    odd[1, vocab - 1] = float("nan")
    odd[2, vocab // 2] = float("inf")
    odd[3] = float("-inf")  # all -inf
    odd[4, : vocab // 2] = float("-inf")  # a -inf beside finite logits
    odd[5, 0] = float("-inf")
    rows.append(odd)
    return rows
