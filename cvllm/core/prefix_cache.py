"""Prefix caching: the content key of a full KV block, and what a cache lookup returns.

A full block of a sequence is keyed by a chained hash: block ``i``'s key digests block
``i - 1``'s key, the block's token ids and its *extra keys* (anything besides the tokens
that changes the block's K/V: a LoRA adapter's name, the content hash of an image whose
placeholder tokens fall in the block, a per-user cache salt). Two sequences whose first
``k`` blocks have equal keys have equal K/V in those blocks, so a new sequence can start
from another's blocks instead of computing them. The digest is 128-bit BLAKE2b, so a
collision (which would silently reuse the wrong K/V) is out of reach, unlike a 64-bit
``hash()``.

Keys are computed on rank 0 by ``Sequence.update_block_hashes`` (only over confirmed
tokens, never placeholders); each KV cache group's ``BlockManager`` maps keys to its own
block ids (``core/block_manager.py``) and ``KVCacheManager.find_cached_prefix`` looks a
sequence up across every group and returns a ``PrefixHit`` (``core/kv_cache_manager.py``).
Nothing here reaches the other ranks: a hit only changes the block tables and the first
position of the step that ``StepInput`` carries.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

BlockHash = bytes
"""16 bytes: the chained content key of one full block."""

_ROOT = b"\x00" * 16  # the "parent" of block 0


def hash_block_tokens(parent: Optional[BlockHash], token_ids: Sequence[int],
                      extra_keys: Tuple = ()) -> BlockHash:
    """Key of one full block: its parent's key (None for the first block), its token ids
    and its extra keys (plain values: str, int, bytes, or tuples of them)."""
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(tuple(extra_keys)).encode())
    return h.digest()


@dataclass
class PrefixHit:
    """The longest cached prefix of a sequence that every KV cache group can serve.

    Built by ``KVCacheManager.find_cached_prefix`` for a sequence about to be admitted;
    read by the scheduler, which adopts the blocks only if the rest of the step fits."""

    num_tokens: int = 0
    """Tokens whose K/V the blocks hold (a multiple of the block size, at most the
    sequence's tokens minus one: the last token is always computed, for its logits)."""
    blocks: List[List[int]] = field(default_factory=list)
    """Per group, the block ids covering those tokens; a sliding-window group's list
    starts with ``PLACEHOLDER_BLOCK`` for the blocks no query of the sequence can see."""


@dataclass
class PrefixCacheStats:
    """Counters for ``/metrics`` (rank 0), in tokens, like vLLM's ``prefix_cache_queries``
    and ``prefix_cache_hits``. Only a sequence's first admission counts (re-admission
    after a preemption is not a request's prompt being looked up)."""

    queries: int = 0
    """Prompt tokens looked up."""
    hits: int = 0
    """Of those, tokens found in the cache."""
