"""ExpertOwner: one machine's share of the routed experts, computed where its records live.

An owner opens its node's copy of the store (or of its shard, `colibri shard`) with the same
IO stack as a single-machine engine (io/stack.py: slab pool, reader, ExpertCache, Prefetcher)
under that node's budget, and the expert FFN kernels of a dense-less Model. It knows nothing of
Ray: colibri/cluster/client.py runs it inside a Ray actor; tests can drive it directly.

Per MoE layer the coordinator sends the rows its experts need (`parts`, one per sequence or
fused batch): h f32 [m, d_model] (the FFN input rows), ids int32 [m, top_k] (the routed expert
of each slot, -1 where another owner has it), weights f32 [m, top_k]. Every (row, slot) it owns
comes back as weights[t, j] * FFN_ids[t, j](h[t]), computed by exactly the kernel call the
single-process pipeline makes (the same rows in the same order for each expert), so the
coordinator's fixed-order sums are byte-identical to one machine's.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from colibri.errors import ColibriError

if TYPE_CHECKING:
    from colibri.engine import EngineOptions

INLINE_ROWS = 16  # up to this many rows with every record cached are computed on the loop
COUNTS_EVERY = 0.25  # seconds between two counts() sent back with an ffn answer
Part = tuple[np.ndarray, np.ndarray, np.ndarray]  # h f32 [m, d], ids int32 [m, k], w f32 [m, k]


def _node_cpus() -> int:
    """The CPU resource of the Ray node this process runs on (0: not under Ray, or none)."""
    try:
        import ray

        if not ray.is_initialized():
            return 0
        node = ray.get_runtime_context().get_node_id()
        for n in ray.nodes():
            if n.get("NodeID") == node:
                return int(n.get("Resources", {}).get("CPU", 0))
    except Exception:  # an older or newer Ray without these: physical cores
        return 0
    return 0


class ExpertOwner:
    """The experts of one shard of a store, with their own cache, reader and prefetcher.

    path: this node's store directory. options: the coordinator's EngineOptions (one
    definition of them: budget is this owner's expert cache bytes, None: every record of the
    store's experts file that fits in half the available memory; owner_threads: kernel
    threads, None: the CPU resource Ray gives this node (local nodes sharing one machine then
    do not oversubscribe its cores; several owners per node each take all of it), 0 (also
    outside Ray): its physical cores;
    activations: must be the coordinator's, it changes the kernels' bytes;
    io, policy, verify, prefetch, queue_depth: this owner's IO stack; the rest is the
    coordinator's). pad: the coordinator's Model.pad (likewise). Opening happens on the first
    call (`open()`), on the actor's event loop. Raises StoreError / ColibriError from open()
    (missing store, budget too small).
    """

    def __init__(self, path: str, options: EngineOptions, pad: int = 1) -> None:
        self.path = path
        self.options, self.pad = options, pad
        self.model: Any = None
        self.stack: Any = None
        self._opening: asyncio.Future | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="colibri-owner")
        self._last_layer = -1
        self._counted = -COUNTS_EVERY
        self.calls = 0
        self.compute_seconds = 0.0
        self.wait_io_seconds = 0.0
        self.pid = os.getpid()
        self.threads = 0  # kernel threads, known once opened

    async def open(self) -> dict[str, Any]:
        """Open the store and the IO stack (once; later calls wait for the first). Returns
        {"pid", "host", "budget_nbytes", "threads"} (threads: its kernel threads)."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opening)
        return {
            "pid": self.pid,
            "host": os.uname().nodename,
            "budget_nbytes": self.stack.cache.budget_nbytes,
            "threads": self.threads,
        }

    async def _open(self) -> None:
        from colibri.engine import available_memory
        from colibri.io.format import open_store
        from colibri.io.stack import open_expert_cache
        from colibri.model import Model
        from colibri.registry import model_spec

        o = self.options
        store = open_store(self.path)
        spec = model_spec(store.config)
        self.threads = o.owner_threads if o.owner_threads is not None else _node_cpus()
        self.model = Model(
            store, spec, nthreads=self.threads, activations=o.activations, pad=self.pad,
            dense=False,
        )  # fmt: skip
        slot = -(-store.layout.record_nbytes // 4096) * 4096
        everything = len(store.records) * slot
        budget = o.budget or min(everything, max(available_memory() // 2, slot))
        budget = max(min(budget, everything), spec.moe.router.top_k * slot)
        self.stack = open_expert_cache(
            store, budget, io=o.io, policy=o.policy, verify=o.verify, prefetch=o.prefetch,
            queue_depth=o.queue_depth,
        )  # fmt: skip
        if self.stack.pool.num_slots >= len(store.records) and self.model.x16_experts_ok():
            # every record of this shard stays resident: packed once read, as Engine does
            self.stack.cache.transform = self.model.x16_record
            self.model.x16_experts = True

    async def ffn(
        self, layer: int, parts: list[Part], predicted: tuple[int, list[int]] | None = None
    ) -> tuple[list[np.ndarray], dict[str, Any]]:
        """The owned slots of MoE layer `layer` for each part: f32 [P, d_model], the
        (row, slot) pairs where ids >= 0 in row-major order (np.nonzero(ids >= 0)).
        predicted: (next MoE layer, [expert ids]) to prefetch. Also returns counts() (for the
        coordinator's statistics; at most every COUNTS_EVERY seconds, else {}). Raises
        StoreError (a record failed its checksum) and ColibriError (an expert this store
        does not hold)."""
        await self.open()
        cache, prefetcher = self.stack.cache, self.stack.prefetcher
        if prefetcher is not None and layer <= self._last_layer:
            prefetcher.new_token()
        self._last_layer = layer
        self.calls += 1
        experts = sorted({int(e) for _, ids, _ in parts for e in np.unique(ids) if e >= 0})
        for e in experts:
            try:
                cache.store.record(layer, e)
            except KeyError:
                raise ColibriError(
                    f"{self.path}: expert {e} of layer {layer} is not in this owner's store "
                    "(the shard map and the node's store disagree)"
                ) from None
        outs = [np.zeros((*ids.shape, h.shape[1]), dtype=np.float32) for h, ids, _ in parts]
        cache.request(layer, experts)
        if prefetcher is not None and predicted is not None:
            prefetcher.predict(*predicted)
        rows = sum(len(h) for h, _, _ in parts)
        if rows <= INLINE_ROWS and all(cache.contains(layer, e) for e in experts):
            # decode, every record in RAM: compute right here, no trip to the compute thread
            # (at batch 1 a thread hand-off costs more than the kernels on a loaded machine)
            ready = [(e, await cache.get(layer, e)) for e in experts]  # never suspends
            try:
                t0 = time.perf_counter()
                self._compute(layer, ready, parts, outs)
                self.compute_seconds += time.perf_counter() - t0
            finally:
                for _, lease in ready:
                    lease.release()
        else:
            await self._read_and_compute(layer, experts, parts, outs)
        now = time.monotonic()
        counts: dict[str, Any] = {}
        if now - self._counted >= COUNTS_EVERY:  # counts() walks the cache's entries
            self._counted, counts = now, self.counts()
        return [out[ids >= 0] for out, (_, ids, _) in zip(outs, parts, strict=True)], counts

    async def _read_and_compute(
        self, layer: int, experts: list[int], parts: list[Part], outs: list[np.ndarray]
    ) -> None:
        """Each record as it arrives (several per trip to the compute thread), released
        right after, so a budget smaller than the layer's experts still makes progress."""
        cache = self.stack.cache
        loop = asyncio.get_running_loop()

        async def get(e: int) -> tuple[int, Any]:
            return e, await cache.get(layer, e)

        pending = {asyncio.ensure_future(get(e)) for e in experts}
        try:
            while pending:
                t0 = time.perf_counter()
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                self.wait_io_seconds += time.perf_counter() - t0
                ready = [t.result() for t in done if t.exception() is None]
                try:
                    error = next((t.exception() for t in done if t.exception()), None)
                    if error is not None:
                        raise error
                    t0 = time.perf_counter()
                    await loop.run_in_executor(
                        self._executor, self._compute, layer, ready, parts, outs
                    )
                    self.compute_seconds += time.perf_counter() - t0
                finally:
                    for _, lease in ready:
                        lease.release()
        finally:
            for t in pending:
                t.cancel()
            for r in await asyncio.gather(*pending, return_exceptions=True):
                if isinstance(r, tuple):
                    r[1].release()

    def _compute(
        self, layer: int, ready: list[tuple[int, Any]], parts: list[Part], outs: list[np.ndarray]
    ) -> None:
        for e, lease in ready:
            for (h, ids, weights), out in zip(parts, outs, strict=True):
                tok, slot = np.nonzero(ids == e)
                if len(tok):
                    out[tok, slot] = self.model.expert_ffn(
                        lease.buffer, h, tok, weights[tok, slot], layer=layer
                    )

    async def prefetch(self, layer: int, experts: list[int]) -> None:
        """Start reads of `experts` of `layer` (predictions for a layer this owner has no
        rows in yet). Never waits for them."""
        await self.open()
        if self.stack.prefetcher is not None:
            self.stack.prefetcher.predict(layer, experts)

    def counts(self) -> dict[str, Any]:
        """The cache's counts() plus calls, compute_seconds, wait_io_seconds and pid; with
        a prefetcher its prefetch_issued, prefetch_useful_reads (reads of predictions a
        later call used) and prefetch_wasted_reads."""
        c = self.stack.cache.counts() if self.stack is not None else {}
        if self.stack is not None and self.stack.prefetcher is not None:
            p = self.stack.prefetcher.statistics()
            c = {**c, "prefetch_issued": p.issued, "prefetch_useful_reads": p.useful_reads,
                 "prefetch_wasted_reads": p.wasted_reads}  # fmt: skip
        return {
            **c,
            "calls": self.calls,
            "compute_seconds": self.compute_seconds,
            "wait_io_seconds": self.wait_io_seconds,
            "pid": self.pid,
        }

    async def aclose(self) -> None:
        """Cancel reads in flight, close the reader and the pool."""
        if self.stack is not None:
            await self.stack.aclose()
            self.stack.close_pool()
            self.stack = None
        self._executor.shutdown(wait=True)
