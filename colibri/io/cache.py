"""ExpertCache: (layer, expert) -> a slab slot holding that expert's record, under a byte budget.

    cache = ExpertCache(store, reader, budget_nbytes, policy="nextuse", pinned=hot_keys)
    cache.request(layer, experts)          # start a layer's misses together (never waits)
    lease = await cache.get(layer, expert)  # hit, or await the read
    with lease: kernel(lease.buffer)       # uint8 [record nbytes], valid until released
    cache.statistics(); await cache.aclose()

Memory: the cache owns `reader.pool` (a SlabPool) whose slots are its whole footprint; the
pool's size is checked against `budget_nbytes` when the cache is built and its resident bytes
are measured (smaps) in `statistics()`. Entries: LOADING (a read in flight, owning a slot) or
READY. A slot is reused only when its entry is READY, unleased (no `get` waiting or holding
it, no pending `request`) and not pinned, so a slot is never handed out under a live read or a
kernel computing on it. Concurrent gets of one missing expert share one read (per-key future).
When every slot is leased or loading, a demand miss waits (FIFO) for a release — it never
overruns the budget. Cancelling a `get` never cancels the shared read: the record lands and
stays cached.

Policies (victim = least valuable evictable entry; lookup is a dict, O(1)):
  nextuse (default) — the record whose next use is estimated farthest: layer distance in the
         cycle over layers plus the expected extra cycles, from a short- and a long-halflife
         routing frequency (NextUsePolicy). Fraction of Belady's hits at half the records:
         0.78 on the real Mixtral-8x7B trace (lfru 0.74, lru 0.70), 0.94 on the demo model's
         (lfru 0.95), 0.98 on the synthetic OLMoE store's (lru 0.98); best of the four at every
         budget 1/16..3/4 on the Mixtral trace, not on requests with disjoint experts run one
         after another, where LRU wins at 1/8 and 1/4 (README, Benchmarks, "Cache policy").
  lru  — least recently used (OrderedDict; O(1) eviction).
  lfu  — fewest demand accesses since the cache was built, counts kept across evictions
         ("perfect LFU": expert popularity is stable per model), ties by recency.
  lfru — decaying frequency: score = sum over past accesses of 2^((t_i - t) / halflife),
         t counted in accesses; halflife defaults to 16 x num_slots (best of 64..16384 on the
         real Mixtral trace, within 0.02 of the best at every budget). Kept in log2 domain.
  lfu/lfru evict in O(log n) through a heap with lazy deletion. Leased entries met while
  searching are skipped; they are few (top-k plus reads in flight).
Pinned experts (a hot set, e.g. `hot_set(load_usage(store.path / "usage.json"), n)`) share
the same budget and are never evicted once loaded.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import heapq
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import xxhash

from colibri.errors import StoreError
from colibri.io.config import text_view
from colibri.io.format import ExpertRecord
from colibri.io.reader import DEMAND, PREFETCH, Reader

Key = tuple[int, int]  # (layer, expert)
POLICIES = ("lru", "lfu", "lfru", "nextuse")


# ---- policies (shared with the offline simulator in colibri.io.replay) ----------------------
class LRUPolicy:
    """Least recently used. access/insert/remove/victim are O(1)."""

    def __init__(self) -> None:
        self._order: collections.OrderedDict[Hashable, None] = collections.OrderedDict()

    def visit(self, layer: Hashable) -> None:
        """Layer `layer` is being processed (only nextuse uses this)."""

    def access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def insert(self, key: Hashable) -> None:
        self._order[key] = None

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, skip: Callable[[Hashable], bool] | None = None) -> Hashable | None:
        for key in self._order:
            if skip is None or not skip(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


class _HeapPolicy:
    """Evict the resident key of lowest score (ties: least recent). Heap with lazy deletion."""

    def __init__(self) -> None:
        self._score: dict[Hashable, float] = {}  # every key ever accessed
        self._resident: dict[Hashable, tuple[float, int]] = {}  # key -> its live heap entry
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = itertools.count()

    def _bump(self, key: Hashable) -> float:
        raise NotImplementedError

    def visit(self, layer: Hashable) -> None:
        """Layer `layer` is being processed (only nextuse uses this)."""

    def _push(self, key: Hashable) -> None:
        item = (self._score.get(key, -math.inf), next(self._seq))
        self._resident[key] = item
        heapq.heappush(self._heap, (*item, key))
        if len(self._heap) > 4 * len(self._resident) + 64:  # drop stale entries
            self._heap = [(*v, k) for k, v in self._resident.items()]
            heapq.heapify(self._heap)

    def access(self, key: Hashable) -> None:
        self._score[key] = self._bump(key)
        if key in self._resident:
            self._push(key)

    def insert(self, key: Hashable) -> None:
        self._push(key)

    def remove(self, key: Hashable) -> None:
        self._resident.pop(key, None)

    def victim(self, skip: Callable[[Hashable], bool] | None = None) -> Hashable | None:
        skipped, found = [], None
        while self._heap:
            score, seq, key = self._heap[0]
            if self._resident.get(key) != (score, seq):
                heapq.heappop(self._heap)  # stale
            elif skip is not None and skip(key):
                skipped.append(heapq.heappop(self._heap))
            else:
                found = key
                break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found

    def __len__(self) -> int:
        return len(self._resident)


class LFUPolicy(_HeapPolicy):
    """Least frequently used, counts kept across evictions, ties by least recent."""

    def _bump(self, key: Hashable) -> float:
        return self._score.get(key, 0.0) + 1.0


class LFRUPolicy(_HeapPolicy):
    """Decaying frequency: score(t) = sum_i 2^((t_i - t)/halflife); stored as log2 of
    sum_i 2^(t_i/halflife), so comparisons need no rescaling and nothing overflows."""

    def __init__(self, halflife: float) -> None:
        super().__init__()
        self.halflife = float(halflife)
        self._t = 0

    def _bump(self, key: Hashable) -> float:
        self._t += 1
        a, b = self._score.get(key, -math.inf), self._t / self.halflife
        return b + math.log2(1.0 + 2.0 ** (a - b))  # log2(2^a + 2^b), a < b


class NextUsePolicy:
    """Evict the record whose next use is estimated farthest away (Belady's MIN with the
    future estimated). MoE access walks the layers in a cycle, so record (l, e) is next
    wanted at the next visit of layer l, d(l) layer visits from now (1 for the next layer,
    the number of layers seen for the current one), with probability p(l, e); if it is not
    wanted then, the wait is a whole cycle more (geometric), so the expected distance is
    d(l) + n_layers (1 - p) / p.

    p(l, e) = w s_short + (1 - w) s_long, s_h = e's share of layer l's visits with weights
    decaying by halflife h visits of l: the short one (`halflife`, default 0.5) is routing's
    token-to-token reuse (what LRU catches), the long one (`long_halflife`, 16) each expert's
    popularity (what LFU catches); w = `weight` (0.5). Measured on the real Mixtral-8x7B
    trace and on colibri's own traces (README, Benchmarks, "Cache policy").

    Layer l's clock is its own visit count, so the order of p within a layer changes only
    when l is visited or its residents change: each layer's least likely resident is kept
    and rescanned lazily; a victim compares one candidate per layer (O(layers)).
    visit(layer) tells it the layer being processed before its reads are started."""

    def __init__(
        self, halflife: float = 0.5, long_halflife: float = 16.0, weight: float = 0.5
    ) -> None:
        self.halflife, self.long_halflife, self.weight = halflife, long_halflife, weight
        self._h = (float(halflife), float(long_halflife))
        self._r = tuple(2.0 ** (-1.0 / h) for h in self._h)
        self._layers: list[Hashable] = []  # MoE layers seen, in order
        self._pos: dict[Hashable, int] = {}
        self._visits: dict[Hashable, int] = {}
        self._cur: Hashable | None = None
        # key -> (log2 sum_i 2^(v_i / h) for both halflives), v_i: the visit of each use
        self._score: dict[Hashable, tuple[float, float]] = {}
        self._resident: dict[Hashable, set[Hashable]] = {}  # layer -> its resident keys
        self._n = 0
        self._last: dict[Hashable, int] = {}  # key -> its last access (ties: least recent)
        self._clock = itertools.count()
        # layer -> (p, last access, key) of its least likely resident; None: rescan
        self._least: dict[Hashable, tuple[float, int, Hashable] | None] = {}

    def visit(self, layer: Hashable) -> None:
        """Layer `layer` is being processed (a new visit of it)."""
        self._cur = layer
        if layer not in self._pos:
            bisect.insort(self._layers, layer)
            self._pos = {x: i for i, x in enumerate(self._layers)}
        self._visits[layer] = self._visits.get(layer, 0) + 1
        self._least[layer] = None  # the clock moved: rescan

    def access(self, key: Hashable) -> None:
        layer = key[0]  # type: ignore[index]
        if layer != self._cur:  # a caller that does not call visit
            self.visit(layer)
        v = self._visits[layer]
        old = self._score.get(key, (-math.inf, -math.inf))
        self._score[key] = tuple(  # type: ignore[assignment]
            b + math.log2(1.0 + 2.0 ** (a - b))  # log2(2^a + 2^b), a < b
            for a, b in zip(old, (v / h for h in self._h), strict=True)
        )
        self._last[key] = next(self._clock)
        self._least[layer] = None

    def _p(self, key: Hashable, v: int) -> float:
        """The probability that key is used at its layer's next visit (v: visits so far)."""
        score = self._score.get(key)
        if score is None or v == 0:
            return 0.0
        p = 0.0
        for a, h, r, w in zip(score, self._h, self._r, (self.weight, 1 - self.weight), strict=True):
            p += w * 2.0 ** (a - v / h) * (1.0 - r) / (1.0 - r**v)
        return p

    def insert(self, key: Hashable) -> None:
        layer = key[0]  # type: ignore[index]
        keys = self._resident.setdefault(layer, set())
        if key in keys:
            return
        keys.add(key)
        self._n += 1
        least = self._least.get(layer)
        if least is not None:
            item = (self._p(key, self._visits.get(layer, 0)), self._last.get(key, -1), key)
            if item[:2] < least[:2]:
                self._least[layer] = item

    def remove(self, key: Hashable) -> None:
        layer = key[0]  # type: ignore[index]
        keys = self._resident.get(layer)
        if keys is None or key not in keys:
            return
        keys.discard(key)
        self._n -= 1
        least = self._least.get(layer)
        if least is not None and least[2] == key:
            self._least[layer] = None

    def _scan(
        self, layer: Hashable, skip: Callable[[Hashable], bool] | None
    ) -> tuple[float, int, Hashable] | None:
        v = self._visits.get(layer, 0)
        found = None
        for key in self._resident[layer]:
            if skip is not None and skip(key):
                continue
            item = (self._p(key, v), self._last.get(key, -1), key)
            if found is None or item[:2] < found[:2]:
                found = item
        return found

    def victim(self, skip: Callable[[Hashable], bool] | None = None) -> Hashable | None:
        n = len(self._layers)
        cur = self._pos.get(self._cur, 0)
        best, far = None, (-1.0, 0)
        for layer, keys in self._resident.items():
            if not keys:
                continue
            least = self._least.get(layer)
            if least is None:
                least = self._least[layer] = self._scan(layer, None)
            if least is not None and skip is not None and skip(least[2]):
                least = self._scan(layer, skip)  # its least likely is held: the next one
            if least is None:
                continue
            p = max(least[0], 1e-12)
            d = (self._pos[layer] - cur) % n or n if layer in self._pos else n
            dist = (d + n * (1.0 - p) / p, -least[1])  # ties: the least recently used
            if dist > far:
                best, far = least[2], dist
        return best

    def __len__(self) -> int:
        return self._n


def make_policy(name: str, num_slots: int, halflife: float | None = None) -> Any:
    """A policy object by name ("lru", "lfu", "lfru", "nextuse"); ValueError for another
    name. halflife: LFRU's in accesses (default 16 x num_slots), nextuse's short one in
    visits of a layer (default 0.5)."""
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUPolicy()
    if name == "lfru":
        return LFRUPolicy(halflife or 16 * num_slots)
    if name == "nextuse":
        return NextUsePolicy(halflife or 0.5)
    raise ValueError(f"unknown cache policy {name!r} (choose from {', '.join(POLICIES)})")


# ---- usage counts (the hot set) --------------------------------------------------------------
def load_usage(path: str | os.PathLike) -> dict[Key, int]:
    """Per-expert demand counts from usage.json ({"counts": [[layer, expert, n], ...]});
    {} when the file does not exist. Raises StoreError when it is malformed."""
    try:
        with open(path) as f:
            data = json.load(f)
        return {(int(a), int(b)): int(n) for a, b, n in data["counts"]}
    except FileNotFoundError:
        return {}
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"{path}: malformed usage counts ({exc})") from None


def save_usage(path: str | os.PathLike, counts: dict[Key, int]) -> None:
    """Write usage.json atomically (temp file + rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"counts": [[a, b, n] for (a, b), n in sorted(counts.items())]}, f)
    os.replace(tmp, path)


def hot_set(counts: dict[Key, int], num: int) -> list[Key]:
    """The `num` most used (layer, expert) keys (ties broken by key)."""
    return [k for k, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:num]]


# ---- the cache ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CacheStatistics:
    """hits/misses count `get` calls (a get that finds a read in flight is a miss; if that
    read was a prefetch it also counts in prefetch_late). bytes_read: bytes loaded into slots.
    resident_nbytes: the slab mapping's resident bytes, measured (smaps). slot_waits: demand
    misses that had to wait for a slot to be released. verify_seconds: time spent hashing."""

    policy: str
    budget_nbytes: int
    num_slots: int
    slot_nbytes: int
    hits: int
    misses: int
    hit_rate: float
    bytes_read: int
    reads: int
    reads_in_flight: int
    resident_entries: int
    resident_nbytes: int
    pinned: int
    evictions: int
    slot_waits: int
    prefetch_issued: int
    prefetch_dropped: int
    prefetch_useful: int
    prefetch_late: int
    prefetch_wasted: int
    verify_seconds: float
    leased: int = 0  # entries held by a get's lease or an unconsumed request


class _Entry:
    __slots__ = (
        "demanded",
        "fresh",
        "fut",
        "key",
        "pending",
        "prefetched",
        "ready",
        "record",
        "refs",
        "slot",
        "task",
    )

    def __init__(self, key: Key, record: ExpertRecord, fut: asyncio.Future) -> None:
        self.key, self.record, self.fut = key, record, fut
        self.slot = -1
        self.ready = False
        self.refs = 0  # gets waiting/holding + requests not yet consumed
        self.pending = 0  # requests not yet consumed by a get
        self.prefetched = False
        self.demanded = False
        self.fresh = False  # started by a demand miss no get has counted yet
        self.task: asyncio.Task | None = None


class Lease:
    """A held cache entry: `buffer` (numpy uint8 [record nbytes]) stays valid and unchanged
    until `release()` (or the end of `with lease:`). Releasing twice raises RuntimeError."""

    __slots__ = ("_cache", "_entry", "buffer")

    def __init__(self, cache: ExpertCache, entry: _Entry) -> None:
        self._cache, self._entry = cache, entry
        self.buffer = cache.pool.view(entry.slot)[: entry.record.nbytes]

    @property
    def key(self) -> Key:
        return self._entry.key

    @property
    def record(self) -> ExpertRecord:
        return self._entry.record

    def release(self) -> None:
        if self._entry is None:
            raise RuntimeError("lease released twice")
        entry, self._entry = self._entry, None
        self.buffer = None
        self._cache._unref(entry)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


async def _off_loop(fn: Any, *args: Any) -> Any:
    """fn(*args) in the loop's default executor, so the event loop keeps reaping completions
    (a 94 MiB Mixtral record hashes in ~10 ms); see run_to_completion."""
    return await run_to_completion(None, fn, *args)


async def run_to_completion(executor: Any, fn: Any, *args: Any) -> Any:
    """fn(*args) in `executor` (None: the loop's default), awaited. If the caller is
    cancelled, fn still runs to its end before the cancellation propagates (CancelledError
    re-raised after it): what it reads (a slab slot) must not be freed under it. Returns
    fn's result; raises what fn raises."""
    fut = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                continue
            except Exception:
                break
        raise


class ExpertCache:
    """Expert records cached in `reader.pool`'s slots under a byte budget (module docstring).

    Args:
        store: has `record(layer, expert) -> ExpertRecord` and `layout.record_nbytes`;
            optionally `verify_record(record, buffer)` (else XXH3-64 against record.xxh3),
            `experts_path` and `config["num_experts_per_tok"]`.
        reader: an open Reader; its pool must hold slots of >= record_nbytes, and
            pool.mapping bytes <= budget_nbytes.
        budget_nbytes: bytes of RAM the cache may use (slots it owns).
        policy: "lru" | "lfu" | "lfru"; lfru_halflife: in accesses (default 16 x num_slots).
        pinned: (layer, expert) keys never evicted once loaded (share the budget).
        verify: check freshly read records' XXH3-64 (StoreError on mismatch): "once"
            (default) checks each record the first time this cache reads it, True every read,
            False never. Hashing a record costs a pass over memory (measured here: ~30 GB/s
            on a 1 MB record, 3-5 GB/s on a 44 MB one, i.e. up to half of the record's read
            time at 1.5 GB/s), so re-reads after eviction are not re-checked by default.
        min_slots: slots that must remain for unpinned traffic: one layer's top-k
            (default config["num_experts_per_tok"], else 2).
    Raises: ValueError when the budget (pool) is smaller than min_slots + pinned records,
        naming the minimum in bytes.
    """

    def __init__(
        self,
        store: Any,
        reader: Reader,
        budget_nbytes: int,
        *,
        policy: str = "nextuse",
        pinned: Iterable[Key] = (),
        verify: bool | str = "once",
        min_slots: int | None = None,
        lfru_halflife: float | None = None,
    ) -> None:
        self.store, self.reader, self.pool = store, reader, reader.pool
        self.record_nbytes = int(store.layout.record_nbytes)
        self.budget_nbytes = int(budget_nbytes)
        self.policy_name = policy
        if verify not in (True, False, "once"):
            raise ValueError(f"verify must be True, False or 'once', got {verify!r}")
        self.verify = verify
        self._verified: set[Key] = set()
        self.pinned = frozenset(pinned)
        if min_slots is None:
            config = getattr(store, "config", None) or {}
            top_k = config.get("num_experts_per_tok") or text_view(config).get("top_k_experts")
            min_slots = int(top_k or 2)  # Gemma 4 spells it top_k_experts
        need = min_slots + len(self.pinned)
        where = getattr(store, "experts_path", "the store")
        if self.pool.slot_nbytes < self.record_nbytes:
            raise ValueError(
                f"{where}: slab slots of {self.pool.slot_nbytes} bytes are smaller "
                f"than a record ({self.record_nbytes} bytes)"
            )
        min_budget = need * self.pool.slot_nbytes
        if self.budget_nbytes < min_budget or self.pool.num_slots < need:
            raise ValueError(
                f"{where}: cache budget {self.budget_nbytes} bytes holds "
                f"{self.budget_nbytes // self.pool.slot_nbytes} records of "
                f"{self.pool.slot_nbytes} bytes; at least {need} are needed ({min_slots} for one "
                f"layer's top-k + {len(self.pinned)} pinned): minimum budget {min_budget} bytes"
            )
        mapped = len(self.pool._mm)
        if mapped > self.budget_nbytes:
            raise ValueError(
                f"{where}: slab pool maps {mapped} bytes, over the cache budget "
                f"of {self.budget_nbytes} bytes (use slots_for_budget)"
            )
        self._policy = make_policy(policy, self.pool.num_slots, lfru_halflife)
        self._entries: dict[Key, _Entry] = {}
        self._slot_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._deferred: dict[Key, None] = {}  # prefetches waiting for a slot, in order
        # prefetch reads in flight at most: a slot being read cannot be evicted, so a wrong
        # guess in flight would make the next demand miss wait for it; one layer's top-k
        # (min_slots) stays out of the prefetches' reach
        self._prefetch_slots = self.pool.num_slots - len(self.pinned) - min_slots
        self._prefetch_in_flight = 0
        self._prefetching: dict[Key, _Entry] = {}  # prefetch loads not done, by key
        self.usage: collections.Counter[Key] = collections.Counter()
        self.observer: Any = None  # the Prefetcher, told of demand accesses and waste
        # transform(record, bytes): the owner's rewrite of each freshly read (and verified)
        # record in its slot before anyone gets it, off the event loop (the engine's: the
        # model's decode layout of resident experts, Model.x16_record); io/ computes nothing
        self.transform: Callable[[ExpertRecord, Any], None] | None = None
        self._n = collections.Counter()
        self._verify_seconds = 0.0
        self._closed = False

    @staticmethod
    def slots_for_budget(budget_nbytes: int, record_nbytes: int) -> int:
        """How many 4096-aligned slots of `record_nbytes` fit in `budget_nbytes`."""
        slot = (record_nbytes + 4095) // 4096 * 4096
        return budget_nbytes // slot

    # -- demand --------------------------------------------------------------------------
    def request(self, layer: int, experts: Iterable[int]) -> None:
        """Start the reads of a layer's experts now (one io_uring submit for the batch); never
        waits. Each requested expert is reserved until a `get` of it (or `unrequest`)."""
        self._policy.visit(layer)
        keys = [(layer, int(expert)) for expert in experts]
        if self._deferred:  # guesses for this layer: demanded now, or wrong
            self._deferred = {k: None for k in self._deferred if k[0] != layer}
        self._cancel_wrong_guesses(layer, set(keys))
        # first reserve what is cached or in flight, so a miss's slot (taken at once, below)
        # never evicts a record this same request wants
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                entry.refs += 1
                entry.pending += 1
        for key in keys:
            if key not in self._entries:
                entry = self._entry_for(key, DEMAND)
                entry.refs += 1
                entry.pending += 1

    def _cancel_wrong_guesses(self, layer: int, wanted: set[Key]) -> None:
        """Cancel the prefetch reads of `layer` that its request does not want and nobody
        waits for: one still queued behind demand reads (reader.py) frees its slot now, one in
        flight when its read ends (instead of staying until evicted as a READY record that
        only a demand may evict). O(prefetch loads not done)."""
        for entry in list(self._prefetching.values()):
            if (
                entry.key[0] == layer
                and entry.prefetched
                and not entry.ready
                and entry.refs == 0
                and entry.task
                and entry.key not in wanted
            ):
                entry.task.cancel()
                self._n["prefetch_cancelled"] += 1

    def unrequest(self, layer: int, experts: Iterable[int]) -> None:
        """Drop reservations made by `request` that will not be consumed by a `get`."""
        for expert in experts:
            entry = self._entries.get((layer, int(expert)))
            if entry is not None and entry.pending:
                entry.pending -= 1
                self._unref(entry)

    def count_hits(self, keys: list[Key]) -> None:
        """Count gets of `keys` that a caller served itself from leases it holds for good
        (Pipeline.resident: every record held, a pass in one trip): hits in the statistics
        and in the usage counts, as `get` would count them. The policy is not told: nothing
        is evicted while everything is held."""
        self._n["hits"] += len(keys)
        self.usage.update(keys)

    async def get(self, layer: int, expert: int) -> Lease:
        """The record of (layer, expert), reading it on a miss.

        Returns a Lease (buffer valid until released). Raises ReadError / StoreError (bad
        checksum) from the read, in every task waiting on it; the entry is then dropped and a
        later get retries. Cancellation: the shared read goes on; nothing leaks.
        """
        key = (layer, int(expert))
        self.usage[key] += 1
        self._policy.access(key)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entry_for(key, DEMAND)
        if entry.pending:
            entry.pending -= 1  # a request's reservation becomes our reference
        else:
            entry.refs += 1
        if entry.fresh:  # this demand started the read (here or in `request`)
            entry.fresh = False
            self._n["misses"] += 1
        elif entry.ready:
            self._n["hits"] += 1
        else:
            self._n["misses"] += 1
            self._n["prefetch_late"] += entry.prefetched and not entry.demanded
        first = not entry.demanded
        entry.demanded = True
        if first and entry.prefetched:
            self._n["prefetch_useful"] += 1
        if self.observer is not None:
            self.observer.on_demand(key, entry.prefetched and first)
        while not entry.ready:
            try:
                await asyncio.shield(entry.fut)
            except asyncio.CancelledError:
                self._unref(entry)
                if asyncio.current_task().cancelling():
                    raise
                # not us: a prefetch read was cancelled just as we joined it; read again
                entry = self._entry_for(key, DEMAND)
                entry.refs += 1
                entry.demanded = True
            except BaseException:
                self._unref(entry)
                raise
        return Lease(self, entry)

    def _entry_for(self, key: Key, priority: int) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            if self._closed:
                raise RuntimeError("ExpertCache is closed")
            entry = _Entry(key, self.store.record(*key), asyncio.get_running_loop().create_future())
            self._entries[key] = entry
            entry.fresh = True
            if priority == DEMAND and not self._slot_waiters:
                # the slot now, not when the load task first runs: a prefetch issued in the
                # same loop iteration (the next layer's guess) must not take it first
                entry.slot = self._take_slot(DEMAND)
                entry.slot = -1 if entry.slot is None else entry.slot
            self._start_load(entry, priority)
        return entry

    # -- prefetch ------------------------------------------------------------------------
    def prefetch(self, layer: int, experts: Iterable[int], *, defer: bool = False) -> int:
        """Start low-priority reads of experts not cached, using only a free slot or the
        policy's victim among unleased READY entries (never one being read or held, never a
        slot a demand miss is waiting for, never a prefetched record not yet demanded).
        Returns how many reads started. The others are counted as dropped, or with `defer`
        kept in order until a slot frees (a lease released, a read landing with nobody
        waiting): then the first of them starts, before anything else asks. A demand
        `request` of their layer, or `cancel_prefetches`, forgets them. Never waits."""
        started = 0
        for expert in experts:
            key = (layer, int(expert))
            if key in self._entries or key in self._deferred:
                continue
            if self._deferred or not self._start_prefetch(key):
                if defer:
                    self._deferred[key] = None
                    self._n["prefetch_deferred"] += 1
                else:
                    self._n["prefetch_dropped"] += 1
                continue
            started += 1
        return started

    def deferred_prefetches(self) -> int:
        """How many prefetches wait for a slot (ExpertCache.prefetch with defer)."""
        return len(self._deferred)

    def _start_prefetch(self, key: Key) -> bool:
        """Start the prefetch read of `key` (not in the cache) if a slot is to be had and
        fewer than _prefetch_slots prefetch reads are in flight."""
        if self._prefetch_in_flight >= self._prefetch_slots:
            return False
        slot = self._take_slot(PREFETCH)
        if slot is None:
            return False
        entry = _Entry(key, self.store.record(*key), asyncio.get_running_loop().create_future())
        entry.slot = slot
        entry.prefetched = True
        self._entries[key] = entry
        self._prefetch_in_flight += 1
        self._prefetching[key] = entry
        self._start_load(entry, PREFETCH)
        self._n["prefetch_issued"] += 1
        if self.observer is not None:
            self.observer.on_issued(key)
        return True

    def _pump(self) -> None:
        """A slot may have freed and no demand waits for it: start deferred prefetches."""
        while self._deferred and not self._slot_waiters:
            key = next(iter(self._deferred))
            if key in self._entries:
                del self._deferred[key]
                continue
            if not self._start_prefetch(key):
                return
            del self._deferred[key]

    def cancel_prefetches(self, keep: Iterable[Key] = ()) -> int:
        """Cancel prefetch reads nobody is waiting for (e.g. at a new token), except those of
        `keep`, and forget deferred ones; their slots return to the pool once the kernel is
        done with them. Returns how many reads were cancelled."""
        keep = set(keep)
        self._deferred = {k: None for k in self._deferred if k in keep}
        n = 0
        for entry in list(self._entries.values()):
            if (
                entry.prefetched
                and not entry.ready
                and entry.refs == 0
                and entry.task
                and entry.key not in keep
            ):
                entry.task.cancel()
                n += 1
        return n

    # -- slots ---------------------------------------------------------------------------
    def _take_slot(self, priority: int) -> int | None:
        if priority == PREFETCH and self._slot_waiters:
            return None
        slot = self.pool.acquire_nowait()
        if slot is not None:
            return slot
        if priority == PREFETCH:  # nor a guess of this token's not yet demanded
            key = self._policy.victim(
                lambda k: (
                    self._entries[k].refs > 0
                    or (self._entries[k].prefetched and not self._entries[k].demanded)
                )
            )
        else:
            key = self._policy.victim(lambda k: self._entries[k].refs > 0)
        if key is None:
            return None
        entry = self._entries.pop(key)
        self._policy.remove(key)
        self._n["evictions"] += 1
        if entry.prefetched and not entry.demanded:
            self._n["prefetch_wasted"] += 1
            if self.observer is not None:
                self.observer.on_wasted(key)
        slot, entry.slot = entry.slot, -1
        return slot

    def _wake_slot_waiter(self) -> None:
        while self._slot_waiters:
            fut = self._slot_waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        if self._deferred:
            self._pump()

    async def _slot(self, priority: int) -> int:
        slot = self._take_slot(priority)
        if slot is not None:
            return slot
        self._n["slot_waits"] += 1
        while True:
            fut = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done():
                    self._wake_slot_waiter()  # pass the wake-up on
                else:
                    self._slot_waiters.remove(fut)
                raise
            slot = self._take_slot(DEMAND)
            if slot is not None:
                if self._slot_waiters and self._has_free_or_victim():
                    self._wake_slot_waiter()
                return slot

    def _has_free_or_victim(self) -> bool:
        return self.pool.num_free > 0 or (
            self._policy.victim(lambda k: self._entries[k].refs > 0) is not None
        )

    def _free_slot(self, slot: int) -> None:
        self.pool.release(slot)
        self._wake_slot_waiter()

    def _start_load(self, entry: _Entry, priority: int) -> None:
        entry.task = asyncio.get_running_loop().create_task(self._load(entry, priority))
        entry.task.add_done_callback(lambda task: self._load_done(entry, task))

    def _load_done(self, entry: _Entry, task: asyncio.Task) -> None:
        if entry.prefetched:
            self._prefetch_in_flight -= 1
            if self._prefetching.get(entry.key) is entry:
                del self._prefetching[entry.key]
            if self._deferred and not self._closed:
                self._pump()  # a deferred guess may start now
        # A task cancelled before its first step never runs _load's body (nor its cleanup):
        # without this the entry would keep its slot and its waiters would wait forever.
        if task.cancelled() and not entry.fut.done():
            self._drop(entry, asyncio.CancelledError())

    async def _load(self, entry: _Entry, priority: int) -> None:
        try:
            if entry.slot < 0:
                entry.slot = await self._slot(priority)
            await self.reader.read_into(entry.record, entry.slot, priority=priority)
            if self.verify is True or (self.verify and entry.key not in self._verified):
                t0 = time.perf_counter()
                await _off_loop(self._check, entry)  # xxhash releases the GIL while hashing
                self._verify_seconds += time.perf_counter() - t0
                self._verified.add(entry.key)
            if self.transform is not None:
                view = self.pool.view(entry.slot)[: entry.record.nbytes]
                await _off_loop(self.transform, entry.record, view)
        except BaseException as exc:
            self._drop(entry, exc)
            if not isinstance(exc, Exception):
                raise
            return
        entry.ready = True
        self._n["reads"] += 1
        self._n["bytes_read"] += entry.record.nbytes
        if entry.key not in self.pinned:
            self._policy.insert(entry.key)
        entry.fut.set_result(None)
        if entry.refs == 0:
            self._wake_slot_waiter()

    def _drop(self, entry: _Entry, exc: BaseException) -> None:
        """A load failed or was cancelled: free its slot, forget the entry, tell its waiters."""
        if entry.slot >= 0:
            slot, entry.slot = entry.slot, -1
            self._free_slot(slot)
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        if isinstance(exc, asyncio.CancelledError):
            entry.fut.cancel()
        else:
            entry.fut.set_exception(exc)
            entry.fut.exception()  # retrieved: waiters (if any) re-raise it
        if entry.prefetched and not entry.demanded:
            self._n["prefetch_wasted"] += 1

    def _check(self, entry: _Entry) -> None:
        buf = self.pool.view(entry.slot)[: entry.record.nbytes]
        verify = getattr(self.store, "verify_record", None)
        if verify is not None:
            verify(entry.record, buf)
        elif xxhash.xxh3_64_intdigest(buf) != entry.record.xxh3:
            raise StoreError(
                f"{getattr(self.store, 'experts_path', '?')}: checksum mismatch in "
                f"layer {entry.record.layer} expert {entry.record.expert} "
                f"(offset {entry.record.offset}, {entry.record.nbytes} bytes)"
            )

    def _unref(self, entry: _Entry) -> None:
        entry.refs -= 1
        if entry.refs < 0:
            raise RuntimeError(f"cache entry {entry.key} released more often than leased")
        if entry.refs == 0 and entry.ready:
            self._wake_slot_waiter()

    # -- reporting / closing -------------------------------------------------------------
    def statistics(self) -> CacheStatistics:
        n = self._n
        gets = n["hits"] + n["misses"]
        ready = [e for e in self._entries.values() if e.ready]
        return CacheStatistics(
            self.policy_name,
            self.budget_nbytes,
            self.pool.num_slots,
            self.pool.slot_nbytes,
            n["hits"],
            n["misses"],
            n["hits"] / gets if gets else 0.0,
            n["bytes_read"],
            n["reads"],
            len(self._entries) - len(ready),
            len(ready),
            self.pool.resident_nbytes(),
            sum(e.key in self.pinned for e in ready),
            n["evictions"],
            n["slot_waits"],
            n["prefetch_issued"],
            n["prefetch_dropped"],
            n["prefetch_useful"],
            n["prefetch_late"],
            n["prefetch_wasted"],
            self._verify_seconds,
            sum(e.refs > 0 for e in self._entries.values()),
        )

    def counts(self) -> dict[str, int]:
        """The counters and occupancy of statistics() without measuring resident memory
        (statistics() asks the kernel page by page): cheap enough for every request and
        every scrape. Keys: hits, misses, bytes_read, reads, evictions, slot_waits,
        reads_in_flight, resident_entries, leased, num_slots, slot_nbytes, budget_nbytes,
        verify_seconds (a float)."""
        ready = sum(e.ready for e in self._entries.values())
        n = self._n
        return {
            **{k: n[k] for k in ("hits", "misses", "bytes_read", "reads", "evictions")},
            "slot_waits": n["slot_waits"],
            "reads_in_flight": len(self._entries) - ready,
            "resident_entries": ready,
            "leased": sum(e.refs > 0 for e in self._entries.values()),
            "num_slots": self.pool.num_slots,
            "slot_nbytes": self.pool.slot_nbytes,
            "budget_nbytes": self.budget_nbytes,
            "verify_seconds": self._verify_seconds,
        }

    def residency(self) -> tuple[list[Key], list[Key]]:
        """(ready, reading): the (layer, expert) keys held in RAM and those being read now.
        O(entries), never waits, changes nothing (the dashboard's tier map)."""
        ready: list[Key] = []
        reading: list[Key] = []
        for key, e in self._entries.items():
            (ready if e.ready else reading).append(key)
        return ready, reading

    @property
    def num_entries(self) -> int:
        """Records in the cache or being read into it."""
        return len(self._entries)

    def contains(self, layer: int, expert: int) -> bool:
        """True when (layer, expert) is READY in the cache (a get would hit)."""
        entry = self._entries.get((layer, expert))
        return entry is not None and entry.ready

    async def aclose(self) -> None:
        """Cancel reads in flight and wait for them (slots return to the pool). The reader
        and pool stay open (their owner closes them)."""
        self._closed = True
        tasks = [e.task for e in self._entries.values() if e.task and not e.task.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> ExpertCache:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
