"""`colibri replay TRACE`: a routing trace's expert reads through the real reader and cache.

Online (default): for each token and layer, `cache.request` the layer's experts, `get` them,
optionally prefetch the next layer, hold the leases for `--compute-ms` (standing in for the
FFN kernels), release. Against `--store STORE`, or a synthetic experts file of random records
(`--record-nbytes`, checksummed) when no store is given. Reports hit rate, bytes read, GB/s,
tokens/s. `--prefetch oracle` predicts layer L+1 exactly (the ceiling of router-based
prediction), `repeat` predicts the experts the previous token used at L+1 (a cheap baseline);
a real router-based predictor lives in the engine.

Offline (`--offline`): simulates LRU, LFU, LFRU and Belady's MIN (evict the record whose next
use is farthest; optimal hit count for demand caching, Belady 1966) on the access sequence, no
IO, and reports each policy as a fraction of Belady. The experts of the layer being processed
are never evicted (they are leased in the engine), in every policy including Belady.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import os
import re
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import xxhash

from colibri.io.cache import POLICIES, ExpertCache, make_policy
from colibri.io.format import ExpertRecord
from colibri.io.stack import open_expert_cache
from colibri.io.trace import RoutingTrace, TraceError, load_mixtral_jsonl

Step = tuple[int, int, list[int]]  # (token, layer, experts)


class SyntheticStore:
    """A file of `num_layers x num_experts` random records of `record_nbytes` (4096-aligned),
    with the store interface the cache needs: experts_path, layout.record_nbytes, config,
    record(layer, expert) -> ExpertRecord (with XXH3-64). `create` writes it (temp + rename)."""

    def __init__(
        self,
        path: str,
        num_layers: int,
        num_experts: int,
        record_nbytes: int,
        checksums: np.ndarray,
        top_k: int = 2,
    ) -> None:
        self.experts_path = path
        self.layout = SimpleNamespace(record_nbytes=record_nbytes)
        self.config = {"num_experts_per_tok": top_k}
        self.num_layers, self.num_experts = num_layers, num_experts
        self._xxh3 = checksums

    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        num_layers: int,
        num_experts: int,
        record_nbytes: int,
        *,
        seed: int = 0,
        top_k: int = 2,
    ) -> SyntheticStore:
        path = os.fspath(path)
        if record_nbytes % 4096:
            raise ValueError(f"record_nbytes {record_nbytes} is not a multiple of 4096")
        rng = np.random.default_rng(seed)
        sums = np.zeros((num_layers, num_experts), np.uint64)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                for layer in range(num_layers):
                    for e in range(num_experts):
                        rec = rng.integers(0, 256, record_nbytes, dtype=np.uint8)
                        sums[layer, e] = xxhash.xxh3_64_intdigest(rec)
                        f.write(rec.data)
            os.replace(tmp, path)
        except BaseException:  # no space, Ctrl-C, SIGTERM (colibri.cli): leave nothing
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return cls(path, num_layers, num_experts, record_nbytes, sums, top_k)

    def record(self, layer: int, expert: int) -> ExpertRecord:
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise KeyError(f"no expert record for layer {layer}, expert {expert}")
        n = self.layout.record_nbytes
        offset = (layer * self.num_experts + expert) * n
        return ExpertRecord(layer, expert, offset, n, int(self._xxh3[layer, expert]))


# ---- offline ---------------------------------------------------------------------------
def simulate(
    steps: list[Step], capacity: int, policy: str, start: int = 0, lookahead: int = 0
) -> tuple[int, int]:
    """(hits, misses) of `policy` ("lru" | "lfu" | "lfru" | "nextuse" | "belady") with
    `capacity` records, the current layer's experts protected from eviction. Only
    steps[start:] are counted (the earlier ones warm the cache, as replay's warmup_tokens).

    lookahead: steps (one step = one layer of one token) of the exact future the policy is
    told: a resident record whose next use falls within the next `lookahead` steps is evicted
    only when every other candidate is one too (then the one used farthest away goes, as in
    Belady's MIN); the others are ranked by `policy`. 0 is the online policy itself; at least
    the trace's length, it is Belady's MIN. This measures how much of the future a policy
    would have to know to come within a fraction of the optimum (a router predicting the
    next layer knows 1 step)."""
    if policy == "belady":
        return _simulate_belady(steps, capacity, start)
    if lookahead < 0:
        raise ValueError(f"lookahead {lookahead} must be >= 0")
    nxt = _next_uses(steps) if lookahead else None
    pol = make_policy(policy, capacity)
    resident: dict = {}  # key -> the step of its next use (when lookahead is on)
    hits = misses = 0
    for i, (_, layer, experts) in enumerate(steps):
        now = {(layer, e) for e in experts}
        pol.visit(layer)  # as ExpertCache.request does
        for j, e in enumerate(experts):
            key = (layer, e)
            pol.access(key)
            if key in resident:
                hits += i >= start
            else:
                misses += i >= start
                if len(resident) >= capacity:
                    victim = _victim(pol, resident, now, i + lookahead if nxt else -1)
                    pol.remove(victim)
                    del resident[victim]
                pol.insert(key)
            resident[key] = nxt[i][j] if nxt else 0
    return hits, misses


def _next_uses(steps: list[Step]) -> list[list[int]]:
    """For each step and each of its experts, the index of the step using it next."""
    out: list[list[int]] = [[]] * len(steps)
    last: dict = {}
    for i in range(len(steps) - 1, -1, -1):
        _, layer, experts = steps[i]
        out[i] = [last.get((layer, e), 1 << 62) for e in experts]
        for e in experts:
            last[(layer, e)] = i
    return out


def _victim(pol: Any, resident: dict, now: set, horizon: int) -> Any:
    """The policy's victim among records not used within `horizon` (a step index; -1: no
    lookahead), else the known record used farthest away."""
    if horizon < 0:
        return pol.victim(lambda k: k in now)
    known = {k for k, n in resident.items() if n <= horizon}
    victim = pol.victim(lambda k: k in now or k in known)
    if victim is None:
        victim = max(known - now, key=resident.__getitem__)
    return victim


def _simulate_belady(steps: list[Step], capacity: int, start: int = 0) -> tuple[int, int]:
    seq = [((layer, e), i) for i, (_, layer, experts) in enumerate(steps) for e in experts]
    nxt = [0] * len(seq)
    last: dict = {}
    for j in range(len(seq) - 1, -1, -1):
        nxt[j] = last.get(seq[j][0], 1 << 62)
        last[seq[j][0]] = j
    resident: dict = {}  # key -> its next use
    heap: list = []  # (-next use, key), lazy
    hits = misses = 0
    for j, (key, step) in enumerate(seq):
        if key in resident:
            hits += step >= start
        else:
            misses += step >= start
            if len(resident) >= capacity:
                now = {(steps[step][1], e) for e in steps[step][2]}
                skipped = []
                while True:
                    neg, k = heapq.heappop(heap)
                    if resident.get(k) != -neg:
                        continue
                    if k in now:
                        skipped.append((neg, k))
                        continue
                    del resident[k]
                    break
                for item in skipped:
                    heapq.heappush(heap, item)
        resident[key] = nxt[j]
        heapq.heappush(heap, (-nxt[j], key))
    return hits, misses


def offline_report(
    steps: list[Step], capacities: list[int], policies: tuple[str, ...] = POLICIES
) -> list[dict[str, Any]]:
    """Per capacity: hit rate of each policy and of Belady, and each as a fraction of Belady."""
    rows = []
    for cap in capacities:
        bh, bm = simulate(steps, cap, "belady")
        row: dict[str, Any] = {"capacity": cap, "belady": bh / (bh + bm)}
        for p in policies:
            h, m = simulate(steps, cap, p)
            row[p] = h / (h + m)
            row[f"{p}/belady"] = (h / bh) if bh else 1.0
        rows.append(row)
    return rows


def lookahead_report(
    steps: list[Step], capacities: list[int], lookaheads: list[int], policy: str = "nextuse"
) -> list[dict[str, Any]]:
    """Per capacity: Belady's hit rate and `policy`'s fraction of it when told the exact
    future `lookahead` steps ahead, for each lookahead (see simulate). Keys: capacity,
    belady, and "lookahead=N" -> fraction of Belady's hits."""
    rows = []
    for cap in capacities:
        bh, bm = simulate(steps, cap, "belady")
        row: dict[str, Any] = {"capacity": cap, "belady": bh / (bh + bm)}
        for n in lookaheads:
            h, _ = simulate(steps, cap, policy, lookahead=n)
            row[f"lookahead={n}"] = h / bh if bh else 1.0
        rows.append(row)
    return rows


# ---- online ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ReplayResult:
    tokens: int
    seconds: float
    tokens_per_second: float
    hit_rate: float
    bytes_read: int
    gb_per_second: float
    cache: Any
    reader: Any
    prefetch: Any
    pool: Any


async def replay(
    trace: RoutingTrace,
    store: Any,
    *,
    budget_nbytes: int,
    policy: str = "lru",
    io: str = "auto",
    prefetch: str = "none",
    compute_ms: float = 0.0,
    queue_depth: int = 32,
    verify: bool | str = "once",
    max_tokens: int | None = None,
    warmup_tokens: int = 0,
) -> ReplayResult:
    """Replay `trace` through a real reader + ExpertCache over `store` (see module docstring).
    prefetch: "none" | "oracle" | "repeat". warmup_tokens: the first tokens (of max_tokens)
    fill the cache untimed and uncounted: tokens, seconds, hit_rate and bytes_read cover the
    rest (the `cache` / `prefetch` statistics stay cumulative). Returns a ReplayResult."""
    nbytes = int(store.layout.record_nbytes)
    num_slots = ExpertCache.slots_for_budget(budget_nbytes, nbytes)
    if num_slots < trace.top_k:
        raise ValueError(
            f"budget {budget_nbytes} bytes holds {num_slots} records of {nbytes} "
            f"bytes; the minimum is top-k = {trace.top_k} records "
            f"({trace.top_k * ((nbytes + 4095) // 4096 * 4096)} bytes)"
        )
    stack = open_expert_cache(
        store, budget_nbytes, io=io, policy=policy, queue_depth=queue_depth, verify=verify,
        prefetch=prefetch != "none", min_slots=trace.top_k,
    )  # fmt: skip
    pool, reader, cache, pf = stack.pool, stack.reader, stack.cache, stack.prefetcher
    ex = trace.experts
    num_tokens = trace.num_tokens if max_tokens is None else min(max_tokens, trace.num_tokens)
    if not 0 <= warmup_tokens < num_tokens:
        raise ValueError(f"warmup_tokens {warmup_tokens} must be in [0, {num_tokens})")
    t0, base = time.perf_counter(), None
    try:
        for t in range(num_tokens):
            if t == warmup_tokens and warmup_tokens:
                t0, base = time.perf_counter(), cache.statistics()
            if pf is not None:
                pf.new_token()
            for layer in range(trace.num_layers):
                experts = [int(e) for e in ex[t, layer] if e >= 0]
                if not experts:
                    continue
                cache.request(layer, experts)
                if pf is not None and layer + 1 < trace.num_layers:
                    src = t if prefetch == "oracle" else t - 1
                    if src >= 0:
                        pf.predict(layer + 1, [int(e) for e in ex[src, layer + 1] if e >= 0])
                leases = [await cache.get(layer, e) for e in experts]
                if compute_ms:
                    await asyncio.sleep(compute_ms / 1000)
                for lease in leases:
                    lease.release()
        seconds = time.perf_counter() - t0
        cstats = cache.statistics()
    finally:
        await stack.aclose()
    hits, misses, nread = cstats.hits, cstats.misses, cstats.bytes_read
    if base is not None:
        hits, misses, nread = hits - base.hits, misses - base.misses, nread - base.bytes_read
    measured = num_tokens - warmup_tokens
    result = ReplayResult(
        measured,
        seconds,
        measured / seconds,
        hits / (hits + misses) if hits + misses else 1.0,
        nread,
        nread / seconds / 1e9,
        cstats,
        reader.statistics(),
        pf.statistics() if pf else None,
        pool.statistics(),
    )
    stack.close_pool()
    return result


# ---- CLI -------------------------------------------------------------------------------
def parse_nbytes(text: str) -> int:
    """'512M', '4GiB', '1.5G', '1048576' -> bytes (K/M/G/T are powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 512M, 4G)")
    scale = 1024 ** " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * scale)


def check_trace_fits(trace: RoutingTrace, steps: list[Step], store: Any, where: str) -> None:
    """TraceError unless every (layer, expert) the trace reads has a record in `store`."""
    have = set(store.moe_layers)
    bad_layers = sorted({layer for _, layer, _ in steps} - have)
    if bad_layers:
        raise TraceError(
            f"{where}: the trace routes layers {bad_layers[:5]}, which have no experts in "
            f"{store.path}"
        )
    top = max(e for _, _, ex in steps for e in ex)
    if top >= store.num_experts:
        raise TraceError(
            f"{where}: the trace uses expert {top} (of {trace.num_experts}), {store.path} has "
            f"{store.num_experts} experts per layer"
        )


def load_trace(path: str) -> RoutingTrace:
    return load_mixtral_jsonl(path) if path.endswith(".jsonl") else RoutingTrace.load(path)


def configure_parser(p: argparse.ArgumentParser) -> None:
    from colibri.options import queue_depth

    p.add_argument("trace", help="routing trace: colibri .npz or the Mixtral JSONL")
    p.add_argument("--store", help="model store (default: a synthetic file of records)")
    p.add_argument(
        "--record-nbytes",
        type=parse_nbytes,
        default=parse_nbytes("1M"),
        help="synthetic record size (default 1M; Mixtral-8x7B q4_0 is ~44M)",
    )
    p.add_argument(
        "--synthetic-dir",
        default="/tmp",
        help="where the synthetic experts file goes (a disk, not tmpfs)",
    )
    p.add_argument("--budget", type=parse_nbytes, help="cache budget in bytes (e.g. 2G)")
    p.add_argument("--budget-records", type=int, help="cache budget in records")
    p.add_argument("--policy", choices=POLICIES, default="nextuse")
    p.add_argument("--prefetch", choices=("none", "oracle", "repeat"), default="none")
    p.add_argument("--io", choices=("auto", "uring", "threads", "mmap"), default="auto")
    p.add_argument("--queue-depth", type=queue_depth, default=32)
    p.add_argument("--compute-ms", type=float, default=0.0, help="simulated compute per layer")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip record checksums (default: each record checked on its first read)",
    )
    p.add_argument("--max-tokens", type=int)
    p.add_argument(
        "--offline",
        action="store_true",
        help="simulate lru/lfu/lfru/nextuse/belady without IO (budgets: --budget-records, "
        "or 1/16, 1/8, 1/4, 1/2 of all records)",
    )


def run_cli(args: argparse.Namespace) -> int:
    for name in ("record_nbytes", "budget", "budget_records", "max_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value}: must be at least 1")
    trace = load_trace(args.trace)
    steps = list(trace.steps())
    if args.max_tokens:
        steps = [s for s in steps if s[0] < args.max_tokens]
    if not steps:
        raise TraceError(f"{args.trace}: no routing steps to replay (the trace is empty)")
    total = len({(layer, e) for _, layer, ex in steps for e in ex})
    print(
        f"trace: {trace.num_tokens} tokens, {trace.num_layers} layers, top-{trace.top_k} of "
        f"{trace.num_experts}; {total} distinct records, {sum(len(s[2]) for s in steps)} reads"
    )
    if args.offline:
        caps = (
            [args.budget_records]
            if args.budget_records
            else [max(trace.top_k, total * f // 16) for f in (1, 2, 4, 8)]
        )
        print(f"{'records':>8} {'belady':>7} " + " ".join(f"{p:>7} {'/MIN':>5}" for p in POLICIES))
        for row in offline_report(steps, caps):
            print(
                f"{row['capacity']:>8} {row['belady']:>7.3f} "
                + " ".join(f"{row[p]:>7.3f} {row[p + '/belady']:>5.2f}" for p in POLICIES)
            )
        return 0
    if args.store:
        from colibri.io.format import open_store

        store, tmp = open_store(args.store), None
        check_trace_fits(trace, steps, store, args.trace)
    else:
        tmp = os.path.join(args.synthetic_dir, f"colibri-replay-{os.getpid()}.bin")
    try:
        if tmp:
            store = SyntheticStore.create(
                tmp, trace.num_layers, trace.num_experts, args.record_nbytes, top_k=trace.top_k
            )
        nbytes = (int(store.layout.record_nbytes) + 4095) // 4096 * 4096
        budget = args.budget or nbytes * (args.budget_records or max(trace.top_k, total // 4))
        r = asyncio.run(
            replay(
                trace,
                store,
                budget_nbytes=budget,
                policy=args.policy,
                io=args.io,
                prefetch=args.prefetch,
                compute_ms=args.compute_ms,
                queue_depth=args.queue_depth,
                verify=False if args.no_verify else "once",
                max_tokens=args.max_tokens,
            )
        )
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
    c = r.cache
    print(f"io: {r.reader.backend} ({r.reader.reason}); slab: {r.pool.backing}")
    print(
        f"cache: {args.policy}, {c.num_slots} slots of {c.slot_nbytes} bytes "
        f"(budget {budget} bytes, resident {c.resident_nbytes})"
    )
    print(
        f"hit rate {r.hit_rate:.3f} ({c.hits} hits, {c.misses} misses), {c.evictions} "
        f"evictions, {r.bytes_read / 1e9:.3f} GB read, {r.gb_per_second:.2f} GB/s, "
        f"{r.tokens_per_second:.1f} tokens/s over {r.tokens} tokens ({r.seconds:.2f} s)"
    )
    if r.prefetch is not None:
        p = r.prefetch
        print(
            f"prefetch {args.prefetch}: predicted {p.predicted}, issued {p.issued}, recall "
            f"{p.recall:.2f}, precision {p.precision:.2f}, useful reads {p.useful_reads}, "
            f"wasted {p.wasted_reads}, back-offs {p.backoffs}"
        )
    return 0
