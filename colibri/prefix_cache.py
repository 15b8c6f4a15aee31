"""The prefix cache: KV of prompt prefixes already computed, reused by later prompts.

As vLLM's automatic prefix caching: a prompt is cut into blocks of `block_size` tokens; block
k is keyed by a hash chained over blocks 0..k (so a key names the whole prefix, not just the
block's tokens) and holds that block's keys and values for every layer (copies, f32 or f16
as the KV cache). After a prompt's prefill, its full blocks are stored; a new prompt copies
the longest run of stored blocks matching its start into its own KV cache and prefills only
the rest. At least one prompt token is always computed (its logits pick the first token).

Memory: at most `budget_nbytes` of block copies; the least recently used block goes first
(a block whose parent was evicted can no longer match and ages out the same way).

Exactness: the reused keys and values are the very bytes a cold run computed for those
positions. The positions after the reused prefix are then prefilled in a chunk that starts
at the block boundary, where a cold run would have them inside a larger chunk; the SIMD
kernels block rows by count, so those rows can differ in the last bits (README "Serving").
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from colibri.model import KVCache


@dataclass
class _Block:
    k: list[np.ndarray]  # per layer [block_size, n_kv_heads, head_dim] (MLA: the latent)
    v: list[np.ndarray | None]  # None where v is k (MLA)
    nbytes: int


class PrefixCache:
    """Blocks of prompt KV under a byte budget (module docstring).

    block_size: tokens a block (16, vLLM's default). budget_nbytes: bytes of block copies.
    """

    def __init__(self, budget_nbytes: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.budget_nbytes, self.block_size = budget_nbytes, block_size
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.nbytes = 0
        self.hit_tokens = 0  # prompt tokens served from the cache
        self.stored_blocks = 0

    def _keys(self, ids: Sequence[int], n_blocks: int) -> list[bytes]:
        keys, h = [], b""
        bs = self.block_size
        for b in range(n_blocks):
            block = np.asarray(ids[b * bs : (b + 1) * bs], dtype=np.int64).tobytes()
            h = hashlib.blake2b(h + block, digest_size=16).digest()
            keys.append(h)
        return keys

    def lookup(self, ids: Sequence[int], kv: KVCache) -> int:
        """Copy the longest stored prefix of `ids` (whole blocks, leaving >= 1 token to
        compute) into the empty KV cache `kv`; return its length in tokens (0: none)."""
        if kv.length != 0:
            raise ValueError("lookup needs an empty KV cache")
        if kv.recurrent_state:  # a hybrid model's state is not per position: nothing to reuse
            return 0
        bs = self.block_size
        n = (len(ids) - 1) // bs
        matched = []
        for key in self._keys(ids, n):
            block = self._blocks.get(key)
            if block is None:
                break
            matched.append(block)
            self._blocks.move_to_end(key)
        for b, block in enumerate(matched):
            s = slice(b * bs, (b + 1) * bs)
            for layer, (k, v) in enumerate(zip(block.k, block.v, strict=True)):
                kv.k[layer][s] = k
                if v is not None:
                    kv.v[layer][s] = v
        kv.length = len(matched) * bs
        self.hit_tokens += kv.length
        return kv.length

    def store(self, ids: Sequence[int], kv: KVCache) -> None:
        """Keep the full blocks of `ids`, whose KV is in kv's first len(ids) positions."""
        if kv.recurrent_state:
            return
        bs = self.block_size
        n = min(len(ids), kv.length) // bs
        for b, key in enumerate(self._keys(ids, n)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            s = slice(b * bs, (b + 1) * bs)
            ks = [k[s].copy() for k in kv.k]
            vs = [None if v is k else v[s].copy() for k, v in zip(kv.k, kv.v, strict=True)]
            nbytes = sum(a.nbytes for a in ks) + sum(a.nbytes for a in vs if a is not None)
            if nbytes > self.budget_nbytes:
                return
            while self.nbytes + nbytes > self.budget_nbytes and self._blocks:
                _, old = self._blocks.popitem(last=False)
                self.nbytes -= old.nbytes
            self._blocks[key] = _Block(ks, vs, nbytes)
            self.nbytes += nbytes
            self.stored_blocks += 1

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0
