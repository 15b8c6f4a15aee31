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
import itertools
import time
from collections.abc import Callable, Sequence
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
    steps: int = 0  # forward passes (one per batch of sequences)


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
        # fused: the batch's rows are stacked into one array, so routers, experts, shared
        # experts and the output head run once over every sequence's rows (one weight pass);
        # the model must pad rows (Model(pad=4)) for that to stay batch-invariant
        self.fused = getattr(model, "pad", 1) > 1
        self.tracer: Any = None  # a RoutingTraceWriter: every token's choice per layer
        self._traced = 0  # tokens recorded so far
        # route_observer(layer, tokens int64 [n], experts int32 [n, k]): called on the event
        # loop for every MoE layer of every forward, before the cache is asked for the
        # experts, with the batch's token ids and their routing (the dashboard's feed)
        self.route_observer: Callable[[int, np.ndarray, np.ndarray], None] | None = None
        self.last_step = (0, 0)  # (sequences, expert records requested) of the last forward
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

    def set_tracer(self, tracer: Any, traced: int = 0) -> tuple[Any, int]:
        """Install `tracer` (a RoutingTraceWriter or None) with its token counter at `traced`
        (the index the next token fed is recorded under). Returns the previous (tracer,
        counter), so a caller can capture a span of tokens and then restore them."""
        previous = self.tracer, self._traced
        self.tracer, self._traced = tracer, traced
        return previous

    async def forward(
        self, tokens: np.ndarray, kv: KVCache, all_logits: bool = False, logits_from: int = 0
    ) -> np.ndarray:
        """Run tokens (int [n], the next n positions of kv) through the model.

        Returns the logits of the last token, f32 [vocab_size], or with all_logits those of
        tokens[logits_from:], f32 [n - logits_from, vocab_size] (row t predicts the token
        after tokens[logits_from + t]; for scoring: perplexity, multiple-choice
        log-likelihoods; the output head runs on those rows only). Raises ValueError when the
        tokens do not fit in the KV cache's context. Cancelling stops between expert loads
        and releases every record it holds.
        """
        return (await self.forward_batch([(tokens, kv)], [all_logits], [logits_from]))[0]

    async def forward_batch(
        self,
        batch: Sequence[tuple[np.ndarray, KVCache]],
        all_logits: Sequence[bool] = (),
        logits_from: Sequence[int] = (),
    ) -> list[np.ndarray]:
        """One forward pass over several sequences: batch[s] = (tokens int [n_s], kv_s), the
        next n_s positions of sequence s (a decode token, or a chunk of its prompt).

        Each MoE layer routes every token, requests the union of the batch's experts from
        the cache once and, as each record arrives, runs that expert over the tokens of every
        sequence routed to it. Batch invariance: every kernel call covers the rows of one
        sequence, exactly the calls that sequence makes when it runs alone, so its logits
        are bit-identical whatever else is in the batch (the kernels' row blocking differs
        with the number of rows, see README "Serving"). What sequences share is the expert
        reads, the cache lookups and the trips to the compute thread.

        Returns per sequence the last token's logits f32 [vocab_size], or where all_logits[s]
        is true those of its tokens from logits_from[s] (default 0) on, f32
        [n_s - logits_from[s], vocab_size] (the output head runs on those rows only).
        Raises ValueError when a sequence's tokens do not fit in its context. Cancelling
        stops between expert loads and releases every record it holds (the KV caches are then
        partly written).
        """
        pos0 = []
        for tokens, kv in batch:
            if kv.length + len(tokens) > kv.n_ctx:
                raise ValueError(
                    f"context length exceeded: {kv.length + len(tokens)} tokens > n_ctx "
                    f"{kv.n_ctx} (raise it with --ctx / n_ctx=)"
                )
            pos0.append(kv.length)
        m = self.model
        if self.prefetcher is not None:
            self.prefetcher.new_token()
        xs, ples = await self._run(self._embed, [t for t, _ in batch])
        stacked = None
        if self.fused:  # one array, each sequence's rows a view into it
            stacked = np.concatenate(xs)
            offsets = np.cumsum([0] + [len(x) for x in xs])
            xs = [stacked[a:b] for a, b in itertools.pairwise(offsets)]
            if ples[0] is not None:
                ples = [np.concatenate(ples)]
        kvs = [kv for _, kv in batch]
        records = 0  # expert records this step requested, over all layers
        for spec in m.spec.layers:
            i = spec.index
            if not spec.moe:  # a dense layer: one trip to the compute thread
                await self._run(self._dense_layers, i, xs, kvs, pos0)
                continue
            routed, predicted = await self._run(
                self._attention_and_route, i, xs, kvs, pos0, stacked
            )
            if self.tracer is not None:
                t0 = self._traced
                for _h, ids, weights in routed:
                    for t in range(len(ids)):
                        self.tracer.record(t0 + t, i, ids[t].tolist(), weights[t].tolist())
                    t0 += len(ids)
            if self.route_observer is not None:
                self.route_observer(
                    i,
                    np.concatenate([np.asarray(t, dtype=np.int64) for t, _ in batch]),
                    np.concatenate([ids for _, ids, _ in routed]),
                )
            experts = np.unique(np.concatenate([ids.ravel() for _, ids, _ in routed])).tolist()
            self.cache.request(i, experts)  # misses go to disk now, as one batch
            records += len(experts)
            if self.prefetcher is not None and predicted is not None:
                self.prefetcher.predict(*predicted)
            await self._moe(i, xs if stacked is None else [stacked], routed, experts, ples)
            self.times.layers += 1
        for (tokens, kv), p in zip(batch, pos0, strict=True):
            kv.length = p + len(tokens)
            self._traced += len(tokens)
        self.times.steps += 1
        self.last_step = (len(batch), records)
        want = list(all_logits) + [False] * (len(batch) - len(all_logits))
        first = list(logits_from) + [0] * (len(batch) - len(logits_from))
        return await self._run(self._logits, xs, want, first, stacked is not None)

    def _embed(self, tokens: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """Per sequence the embeddings and the per-layer inputs (None: the model has none)."""
        ids = [np.asarray(t, dtype=np.int64) for t in tokens]
        xs = [self.model.embed(t) for t in ids]
        return xs, [self.model.per_layer_inputs(t, x) for t, x in zip(ids, xs, strict=True)]

    def _logits(
        self, xs: list[np.ndarray], all_logits: list[bool], first: list[int], fused: bool
    ) -> list[np.ndarray]:
        m = self.model
        if not fused:
            return [
                m.logits(x[f:]) if full else m.logits(x[-1:])[0]
                for x, full, f in zip(xs, all_logits, first, strict=True)
            ]
        rows = [x[f:] if full else x[-1:] for x, full, f in zip(xs, all_logits, first, strict=True)]
        out, k = m.logits(np.concatenate(rows)), 0
        result = []
        for r, full in zip(rows, all_logits, strict=True):
            result.append(out[k : k + len(r)] if full else out[k])
            k += len(r)
        return result

    def _dense_layers(
        self, i: int, xs: list[np.ndarray], kvs: list[KVCache], pos0: list[int]
    ) -> None:
        for x, kv, p in zip(xs, kvs, pos0, strict=True):
            self._dense_layer(i, x, kv, p)

    def _dense_layer(self, i: int, x: np.ndarray, kv: KVCache, pos0: int) -> None:
        m = self.model
        m.attention(i, x, kv, pos0)
        out = np.zeros_like(x)
        m.dense_ffn(i, m.post_norm(i, x), out)
        x += out

    def _attention_and_route(
        self,
        i: int,
        xs: list[np.ndarray],
        kvs: list[KVCache],
        pos0: list[int],
        stacked: np.ndarray | None = None,
    ) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray]], tuple[int, list[int]] | None]:
        """Per sequence: attention, the FFN input h and the routing (ids int32 [n, k],
        weights f32 [n, k]) of MoE layer i; and the union of what the next MoE layer's router
        predicts (one trip to the compute thread). With `stacked` (fused batches: xs are
        views into it), the attention is per sequence and the rest runs once over all rows:
        one (h, ids, weights) entry for the whole batch."""
        m = self.model
        nxt = None
        if self.prefetcher is not None and self.prefetcher.enabled:
            nxt = next((j for j in self._moe_layers if j > i), None)
        if stacked is not None:
            for x, kv, p in zip(xs, kvs, pos0, strict=True):
                m.attention(i, x, kv, p)
            h = m.post_norm(i, stacked)
            predicted = None
            if nxt is not None:
                guess = m.route(nxt, m.post_norm(nxt, stacked), stacked)[0]
                predicted = (nxt, np.unique(guess).tolist())
            return [(h, *m.route(i, h, stacked))], predicted
        routed, guesses = [], []
        for x, kv, p in zip(xs, kvs, pos0, strict=True):
            m.attention(i, x, kv, p)
            h = m.post_norm(i, x)
            routed.append((h, *m.route(i, h, x)))
            if nxt is not None:
                # the next layer's router applied to this layer's hidden state (after that
                # layer's norm): the prediction DESIGN.md §5 describes
                guesses.append(m.route(nxt, m.post_norm(nxt, x), x)[0].ravel())
        predicted = (nxt, np.unique(np.concatenate(guesses)).tolist()) if guesses else None
        return routed, predicted

    async def _moe(
        self,
        i: int,
        xs: list[np.ndarray],
        routed: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        experts: list[int],
        ples: Sequence[np.ndarray | None] = (),
    ) -> None:
        """x_s += shared expert (if any) + sum of the routed experts' weighted outputs, for
        every sequence s of the batch (routed[s] = (h, ids, weights)).

        Records already in the cache are computed in the first trip to the compute thread,
        together with the shared experts, while the misses are read; each later trip takes
        every record that has arrived. Each expert writes its own slot of the sequence's
        `slots` (f32 [n, k, d_model]) and the last trip adds them to x in slot order (Gemma 4,
        Model.sandwich: the dense part waits in `dense` and Model.ffn_residual ends the layer,
        with the sequence's per-layer inputs `ples`).
        """
        slots = [np.zeros((*ids.shape, h.shape[1]), dtype=np.float32) for h, ids, _ in routed]
        dense = [np.zeros_like(x) for x in xs] if self.model.sandwich(i) else None
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
                        self._expert_step, i, batch, xs, routed, slots, first, not pending,
                        dense, ples,
                    )  # fmt: skip
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
        xs: list[np.ndarray],
        routed: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        slots: list[np.ndarray],
        first: bool,
        last: bool,
        dense: list[np.ndarray] | None = None,
        ples: Sequence[np.ndarray | None] = (),
    ) -> None:
        """One trip: the shared expert / dense MLP (first trip), the experts of `batch`
        ((expert, lease) pairs) on each sequence's tokens routed to them, and (last trip)
        the residual sums."""
        if first and dense is not None:  # Gemma 4: the MLP output waits for the experts'
            for x, (h, _, _), out in zip(xs, routed, dense, strict=True):
                self.model.dense_ffn(i, h, out, x)
        elif first:
            for x, (h, _, _) in zip(xs, routed, strict=True):
                out = np.zeros_like(x)
                self.model.dense_ffn(i, h, out)
                x += out
        for e, lease in batch:
            for (h, ids, weights), sl in zip(routed, slots, strict=True):
                tok, slot = np.nonzero(ids == e)
                if len(tok):
                    sl[tok, slot] = self.model.expert_ffn(
                        lease.buffer, h, tok, weights[tok, slot], layer=i
                    )
        if last and dense is not None:
            ples = list(ples) or [None] * len(xs)
            for x, sl, out, ple in zip(xs, slots, dense, ples, strict=True):
                self.model.ffn_residual(i, x, out, sl, ple)
        elif last:
            for x, sl in zip(xs, slots, strict=True):
                for j in range(sl.shape[1]):  # fixed order, whatever the arrival order
                    x += sl[:, j]
