"""The runner's persistent rows against plain Python lists, through reuse and growth."""

from __future__ import annotations

import random

import numpy as np

from kvflow.worker.input_rows import InputRows
from kvflow.worker.sampler import TokenHistory

PAD = 1000


def test_rows_match_lists_through_reuse_and_growth() -> None:
    gen = random.Random(0)
    rows = InputRows(rows=2, tokens=3, blocks=1)  # every dimension grows below
    live: dict[int, tuple[list[int], list[int], list[int]]] = {}  # row -> prompt, outputs, blocks
    for step in range(60):
        if len(live) < 5 or gen.random() < 0.2:  # a new or resumed request (outputs non-empty)
            prompt = [gen.randrange(PAD) for _ in range(gen.randrange(1, 40))]
            outputs = [gen.randrange(PAD) for _ in range(gen.randrange(3))]
            blocks = [gen.randrange(1, 99) for _ in range(gen.randrange(1, 4))]
            live[rows.add(prompt, outputs, blocks, num_computed=0)] = (prompt, outputs, blocks)
        if gen.random() < 0.15:
            gone = gen.choice(sorted(live))
            rows.remove(gone)
            del live[gone]
        sampled = gen.sample(sorted(live), gen.randrange(1, len(live) + 1))
        tokens = [gen.randrange(PAD) for _ in sampled]
        rows.append_tokens(sampled, tokens)
        for row, token in zip(sampled, tokens, strict=True):
            live[row][1].append(token)
        for row in sampled[:2]:
            new_blocks = [gen.randrange(1, 99)]
            rows.append_blocks(row, new_blocks)
            live[row][2].extend(new_blocks)

        index = np.array(gen.sample(sorted(live), len(live)))
        prompts = [live[r][0] for r in index]
        outputs = [live[r][1] for r in index]
        got, want = rows.history(index), TokenHistory.from_lists(prompts, outputs)
        for start, end in (
            (np.zeros_like(want.prompt_lens), want.prompt_lens),
            (want.prompt_lens, want.num_tokens),
        ):
            assert np.array_equal(got.padded(start, end, PAD), want.padded(start, end, PAD))
        widest = int(rows.num_blocks[index].max())
        table = rows.block_table[index, :widest]
        for r, table_row in zip(index, table, strict=True):
            blocks = live[r][2]
            assert table_row.tolist() == blocks + [0] * (widest - len(blocks)), step
        # a step scheduling the last q tokens of each request reads exactly those tokens
        q_lens = np.array([gen.randrange(1, 4) for _ in index])
        q_lens = np.minimum(q_lens, rows.num_tokens[index])
        starts = rows.num_tokens[index] - q_lens
        positions = np.concatenate(
            [np.arange(s, s + q) for s, q in zip(starts, q_lens, strict=True)]
        )
        known = {r: live[r][0] + live[r][1] for r in index}
        expected = [t for r, q in zip(index, q_lens, strict=True) for t in known[r][-q:]]
        assert rows.input_ids(index, q_lens, positions).tolist() == expected
    assert rows.token_ids.shape[0] > 2 and rows.token_ids.shape[1] > 3
    for row in rows._free:
        assert not rows.block_table[row].any()
