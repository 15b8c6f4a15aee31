"""ExpertCache and Prefetcher: races through a fake reader whose completions the test controls,
policies against independent references, and the byte budget measured on a real reader."""

from __future__ import annotations

import asyncio
import collections
import os
import resource
from types import SimpleNamespace

import numpy as np
import pytest
import xxhash

from colibri.errors import ReadError, StoreError
from colibri.io.cache import (
    ExpertCache,
    LFRUPolicy,
    LFUPolicy,
    LRUPolicy,
    NextUsePolicy,
    hot_set,
    load_usage,
    save_usage,
)
from colibri.io.format import ExpertRecord
from colibri.io.prefetch import Prefetcher
from colibri.io.reader import PREFETCH, open_reader, wait_io
from colibri.io.replay import SyntheticStore
from colibri.io.slab import SlabPool

N = 4096  # record bytes


class FakeStore:
    def __init__(self, num_layers=4, num_experts=8, seed=0):
        rng = np.random.default_rng(seed)
        self.data = {
            (la, e): rng.integers(0, 256, N, dtype=np.uint8)
            for la in range(num_layers)
            for e in range(num_experts)
        }
        self.layout = SimpleNamespace(record_nbytes=N)
        self.config = {"num_experts_per_tok": 1}
        self.experts_path = "fake.bin"

    def record(self, layer, expert):
        return ExpertRecord(layer, expert, 0, N, xxhash.xxh3_64_intdigest(self.data[layer, expert]))


_READERS: list = []  # this test's FakeReaders (the fixture below ends their reads)


class FakeReader:
    """read_into parks until the test calls complete(key) (or fail(key, exc)); the 'kernel'
    writes the slot only at completion, and the slot must still be unreleased then."""

    def __init__(self, pool, store):
        self.pool, self.store = pool, store
        self.pending: dict = {}
        self.started: list = []
        _READERS.append(self)

    async def read_into(self, record, slot, *, priority=0):
        key = (record.layer, record.expert)
        assert self.pool._leased[slot], "read into a slot that is not leased"
        fut = asyncio.get_running_loop().create_future()
        self.pending[key] = (fut, slot)
        self.started.append((key, priority))
        await wait_io(fut)

    def complete(self, key, data=None):
        fut, slot = self.pending.pop(key)
        assert self.pool._leased[slot], "kernel wrote into a released slot"
        self.pool.view(slot)[:N] = self.store.data[key] if data is None else data
        fut.set_result(None)

    def fail(self, key, exc):
        fut, _ = self.pending.pop(key)
        fut.set_exception(exc)


@pytest.fixture(autouse=True)
async def _no_read_left_pending():
    """A read a test leaves parked would never end: wait_io (rightly, for a real read) keeps
    its task alive through cancellation, so the event loop's teardown waited for it forever.
    After each test, fail whatever is still pending (the tasks end within a few loop
    iterations) and fail the test naming the keys."""
    _READERS.clear()
    yield
    left = [key for r in _READERS for key in r.pending]
    for r in _READERS:
        for key in list(r.pending):
            r.fail(key, ReadError("test ended with the read pending"))
    await asyncio.wait_for(spin(20), timeout=5)
    _READERS.clear()
    assert not left, f"reads left pending at the end of the test: {left}"


def make(num_slots=3, **kw):
    """A cache over a fake store and reader. Records are not hashed unless the test asks
    (verify=...): hashing runs in an executor thread, so with it on a load ends after a
    number of loop iterations that depends on the machine's load, and the tests that count
    iterations (spin) were flaky on a busy 2-core machine."""
    store = FakeStore()
    pool = SlabPool(N, num_slots)
    reader = FakeReader(pool, store)
    kw.setdefault("min_slots", 1)
    kw.setdefault("verify", False)
    return store, pool, reader, ExpertCache(store, reader, num_slots * N, **kw)


async def spin(n=5):
    for _ in range(n):
        await asyncio.sleep(0)


def check_slots(cache, pool):
    """Every slot is either free or owned by exactly one entry."""
    owned = [e.slot for e in cache._entries.values() if e.slot >= 0]
    assert len(owned) == len(set(owned))
    assert sorted(owned + list(pool._free)) == list(range(pool.num_slots))


async def test_two_waiters_share_one_read():
    store, pool, reader, cache = make()
    t1 = asyncio.create_task(cache.get(0, 1))
    t2 = asyncio.create_task(cache.get(0, 1))
    await spin()
    assert [k for k, _ in reader.started] == [(0, 1)]
    reader.complete((0, 1))
    l1, l2 = await t1, await t2
    np.testing.assert_array_equal(l1.buffer, store.data[0, 1])
    assert l1.buffer.ctypes.data == l2.buffer.ctypes.data
    st = cache.statistics()
    assert (st.hits, st.misses, st.reads, st.bytes_read) == (0, 2, 1, N)
    l1.release()
    l2.release()
    with pytest.raises(RuntimeError, match="twice"):
        l2.release()
    with await cache.get(0, 1) as lease:
        np.testing.assert_array_equal(lease.buffer, store.data[0, 1])
    assert cache.statistics().hits == 1
    check_slots(cache, pool)


async def test_eviction_never_touches_in_flight_or_leased():
    store, pool, reader, cache = make(num_slots=3)
    for e in (0, 1):  # A = (0,0) ready unleased, B = (0,1) ready leased
        t = asyncio.create_task(cache.get(0, e))
        await spin()
        reader.complete((0, e))
        lease = await t
        if e == 0:
            lease.release()
        else:
            held = lease
    tc = asyncio.create_task(cache.get(0, 2))  # C in flight, takes the last free slot
    await spin()
    td = asyncio.create_task(cache.get(0, 3))  # D must evict A: B leased, C in flight
    await spin()
    assert not cache.contains(0, 0) and cache.contains(0, 1)
    assert set(reader.pending) == {(0, 2), (0, 3)}
    reader.complete((0, 3))
    reader.complete((0, 2))
    lc, ld = await tc, await td
    np.testing.assert_array_equal(lc.buffer, store.data[0, 2])
    np.testing.assert_array_equal(ld.buffer, store.data[0, 3])
    np.testing.assert_array_equal(held.buffer, store.data[0, 1])
    assert cache.statistics().evictions == 1
    check_slots(cache, pool)


async def test_cancel_waiter_mid_read_keeps_the_record_and_leaks_nothing():
    store, pool, reader, cache = make(num_slots=2)
    t = asyncio.create_task(cache.get(1, 5))
    await spin()
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert (1, 5) in reader.pending  # the shared read goes on
    reader.complete((1, 5))
    await spin()
    assert cache.contains(1, 5) and cache._entries[1, 5].refs == 0
    check_slots(cache, pool)
    with await cache.get(1, 5) as lease:
        np.testing.assert_array_equal(lease.buffer, store.data[1, 5])


async def test_cancel_prefetch_mid_read_frees_the_slot_once():
    _store, pool, reader, cache = make(num_slots=2)
    assert cache.prefetch(2, [3]) == 1
    await spin()
    assert reader.started == [((2, 3), PREFETCH)]
    assert cache.cancel_prefetches() == 1
    await spin()
    assert pool.num_free == 1  # the 'kernel' still owns the slot
    reader.complete((2, 3))  # asserts the slot is still leased while written
    await spin()
    assert pool.num_free == 2 and not cache._entries
    st = cache.statistics()
    assert st.prefetch_wasted == 1 and st.reads == 0


async def test_all_slots_leased_waits_without_overrun():
    store, pool, reader, cache = make(num_slots=2)
    leases = []
    for e in (0, 1):
        t = asyncio.create_task(cache.get(0, e))
        await spin()
        reader.complete((0, e))
        leases.append(await t)
    t = asyncio.create_task(cache.get(0, 2))
    await spin(10)
    assert not t.done() and (0, 2) not in reader.pending  # waiting for a slot, no read
    assert cache.prefetch(0, [4]) == 0  # prefetch never takes the slot a demand waits for
    assert cache.statistics().slot_waits == 1
    leases[0].release()
    await spin()
    assert (0, 2) in reader.pending
    reader.complete((0, 2))
    lease = await t
    np.testing.assert_array_equal(lease.buffer, store.data[0, 2])
    np.testing.assert_array_equal(leases[1].buffer, store.data[0, 1])
    assert not cache.contains(0, 0)
    check_slots(cache, pool)


async def test_read_error_reaches_every_waiter_then_retries():
    _store, pool, reader, cache = make()
    t1 = asyncio.create_task(cache.get(0, 1))
    t2 = asyncio.create_task(cache.get(0, 1))
    await spin()
    reader.fail((0, 1), ReadError("fake.bin: read of 4096 bytes at offset 0 failed: EIO"))
    for t in (t1, t2):
        with pytest.raises(ReadError, match="EIO"):
            await t
    check_slots(cache, pool)
    assert pool.num_free == 3
    t = asyncio.create_task(cache.get(0, 1))
    await spin()
    reader.complete((0, 1))
    (await t).release()


async def test_checksum_mismatch_is_a_store_error():
    _store, pool, reader, cache = make(verify="once")
    t = asyncio.create_task(cache.get(3, 3))
    await spin()
    reader.complete((3, 3), data=np.zeros(N, np.uint8))
    with pytest.raises(StoreError, match="layer 3 expert 3"):
        await t
    assert pool.num_free == 3
    # "once" (default): a record that passed is not hashed again when re-read after eviction
    for verify, caught in (("once", False), (True, True)):
        _, _, rd, c = make(num_slots=1, verify=verify)
        for e, data in ((1, None), (2, None), (1, np.zeros(N, np.uint8))):
            t = asyncio.create_task(c.get(0, e))
            await spin()
            rd.complete((0, e), data=data)
            if data is not None and caught:
                with pytest.raises(StoreError):
                    await t
            else:
                (await t).release()
    _, _, reader2, unchecked = make(verify=False)
    t = asyncio.create_task(unchecked.get(3, 3))
    await spin()
    reader2.complete((3, 3), data=np.zeros(N, np.uint8))
    (await t).release()


async def test_request_batches_a_layer_and_reserves():
    _store, _pool, reader, cache = make(num_slots=3)
    cache.request(1, [2, 4, 6])
    await spin()
    assert sorted(k for k, _ in reader.started) == [(1, 2), (1, 4), (1, 6)]
    for e in (6, 2, 4):
        reader.complete((1, e))
    await spin()
    # reserved until fetched: a new miss cannot evict them and waits
    t = asyncio.create_task(cache.get(2, 0))
    await spin()
    assert not t.done() and (2, 0) not in reader.pending
    lease = await cache.get(1, 4)
    lease.release()
    await spin()
    assert (2, 0) in reader.pending
    cache.unrequest(1, [2, 6])
    reader.complete((2, 0))
    (await t).release()
    st = cache.statistics()
    assert (st.misses, st.hits) == (2, 0)


def test_budget_too_small_names_the_minimum():
    store = FakeStore()
    pool = SlabPool(N, 1)
    with pytest.raises(ValueError, match=f"minimum budget {2 * N} bytes"):
        ExpertCache(store, FakeReader(pool, store), N, min_slots=2)
    pool2 = SlabPool(N, 4)
    with pytest.raises(ValueError, match="over the cache budget"):
        ExpertCache(store, FakeReader(pool2, store), 3 * N, min_slots=1)


async def test_pinned_are_never_evicted_and_usage_roundtrip(tmp_path):
    _store, _pool, reader, cache = make(num_slots=3, pinned=[(0, 0)], policy="lfu")
    for key in [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]:
        t = asyncio.create_task(cache.get(*key))
        await spin()
        if key in reader.pending:
            reader.complete(key)
        (await t).release()
    assert cache.contains(0, 0)
    assert cache.statistics().pinned == 1
    save_usage(tmp_path / "usage.json", dict(cache.usage))
    counts = load_usage(tmp_path / "usage.json")
    assert counts == {(0, e): 1 for e in range(5)}
    assert hot_set({(0, 1): 5, (2, 2): 9, (1, 1): 5}, 2) == [(2, 2), (0, 1)]
    assert load_usage(tmp_path / "missing.json") == {}
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(StoreError, match=r"bad\.json"):
        load_usage(tmp_path / "bad.json")


# ---- policies against references -----------------------------------------------------
def reference_victim(policy, history, resident):
    """Brute-force victim from the full access history (time = index)."""

    def last(k):
        return max(i for i, h in enumerate(history) if h == k)

    if policy == "lru":
        return min(resident, key=last)
    if policy == "lfu":
        return min(resident, key=lambda k: (history.count(k), last(k)))
    hl = 8.0
    t = len(history)
    score = {
        k: sum(2 ** ((i + 1 - t) / hl) for i, h in enumerate(history) if h == k) for k in resident
    }
    return min(resident, key=lambda k: (score[k], last(k)))


@pytest.mark.parametrize("name", ["lru", "lfu", "lfru"])
def test_policy_victims_match_brute_force(name):
    rng = np.random.default_rng(5)
    pol = {"lru": LRUPolicy, "lfu": LFUPolicy, "lfru": lambda: LFRUPolicy(8.0)}[name]()
    resident, history, cap = set(), [], 5
    for _ in range(400):
        key = int(rng.zipf(1.5)) % 12
        history.append(key)
        pol.access(key)
        if key in resident:
            continue
        if len(resident) >= cap:
            skip = {int(rng.integers(0, 12))}
            cands = resident - skip
            want = reference_victim(name, history[:-1], cands)
            got = pol.victim(lambda k, skip=skip: k in skip)
            assert got == want
            pol.remove(got)
            resident.discard(got)
        resident.add(key)
        pol.insert(key)
        assert len(pol) == len(resident)


def reference_next_use(history, key, cur, layers, short=0.5, long=16.0, w=0.5):
    """Expected distance to key's next use, from the full history: a list of visits
    (layer, [experts used]); key's layer l is next visited d visits from now (layer order
    in the cycle, d = len(layers) for the current one), p = w s(short) + (1 - w) s(long)
    with s(h) = sum over l's visits used of 2^-(age/h) / sum over all of l's visits."""
    layer = key[0]
    mine = [ex for lay, ex in history if lay == layer]
    v = len(mine)
    p = 0.0
    for h, wt in ((short, w), (long, 1 - w)):
        used = sum(2 ** (-(v - 1 - j) / h) for j, ex in enumerate(mine) if key[1] in ex)
        p += wt * used / sum(2 ** (-(v - 1 - j) / h) for j in range(v))
    n = len(layers)
    d = (layers.index(layer) - layers.index(cur)) % n or n
    p = max(p, 1e-12)
    return d + n * (1 - p) / p


def test_next_use_victim_is_the_farthest_expected_next_use():
    """NextUsePolicy's victim against the distance computed from the whole history: a cycle
    over 4 layers, 2 of 6 experts per visit (skewed), a cache of 9 records, a random
    resident skipped (held) now and then."""
    rng = np.random.default_rng(7)
    pol, resident, history, cap = NextUsePolicy(), set(), [], 9
    layers = [0, 1, 2, 3]
    checked = 0
    for t in range(120):
        for layer in layers:
            experts = [
                int(e) for e in rng.choice(6, 2, replace=False, p=[0.4, 0.2, 0.15, 0.1, 0.1, 0.05])
            ]
            history.append((layer, experts))
            pol.visit(layer)
            now = {(layer, e) for e in experts}
            for e in experts:
                key = (layer, e)
                pol.access(key)
                if key in resident:
                    continue
                if len(resident) >= cap:
                    held = now | (
                        {sorted(resident)[int(rng.integers(len(resident)))]}
                        if t % 3 == 0
                        else set()
                    )
                    dist = {
                        k: reference_next_use(history, k, layer, layers) for k in resident - held
                    }
                    got = pol.victim(lambda k, held=held: k in held)
                    assert got in dist and dist[got] == pytest.approx(max(dist.values()), rel=1e-9)
                    checked += 1
                    pol.remove(got)
                    resident.discard(got)
                resident.add(key)
                pol.insert(key)
                assert len(pol) == len(resident)
    assert checked > 100


# ---- prefetcher ---------------------------------------------------------------------------
async def test_prefetcher_counts_and_backs_off():
    _store, _pool, reader, cache = make(num_slots=6)
    pf = Prefetcher(cache, window=2, cooldown=3, min_read_precision=0.5, probe_every=99)
    pf.new_token()
    assert pf.predict(1, [2, 3]) == 2
    await spin()
    assert {k for k, p in reader.started if p == PREFETCH} == {(1, 2), (1, 3)}
    reader.complete((1, 2))
    await spin()
    t = asyncio.create_task(cache.get(1, 2))  # useful, already landed: a hit
    t2 = asyncio.create_task(cache.get(1, 5))  # not predicted
    await spin()
    reader.complete((1, 5))
    (await t).release()
    (await t2).release()
    st = pf.statistics()
    assert (st.predicted, st.issued, st.useful, st.demanded) == (2, 2, 1, 2)
    assert st.recall == 0.5 and st.precision == 0.5
    assert cache.statistics().hits == 1
    pf.new_token()  # (1, 3) still in flight, nobody waits: cancelled
    reader.complete((1, 3))
    await spin()
    assert pf.statistics().cancelled == 1 and not cache.contains(1, 3)
    # keep predicting wrongly: after a window below 50% useful reads it stops issuing
    for tok in range(4):
        pf.predict(2, [tok])
        await spin()
        if (2, tok) in reader.pending:
            reader.complete((2, tok))
        pf.new_token()
    st = pf.statistics()
    assert st.backoffs == 1 and not st.enabled
    skipped = st.skipped_while_backing_off
    assert pf.predict(3, [7]) == 0 and (3, 7) not in reader.pending
    assert pf.statistics().skipped_while_backing_off == skipped + 1


# ---- the budget, measured on a real reader ---------------------------------------------
async def test_memory_stays_within_budget_measured(tmp_path):
    rec = 256 * 1024
    store = SyntheticStore.create(tmp_path / "experts.bin", 8, 8, rec)
    budget = 10 * rec + 1000
    num_slots = ExpertCache.slots_for_budget(budget, rec)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pool = SlabPool(rec, num_slots)
    reader = open_reader(store.experts_path, "auto", pool=pool, queue_depth=8)
    cache = ExpertCache(store, reader, budget, policy="lfru")
    rng = np.random.default_rng(0)
    counts = collections.Counter()
    for _ in range(40):
        for layer in range(8):
            experts = [int(x) for x in rng.choice(8, 2, replace=False)]
            cache.request(layer, experts)
            leases = [await cache.get(layer, e) for e in experts]
            for lease in leases:
                got = lease.buffer
                assert xxhash.xxh3_64_intdigest(got) == lease.record.xxh3
                lease.release()
            counts.update((layer, e) for e in experts)
    st = cache.statistics()
    assert st.reads > num_slots  # it really cycled through the budget
    assert 0 < st.resident_nbytes <= budget  # measured from /proc/self/smaps
    assert st.resident_nbytes == pool.resident_nbytes()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert rss1 - rss0 <= budget + (8 << 20)  # process peak: budget + interpreter slack
    assert dict(cache.usage) == dict(counts)
    await cache.aclose()
    await reader.aclose()
    assert os.path.getsize(store.experts_path) == 64 * rec


@pytest.mark.parametrize("on_cost, off_cost", [(2.0, 1.0), (1.0, 2.0)])
async def test_prefetcher_judges_by_token_time(on_cost, off_cost):
    """Tokens that take longer with prefetch on than in the off probes make it back off;
    tokens that get faster keep it on (only the probe windows run without it)."""
    *_, cache = make(num_slots=4)
    t = [0.0]
    pf = Prefetcher(
        cache, window=2, probe_every=2, cooldown=1, min_read_precision=0.0, clock=lambda: t[0]
    )
    modes = []
    pf.new_token()
    for _ in range(24):
        modes.append(pf.enabled)
        t[0] += on_cost if pf.enabled else off_cost
        pf.new_token()
    st = pf.statistics()
    if on_cost > off_cost:
        assert st.backoffs >= 2 and sum(modes) <= 12
    else:
        assert st.backoffs == 0 and sum(modes) == 16  # 2 of every 3 windows on


async def test_prefetch_cancelled_before_it_started_frees_its_slot_and_waiters():
    """cancel_prefetches right after prefetch, before the read's task ever ran: the task's body
    (and its cleanup) never executes. A demand get of that expert must still complete (this
    hung `colibri bench`'s Mixtral replay), and the slot must come back."""
    store, pool, reader, cache = make(num_slots=2)
    assert cache.prefetch(2, [3]) == 1
    assert cache.cancel_prefetches() == 1  # no await in between: the task has not started
    get = asyncio.ensure_future(cache.get(2, 3))
    for _ in range(50):
        await spin()
        if (2, 3) in reader.pending:
            break
    assert (2, 3) in reader.pending, "the demand get never started a read of its own"
    reader.complete((2, 3))
    with await asyncio.wait_for(get, 5) as lease:
        np.testing.assert_array_equal(lease.buffer, store.data[2, 3])
    check_slots(cache, pool)
    st = cache.statistics()
    assert st.reads == 1 and st.misses == 1 and st.reads_in_flight == 0


async def test_run_to_completion_lets_fn_finish_before_the_cancellation():
    """The caller cancelled while fn runs in the executor: CancelledError reaches it only after
    fn returned (what fn reads, a slab slot, is not freed under it); results and errors pass
    through otherwise. The compute thread (pipeline.py) and record hashing share it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from colibri.io.cache import run_to_completion

    started, release, log = threading.Event(), threading.Event(), []

    def slow() -> int:
        started.set()
        release.wait(5)
        log.append("fn done")
        return 7

    with ThreadPoolExecutor(1) as ex:
        task = asyncio.create_task(run_to_completion(ex, slow))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # still waiting for fn
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert log == ["fn done"]
        assert await run_to_completion(ex, lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ZeroDivisionError):
            await run_to_completion(None, lambda: 1 / 0)


# ---- demand before prefetch, deferred prefetches, guess sources ---------------------------
async def test_demand_takes_its_slots_before_a_prefetch_of_the_same_iteration():
    """request() then prefetch() with no await in between (the pipeline's order): the demand
    misses own the slots at once, so the prefetch finds none and the demands read first."""
    _store, pool, reader, cache = make(num_slots=2)
    cache.request(0, [1, 2])
    assert cache.prefetch(1, [3, 4]) == 0
    assert cache.statistics().prefetch_dropped == 2
    await spin()
    assert sorted(reader.started) == [((0, 1), 0), ((0, 2), 0)]
    for e in (1, 2):
        reader.complete((0, e))
        (await cache.get(0, e)).release()
    assert cache.statistics().misses == 2
    check_slots(cache, pool)


async def test_request_never_evicts_a_record_it_also_wants():
    """A miss's slot is taken during request(): a cached record of the same request (listed
    after the miss) is reserved first, so it stays a hit."""
    _store, pool, reader, cache = make(num_slots=2, policy="lru")
    for e in (5, 6):  # both cached, unleased; (0, 5) is the LRU victim
        t = asyncio.create_task(cache.get(0, e))
        await spin()
        reader.complete((0, e))
        (await t).release()
    cache.request(0, [1, 5])  # 1 misses: its slot must come from (0, 6), not (0, 5)
    assert cache.contains(0, 5) and not cache.contains(0, 6)
    await spin()
    reader.complete((0, 1))
    for e in (1, 5):
        (await cache.get(0, e)).release()
    st = cache.statistics()
    assert (st.hits, st.misses) == (1 + 0, 1 + 2)  # (0,5) hit; (0,1) and the first two missed
    check_slots(cache, pool)


async def test_deferred_prefetch_starts_when_a_slot_frees_and_is_forgotten_on_request():
    _store, pool, reader, cache = make(num_slots=2)
    t1 = asyncio.create_task(cache.get(0, 1))
    t2 = asyncio.create_task(cache.get(0, 2))
    await spin()
    assert cache.prefetch(1, [3, 4, 5], defer=True) == 0
    assert cache.deferred_prefetches() == 3
    reader.complete((0, 1))
    reader.complete((0, 2))
    l1, l2 = await t1, await t2
    await spin()
    assert [k for k, p in reader.started if p == PREFETCH] == []  # both slots leased
    l1.release()  # a slot frees: the first deferred guess starts in it
    await spin()
    assert [k for k, p in reader.started if p == PREFETCH] == [(1, 3)]
    assert cache.deferred_prefetches() == 2
    reader.complete((1, 3))
    await spin()
    l2.release()  # (0, 2) is evicted for (1, 4); a landed guess not yet demanded is kept
    await spin()
    assert [k for k, p in reader.started if p == PREFETCH] == [(1, 3), (1, 4)]
    assert cache.contains(1, 3)
    cache.request(1, [3])  # layer 1 demanded: its remaining guess (1, 5) is dropped
    assert cache.deferred_prefetches() == 0
    (await cache.get(1, 3)).release()
    reader.complete((1, 4))
    await spin()
    assert (1, 5) not in [k for k, _ in reader.started]
    st = cache.statistics()
    assert (st.prefetch_issued, st.prefetch_useful) == (2, 1)
    check_slots(cache, pool)


async def test_prefetcher_keeps_next_token_guesses_and_orders_sources_by_their_record():
    _store, _pool, reader, cache = make(num_slots=8)
    pf = Prefetcher(cache, window=99, probe_every=99)
    pf.new_token()
    pf.predict_next_token(0, [1, 2])
    await spin()
    pf.new_token()  # the guesses for this token survive it (not cancelled)
    assert {k for k, p in reader.started if p == PREFETCH} == {(0, 1), (0, 2)}
    assert pf.statistics().cancelled == 0 and pf.statistics().predicted == 2
    for e in (1, 2):
        reader.complete((0, e))
    await spin()
    (await cache.get(0, 1)).release()
    assert pf.statistics().useful == 1
    # the router's guesses are never demanded, the repeats always: repeats go first
    for _ in range(10):
        pf.predict(1, [0, 1, 2], repeat=[4, 5, 6], limit=6)
        await spin()
        for key in list(reader.pending):
            reader.complete(key)
        await spin()
        for e in (4, 5, 6):
            (await cache.get(1, e)).release()
        pf.new_token()
    assert pf._source_precision("repeat") > 0.9 > 0.1 > pf._source_precision("router")
    started = len(reader.started)
    pf.predict(2, [7, 1, 3], repeat=[3, 6, 2], limit=3)  # both: 3; then repeat's 6, 2
    await spin()
    assert [k for k, _ in reader.started[started:]] == [(2, 3), (2, 6), (2, 2)]
    for key in list(reader.pending):
        reader.complete(key)
    await spin()


async def test_request_cancels_its_layers_wrong_guesses_before_they_read():
    """Guesses for a layer that its request does not want stop holding slots: one whose read
    has not started is cancelled (never read) and its slot goes to the layer's miss."""
    _store, pool, reader, cache = make(num_slots=3)
    held = asyncio.create_task(cache.get(0, 1))  # one slot leased throughout
    await spin()
    reader.complete((0, 1))
    lease = await held
    assert cache.prefetch(1, [3, 4]) == 2  # the other slots: guesses, reads not started
    cache.request(1, [3, 5])  # (1, 4) was wrong; (1, 5) misses and finds no free slot
    await spin()
    started = sorted(reader.started)
    lease.release()  # (so that a failure below does not leave (1, 5) waiting for a slot)
    assert started == [((0, 1), 0), ((1, 3), PREFETCH), ((1, 5), 0)]
    for e in (3, 5):
        reader.complete((1, e))
        (await cache.get(1, e)).release()
    assert not cache.contains(1, 4)
    assert cache._n["prefetch_cancelled"] == 1
    check_slots(cache, pool)


async def test_prefetcher_times_steps_of_one_shape_and_not_prompt_chunks():
    """Prompt chunks (shape None) take 20x a decode step and here fall in prefetch-on windows
    only: not timed, they cannot make prefetch look slower. Decode steps of two shapes
    alternate, the 2-sequence one slower: each is compared with its own kind, so prefetch
    (same speed on and off) never backs off."""
    *_, cache = make(num_slots=4)
    t = [0.0]
    pf = Prefetcher(
        cache, window=2, probe_every=2, cooldown=1, min_read_precision=0.0, clock=lambda: t[0]
    )
    for i in range(48):  # each step: new_token(its shape) as it starts, then its time
        if pf.enabled and i % 3 == 0:
            pf.new_token(None)  # a prompt chunk
            t[0] += 20.0
        shape = (1,) if i % 2 else (1, 1)
        pf.new_token(shape)
        t[0] += 1.0 if shape == (1,) else 1.5
    pf.new_token(None)
    assert pf.statistics().backoffs == 0
    # the same steps with the chunks timed as ordinary steps back off
    t[0] = 0.0
    pf2 = Prefetcher(
        cache, window=2, probe_every=2, cooldown=1, min_read_precision=0.0, clock=lambda: t[0]
    )
    for i in range(48):
        if pf2.enabled and i % 3 == 0:
            pf2.new_token()
            t[0] += 20.0
        pf2.new_token()
        t[0] += 1.0 if i % 2 else 1.5
    pf2.new_token()
    assert pf2.statistics().backoffs >= 1
