"""open_expert_cache(): the IO stack (slab pool, reader, expert cache, prefetcher) wired once.

    stack = open_expert_cache(store, budget_nbytes, io="auto", policy="nextuse")
    lease = await stack.cache.get(layer, expert)
    ...
    await stack.aclose()

Used by the engine, `colibri replay` and the benchmarks, so the pool is sized from the budget
the same way everywhere (ExpertCache.slots_for_budget) and the components close in the right
order (cache, whose reads must end first; then the reader; then the pool's mapping).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibri.io.cache import ExpertCache
from colibri.io.prefetch import Prefetcher
from colibri.io.reader import open_reader
from colibri.io.slab import SlabPool


@dataclass
class ExpertStack:
    """The pool, reader, cache and (optional) prefetcher over one store's experts file."""

    pool: SlabPool
    reader: Any
    cache: ExpertCache
    prefetcher: Prefetcher | None

    async def aclose(self) -> None:
        """Cancel and wait for the reads in flight, close the reader, unmap the pool."""
        try:
            await self.cache.aclose()
        finally:
            await self.reader.aclose()

    def close_pool(self) -> None:
        """Unmap the slab pool (after aclose, once no lease or view of a slot is left)."""
        self.pool.close()


def open_expert_cache(
    store: Any,
    budget_nbytes: int,
    *,
    io: str = "auto",
    policy: str = "nextuse",
    queue_depth: int = 32,
    verify: bool | str = "once",
    prefetch: bool = False,
    min_slots: int | None = None,
    mirrors: tuple[str, ...] = (),
    mirror_weights: tuple[float, ...] | None = None,
    **cache_options: Any,
) -> ExpertStack:
    """The IO stack over `store`'s experts file (a colibri.io.format.Store).

    budget_nbytes: bytes of slabs for the cache (rounded down to whole slots of
    store.layout.record_nbytes). io: "auto" | "uring" | "threads" | "mmap" (open_reader).
    policy, verify, min_slots and cache_options (pinned, lfru_halflife): as ExpertCache.
    prefetch: also make a Prefetcher over the cache. mirrors: directories holding copies of
    the experts file (`colibri mirror`), read through io/mirror.py's MirrorReader with
    mirror_weights (one read share per copy, the store's first; default equal); each copy's
    records are verified there, so a bad copy fails over to another.
    Raises ValueError (budget below min_slots records) and OSError (the experts file).
    """
    nbytes = int(store.layout.record_nbytes)
    pool = SlabPool(nbytes, ExpertCache.slots_for_budget(budget_nbytes, nbytes))
    try:
        if mirrors:
            from colibri.io.mirror import open_mirrored_reader

            reader = open_mirrored_reader(
                store,
                mirrors,
                io,
                pool=pool,
                queue_depth=queue_depth,
                weights=mirror_weights,
                verify=verify,
            )
            verify = False  # checked per copy by the mirrored reader
        else:
            reader = open_reader(store.experts_path, io, pool=pool, queue_depth=queue_depth)
    except BaseException:
        pool.close()
        raise
    try:
        cache = ExpertCache(
            store, reader, budget_nbytes, policy=policy, verify=verify, min_slots=min_slots,
            **cache_options,
        )  # fmt: skip
    except BaseException:
        pool.close()
        raise
    return ExpertStack(pool, reader, cache, Prefetcher(cache) if prefetch else None)
