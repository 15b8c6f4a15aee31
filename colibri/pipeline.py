"""The forward pass: the one place that both awaits and computes.

For each layer: attention on resident weights with the KV cache; the router and top-k;
ask the cache for the chosen experts (misses go to disk as one batch); tell the prefetcher
what the next layer's router predicts; compute each expert's FFN as soon as its record is
ready; shared expert or dense MLP; residual. Math runs in a one-thread executor (kernels are
multi-threaded inside), so the event loop keeps reaping IO completions while kernels run.

Results do not depend on arrival order: each expert writes its own output slot and the slots
are summed in a fixed order, so placement (backend, budget, policy, prefetch) changes speed,
never tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from colibri.model import KVCache, Model

T = TypeVar("T")


@dataclass
class StepTimes:
    """Seconds spent, summed over forward passes (for the per-token breakdown)."""

    compute: float = 0.0  # in kernels (executor)
    wait_io: float = 0.0  # awaiting expert records that were not ready
    layers: int = 0
    experts: int = 0


class Pipeline:
    """Runs forward passes of `model`, fetching routed experts through `cache`.

    cache: an ExpertCache (colibri.io.cache). prefetcher: a Prefetcher or None.
    executor: a ThreadPoolExecutor for the math (default: one worker).
    """

    def __init__(
        self,
        model: Model,
        cache: Any,
        prefetcher: Any | None = None,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self.model, self.cache, self.prefetcher = model, cache, prefetcher
        self._own_executor = executor is None
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix="colibri-compute")
        self.times = StepTimes()
        self.tracer: Any = None  # a RoutingTraceWriter: every token's choice per layer
        self._traced = 0  # tokens recorded so far
        self._moe_layers = [s.index for s in model.spec.layers if s.moe]

    def close(self) -> None:
        if self._own_executor:
            self.executor.shutdown(wait=True)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in the compute thread. If the caller is cancelled, the kernel still
        runs to its end before the cancellation propagates: buffers it reads (slab slots)
        must not be released under it."""
        t0 = time.perf_counter()
        fut = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        try:
            out = await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():
                try:
                    await asyncio.shield(fut)
                except asyncio.CancelledError:
                    continue
                except Exception:
                    break
            raise
        self.times.compute += time.perf_counter() - t0
        return out

    async def forward(self, tokens: np.ndarray, kv: KVCache) -> np.ndarray:
        """Run tokens (int [n], the next n positions of kv) through the model.

        Returns the logits of the last token, f32 [vocab_size]. Raises ValueError when the
        tokens do not fit in the KV cache's context. Cancelling stops between expert loads
        and releases every record it holds.
        """
        n, pos0 = len(tokens), kv.length
        if pos0 + n > kv.n_ctx:
            raise ValueError(
                f"context length exceeded: {pos0 + n} tokens > n_ctx {kv.n_ctx} "
                "(raise it with --ctx / n_ctx=)"
            )
        m = self.model
        if self.prefetcher is not None:
            self.prefetcher.new_token()
        x = await self._run(m.embed, np.asarray(tokens, dtype=np.int64))
        for spec in m.spec.layers:
            i = spec.index
            if not spec.moe:  # a dense layer: one trip to the compute thread
                await self._run(self._dense_layer, i, x, kv, pos0)
                continue
            h, ids, weights, predicted = await self._run(self._attention_and_route, i, x, kv, pos0)
            if self.tracer is not None:
                for t in range(n):
                    self.tracer.record(self._traced + t, i, ids[t].tolist(), weights[t].tolist())
            experts = np.unique(ids).tolist()
            self.cache.request(i, experts)  # misses go to disk now, as one batch
            if self.prefetcher is not None and predicted is not None:
                self.prefetcher.predict(*predicted)
            await self._moe(i, x, h, ids, weights, experts)
            self.times.layers += 1
        kv.length = pos0 + n
        self._traced += n
        return (await self._run(m.logits, x[-1:]))[0]

    def _dense_layer(self, i: int, x: np.ndarray, kv: KVCache, pos0: int) -> None:
        m = self.model
        m.attention(i, x, kv, pos0)
        out = np.zeros_like(x)
        m.dense_ffn(i, m.post_norm(i, x), out)
        x += out

    def _attention_and_route(
        self, i: int, x: np.ndarray, kv: KVCache, pos0: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, list[int]] | None]:
        """Attention, FFN input, routing of MoE layer i and the prediction for the next MoE
        layer (one trip to the compute thread)."""
        m = self.model
        m.attention(i, x, kv, pos0)
        h = m.post_norm(i, x)
        ids, weights = m.route(i, h)
        predicted = None
        if self.prefetcher is not None and self.prefetcher.enabled:
            nxt = next((j for j in self._moe_layers if j > i), None)
            if nxt is not None:
                # the next layer's router applied to this layer's hidden state (after that
                # layer's norm): the prediction DESIGN.md §5 describes
                p_ids, _ = m.route(nxt, m.post_norm(nxt, x))
                predicted = (nxt, np.unique(p_ids).tolist())
        return h, ids, weights, predicted

    async def _moe(
        self,
        i: int,
        x: np.ndarray,
        h: np.ndarray,
        ids: np.ndarray,
        weights: np.ndarray,
        experts: list[int],
    ) -> None:
        """x += shared expert (if any) + sum of the routed experts' weighted outputs.

        Records already in the cache are computed in the first trip to the compute thread,
        together with the shared expert, while the misses are read; each later trip takes
        every record that has arrived. Each expert writes its own slot of `slots`
        (f32 [n, k, d_model]) and the last trip adds them to x in slot order.
        """
        slots = np.zeros((*ids.shape, h.shape[1]), dtype=np.float32)
        hits = [e for e in experts if self.cache.contains(i, e)]
        ready = [(e, await self.cache.get(i, e)) for e in hits]  # never suspends on a hit

        async def fetch(e: int) -> tuple[int, Any]:
            return e, await self.cache.get(i, e)

        tasks = [asyncio.ensure_future(fetch(e)) for e in experts if e not in hits]
        consumed: set[asyncio.Future] = set()
        try:
            pending = set(tasks)
            first = True
            while first or pending:
                if not first:
                    t0 = time.perf_counter()
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    self.times.wait_io += time.perf_counter() - t0
                    error = None
                    for task in done:
                        consumed.add(task)
                        if task.exception() is not None:
                            error = error or task.exception()
                        else:
                            ready.append(task.result())
                    if error is not None:
                        raise error
                batch, ready = ready, []
                try:
                    await self._run(
                        self._expert_step, i, batch, x, h, ids, weights, slots, first, not pending
                    )
                    self.times.experts += len(batch)
                finally:
                    for _, lease in batch:
                        lease.release()
                first = False
        finally:
            # on error or cancellation: stop the other reads, collect their outcome (so no
            # exception goes unretrieved) and release what they hold
            for _, lease in ready:
                lease.release()
            rest = [t for t in tasks if t not in consumed]
            for t in rest:
                t.cancel()
            for r in await asyncio.gather(*rest, return_exceptions=True):
                if isinstance(r, tuple):
                    r[1].release()

    def _expert_step(
        self,
        i: int,
        batch: list[tuple[int, Any]],
        x: np.ndarray,
        h: np.ndarray,
        ids: np.ndarray,
        weights: np.ndarray,
        slots: np.ndarray,
        first: bool,
        last: bool,
    ) -> None:
        """One trip: the shared expert / dense MLP (first trip), the experts of `batch`
        ((expert, lease) pairs) on their tokens, and (last trip) the residual sum."""
        if first:
            out = np.zeros_like(x)
            self.model.dense_ffn(i, h, out)
            x += out
        for e, lease in batch:
            tok, slot = np.nonzero(ids == e)
            slots[tok, slot] = self.model.expert_ffn(
                lease.buffer, h, tok, weights[tok, slot], layer=i
            )
        if last:
            for j in range(slots.shape[1]):  # fixed order, whatever the arrival order
                x += slots[:, j]
