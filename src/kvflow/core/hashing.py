"""Chained block hashes: a full block's hash covers its tokens and every block before it."""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes
NONE_HASH: BlockHash = b""


def hash_block(parent: BlockHash, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    """Hash of one full block, chained on its parent's hash (NONE_HASH for the first block)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


def hash_full_blocks(
    token_ids: list[int], block_size: int, known: list[BlockHash], extra: bytes = b""
) -> list[BlockHash]:
    """Extend `known` (hashes of the first len(known) blocks) to every full block of `token_ids`.

    Returns a new list; `known` is not modified.
    """
    hashes = list(known)
    parent = hashes[-1] if hashes else NONE_HASH
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
