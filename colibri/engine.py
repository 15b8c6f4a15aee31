"""The engine: a store opened for inference, and the API users meet.

    async with colibri.open_engine("path/to/store") as engine:
        async for token in engine.stream("Hello", max_tokens=64):
            print(token.text, end="", flush=True)

open_engine() loads the dense weights (resident), sets up the reader, slab pool, expert cache
and prefetcher, and the compute thread. Sequences (one KV cache each) are independent: several
streams may run at once on one engine; they share the expert cache and the compute thread.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibri.errors import ColibriError
from colibri.io.cache import ExpertCache
from colibri.io.format import Store, open_store
from colibri.io.prefetch import Prefetcher
from colibri.io.reader import open_reader
from colibri.io.slab import SlabPool
from colibri.model import KVCache, Model
from colibri.pipeline import Pipeline
from colibri.registry import model_spec

DEFAULT_N_CTX = 4096


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, bytes (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def default_budget(store: Store, dense_nbytes: int) -> int:
    """Expert cache bytes when none is given: every expert if that fits in half of the
    available memory left after the dense weights, else that half (at least one layer's
    worth of top-k records is enforced by the cache)."""
    total = sum(r.nbytes for r in store.records)
    spare = max(0, (available_memory() - dense_nbytes) // 2)
    return min(total, spare) if spare else total


@dataclass(frozen=True)
class EngineOptions:
    """budget: expert cache bytes (None: default_budget). policy: "lru" | "lfu" | "lfru".
    prefetch: predict the next layer's experts with its router. io: "auto" | "uring" |
    "threads" | "mmap". threads: kernel threads (0: physical cores). n_ctx: context length of
    each sequence's KV cache, tokens. kv_dtype: "f32" | "f16"."""

    budget: int | None = None
    policy: str = "lru"
    prefetch: bool = True
    io: str = "auto"
    threads: int = 0
    n_ctx: int = DEFAULT_N_CTX
    kv_dtype: str = "f32"
    queue_depth: int = 32
    verify: bool = True


class Sequence:
    """One conversation's state: its KV cache and the tokens it has seen."""

    def __init__(self, kv: KVCache):
        self.kv = kv
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return self.kv.length


class Engine:
    """A store opened for inference. Create with open_engine(); close with aclose()."""

    def __init__(self, store: Store, options: EngineOptions):
        self.store, self.options = store, options
        self.spec = model_spec(store.config)
        self.model = Model(store, self.spec, nthreads=options.threads)
        budget = options.budget
        if budget is None:
            budget = default_budget(store, self.model.dense_nbytes)
        record_nbytes = store.layout.record_nbytes
        self.pool = SlabPool(record_nbytes, ExpertCache.slots_for_budget(budget, record_nbytes))
        self.reader = open_reader(
            store.experts_path, options.io, pool=self.pool, queue_depth=options.queue_depth
        )
        self.cache = ExpertCache(
            store, self.reader, budget, policy=options.policy, verify=options.verify
        )
        self.prefetcher = Prefetcher(self.cache) if options.prefetch else None
        self.pipeline = Pipeline(self.model, self.cache, self.prefetcher)
        self.n_ctx = min(options.n_ctx, self.spec.max_position_embeddings)

    def new_sequence(self, n_ctx: int | None = None) -> Sequence:
        """A fresh sequence with its KV cache (n_ctx tokens, default the engine's)."""
        dtype = np.float16 if self.options.kv_dtype == "f16" else np.float32
        return Sequence(KVCache.allocate(self.spec, n_ctx or self.n_ctx, dtype))

    async def forward(self, seq: Sequence, tokens: list[int]) -> np.ndarray:
        """Feed tokens (prefill when several, decode when one) and return the next-token
        logits, f32 [vocab_size]. Raises ColibriError when the context would overflow."""
        if seq.length + len(tokens) > seq.kv.n_ctx:
            raise ColibriError(
                f"prompt too long: {seq.length + len(tokens)} tokens exceed the context "
                f"length {seq.kv.n_ctx} (set n_ctx / --ctx)"
            )
        logits = await self.pipeline.forward(np.asarray(tokens, dtype=np.int64), seq.kv)
        seq.tokens.extend(tokens)
        return logits

    async def aclose(self) -> None:
        """Release the cache, the reader and the compute thread."""
        self.pipeline.close()
        await self.cache.aclose()
        await self.reader.aclose()
        self.pool.close()


@asynccontextmanager
async def open_engine(path: str | os.PathLike[str], **options: Any) -> AsyncIterator[Engine]:
    """Open the store at `path` for inference; options as in EngineOptions.

    Raises StoreError (not a store, corrupt, unsupported architecture) and ValueError (bad
    option). Yields the Engine; closes it on exit.
    """
    store = open_store(Path(path))
    engine = Engine(store, EngineOptions(**options))
    try:
        yield engine
    finally:
        await engine.aclose()
