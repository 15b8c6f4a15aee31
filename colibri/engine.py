"""The engine: a store opened for inference, and the API users meet.

    async with colibri.open_engine("path/to/store") as engine:
        async for token in engine.stream("Hello", max_tokens=64):
            print(token.text, end="", flush=True)

open_engine() loads the dense weights (resident), sets up the reader, slab pool, expert cache
and prefetcher, and the compute thread. Sequences (one KV cache each) are independent: several
streams may run at once on one engine, and its scheduler (colibri/scheduler.py) decodes them
together, one batched forward pass a step, sharing expert reads; each stream's tokens are
those it would get alone.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import copy
import errno
import json
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping
from collections.abc import Sequence as Seq
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from colibri.errors import ColibriError
from colibri.io.cache import POLICIES
from colibri.io.format import Store, open_store
from colibri.io.reader import MAX_QUEUE_DEPTH
from colibri.io.stack import open_expert_cache
from colibri.model import KVCache, Model
from colibri.pipeline import Pipeline
from colibri.prefix_cache import PrefixCache
from colibri.registry import store_spec
from colibri.sampling import SamplingParams
from colibri.scheduler import Generation, GenerationStatistics, Scheduler, Token
from colibri.tokenizer import Tokenizer

__all__ = [
    "Engine",
    "EngineOptions",
    "EngineStatistics",
    "GenerationStatistics",
    "Sequence",
    "SyncEngine",
    "Token",
    "open_engine",
]

if TYPE_CHECKING:
    from colibri.io.trace import RoutingTraceWriter

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


def generation_defaults(path: Path) -> dict[str, Any]:
    """Sampling defaults from generation_config.json: greedy unless do_sample is true, then
    its temperature, top_k, top_p, min_p and repetition_penalty. Greedy when the file is
    absent (transformers' GenerationConfig default: do_sample false). Raises ColibriError
    naming the file when it is not JSON or a value is out of SamplingParams' range."""
    f = path / "generation_config.json"
    try:
        cfg = json.loads(f.read_text())
    except FileNotFoundError:
        return {"temperature": 0.0}
    except (OSError, ValueError, RecursionError) as exc:
        raise ColibriError(f"{f}: not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ColibriError(f"{path / 'generation_config.json'}: expected a JSON object")
    if not cfg.get("do_sample"):
        return {"temperature": 0.0}
    keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
    out = {k: cfg[k] for k in keys if cfg.get(k) is not None}
    try:  # checked here, so the message names the file the bad value came from
        SamplingParams(**out)
    except ColibriError as exc:
        raise ColibriError(f"{path / 'generation_config.json'}: {exc}") from None
    return out


def default_budget(store: Store, dense_nbytes: int) -> int:
    """Expert cache bytes when none is given: every expert if that fits in half of the
    available memory left after the dense weights, else that half (at least one layer's
    worth of top-k records is enforced by the cache)."""
    total = sum(r.nbytes for r in store.records)
    spare = max(0, (available_memory() - dense_nbytes) // 2)
    return min(total, spare) if spare else total


@dataclass(frozen=True)
class EngineOptions:
    """budget: expert cache bytes (None: default_budget). policy: "nextuse" (default: the
    estimated-farthest-next-use policy, colibri.io.cache.NextUsePolicy) | "lru" | "lfu" | "lfru".
    prefetch: predict the next layer's experts with its router and the previous token's
    choice, reading them as slots free up. io: "auto" | "uring" |
    "threads" | "mmap". threads: kernel threads (0: physical cores). n_ctx: context length of
    each sequence's KV cache, tokens. kv_dtype: "f32" | "f16". activations: "q8_k" (default:
    as q8_0, but experts whose gate, up and down are all Q4_K / Q5_K / Q6_K run on Q8_K
    activations, llama.cpp's K-quant path: 2x faster decode and 1.5x faster prefill than those
    experts on Q8_0 here; the type follows the weights, never the row count, so rows stay
    batch invariant) | "q8_0" (quantized weights multiply Q8_0-quantized activations with
    integer dot products, as llama.cpp's CPU backend does for Q4_0/Q8_0/MXFP4) | "f32" (exact
    f32 activations); float weights always keep f32."""

    budget: int | None = None
    policy: str = "nextuse"
    prefetch: bool = True
    io: str = "auto"
    threads: int = 0
    n_ctx: int = DEFAULT_N_CTX
    kv_dtype: str = "f32"
    activations: str = "q8_k"
    queue_depth: int = 32
    # check freshly read records' XXH3-64: "once" (each record the first time it is read,
    # as the cache and replay default), True (every read), False. Re-reads after eviction
    # are what a small budget does most: at a 1/4 budget with 4 streams (45 reads a step)
    # hashing every read cost 9 ms CPU and ~15% of the wall time a step (bench serve)
    verify: bool | str = "once"
    trace: str | None = None  # write a routing trace (.npz, colibri/io/trace.py) on close
    # copies of the experts file (`colibri mirror`), read through io/mirror.py's MirrorReader;
    # mirror_weights: one read share per copy, the store's first (default equal)
    mirrors: tuple[str, ...] = ()
    mirror_weights: tuple[float, ...] | None = None
    max_running: int = 8  # sequences decoded together by stream() (continuous batching)
    prefix_cache: int = 0  # bytes of prompt-prefix KV kept for reuse (0: off)
    batch: str = "split"  # how a batch's rows meet the kernels: "split" | "fused"
    # a Ray address ("auto": the running cluster): routed experts run on expert owners, one
    # per node (colibri/cluster); budget is then each owner's expert cache bytes
    cluster: str | None = None
    owners_per_node: int = 1
    shard_map: str | None = None  # a shard map file (colibri shard): owners and their stores
    # decode's layer calls through a Ray Compiled Graph (False: plain actor calls only)
    cluster_graph: bool = True
    # kernel threads of each expert owner (None: its node's Ray CPU resource, the cores Ray
    # gives that node; `threads` is this process's)
    owner_threads: int | None = None

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ColibriError:
            return ColibriError(f"option {field}={getattr(self, field)!r}: {why}")

        if self.budget is not None and self.budget <= 0:
            raise bad("budget", "must be a positive number of bytes")
        if self.policy not in POLICIES:
            raise bad("policy", f"must be one of {', '.join(POLICIES)}")
        if self.io not in ("auto", "uring", "threads", "mmap"):
            raise bad("io", "must be auto, uring, threads or mmap")
        if self.threads < 0:
            raise bad("threads", "must be >= 0 (0: one per physical core)")
        if self.n_ctx < 1:
            raise bad("n_ctx", "must be at least 1 token")
        if self.kv_dtype not in ("f32", "f16"):
            raise bad("kv_dtype", "must be f32 or f16")
        if self.activations not in ("f32", "q8_0", "q8_k"):
            raise bad("activations", "must be f32, q8_0 or q8_k")
        if not 1 <= self.queue_depth <= MAX_QUEUE_DEPTH:
            raise bad("queue_depth", f"must be in [1, {MAX_QUEUE_DEPTH}] (io_uring's ring limit)")
        if self.verify not in (True, False, "once"):
            raise bad("verify", "must be True, False or 'once'")
        if self.mirror_weights is not None and (
            len(self.mirror_weights) != 1 + len(self.mirrors)
            or not all(w > 0 for w in self.mirror_weights)
        ):
            raise bad("mirror_weights", f"needs {1 + len(self.mirrors)} positive read shares")
        if self.trace is not None and not Path(self.trace).resolve().parent.is_dir():
            raise bad("trace", f"directory {Path(self.trace).parent} does not exist")
        if self.max_running < 1:
            raise bad("max_running", "must be >= 1")
        if self.batch not in ("split", "fused"):
            raise bad("batch", "must be split or fused")
        if self.prefix_cache < 0:
            raise bad("prefix_cache", "must be >= 0 bytes (0: off)")
        if self.owner_threads is not None and self.owner_threads < 0:
            raise bad("owner_threads", "must be >= 0 (0: one per physical core of its node)")
        if self.owners_per_node < 1:
            raise bad("owners_per_node", "must be >= 1")
        if self.shard_map is not None and self.cluster is None:
            raise bad("shard_map", "needs a cluster (--cluster)")


@dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of an engine's figures, read by the CLI, the server's /metrics and bench.

    Counters (since the engine opened; `delta()` turns two snapshots into an interval):
    expert_hits / expert_misses: expert cache gets served from RAM / needing a read;
    bytes_read: bytes of expert records read; reads: records read; evictions;
    wait_io_seconds / compute_seconds: pipeline time awaiting records / in kernels;
    head_seconds: of compute_seconds, the output head's (final norm and logits);
    verify_seconds: time hashing freshly read records;
    forward_steps: batched forward passes; prompt_tokens / generated_tokens: tokens prefilled
    and sampled by streams; prefix_hits: prompt tokens whose KV came from the prefix cache.
    Gauges (the moment of the snapshot): running / waiting: sequences decoding / queued;
    reads_in_flight; leased: cache entries held by a computation; cache_used_nbytes /
    cache_budget_nbytes: expert cache bytes holding records / allowed; prefix_nbytes: KV bytes
    held by the prefix cache. hit_rate: expert_hits / gets (1.0 when there were none).
    cache, prefetch, reader, slab: the components' own records (not subtracted by delta).
    cluster: with --cluster, colibri.cluster.client.ClusterStatistics (per-owner latency,
    bytes on the wire); the expert counters are then the owners' sums.
    """

    expert_hits: int
    expert_misses: int
    bytes_read: int
    reads: int
    evictions: int
    wait_io_seconds: float
    compute_seconds: float
    verify_seconds: float
    forward_steps: int
    prompt_tokens: int
    generated_tokens: int
    prefix_hits: int
    running: int
    waiting: int
    reads_in_flight: int
    leased: int
    cache_used_nbytes: int
    cache_budget_nbytes: int
    prefix_nbytes: int
    dense_nbytes: int
    head_seconds: float = 0.0
    cache: Any = None
    prefetch: Any = None
    reader: Any = None
    slab: Any = None
    cluster: Any = None

    COUNTERS = (
        "expert_hits",
        "expert_misses",
        "bytes_read",
        "reads",
        "evictions",
        "wait_io_seconds",
        "compute_seconds",
        "head_seconds",
        "verify_seconds",
        "forward_steps",
        "prompt_tokens",
        "generated_tokens",
        "prefix_hits",
    )

    @property
    def hit_rate(self) -> float:
        gets = self.expert_hits + self.expert_misses
        return self.expert_hits / gets if gets else 1.0

    def delta(self, before: EngineStatistics) -> EngineStatistics:
        """The counters of the interval since `before` (gauges as in self)."""
        return replace(self, **{k: getattr(self, k) - getattr(before, k) for k in self.COUNTERS})


class Sequence:
    """One conversation's state: its KV cache and the tokens it has seen."""

    def __init__(self, kv: KVCache):
        self.kv = kv
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return self.kv.length

    def truncate(self, length: int) -> None:
        """Rewind to the first `length` tokens: the KV cache keeps their keys/values (later
        positions are overwritten by the next forward), so several continuations can each
        follow one shared prefix computed once. Raises ColibriError unless
        0 <= length <= self.length, and on a hybrid (Gated DeltaNet) model, whose recurrent
        state summarises every token, unless length is 0 or the current length: use
        snapshot() / restore() there."""
        if not 0 <= length <= self.kv.length:
            raise ColibriError(f"cannot truncate a {self.kv.length}-token sequence to {length}")
        if self.kv.recurrent_state and 0 < length < self.kv.length:
            raise ColibriError(
                "a hybrid model's recurrent state cannot be cut back to a shorter prefix; "
                "take Sequence.snapshot() there and restore() it"
            )
        if length == 0 and self.kv.recurrent_state:
            for a in self.kv.conv + self.kv.recurrent:
                if a is not None:
                    a[...] = 0
        self.kv.length = length
        del self.tokens[length:]

    def snapshot(self) -> tuple[Any, ...]:
        """The sequence now, to restore() later: its length, and a copy of the recurrent
        state on hybrid models (keys and values are positional and are kept in place)."""
        return (len(self.tokens), self.kv.snapshot())

    def restore(self, snap: tuple[Any, ...]) -> None:
        """Return to a snapshot() taken on this sequence at a length <= the current one."""
        n, kv = snap
        self.kv.restore(kv)
        del self.tokens[n:]

    def fork(self) -> Sequence:
        """A new sequence holding a copy of this one's state (its KV cache, of the same
        n_ctx, recurrent state included, and its tokens): several continuations of one
        prefix computed once, run side by side in one Engine.forward_batch (colibri/eval)."""
        other = Sequence(copy.deepcopy(self.kv))
        other.tokens = list(self.tokens)
        return other


class Engine:
    """A store opened for inference. Create with open_engine(); close with aclose()."""

    def __init__(self, store: Store, options: EngineOptions):
        self.store, self.options = store, options
        self.spec = store_spec(store)
        self.n_ctx = min(options.n_ctx, self.spec.max_position_embeddings)
        self._check_kv_fits(self.n_ctx)
        self.model = Model(
            store,
            self.spec,
            nthreads=options.threads,
            activations=options.activations,
            pad=4 if options.batch == "fused" else 1,
        )
        budget = options.budget
        if budget is None:
            budget = default_budget(store, self.model.dense_nbytes)
        record_nbytes = store.layout.record_nbytes
        minimum = self.spec.moe.router.top_k * record_nbytes
        if budget < minimum:
            raise ColibriError(
                f"expert cache budget {budget} bytes is too small: one layer's top-"
                f"{self.spec.moe.router.top_k} needs {minimum} bytes "
                f"({minimum / 2**20:.1f} MiB; records are {record_nbytes} bytes)"
            )
        # more than every record is never used: a budget above that does not reserve memory
        budget = min(budget, max(minimum, len(store.records) * (-(-record_nbytes // 4096) * 4096)))
        if options.cluster is not None:
            budget = minimum  # the routed experts live on the owners; this cache stays unused
        try:
            self.io = open_expert_cache(
                store,
                budget,
                io=options.io,
                policy=options.policy,
                queue_depth=options.queue_depth,
                verify=options.verify,
                prefetch=options.prefetch and options.cluster is None,
                mirrors=options.mirrors,
                mirror_weights=options.mirror_weights,
            )
        except (OSError, MemoryError) as exc:
            if isinstance(exc, OSError) and exc.errno != errno.ENOMEM:
                raise
            raise ColibriError(
                f"expert cache budget {budget / 2**30:.2f} GiB (--budget): cannot reserve that "
                f"much memory ({getattr(exc, 'strerror', None) or exc}); give a smaller --budget"
            ) from None
        self.pool, self.reader, self.cache = self.io.pool, self.io.reader, self.io.cache
        if (
            options.cluster is None
            and self.pool.num_slots >= len(store.records)
            and self.model.x16_experts_ok()
        ):  # every record stays resident once read: pack each once for the decode matvec
            self.cache.transform = self.model.x16_record
            self.model.x16_experts = True
        self.prefetcher = self.io.prefetcher
        self.pipeline = Pipeline(self.model, self.cache, self.prefetcher)
        # every record fits: once all are read, a forward pass is one trip (Pipeline.resident)
        self.pipeline.resident = options.cluster is None and self.pool.num_slots >= len(
            store.records
        )
        self.cluster: Any = None
        if options.cluster is not None:
            try:
                self.cluster = self._open_cluster()
            except BaseException:
                self.pipeline.close()
                self.io.close_pool()
                raise
            self.pipeline.experts = self.cluster
        if options.trace:
            from colibri.io.trace import RoutingTraceWriter

            router = self.spec.moe.router
            self.pipeline.tracer = RoutingTraceWriter(
                len(self.spec.layers),
                router.top_k,
                router.num_experts,
                meta={"model_type": self.spec.model_type, "source": str(store.path)},
            )
        self.tokenizer: Tokenizer | None = None
        if (store.path / "tokenizer.json").exists():
            self.tokenizer = Tokenizer.from_dir(store.path)
        self.prefill_chunk = 256
        self.generation_defaults = generation_defaults(store.path)
        self._closing = False
        self._close_task: asyncio.Future | None = None
        self._counts = dict.fromkeys(
            ("prompt_tokens", "generated_tokens", "prefix_hits", "running", "waiting"), 0
        )
        self.prefix_cache = PrefixCache(options.prefix_cache) if options.prefix_cache else None
        self.scheduler = Scheduler(self, options.max_running, self.prefill_chunk)

    def _open_cluster(self) -> Any:
        """The expert owners on the Ray cluster of options.cluster (colibri/cluster), with
        this engine's options (options.budget: each owner's expert cache)."""
        from colibri.cluster.client import open_cluster_experts
        from colibri.cluster.placement import load_shard_map

        o = self.options
        shard = nodes = hosts = None
        if o.shard_map is not None:
            shard, nodes, hosts = load_shard_map(
                o.shard_map, len(self.spec.layers), self.store.num_experts
            )
        return open_cluster_experts(
            self.store,
            o,
            pad=self.model.pad,
            shard=shard,
            node_stores=nodes,
            hosts=hosts,
        )

    def _check_kv_fits(self, n_ctx: int) -> None:
        """ColibriError when one sequence's KV cache of n_ctx tokens exceeds the memory
        available (MemAvailable), before anything is allocated."""
        dtype = np.float16 if self.options.kv_dtype == "f16" else np.float32
        need, avail = KVCache.nbytes_for(self.spec, n_ctx, dtype), available_memory()
        if avail and need > avail:
            raise ColibriError(
                f"context length {n_ctx} (--ctx / n_ctx): one sequence's {self.options.kv_dtype}"
                f" KV cache needs {need / 2**30:.2f} GiB, only {avail / 2**30:.2f} GiB of "
                "memory is available; lower --ctx" + (" or use --kv f16" * (dtype == np.float32))
            )

    def new_sequence(self, n_ctx: int | None = None) -> Sequence:
        """A fresh sequence with its KV cache (n_ctx tokens, default the engine's).
        Raises ColibriError when that KV cache does not fit in memory."""
        dtype = np.float16 if self.options.kv_dtype == "f16" else np.float32
        n = n_ctx or self.n_ctx
        if n != self.n_ctx:
            self._check_kv_fits(n)
        try:
            return Sequence(KVCache.allocate(self.spec, n, dtype))
        except MemoryError:
            need = KVCache.nbytes_for(self.spec, n, dtype)
            raise ColibriError(
                f"context length {n}: cannot allocate its KV cache of {need / 2**30:.2f} GiB"
            ) from None

    async def forward(
        self, seq: Sequence, tokens: list[int], all_logits: bool = False, logits_from: int = 0
    ) -> np.ndarray:
        """Feed tokens (prefill when several, decode when one) and return the next-token
        logits, f32 [vocab_size], or with all_logits those of every token from index
        logits_from on, f32 [len(tokens) - logits_from, vocab_size] (row t: the distribution
        of the token after tokens[logits_from + t]; used to score given tokens, colibri/eval).
        Raises ColibriError when the context would overflow or logits_from is out of range."""
        if not 0 <= logits_from <= len(tokens):
            raise ColibriError(f"logits_from {logits_from} outside 0..{len(tokens)}")
        if seq.length + len(tokens) > seq.kv.n_ctx:
            raise ColibriError(
                f"prompt too long: {seq.length + len(tokens)} tokens exceed the context "
                f"length {seq.kv.n_ctx} (set n_ctx / --ctx)"
            )
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.spec.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.spec.vocab_size)][0])
            raise ColibriError(
                f"token id {bad} is outside the model's vocabulary (vocab_size "
                f"{self.spec.vocab_size})"
            )
        logits = await self.pipeline.forward(
            ids, seq.kv, all_logits=all_logits, logits_from=logits_from
        )
        seq.tokens.extend(tokens)
        return logits

    async def forward_batch(
        self,
        seqs: Seq[Sequence],
        tokens: Seq[Seq[int]],
        all_logits: Seq[bool] = (),
        logits_from: Seq[int] = (),
        targets: Seq[Seq[int] | None] = (),
    ) -> list[np.ndarray]:
        """forward() of several sequences in one batched pass (Pipeline.forward_batch: the
        union of their experts read once, every expert run over each sequence's rows; in
        the default split batch mode each sequence's logits are bit-identical to a forward()
        of it alone). tokens[s]: the next tokens of seqs[s] (non-empty); all_logits[s] /
        logits_from[s] as forward()'s (default False / 0). Returns one array per sequence,
        f32 [vocab_size] or [len(tokens[s]) - logits_from[s], vocab_size]; where
        targets[s] is given (with all_logits[s]: one token id per row from logits_from[s]
        on) instead the log-probabilities of those tokens, float64 [len(tokens[s]) -
        logits_from[s]] (log-softmax of row t at targets[s][t]; scoring without the
        [rows, vocab] logits: colibri/eval). Raises ColibriError as forward() does, naming
        the sequence's index in the batch."""
        if len(tokens) != len(seqs) or len(set(map(id, seqs))) != len(seqs):
            raise ColibriError("forward_batch: one list of tokens per distinct sequence")
        full = list(all_logits) + [False] * (len(seqs) - len(all_logits))
        first = list(logits_from) + [0] * (len(seqs) - len(logits_from))
        batch = []
        vocab = self.spec.vocab_size
        for i, (seq, toks) in enumerate(zip(seqs, tokens, strict=True)):
            ids = np.asarray(toks, dtype=np.int64)
            if not ids.size:
                raise ColibriError(f"forward_batch: sequence {i} has no tokens")
            if not 0 <= first[i] <= ids.size:
                raise ColibriError(f"sequence {i}: logits_from {first[i]} outside 0..{ids.size}")
            if seq.length + ids.size > seq.kv.n_ctx:
                raise ColibriError(
                    f"sequence {i}: {seq.length + ids.size} tokens exceed the context length "
                    f"{seq.kv.n_ctx} (set n_ctx / --ctx)"
                )
            if ids.min() < 0 or ids.max() >= vocab:
                bad = int(ids[(ids < 0) | (ids >= vocab)][0])
                raise ColibriError(
                    f"sequence {i}: token id {bad} is outside the model's vocabulary "
                    f"(vocab_size {vocab})"
                )
            batch.append((ids, seq.kv))
        tgts: list[np.ndarray | None] = []
        for i, t in enumerate(list(targets) + [None] * (len(seqs) - len(targets))):
            if t is None:
                tgts.append(None)
                continue
            tg = np.asarray(t, dtype=np.int64)
            want = len(batch[i][0]) - first[i]
            if not full[i] or tg.shape != (want,):
                raise ColibriError(
                    f"sequence {i}: targets need all_logits and one token id per row "
                    f"({want}), got {tg.size}"
                )
            if tg.size and (tg.min() < 0 or tg.max() >= vocab):
                bad = int(tg[(tg < 0) | (tg >= vocab)][0])
                raise ColibriError(
                    f"sequence {i}: target id {bad} is outside the model's vocabulary "
                    f"(vocab_size {vocab})"
                )
            tgts.append(tg)
        out = await self.pipeline.forward_batch(batch, full, first, tgts)
        for seq, toks in zip(seqs, tokens, strict=True):
            seq.tokens.extend(int(t) for t in toks)
        return out

    @contextmanager
    def capture_routing(self) -> Iterator[RoutingTraceWriter]:
        """Record the router's choice for every token fed while inside, on every sequence:
        yields a RoutingTraceWriter (colibri/io/trace.py) whose token 0 is the first token fed
        after entering; its trace().experts is int32 [tokens, layers, top_k] (-1 on dense
        layers). The engine's own --trace tracer (if any) is paused meanwhile and resumed on
        exit."""
        from colibri.io.trace import RoutingTraceWriter

        router = self.spec.moe.router
        writer = RoutingTraceWriter(len(self.spec.layers), router.top_k, router.num_experts)
        previous = self.pipeline.set_tracer(writer, 0)
        try:
            yield writer
        finally:
            self.pipeline.set_tracer(*previous)

    def encode_prompt(
        self,
        prompt: str | Seq[Mapping[str, Any]],
        *,
        max_prompt_tokens: int | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a plain-text prompt (with the tokenizer's BOS handling) or of chat
        messages rendered with the model's chat template and a generation prompt.
        Raises TokenizerError when the store has no tokenizer or no chat template,
        PromptTooLongError when the prompt has more than max_prompt_tokens tokens."""
        tok = self._tokenizer()
        if isinstance(prompt, str):
            return tok.encode(prompt, max_tokens=max_prompt_tokens)
        text = tok.apply_chat_template(prompt, add_generation_prompt=True, **template_kwargs)
        return tok.encode(text, add_special_tokens=False, max_tokens=max_prompt_tokens)

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            from colibri.tokenizer import TokenizerError

            raise TokenizerError(f"{self.store.path}: the store has no tokenizer.json")
        return self.tokenizer

    async def stream(
        self,
        prompt: str | Seq[Mapping[str, Any]] | Seq[int],
        *,
        max_tokens: int = 256,
        template_kwargs: Mapping[str, Any] | None = None,
        ignore_eos: bool = False,
        **sampling: Any,
    ) -> AsyncIterator[Token]:
        """Generate from a prompt: a string, chat messages ([{"role", "content"}, ...], rendered
        with the chat template), or token ids.

        sampling: SamplingParams fields (temperature, top_k, top_p, min_p, repetition_penalty,
        presence_penalty, frequency_penalty, seed, logprobs, stop); temperature 0 is greedy.
        Fields not given come from the model's generation_config.json (as transformers'
        generate() does), else SamplingParams' defaults. ignore_eos: keep generating past
        end-of-sequence tokens (benchmarks; vLLM's option of that name).
        Yields Token items; the last one carries finish_reason and statistics. Breaking out
        of the loop or cancelling the task stops generation and releases every expert
        record it held. Raises SamplingError (bad sampling values), TokenizerError, and
        ColibriError when the prompt does not fit in the context.
        """
        params = SamplingParams(max_tokens=max_tokens, **{**self.generation_defaults, **sampling})
        t0 = time.perf_counter()
        ids = self.prompt_ids(prompt, template_kwargs)
        if len(ids) >= self.n_ctx:
            raise ColibriError(
                f"prompt too long: {len(ids)} tokens, context length {self.n_ctx} "
                "(set n_ctx / --ctx)"
            )
        tok = self.tokenizer
        eos = tok.eos_token_ids if tok is not None and not ignore_eos else frozenset()
        gen = Generation(self, ids, params, eos, t0)
        async with contextlib.aclosing(self.run_generation(gen)) as items:  # closed with this
            async for item in items:
                yield item

    def prompt_ids(
        self,
        prompt: str | Seq[Mapping[str, Any]] | Seq[int],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The token ids of a stream() prompt (a string, chat messages, or token ids, checked
        against the vocabulary). Raises ColibriError (empty, not ids, outside the vocabulary)
        and TokenizerError."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], Mapping)):
            ids = self.encode_prompt(prompt, **(template_kwargs or {}))  # type: ignore[arg-type]
        else:
            ids = list(prompt)
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
            if bad:
                raise ColibriError(
                    f"prompt: a list must hold token ids (integers) or messages, got {bad[0]!r}"
                )
            ids = [int(t) for t in ids]
        if not ids:
            raise ColibriError("empty prompt")
        vocab = self.spec.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ColibriError(
                f"token id {bad} is outside the model's vocabulary (vocab_size {vocab})"
            )
        return ids

    async def run_generation(self, gen: Generation) -> AsyncIterator[Token]:
        """Submit `gen` to the scheduler and yield its Token items until the last; leaving
        early cancels it (stream() and Session.stream())."""
        self.scheduler.submit(gen)
        try:
            while True:
                item = await gen.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            step = self.scheduler.cancel(gen)  # a no-op once it has finished
            if step is not None:  # it ran alone: its records are released when it ends
                await asyncio.wait({step})

    async def score(self, ids: Seq[int], logprobs: int = 0) -> list[Token]:
        """The log-probability of each token of `ids` given the ones before it (the raw
        model distribution: log-softmax of the logits, no sampling processors), as
        Token(text="", token_id, logprob, top_logprobs) for ids[1:]; top_logprobs: the
        `logprobs` most likely (id, logprob) alternatives, most likely first. The prompt is
        fed in the same chunks as a generation's prefill. Raises ColibriError when ids do
        not fit in the context or hold an id outside the vocabulary."""
        from colibri.sampling import log_softmax

        ids = [int(t) for t in ids]
        if len(ids) > self.n_ctx:
            raise ColibriError(f"{len(ids)} tokens exceed the context length {self.n_ctx}")
        vocab = self.spec.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise ColibriError(f"token ids must be in [0, {vocab})")
        seq = self.new_sequence()
        rows: list[np.ndarray] = []
        for start in range(0, len(ids) - 1, self.prefill_chunk):
            chunk = np.asarray(ids[start : start + self.prefill_chunk], dtype=np.int64)
            rows.append((await self.pipeline.forward_batch([(chunk, seq.kv)], [True]))[0])
        seq.kv = None  # type: ignore[assignment]
        out = []
        if not rows:
            return out
        logits = np.concatenate(rows)
        for t in range(1, len(ids)):
            lp = log_softmax(logits[t - 1])
            top: tuple[tuple[int, float], ...] = ()
            if logprobs:
                n = min(logprobs, lp.size)
                cand = np.argpartition(-lp, n - 1)[:n]
                best = cand[np.lexsort((cand, -lp[cand]))]  # by logprob, then lowest id
                top = tuple((int(i), float(lp[i])) for i in best)
            out.append(Token("", ids[t], float(lp[ids[t]]), top))
        return out

    async def generate(self, prompt: str | Seq[Mapping[str, Any]] | Seq[int], **kw: Any) -> str:
        """The whole completion as one string (same arguments as stream())."""
        return "".join([t.text async for t in self.stream(prompt, **kw)])

    # ---- sessions: conversations kept across turns and restarts (colibri/session.py) ----
    def new_session(self, messages: list[dict[str, Any]] | None = None) -> Any:
        """A Session: one conversation whose KV cache stays between turns (session.py)."""
        from colibri.session import Session

        return Session(self, self.new_sequence(), list(messages or []))

    def save_session(self, path: str | os.PathLike[str], session: Any) -> Path:
        """Write the session (tokens, KV cache, messages) to `path` atomically."""
        from colibri.session import save_session

        return save_session(self, session, path)

    def load_session(self, path: str | os.PathLike[str]) -> Any:
        """The Session saved at `path`, continuing exactly where it stopped. Raises
        SessionError for a session of another store or config, or a damaged file."""
        from colibri.session import load_session

        return load_session(self, path)

    def statistics(self, components: bool = True) -> EngineStatistics:
        """A snapshot of the engine's figures (EngineStatistics; never blocks).
        components=False leaves out the components' own records (cache, prefetch, reader,
        slab): the cache's record measures resident memory page by page, too slow to take
        on every request of a big pool."""
        c = self.cache.counts()
        if self.cluster is not None:
            c = {**c, **self.cluster.counts()}
        t = self.pipeline.times
        return EngineStatistics(
            expert_hits=c["hits"],
            expert_misses=c["misses"],
            bytes_read=c["bytes_read"],
            reads=c["reads"],
            evictions=c["evictions"],
            wait_io_seconds=t.wait_io,
            compute_seconds=t.compute,
            verify_seconds=c["verify_seconds"],
            forward_steps=t.steps,
            prompt_tokens=self._counts["prompt_tokens"],
            generated_tokens=self._counts["generated_tokens"],
            prefix_hits=self._counts["prefix_hits"],
            running=self._counts["running"],
            waiting=self._counts["waiting"],
            reads_in_flight=c["reads_in_flight"],
            leased=c["leased"],
            cache_used_nbytes=c["resident_entries"] * c["slot_nbytes"],
            cache_budget_nbytes=c["budget_nbytes"],
            prefix_nbytes=self.prefix_cache.nbytes if self.prefix_cache else 0,
            dense_nbytes=self.model.dense_nbytes,
            head_seconds=t.head,
            cache=self.cache.statistics() if components else None,
            prefetch=self.prefetcher.statistics() if components and self.prefetcher else None,
            reader=self.reader.statistics() if components else None,
            slab=self.pool.statistics() if components else None,
            cluster=self.cluster.statistics() if self.cluster is not None else None,
        )

    async def aclose(self) -> None:
        """Release the cache, the reader and the compute thread. Streams still running end
        with finish_reason "cancelled" after the current step. Calling it again waits for
        the first call to finish."""
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._aclose())
        await asyncio.shield(self._close_task)

    async def _aclose(self) -> None:
        self._closing = True
        await self.scheduler.aclose()
        try:
            if self.pipeline.tracer is not None:
                self.pipeline.tracer.save(self.options.trace)  # TraceError names the file
        finally:
            self.pipeline.close()
            try:
                if self.cluster is not None:
                    await self.cluster.aclose()
            finally:
                await self.io.aclose()
                self.io.close_pool()


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


_OPEN_SYNC_ENGINES: weakref.WeakSet[SyncEngine] = weakref.WeakSet()


@atexit.register
def _close_sync_engines() -> None:
    """At interpreter exit, close the SyncEngines a script left open (their loop thread is a
    daemon: without this its tasks would be destroyed pending, with a warning each)."""
    for engine in list(_OPEN_SYNC_ENGINES):
        with contextlib.suppress(Exception):
            engine.close()


class SyncEngine:
    """A blocking wrapper for scripts and notebooks: the engine runs on an event loop in a
    background thread, so this works even where a loop is already running (Jupyter).

        with colibri.SyncEngine("path/to/store") as engine:
            print(engine.generate("Hello", max_tokens=32))
            for token in engine.stream("Hello"):
                print(token.text, end="")

    Arguments and errors as open_engine() and Engine.stream(). An engine not closed (close(),
    or the with block) is closed at interpreter exit.
    """

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        # close() may come from another thread than a running stream(): the loop stays up
        # until the last stream has ended (with finish_reason "cancelled")
        self._lock = threading.Lock()
        self._streams = 0
        self._closing = self._closed = self._stopped = False
        self._cm = open_engine(path, **options)
        try:
            self.engine: Engine = self._call(self._cm.__aenter__())
        except BaseException:
            self._closing = self._closed = True
            self._release_loop()
            raise
        _OPEN_SYNC_ENGINES.add(self)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _check_open(self) -> None:
        if self._closing:
            raise ColibriError("the engine is closed")

    def generate(self, prompt: str | Seq[Mapping[str, Any]] | Seq[int], **kw: Any) -> str:
        """The whole completion as one string."""
        self._check_open()
        return self._call(self.engine.generate(prompt, **kw))

    def stream(self, prompt: str | Seq[Mapping[str, Any]] | Seq[int], **kw: Any) -> Iterator[Token]:
        """Token items as they are generated (see Engine.stream). A close() from another
        thread ends it with finish_reason "cancelled"."""
        with self._lock:
            self._check_open()
            self._streams += 1
        try:
            agen = self.engine.stream(prompt, **kw)
            try:
                while True:
                    try:
                        yield self._call(agen.__anext__())
                    except StopAsyncIteration:
                        return
            finally:
                self._call(agen.aclose())
        finally:
            with self._lock:
                self._streams -= 1
            self._release_loop()

    def statistics(self) -> EngineStatistics:
        return self.engine.statistics()

    def _release_loop(self) -> None:
        """Stop the loop thread once the engine is closed and no stream is left (once). A
        stream that ends while close() still runs on the loop leaves the stopping to close()."""
        with self._lock:
            if not self._closed or self._streams or self._stopped:
                return
            self._stopped = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join()
            self._loop.close()

    def close(self) -> None:
        """Close the engine; its thread ends once no stream() is running (idempotent)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        _OPEN_SYNC_ENGINES.discard(self)
        try:
            self._call(self._cm.__aexit__(None, None, None))
        finally:
            with self._lock:
                self._closed = True
            self._release_loop()

    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
