"""Reader conformance: every backend (io_uring, threads, mmap, buffered) reads the same bytes and
fails the same way. Files live under /tmp (a disk file system: O_DIRECT alignment is real)."""

from __future__ import annotations

import asyncio
import errno
import os

import numpy as np
import pytest

from colibri.errors import ReadError
from colibri.io import reader as reader_mod
from colibri.io.format import ExpertRecord
from colibri.io.reader import DEMAND, PREFETCH, ThreadReader, _PriorityGate, open_reader
from colibri.io.slab import SLOT_ALIGN, SlabPool
from colibri.io.uring import uring_unavailable_reason

REC = 64 * 1024
NREC = 12
URING = uring_unavailable_reason()

BACKENDS = [
    pytest.param(
        ("uring", True),
        id="uring",
        marks=pytest.mark.skipif(URING is not None, reason=f"io_uring: {URING}"),
    ),
    pytest.param(("threads", True), id="threads"),
    pytest.param(("threads", False), id="threads-buffered"),
    pytest.param(("mmap", False), id="mmap"),
    pytest.param(
        ("uring", False),
        id="uring-buffered",
        marks=pytest.mark.skipif(URING is not None, reason=f"io_uring: {URING}"),
    ),
]


@pytest.fixture
def datafile(tmp_path):
    assert not str(tmp_path).startswith("/dev/shm")
    data = np.random.default_rng(1).integers(0, 256, REC * NREC, dtype=np.uint8)
    path = tmp_path / "experts.bin"
    data.tofile(path)
    return str(path), data


def rec(i: int, nbytes: int = REC, offset: int | None = None) -> ExpertRecord:
    return ExpertRecord(0, i, i * REC if offset is None else offset, nbytes, 0)


def make(path, kind, *, slots=4, slot_nbytes=REC, qd=4):
    pool = SlabPool(slot_nbytes, slots)
    backend, direct = kind
    return pool, open_reader(path, backend, pool=pool, queue_depth=qd, direct=direct)


@pytest.mark.parametrize("kind", BACKENDS)
async def test_reads_correct_bytes_concurrently(datafile, kind):
    path, data = datafile
    pool, r = make(path, kind, slots=NREC)
    assert r.backend == kind[0] and r.reason
    assert r.statistics().direct == (kind[1] and kind[0] != "mmap")
    order = [7, 0, 11, 3, 5, 1, 2, 9, 4, 10, 6, 8]  # more reads than the queue depth (4)
    slots = await asyncio.gather(*(r.read(rec(i)) for i in order))
    for i, s in zip(order, slots, strict=True):
        assert pool.slot_address(s) % SLOT_ALIGN == 0
        np.testing.assert_array_equal(pool.view(s)[:REC], data[i * REC : (i + 1) * REC])
    st = r.statistics()
    assert (st.reads, st.bytes_read, st.errors, st.in_flight) == (12, 12 * REC, 0, 0)
    await r.aclose()


@pytest.mark.parametrize("kind", BACKENDS)
async def test_misaligned_record(datafile, kind):
    """O_DIRECT refuses an offset that is not block-aligned (EINVAL, reported with file,
    offset and length); buffered backends read it. Either way the reader keeps working."""
    path, data = datafile
    pool, r = make(path, kind)
    bad = rec(1, REC - 4096, offset=REC + 100)
    if r.direct:
        with pytest.raises(ReadError) as ei:
            await r.read_into(bad, 0)
        msg = str(ei.value)
        assert path in msg and f"offset {REC + 100}" in msg and f"{REC - 4096} bytes" in msg
        assert ei.value.errno == errno.EINVAL
    else:
        await r.read_into(bad, 0)
        np.testing.assert_array_equal(pool.view(0)[: REC - 4096], data[REC + 100 : 2 * REC - 3996])
    await r.read_into(rec(2), 1)
    np.testing.assert_array_equal(pool.view(1)[:REC], data[2 * REC : 3 * REC])
    await r.aclose()


@pytest.mark.parametrize("kind", BACKENDS)
async def test_read_at_end_of_file(datafile, kind):
    path, data = datafile
    pool, r = make(path, kind, slot_nbytes=2 * REC)
    await r.read_into(rec(NREC - 1), 0)  # ends exactly at EOF
    np.testing.assert_array_equal(pool.view(0)[:REC], data[-REC:])
    with pytest.raises(ReadError, match="cut short"):  # starts inside, ends past EOF
        await r.read_into(rec(0, 2 * REC, offset=(NREC - 1) * REC), 1)
    with pytest.raises(ReadError, match=f"offset {NREC * REC}"):  # starts at EOF
        await r.read_into(rec(NREC), 2)
    assert r.statistics().errors == 2
    await r.aclose()


@pytest.mark.parametrize("kind", BACKENDS)
async def test_file_truncated_after_open(datafile, kind):
    path, data = datafile
    pool, r = make(path, kind)
    os.truncate(path, 4 * REC)
    results = await asyncio.gather(
        r.read_into(rec(2), 0),
        r.read_into(rec(8), 1),
        r.read_into(rec(3), 2),
        return_exceptions=True,
    )
    assert results[0] is None and results[2] is None  # errors hit only the awaiting task
    assert isinstance(results[1], ReadError) and f"offset {8 * REC}" in str(results[1])
    np.testing.assert_array_equal(pool.view(0)[:REC], data[2 * REC : 3 * REC])
    np.testing.assert_array_equal(pool.view(2)[:REC], data[3 * REC : 4 * REC])
    await r.aclose()


@pytest.mark.parametrize("kind", BACKENDS)
async def test_bad_offset_and_oversized_record(datafile, kind):
    path, _ = datafile
    _pool, r = make(path, kind)
    with pytest.raises(ReadError, match="offset -4096"):
        await r.read_into(rec(0, offset=-4096), 0)
    with pytest.raises(ValueError, match="more than a slot"):
        await r.read_into(rec(0, 2 * REC), 0)
    with pytest.raises(ValueError, match="out of range"):
        await r.read_into(rec(0), 4)
    await r.aclose()


@pytest.mark.parametrize("kind", BACKENDS)
async def test_cancel_mid_read_waits_for_the_io(tmp_path, kind):
    """A read cancelled after submission re-raises CancelledError only once the IO is over:
    nothing is in flight afterwards, so the caller may reuse the slot at once."""
    path = tmp_path / "big.bin"
    nbytes = 32 << 20
    with open(path, "wb") as f:
        f.truncate(nbytes)
    _pool, r = make(str(path), kind, slots=1, slot_nbytes=nbytes)
    task = asyncio.create_task(r.read_into(ExpertRecord(0, 0, 0, nbytes, 0), 0))
    await asyncio.sleep(0)  # the read is submitted (or handed to a worker), not finished
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    st = r.statistics()
    assert st.in_flight == 0 and st.queued == 0
    if kind[0] == "uring":
        assert not r._ops
    await r.aclose()


def test_uring_under_uvloop(datafile):
    uvloop = pytest.importorskip("uvloop")
    if URING is not None:
        pytest.skip(f"io_uring: {URING}")
    path, data = datafile

    async def main():
        pool, r = make(path, ("uring", True), slots=NREC)
        slots = await asyncio.gather(*(r.read(rec(i)) for i in range(NREC)))
        os.truncate(path, 2 * REC)
        with pytest.raises(ReadError):
            await r.read_into(rec(5), slots[0])
        await r.aclose()
        return [bytes(pool.view(s)[:16]) for s in slots[1:]]

    heads = uvloop.run(main())
    assert heads == [bytes(data[i * REC : i * REC + 16]) for i in range(1, NREC)]


async def test_auto_choice_and_fallbacks(datafile, monkeypatch):
    path, _ = datafile
    pool = SlabPool(REC, 2)
    r = open_reader(path, "auto", pool=pool)
    assert r.backend == ("uring" if URING is None else "threads")
    await r.aclose()
    # io_uring blocked (as under a seccomp filter): threads, and the reason says why
    import colibri.io.uring as u

    monkeypatch.setattr(u, "uring_unavailable_reason", lambda qd=4: "io_uring_setup: EPERM")
    r = open_reader(path, "auto", pool=pool)
    assert isinstance(r, ThreadReader) and "EPERM" in r.statistics().reason
    await r.aclose()
    with pytest.raises(ReadError, match="EPERM"):
        open_reader(path, "uring", pool=pool)
    # O_DIRECT refused by the file system: buffered, reported
    real_open = os.open

    def no_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *a)

    monkeypatch.setattr(reader_mod.os, "open", no_direct)
    r = open_reader(path, "threads", pool=pool)
    assert not r.direct and "O_DIRECT refused" in r.reason
    await r.read_into(rec(1), 0)
    await r.aclose()


async def test_priority_gate_serves_demand_first():
    gate = _PriorityGate(1)
    await gate.acquire(DEMAND)
    order = []

    async def waiter(name, prio):
        await gate.acquire(prio)
        order.append(name)
        gate.release(prio)

    tasks = [
        asyncio.create_task(waiter(n, p))
        for n, p in [("p1", PREFETCH), ("d1", DEMAND), ("p2", PREFETCH), ("d2", DEMAND)]
    ]
    await asyncio.sleep(0)
    tasks[1].cancel()  # a cancelled waiter leaves the queue
    await asyncio.sleep(0)
    gate.release(DEMAND)
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == ["d2", "p1", "p2"]
    assert gate.held == 0 and gate.queued == 0


async def test_priority_gate_holds_prefetches_while_a_demand_read_is_in_flight():
    """Room in the gate or not, a prefetch read starts only when no demand read holds it;
    then every queued prefetch that fits starts at once, and demand reads never wait for
    prefetches."""
    gate = _PriorityGate(4)
    await gate.acquire(DEMAND)
    started = []

    async def take(name, prio):
        await gate.acquire(prio)
        started.append(name)

    prefetches = [asyncio.create_task(take(f"p{i}", PREFETCH)) for i in range(4)]
    await asyncio.sleep(0)
    assert started == [] and gate.held == 1 and gate.queued == 4
    await take("d2", DEMAND)  # a demand read passes the queued prefetches
    assert started == ["d2"] and gate.held == 2
    gate.release(DEMAND)
    await asyncio.sleep(0)
    assert started == ["d2"]  # d2 is still in flight
    gate.release(DEMAND)
    await asyncio.gather(*prefetches)
    assert started == ["d2", "p0", "p1", "p2", "p3"] and gate.held == 4
    assert gate.demand_held == 0 and gate.queued == 0
    demand = asyncio.create_task(take("d3", DEMAND))  # the gate is full: waits for a slot
    await asyncio.sleep(0)
    assert not demand.done()
    gate.release(PREFETCH)
    await demand
    assert gate.held == 4 and gate.demand_held == 1


def test_slab_pool_backing_leases_and_measured_memory():
    pool = SlabPool(5000, 3)
    assert pool.slot_nbytes == 8192 and pool.address % SLOT_ALIGN == 0
    st = pool.statistics()
    assert st.backing in ("hugetlb", "thp", "normal") and st.backing_reason
    assert st.resident_nbytes == 0  # nothing touched yet: measured, not assumed
    slots = [pool.acquire_nowait() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.acquire_nowait() is None
    pool.view(1)[:] = 7
    assert pool.resident_nbytes() >= 8192
    pool.release(1)
    with pytest.raises(RuntimeError, match="twice"):
        pool.release(1)
    normal = SlabPool(4096, 2, backing="normal")
    assert normal.statistics().backing == "normal"
    with pytest.raises(ValueError):
        SlabPool(0, 1)


@pytest.mark.parametrize("kind", [BACKENDS[0], BACKENDS[1]])
async def test_reads_split_at_the_read_limit(datafile, kind, monkeypatch):
    """A record larger than one read's limit goes in pieces (the short-read path)."""
    import colibri.io.uring as u

    monkeypatch.setattr(u, "MAX_READ_NBYTES", 8192)
    monkeypatch.setattr(reader_mod, "MAX_READ_NBYTES", 8192)
    path, data = datafile
    pool, r = make(path, kind, slot_nbytes=3 * REC)
    await r.read_into(rec(2, 3 * REC), 0)
    np.testing.assert_array_equal(pool.view(0)[: 3 * REC], data[2 * REC : 5 * REC])
    assert r.statistics().short_reads == 3 * REC // 8192 - 1
    await r.aclose()


def test_hugetlb_backing_forced_without_reserved_pages():
    free = reader_mod_hugepages()
    if free >= 1:
        pool = SlabPool(4096, 1, backing="hugetlb")
        assert pool.statistics().backing == "hugetlb"
    else:
        with pytest.raises(OSError, match="huge pages reserved"):
            SlabPool(4096, 1, backing="hugetlb")
        assert SlabPool(4096, 1).statistics().backing != "hugetlb"


def reader_mod_hugepages() -> int:
    from colibri.io.slab import _hugepages_free

    return _hugepages_free()


@pytest.mark.parametrize("backend", ["auto", "uring", "threads", "mmap"])
def test_out_of_range_queue_depth_is_refused_not_a_fallback(datafile, backend):
    """A depth io_uring cannot set up (> IORING_MAX_ENTRIES, 32768) is refused by name for
    every backend, rather than "auto" quietly becoming thread reads."""
    from colibri.io.reader import MAX_QUEUE_DEPTH

    path, _ = datafile
    pool = SlabPool(REC, 2)
    for qd in (0, MAX_QUEUE_DEPTH + 1, 100_000):
        with pytest.raises(ValueError, match=rf"queue_depth must be in \[1, 32768\].*got {qd}"):
            open_reader(path, backend, pool=pool, queue_depth=qd)
    if URING is None or backend != "uring":  # the largest depth opens (a ring of 32768)
        r = open_reader(path, backend, pool=pool, queue_depth=MAX_QUEUE_DEPTH)
        assert r.queue_depth == MAX_QUEUE_DEPTH
        asyncio.run(r.aclose())
