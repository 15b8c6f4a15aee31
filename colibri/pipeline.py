"""The forward pass: the one place that both awaits and computes.

For each layer: attention on resident weights with the KV cache; the router and top-k;
ask the cache for the chosen experts (misses go to disk as one batch); tell the prefetcher
what the next layer's router predicts; compute each expert's FFN as soon as its record is
ready; shared expert or dense MLP; residual. Math runs in a one-thread executor (kernels are
multi-threaded inside), so the event loop keeps reaping IO completions while kernels run.

Results do not depend on arrival order: each expert writes its own output slot and the slots
are summed in a fixed order, so placement (backend, budget, policy, prefetch, the machine
that owns an expert) changes speed, never tokens.

With an expert-FFN provider (`Pipeline.experts`, e.g. colibri/cluster's ClusterExperts), the
routed experts run elsewhere: the layer awaits the provider's filled slots the way it awaits
local records, computing the shared expert meanwhile, and adds them in the same order.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from colibri.compute import ops
from colibri.io.cache import run_to_completion
from colibri.model import KVCache, Model

T = TypeVar("T")
# scoring (forward_batch's targets): the output head runs on blocks of rows holding at most
# this many bytes of logits
HEAD_BLOCK_NBYTES = 16 << 20
# steps of at most this many rows (decode) remember their experts per layer as a guess for
# the next step's (the prefetcher's second source beside the next layer's router)
PREV_ROWS_MAX = 4
# while prefetches wait for slots, a trip computes its ready experts this many at a time and
# frees each group's slots at once, so the next layer's reads start during the rest
PROGRESSIVE_CHUNK = 2


@dataclass
class StepTimes:
    """Seconds spent, summed over forward passes (for the per-token breakdown)."""

    compute: float = 0.0  # in kernels (executor)
    head: float = 0.0  # of compute: the output head (final norm, logits or log-probabilities)
    wait_io: float = 0.0  # awaiting expert records that were not ready
    # with the routed experts elsewhere (cluster): seconds of this process's own work for a
    # MoE layer (shared expert / dense MLP) done while the owners' calls were out
    overlapped: float = 0.0
    layers: int = 0
    experts: int = 0
    steps: int = 0  # forward passes (one per batch of sequences)
    resident_steps: int = 0  # of them in one trip, every record held (Pipeline.resident)


@dataclass
class _Step:
    """One forward pass's state, shared by its trips to the compute thread."""

    kvs: list[KVCache]
    pos0: list[int]  # each sequence's first position
    want: list[bool]  # all_logits per sequence
    first: list[int]  # logits_from per sequence
    # per sequence None, or the token ids int64 [n_s - first] whose log-probabilities to
    # return instead of logits (scoring)
    targets: list[np.ndarray | None] = field(default_factory=list)
    xs: list[np.ndarray] = field(default_factory=list)  # hidden states f32 [n_s, d_model]
    stacked: np.ndarray | None = None  # fused batches: every row; xs are views into it
    tokens: list[np.ndarray] = field(default_factory=list)  # token ids int64 [n_s]
    # hyper-connections, during a MoE layer: (the streams, each entry's mix); the layer's
    # FFN output is summed into zeroed arrays and goes into the streams through the mix
    hc: tuple[list[np.ndarray], list[Any]] | None = None
    # Gemma 4's per-layer inputs f32 [n_s, num_layers, P] per sequence (one entry over the
    # stacked rows for fused batches), or () when the model has none
    ples: list[np.ndarray | None] | tuple = ()
    # per sequence the first row the last layer computes past its keys and values (the rows
    # whose logits are wanted: Pipeline._kept_rows), or None: every row
    starts: list[int] | None = None


@dataclass
class _Routed:
    """What a trip returns when it stops at MoE layer `layer`: routed[s] = (h, ids, weights)
    per sequence (one entry for fused batches), and the next MoE layer's predicted experts."""

    layer: int
    routed: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    predicted: tuple[int, list[int]] | None
    # hyper-connections (DeepSeek-V4): per routed entry the mix for Model.ffn_residual; the
    # FFN output then goes into the streams through it instead of being added to x
    mixes: list[Any] | None = None


def _rows_view(slots: np.ndarray) -> np.ndarray:
    """slots f32 [n, k, d_model] as a [n * k, d_model] view (never a copy: raises if it would
    need one)."""
    v = slots.view()
    v.shape = (-1, slots.shape[-1])
    return v


def _release(batch: list[tuple[int, Any]]) -> None:
    """Release the leases of `batch` ((expert, lease) pairs) not yet released (on the loop)."""
    for _, lease in batch:
        if lease.buffer is not None:
            lease.release()


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
        # DeepSeek-V4 hash-routed layers: their experts are a function of the token ids, so
        # the prefetcher is told all of them when the tokens arrive (perfect prediction)
        self._hash_layers = [s.index for s in model.spec.layers if getattr(s, "hash_routed", 0)]
        # MoE layer -> the experts the last step of at most PREV_ROWS_MAX rows chose there
        self._last_experts: dict[int, list[int]] = {}
        # experts: a provider of the routed experts' outputs computed elsewhere, or None (they
        # come from `cache` and run here). It has `prefetch` (bool: wants the next layer's
        # prediction) and `async ffn(layer, routed, predicted) -> slots`: routed as below,
        # predicted (next MoE layer, [expert ids]) or None; returns per entry of routed the
        # f32 [n, top_k, d_model] weighted outputs, slot [t, j] from expert ids[t, j]
        self.experts: Any = None
        # the last layer computes its attention output, FFN and residual only for the rows
        # whose logits are wanted (keys, values and recurrent state for every row), as
        # llama.cpp's inp_out_ids; where its kernels are row-invariant (Model.ffn_rows_exact),
        # so the logits are the same bits. False: every row (tests compare the two)
        self.skip_unused_rows = True
        self._last = len(model.spec.layers) - 1
        self._last_exact: bool | None = None  # Model.ffn_rows_exact(self._last), once known
        # resident: every expert record stays in the cache once read (the engine sets it when
        # the budget holds them all); once all are read, the pipeline holds a lease on each
        # (_held) and runs a forward pass in one trip to the compute thread (_resident_step)
        # instead of one per MoE layer and the first: each trip is two thread wake-ups, tens
        # of microseconds on a quiet machine, milliseconds when other work takes the cores
        self.resident = False
        self._held: dict[tuple[int, int], Any] | None = None

    def close(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            for lease in held.values():
                lease.release()
        if self._own_executor:
            self.executor.shutdown(wait=True)

    async def _hold_all(self) -> bool:
        """With `resident` set and every record read: lease each one for good (hits: never
        suspends). Returns whether every record is held."""
        if self._held is not None:
            return True
        cache = self.cache
        if cache.num_entries < len(cache.store.records):
            return False
        keys = [(r.layer, r.expert) for r in cache.store.records]
        if not all(cache.contains(*k) for k in keys):
            return False
        self._held = {k: await cache.get(*k) for k in keys}
        return True

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in the compute thread. If the caller is cancelled, the kernel still
        runs to its end before the cancellation propagates: buffers it reads (slab slots)
        must not be released under it."""
        t0 = time.perf_counter()
        out = await run_to_completion(self.executor, fn, *args)
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
        targets: Sequence[np.ndarray | None] = (),
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
        [n_s - logits_from[s], vocab_size] (the output head runs on those rows only); where
        targets[s] is also given (int [n_s - logits_from[s]]) instead the log-probabilities
        float64 [n_s - logits_from[s]] of targets[s][t] under row t: the head runs on
        blocks of rows (_target_logprobs), so the [rows, vocab] logits of a long span are
        never held at once. The last layer computes every row's keys and values but its
        output only for the rows returned (all_logits with logits_from = n_s: none, an empty
        [0, vocab_size] array; _kept_rows). Raises ValueError when a sequence's tokens do not
        fit in its context. Cancelling stops between expert loads and releases every record
        it holds (the KV caches are then partly written).
        """
        pos0 = []
        for tokens, kv in batch:
            if kv.length + len(tokens) > kv.n_ctx:
                raise ValueError(
                    f"context length exceeded: {kv.length + len(tokens)} tokens > n_ctx "
                    f"{kv.n_ctx} (raise it with --ctx / n_ctx=)"
                )
            pos0.append(kv.length)
        if self.prefetcher is not None:
            # its timing compares steps of one shape; prompt chunks are not timed
            lens = tuple(len(t) for t, _ in batch)
            self.prefetcher.new_token(lens if max(lens, default=0) <= PREV_ROWS_MAX else None)
        want = list(all_logits) + [False] * (len(batch) - len(all_logits))
        first = list(logits_from) + [0] * (len(batch) - len(logits_from))
        tgts = list(targets) + [None] * (len(batch) - len(targets))
        step = _Step([kv for _, kv in batch], pos0, want, first, tgts)
        step.tokens = [np.asarray(t, dtype=np.int64) for t, _ in batch]
        step.starts = self._kept_rows(step)
        if self.prefetcher is not None and self.prefetcher.enabled and self._hash_layers:
            every = np.concatenate(step.tokens)
            for j in self._hash_layers:
                if j == self._last and step.starts is not None:  # the rows routed there
                    kept = zip(step.tokens, step.starts, strict=True)
                    every = np.concatenate([t[a:] for t, a in kept])
                self.prefetcher.predict(j, np.unique(self.model.hash_experts(j, every)).tolist())
        if (
            self.resident
            and self.experts is None
            and self.tracer is None
            and self.route_observer is None
            and await self._hold_all()
        ):  # every record held: the whole pass in one trip
            state, keys = await self._run(self._resident_step, [t for t, _ in batch], step)
            self.cache.count_hits(keys)
            records = len(keys)
            for (tokens, kv), p in zip(batch, pos0, strict=True):
                kv.length = p + len(tokens)
                self._traced += len(tokens)
            self.times.steps += 1
            self.times.resident_steps += 1
            self.last_step = (len(batch), records)
            return state
        # one trip to the compute thread per layer when its records are ready: the first trip
        # embeds and runs up to the first MoE layer's routing; each layer's last expert trip
        # goes on with the next layer's attention and routing (or the logits after the last)
        state = await self._run(self._begin, [t for t, _ in batch], step)
        records = 0  # expert records this step requested, over all layers
        while isinstance(state, _Routed):
            i, routed = state.layer, state.routed
            if self.tracer is not None:
                t0 = self._traced
                for _h, ids, weights in routed:
                    for t in range(len(ids)):
                        self.tracer.record(t0 + t, i, ids[t].tolist(), weights[t].tolist())
                    t0 += len(ids)
            if self.route_observer is not None:  # the tokens of the routed rows
                self.route_observer(
                    i, np.concatenate(step.tokens), np.concatenate([ids for _, ids, _ in routed])
                )
            experts = np.unique(np.concatenate([ids.ravel() for _, ids, _ in routed])).tolist()
            records += len(experts)
            if self.experts is not None:
                state = await self._moe_elsewhere(i, step, routed, state.predicted, state.mixes)
            else:
                self.cache.request(i, experts)  # misses go to disk now, as one batch
                if self.prefetcher is not None:
                    self._prefetch(i, state.predicted, experts, sum(map(len, step.tokens)))
                state = await self._moe(i, step, routed, experts, state.mixes)
            self.times.layers += 1
        for (tokens, kv), p in zip(batch, pos0, strict=True):
            kv.length = p + len(tokens)
            self._traced += len(tokens)
        self.times.steps += 1
        self.last_step = (len(batch), records)
        return state

    def _kept_rows(self, step: _Step) -> list[int] | None:
        """Per sequence the first row whose output the last layer computes: logits_from
        where all logits are wanted (the last row when that is none), else the last row.
        None (every row) when that is every row, skip_unused_rows is off, a tracer records
        every token's routing, or the last layer's kernels after its attention are not
        row-invariant (Model.ffn_rows_exact)."""
        if not self.skip_unused_rows or self.tracer is not None:
            return None
        # at least the last row (no logits at all: logits_from = n): no kernel sees 0 rows
        starts = [
            min(f, len(t) - 1) if full else len(t) - 1
            for t, full, f in zip(step.tokens, step.want, step.first, strict=True)
        ]
        if not any(starts):
            return None
        if self._last_exact is None:
            self._last_exact = self.model.ffn_rows_exact(self._last)
        return starts if self._last_exact else None

    def _resident_step(
        self, tokens: list[np.ndarray], step: _Step
    ) -> tuple[Any, list[tuple[int, int]]]:
        """A whole forward pass on the compute thread with every record held (_held): _begin,
        then per MoE layer what _moe does when all its experts hit (one _expert_step with
        every expert, the residual sums, the next layer's head). Returns (what forward_batch
        returns, the (layer, expert) records used: the gets a layer-by-layer pass makes)."""
        state = self._begin(tokens, step)
        keys: list[tuple[int, int]] = []
        while isinstance(state, _Routed):
            i, routed = state.layer, state.routed
            experts = np.unique(np.concatenate([ids.ravel() for _, ids, _ in routed])).tolist()
            keys += [(i, e) for e in experts]
            xs = self._ffn_targets(step, routed, state.mixes)
            slots = [np.zeros((*ids.shape, h.shape[1]), dtype=np.float32) for h, ids, _ in routed]
            batch = [(e, self._held[i, e]) for e in experts]
            state = self._expert_step(
                i, batch, xs, routed, slots, True, step, self._sandwich(i, xs)
            )
            self.times.experts += len(batch)
            self.times.layers += 1
        return state, keys

    def _prefetch(
        self, i: int, predicted: tuple[int, list[int]] | None, experts: list[int], rows: int
    ) -> None:
        """Tell the prefetcher what MoE layer i's successor will want: its router's guess
        (`predicted`, from layer i's hidden state) and the previous step's choice there
        (decode repeats experts from token to token; Prefetcher.predict orders the two by
        their record). After the last MoE layer,
        the next step's first layer: this step's choice there. `experts`: layer i's choice
        now; rows: the rows of this step (a prompt's union of experts is no guess for a
        token's, so only steps of a few rows are remembered)."""
        pf = self.prefetcher
        prev = self._last_experts
        if rows > PREV_ROWS_MAX:
            prev.clear()
        else:
            prev[i] = experts
        if not pf.enabled:
            return
        if predicted is not None:
            nxt, guess = predicted
            # the previous step's choice at nxt (nxt > i: not yet replaced); as many guesses
            # as this layer chose: more would only wait for slots and displace demand reads
            pf.predict(nxt, guess, repeat=prev.get(nxt, ()), limit=max(len(experts), 1))
            return
        later = [j for j in self._moe_layers if j > i and j not in self._hash_layers]
        if later:  # predicting is off for them (hash-routed) or guessed nothing
            return
        first = next((j for j in self._moe_layers if j not in self._hash_layers), None)
        if first is not None and first in prev:
            pf.predict_next_token(first, prev[first])

    def _begin(self, tokens: list[np.ndarray], step: _Step) -> _Routed | list[np.ndarray]:
        """The first trip: embed every sequence's tokens into step.xs (views into one
        stacked array for fused batches), then _head from layer 0."""
        step.xs, ples = self._embed(tokens)
        if ples[0] is not None:
            step.ples = ples
        if self.fused:  # one array, each sequence's rows a view into it
            step.stacked = np.concatenate(step.xs)
            offsets = np.cumsum([0] + [len(x) for x in step.xs])
            step.xs = [step.stacked[a:b] for a, b in itertools.pairwise(offsets)]
            if step.ples:
                step.ples = [np.concatenate(step.ples)]
        return self._head(0, step)

    def _head(self, start: int, step: _Step) -> _Routed | list[np.ndarray]:
        """Layers from `start` up to the next MoE layer: dense layers whole, then the MoE
        layer's attention and routing (a _Routed); after the last layer, the logits
        _logits returns."""
        m = self.model
        for spec in m.spec.layers[start:]:
            i = spec.index
            last = i == self._last and step.starts is not None
            if spec.moe:
                if last:
                    self._attention_kept(i, step)
                else:
                    m.attention_batch(i, step.xs, step.kvs, step.pos0)
                routed, predicted, mixes = self._route(i, step)
                return _Routed(i, routed, predicted, mixes)
            if last:
                self._attention_kept(i, step)
                self._dense_ffn_batch(i, [m.post_norm(i, x) for x in step.xs], step.xs)
            else:
                self._dense_layers(i, step.xs, step.kvs, step.pos0)
        fused = step.stacked is not None or (len(step.xs) > 1 and m.lm_head.row_invariant)
        t0 = time.perf_counter()
        out = self._logits(step.xs, step.want, step.first, fused, step.targets)
        self.times.head += time.perf_counter() - t0
        return out

    def _embed(self, tokens: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """Per sequence the embeddings and the per-layer inputs (None: the model has none)."""
        ids = [np.asarray(t, dtype=np.int64) for t in tokens]
        xs = [self.model.embed(t) for t in ids]
        return xs, [self.model.per_layer_inputs(t, x) for t, x in zip(ids, xs, strict=True)]

    def _logits(
        self,
        xs: list[np.ndarray],
        all_logits: list[bool],
        first: list[int],
        fused: bool,
        targets: list[np.ndarray | None],
    ) -> list[np.ndarray]:
        m = self.model
        scored = [full and t is not None for full, t in zip(all_logits, targets, strict=True)]
        if not fused:
            return [
                self._target_logprobs(x[f:], t) if sc else m.logits(x[f:]) if full
                else m.logits(x[-1:])[0]
                for x, full, f, t, sc in zip(xs, all_logits, first, targets, scored, strict=True)
            ]  # fmt: skip
        result: list[Any] = [None] * len(xs)
        if any(scored):  # the scored rows of every sequence together, in blocks
            idx = [s for s, sc in enumerate(scored) if sc]
            rows = np.concatenate([xs[s][first[s] :] for s in idx])
            lp = self._target_logprobs(rows, np.concatenate([targets[s] for s in idx]))
            k = 0
            for s in idx:
                result[s], k = lp[k : k + len(xs[s]) - first[s]], k + len(xs[s]) - first[s]
        rest = [s for s, sc in enumerate(scored) if not sc]
        if rest:
            rows = [xs[s][first[s] :] if all_logits[s] else xs[s][-1:] for s in rest]
            out, k = m.logits(np.concatenate(rows)), 0
            for s, r in zip(rest, rows, strict=True):
                result[s] = out[k : k + len(r)] if all_logits[s] else out[k]
                k += len(r)
        return result

    def _target_logprobs(self, x: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """log softmax(logits(x[t]))[targets[t]], float64 [n], for hidden rows x [n, ...] and
        token ids [n]: the output head on blocks of HEAD_BLOCK_NBYTES of logits, each block's
        target logits minus its rows' log-sum-exp (ops.logsumexp) while the block is in cache;
        a fresh [n, vocab] array would cost its page faults, its memory traffic, and a read
        back."""
        m = self.model
        block = max(4, HEAD_BLOCK_NBYTES // (4 * m.spec.vocab_size) // 4 * 4)
        out = np.empty(len(x), np.float64)
        for a in range(0, len(x), block):
            logits = m.logits(np.ascontiguousarray(x[a : a + block]))
            tg = targets[a : a + block]
            lse = ops.logsumexp(logits, m.nthreads)
            out[a : a + len(tg)] = logits[np.arange(len(tg)), tg] - lse
        return out

    def _dense_layers(
        self, i: int, xs: list[np.ndarray], kvs: list[KVCache], pos0: list[int]
    ) -> None:
        m = self.model
        if len(xs) == 1:
            return self._dense_layer(i, xs[0], kvs[0], pos0[0])
        m.attention_batch(i, xs, kvs, pos0)
        self._dense_ffn_batch(i, [m.post_norm(i, x) for x in xs], xs)

    def _dense_ffn_batch(self, i: int, hs: list[np.ndarray], xs: list[np.ndarray]) -> None:
        """xs[s] += dense_ffn(hs[s]) (dense MLP or shared expert of layer i) for every
        sequence s: one call over the stacked rows when its kernels are row-invariant (the
        same bits as one call per sequence), else one call per sequence."""
        m = self.model
        if len(xs) > 1 and m.dense_ffn_row_invariant(i):
            h = np.concatenate(hs)
            out = np.zeros_like(h)
            m.dense_ffn(i, h, out)
            r = 0
            for x in xs:
                x += out[r : r + len(x)]
                r += len(x)
            return
        for x, h in zip(xs, hs, strict=True):
            out = np.zeros_like(x)
            m.dense_ffn(i, h, out)
            x += out

    def _dense_layer(self, i: int, x: np.ndarray, kv: KVCache, pos0: int) -> None:
        m = self.model
        m.attention(i, x, kv, pos0)
        out = np.zeros_like(x)
        m.dense_ffn(i, m.post_norm(i, x), out)
        x += out

    def _attention_kept(self, i: int, step: _Step) -> None:
        """The last layer's attention (Model.attention_rows): keys, values and state of every
        row; then the step keeps each sequence's rows from step.starts[s] on (hidden states,
        token ids, per-layer inputs; logits_from counts from the first kept row), so the
        layer's FFN, the residual and the output head run on those rows only."""
        starts = step.starts
        assert starts is not None
        xs = self.model.attention_rows(i, step.xs, step.kvs, step.pos0, starts)
        step.tokens = [t[a:] for t, a in zip(step.tokens, starts, strict=True)]
        step.first = [f - a for f, a in zip(step.first, starts, strict=True)]
        if step.stacked is not None:  # one array again, each sequence's rows a view into it
            if step.ples:
                offsets = np.cumsum([0] + [len(x) for x in step.xs])
                spans = zip(offsets, starts, offsets[1:], strict=False)
                keep = np.concatenate([np.arange(o + a, b) for o, a, b in spans])
                step.ples = [step.ples[0][keep]]
            step.stacked = np.concatenate(xs)
            offsets = np.cumsum([0] + [len(x) for x in xs])
            step.xs = [step.stacked[a:b] for a, b in itertools.pairwise(offsets)]
            return
        if step.ples:
            step.ples = [p[a:] for p, a in zip(step.ples, starts, strict=True)]
        step.xs = xs

    def _route(
        self, i: int, step: _Step
    ) -> tuple[
        list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        tuple[int, list[int]] | None,
        list[Any] | None,
    ]:
        """After MoE layer i's attention, per sequence: the FFN input h and the routing (ids
        int32 [n, k], weights f32 [n, k]); the union of what the next MoE layer's router
        predicts (one trip to the compute thread); and, with hyper-connections (DeepSeek-V4),
        each entry's mix for Model.ffn_residual (else None). Fused batches (step.stacked:
        step.xs are views into it) run once over all rows: one (h, ids, weights) entry for
        the whole batch. The token ids choose on hash-routed layers. When the next MoE layer
        is the last one and computes the kept rows only (step.starts), so is its guess."""
        m = self.model
        nxt = None
        elsewhere = self.experts is not None and self.experts.prefetch
        if elsewhere or (self.prefetcher is not None and self.prefetcher.enabled):
            nxt = next((j for j in self._moe_layers if j > i), None)
            if nxt in self._hash_layers:  # already predicted exactly from the tokens
                nxt = None
        hc = getattr(m.spec, "hc", None) is not None
        xs, stacked, tokens = step.xs, step.stacked, step.tokens
        starts = [0] * len(xs)
        if nxt == self._last and step.starts is not None:
            starts = step.starts
        if stacked is not None:
            h, mix = m.ffn_input(i, stacked)
            predicted = None
            if nxt is not None:
                g = stacked
                if any(starts):
                    g = np.concatenate([x[a:] for x, a in zip(xs, starts, strict=True)])
                guess = m.route(nxt, m.post_norm(nxt, g), x=g)[0]
                predicted = (nxt, list(dict.fromkeys(guess.ravel().tolist())))
            every = np.concatenate(tokens)
            return [(h, *m.route(i, h, every, x=stacked))], predicted, [mix] if hc else None
        routed, guesses, mixes = [], [], []
        for x, tok, a in zip(xs, tokens, starts, strict=True):
            h, mix = m.ffn_input(i, x)
            mixes.append(mix)
            routed.append((h, *m.route(i, h, tok, x=x)))
            if nxt is not None and a < len(x):
                # the next layer's router applied to this layer's hidden state (after that
                # layer's norm): the prediction DESIGN.md §5 describes
                g = x[a:]
                guesses.append(m.route(nxt, m.post_norm(nxt, g), x=g)[0].ravel())
        # in the router's order (best first, token by token): the prefetcher reads the first
        # ones first
        predicted = (
            (nxt, list(dict.fromkeys(np.concatenate(guesses).tolist()))) if guesses else None
        )
        return routed, predicted, mixes if hc else None

    async def _moe(
        self,
        i: int,
        step: _Step,
        routed: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        experts: list[int],
        mixes: list[Any] | None = None,
    ) -> _Routed | list[np.ndarray]:
        """x_s += shared expert (if any) + sum of the routed experts' weighted outputs, for
        every sequence s of the batch (routed[s] = (h, ids, weights); one entry over the
        stacked rows for fused batches), then _head(i + 1): returns what it returns.

        Records already in the cache are computed in the first trip to the compute thread,
        together with the shared experts, while the misses are read; each later trip takes
        every record that has arrived. Each expert writes its own slot of the sequence's
        `slots` (f32 [n, k, d_model]); the last trip adds them to x in slot order and goes on
        with the next layers, so with every record ready a layer is one trip.
        """
        loop = asyncio.get_running_loop()
        xs = self._ffn_targets(step, routed, mixes)
        slots = [np.zeros((*ids.shape, h.shape[1]), dtype=np.float32) for h, ids, _ in routed]
        dense = self._sandwich(i, xs)
        hits = [e for e in experts if self.cache.contains(i, e)]
        ready = [(e, await self.cache.get(i, e)) for e in hits]  # never suspends on a hit

        started: set[int] = set()  # misses whose get ran (it takes request's reservation)

        async def fetch(e: int) -> tuple[int, Any]:
            started.add(e)
            return e, await self.cache.get(i, e)

        tasks = [asyncio.ensure_future(fetch(e)) for e in experts if e not in hits]
        consumed: set[asyncio.Future] = set()
        try:  # from here a cancellation releases the hits' leases and the misses' reads
            if tasks:
                # two loop iterations: the misses' load tasks prepare their reads, then the
                # reader submits them, before the compute thread takes the CPU for the hits (on
                # 2 busy cores the loop could otherwise wait for the whole trip before the disk
                # starts)
                await asyncio.sleep(0)
                await asyncio.sleep(0)
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
                    result = await self._run(
                        self._expert_step,
                        i,
                        batch,
                        xs,
                        routed,
                        slots,
                        first,
                        None if pending else step,
                        dense,
                        loop,
                        PROGRESSIVE_CHUNK if self.cache.deferred_prefetches() else 0,
                    )
                    self.times.experts += len(batch)
                finally:
                    _release(batch)
                first = False
            return result
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
            # a task cancelled before it ran never took its reservation: drop it
            self.cache.unrequest(i, [e for e in experts if e not in hits and e not in started])

    @staticmethod
    def _ffn_targets(
        step: _Step,
        routed: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        mixes: list[Any] | None,
    ) -> list[np.ndarray]:
        """Where a MoE layer's FFN output is added: the hidden states, or with
        hyper-connections zeroed arrays that the last trip mixes into the streams."""
        xs = step.xs if step.stacked is None else [step.stacked]
        if mixes is None:
            return xs
        step.hc = (xs, mixes)
        return [np.zeros(h.shape, dtype=np.float32) for h, _, _ in routed]

    def _sandwich(self, i: int, xs: list[np.ndarray]) -> list[np.ndarray] | None:
        """Gemma 4 (Model.sandwich): zeroed arrays where layer i's dense MLP output waits for
        the experts'; else None (it is added to x at once)."""
        return [np.zeros_like(x) for x in xs] if self.model.sandwich(i) else None

    async def _moe_elsewhere(
        self,
        i: int,
        step: _Step,
        routed: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        predicted: tuple[int, list[int]] | None,
        mixes: list[Any] | None = None,
    ) -> _Routed | list[np.ndarray]:
        """As _moe, the routed experts computed by `self.experts` (on other machines): the
        shared expert runs here while their outputs travel; then the same slot-order sums and
        _head(i + 1) in the last trip, whose result it returns."""
        xs = self._ffn_targets(step, routed, mixes)
        dense = self._sandwich(i, xs)
        call = asyncio.ensure_future(self.experts.ffn(i, routed, predicted))
        done_at: list[float] = []
        call.add_done_callback(lambda _: done_at.append(time.perf_counter()))
        try:
            await asyncio.sleep(0)  # the call's first step sends to the owners before our trip
            t0 = time.perf_counter()
            await self._run(self._expert_step, i, [], xs, routed, [], True, None, dense)
            t1 = time.perf_counter()
            end = min(t1, done_at[0]) if done_at else t1  # the trip's part the call was out
            self.times.overlapped += max(0.0, end - t0)
            slots = await call
            self.times.wait_io += time.perf_counter() - t1
        finally:
            if not call.done():
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
        result = await self._run(self._expert_step, i, [], xs, routed, slots, False, step, dense)
        self.times.experts += len(np.unique(np.concatenate([ids.ravel() for _, ids, _ in routed])))
        return result

    def _expert_step(
        self,
        i: int,
        batch: list[tuple[int, Any]],
        xs: list[np.ndarray],
        routed: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        slots: list[np.ndarray],
        first: bool,
        last: _Step | None,
        dense: list[np.ndarray] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        chunk: int = 0,
    ) -> _Routed | list[np.ndarray] | None:
        """One trip: the shared expert / dense MLP (first trip), the experts of `batch`
        ((expert, lease) pairs) on each sequence's tokens routed to them, and on the last
        trip (`last` = the step) the residual sums and _head(i + 1), whose result it
        returns. dense (Gemma 4, Model.sandwich): the dense MLP's output waits there and
        Model.sandwich_residual ends the layer, with the per-layer inputs. loop: the event
        loop, to hand the leases of `batch` back as soon as their experts are done (before
        the next layers' attention and routing, or the output head, so the slots take the
        prefetcher's next reads meanwhile); the caller releases them otherwise. chunk: with
        a loop, run the grouped experts `chunk` at a time, each chunk's leases handed back
        when it is done (0: all in one call)."""
        m = self.model
        leases = batch
        if first and dense is not None:
            for x, (h, _, _), out in zip(xs, routed, dense, strict=True):
                m.dense_ffn(i, h, out, x)
        elif first:
            self._dense_ffn_batch(i, [h for h, _, _ in routed], xs)
        if batch and m.expert_group_ok(i):  # every ready expert in one kernel call
            if loop is not None and chunk:  # or a few at a time, each chunk's slots freed
                for a in range(0, len(batch), chunk):
                    part = batch[a : a + chunk]
                    self._expert_group(i, part, routed, slots)
                    loop.call_soon_threadsafe(_release, part)
            else:
                self._expert_group(i, batch, routed, slots)
            batch = []
        stack = len(routed) > 1 and m.expert_row_invariant(i)
        for e, lease in batch:
            if stack:  # one pass over the expert's weights for every sequence's rows
                self._expert_stacked(i, e, lease.buffer, routed, slots)
                continue
            for (h, ids, weights), sl in zip(routed, slots, strict=True):
                tok, slot = np.nonzero(ids == e)
                if len(tok):
                    sl[tok, slot] = m.expert_ffn(lease.buffer, h, tok, weights[tok, slot], layer=i)
        if last is None:
            return None
        if loop is not None and leases:
            loop.call_soon_threadsafe(_release, leases)
        if dense is not None:
            ples = list(last.ples) or [None] * len(xs)
            for x, sl, out, ple in zip(xs, slots, dense, ples, strict=True):
                m.sandwich_residual(i, x, out, sl, ple)
        else:
            for x, sl in zip(xs, slots, strict=True):
                for j in range(sl.shape[1]):  # fixed order, whatever the arrival order
                    x += sl[:, j]
        if last.hc is not None:  # hyper-connections: xs are the FFN outputs
            streams, mixes = last.hc
            last.hc = None
            for x, y, mix in zip(streams, xs, mixes, strict=True):
                m.ffn_residual(x, y, mix)
        return self._head(i + 1, last)

    def _expert_group(
        self,
        i: int,
        batch: list[tuple[int, Any]],
        routed: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        slots: list[np.ndarray],
    ) -> None:
        """The experts of `batch` ((expert, lease) pairs) of layer i over every sequence's
        rows routed to them, in one Model.expert_ffn_group call (row-invariant kernels: each
        row the same bits as in its own sequence's call of that expert). Each output row goes
        to its sequence's slot [token, choice]."""
        order = np.argsort([e for e, _ in batch], kind="stable")
        es = np.array([batch[j][0] for j in order])
        toks, ws, ranks, dest = [], [], [], []
        for s, (_, ids, weights) in enumerate(routed):
            tok, sl = np.nonzero(np.isin(ids, es))
            if not len(tok):
                continue
            toks.append((s, tok))
            ws.append(weights[tok, sl])
            ranks.append(np.searchsorted(es, ids[tok, sl]))
            dest.append((s, tok * ids.shape[1] + sl))  # row of slots[s] as [n * k, d_model]
        if not toks:
            return
        rank = np.concatenate(ranks)
        perm = np.argsort(rank, kind="stable")  # rows grouped by expert, in batch order
        row_off = np.zeros(len(es) + 1, dtype=np.int64)
        np.cumsum(np.bincount(rank, minlength=len(es)), out=row_off[1:])
        if len(toks) == 1:  # one gather of the rows in expert order (long prefills: 64 MB)
            (s, tok), d = toks[0], dest[0][1]
            h = np.take(routed[s][0], tok[perm], axis=0)
        else:
            h = np.concatenate([routed[s][0][tok] for s, tok in toks])[perm]
        y = self.model.expert_ffn_group(
            [batch[j][1].buffer for j in order], h, np.concatenate(ws)[perm], row_off, layer=i
        )
        # y's row r is the batch's row perm[r]: straight to its sequence's slot
        if len(toks) == 1:
            _rows_view(slots[dest[0][0]])[d[perm]] = y
            return
        seq = np.concatenate([np.full(len(d), s) for s, d in dest])[perm]
        flat = np.concatenate([d for _, d in dest])[perm]
        for s, _ in dest:
            mine = seq == s
            _rows_view(slots[s])[flat[mine]] = y[mine]

    def _expert_stacked(
        self,
        i: int,
        e: int,
        record: np.ndarray,
        routed: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        slots: list[np.ndarray],
    ) -> None:
        """Expert e of layer i in one call over the rows of every sequence routed to it
        (row-invariant kernels: each row the same bits as in that sequence's own call)."""
        picks = [np.nonzero(ids == e) for _, ids, _ in routed]
        if not any(len(tok) for tok, _ in picks):
            return
        h = np.concatenate([h[tok] for (h, _, _), (tok, _) in zip(routed, picks, strict=True)])
        w = np.concatenate(
            [wt[tok, sl] for (_, _, wt), (tok, sl) in zip(routed, picks, strict=True)]
        )
        y = self.model.expert_ffn(record, h, np.arange(len(h)), w, layer=i)
        r = 0
        for out, (tok, slot) in zip(slots, picks, strict=True):
            out[tok, slot] = y[r : r + len(tok)]
            r += len(tok)
