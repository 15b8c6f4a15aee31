"""Readers: get one expert record from the experts file into a slab slot.

Every backend has the same interface (`Reader`) and passes the same conformance suite:

    reader = open_reader(path, backend="auto", pool=pool, queue_depth=32)
    await reader.read_into(record, slot)            # fills pool.view(slot)[:record.nbytes]
    slot = await reader.read(record)                # acquires a slot from the pool first
    reader.statistics(); await reader.aclose()

Backends: "uring" (UringReader, colibri/io/uring.py: io_uring, O_DIRECT, fixed buffers),
"threads" (ThreadReader: pread into the slot from a bounded thread pool), "mmap" (MmapReader:
copies from a read-only mapping into the slot; the llama.cpp-like baseline — llama.cpp computes
straight from the page cache, here the copy keeps one interface and is a memory-speed memcpy).
"auto" tries io_uring and falls back to threads when it is missing or blocked (ENOSYS, EPERM:
containers often filter it); O_DIRECT refused by the file system falls back to buffered reads.
The choice and the reason are in `reader.backend`, `reader.reason` and `statistics()`.

Priorities: DEMAND reads always go before queued PREFETCH reads (at most `queue_depth` reads are
in flight; the rest wait in two FIFO queues), and a PREFETCH read starts only while no DEMAND
read is in flight: the disk shares its bandwidth among the reads it serves, so a guess started
beside a layer's misses delays the misses the compute is waiting for, while the misses alone
keep the disk near its rate (colibri's reader, 2.5 MiB records: 4.05 GB/s at depth 8, 4.36 at
32 on the benchmark machine). Cancellation: a read cancelled while queued
leaves at once; once the kernel (or a worker thread) owns the buffer, `read_into` waits for that
IO to end before re-raising CancelledError, so the slot is never released under a live read.
Errors: ReadError naming the file, offset and length, raised in the awaiting task only; the
reader keeps serving other reads.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import mmap
import os
from dataclasses import dataclass

import numpy as np

from colibri.errors import ReadError
from colibri.io.format import ExpertRecord
from colibri.io.slab import SlabPool

DEMAND, PREFETCH = 0, 1
MAX_READ_NBYTES = 1 << 30  # one read at most; Linux caps a read at MAX_RW_COUNT (2 GiB - 4 KiB)


@dataclass(frozen=True, slots=True)
class ReaderStatistics:
    """backend: "uring" | "threads" | "mmap"; reason: why this backend (and buffered or not).
    direct: O_DIRECT in use. fixed_buffers: io_uring read_fixed over the slab pool.
    bytes_read: bytes delivered into slots; retries: EINTR/EAGAIN resubmissions; short_reads:
    partial reads continued for the remainder; in_flight/queued: reads now."""

    backend: str
    reason: str
    direct: bool
    fixed_buffers: bool
    queue_depth: int
    reads: int
    bytes_read: int
    errors: int
    retries: int
    short_reads: int
    in_flight: int
    queued: int


def read_error(path: str, record: ExpertRecord, what: str, err: int = errno.EIO) -> ReadError:
    exc = ReadError(
        f"{path}: read of layer {record.layer} expert {record.expert} "
        f"({record.nbytes} bytes at offset {record.offset}) failed: {what}"
    )
    exc.errno = err
    return exc


class _PriorityGate:
    """At most `capacity` holders; waiters served DEMAND first, FIFO within a priority; a
    PREFETCH holder only while no DEMAND one holds (module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self.demand_held = 0
        self._waiters: tuple[collections.deque, collections.deque] = (
            collections.deque(),
            collections.deque(),
        )

    @property
    def queued(self) -> int:
        return len(self._waiters[0]) + len(self._waiters[1])

    def _may_hold(self, priority: int) -> bool:
        return self.held < self.capacity and (priority == DEMAND or not self.demand_held)

    async def acquire(self, priority: int) -> None:
        if (
            self._may_hold(priority)
            and not self._waiters[DEMAND]
            and (priority == DEMAND or not self._waiters[PREFETCH])
        ):
            self._hold(priority)
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters[priority].append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(priority)  # handed over as we were cancelled: pass it on
            else:
                self._waiters[priority].remove(fut)
            raise

    def _hold(self, priority: int) -> None:
        self.held += 1
        self.demand_held += priority == DEMAND

    def release(self, priority: int) -> None:
        self.held -= 1
        self.demand_held -= priority == DEMAND
        for p, q in enumerate(self._waiters):
            while q and self._may_hold(p):
                fut = q.popleft()
                if not fut.done():
                    self._hold(p)
                    fut.set_result(None)
            if q:  # DEMAND waiters left (no room), or PREFETCH ones behind a demand read
                return


async def wait_io(fut: asyncio.Future) -> object:
    """Await an IO future that owns a buffer. If cancelled meanwhile, keep waiting until the IO
    ends (the buffer must not be reused under it), then re-raise CancelledError."""
    cancelled: asyncio.CancelledError | None = None
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError as exc:
            cancelled = exc
        except BaseException:
            break
    if cancelled is not None:
        raise cancelled
    return fut.result()


def open_direct(path: str, direct: bool) -> tuple[int, bool, str]:
    """(fd, direct, note): O_DIRECT when asked and the file system accepts it, else buffered."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC), True, "O_DIRECT"
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            note = f"buffered (O_DIRECT refused: {exc.strerror})"
    else:
        note = "buffered (O_DIRECT not requested)"
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC), False, note


# reads in flight at most: io_uring refuses rings above IORING_MAX_ENTRIES (32768); a deeper
# queue is refused by name rather than quietly turned into thread reads
MAX_QUEUE_DEPTH = 32768


def check_queue_depth(queue_depth: int) -> None:
    """ValueError naming queue_depth unless 1 <= queue_depth <= MAX_QUEUE_DEPTH."""
    if not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
        raise ValueError(
            f"queue_depth must be in [1, {MAX_QUEUE_DEPTH}] (io_uring's ring limit), "
            f"got {queue_depth}"
        )


class Reader:
    """Common part of every backend: the priority gate, slot checks, statistics."""

    backend = "?"

    def __init__(self, path: str, pool: SlabPool, queue_depth: int) -> None:
        check_queue_depth(queue_depth)
        self.path = os.fspath(path)
        self.pool = pool
        self.queue_depth = queue_depth
        self.direct = False
        self.fixed_buffers = False
        self.reason = ""
        self._gate = _PriorityGate(queue_depth)
        self._reads = self._bytes = self._errors = self._retries = self._short = 0
        self._closed = False

    def _check(self, record: ExpertRecord, slot: int) -> None:
        if self._closed:
            raise RuntimeError(f"{self.path}: reader is closed")
        if not 0 <= slot < self.pool.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.pool.num_slots})")
        if record.nbytes > self.pool.slot_nbytes:
            raise ValueError(
                f"{self.path}: record layer {record.layer} expert {record.expert} "
                f"has {record.nbytes} bytes, more than a slot "
                f"({self.pool.slot_nbytes})"
            )

    async def read_into(self, record: ExpertRecord, slot: int, *, priority: int = DEMAND) -> None:
        """Fill `pool.view(slot)[:record.nbytes]` with the record's bytes.

        Args: record: where it lives (offset, nbytes in bytes); slot: a slot index of `pool`
        leased by the caller; priority: DEMAND (default) or PREFETCH.
        Raises: ReadError (file, offset, length named) — the slot's content is then undefined.
        Cancellation: see the module docstring (waits for an IO already started).
        """
        self._check(record, slot)
        if record.offset < 0:
            self._errors += 1
            raise read_error(self.path, record, "negative offset", errno.EINVAL)
        await self._gate.acquire(priority)
        try:
            await self._read(record, slot)
        except ReadError:
            self._errors += 1
            raise
        finally:
            self._gate.release(priority)
        self._reads += 1
        self._bytes += record.nbytes

    async def read(self, record: ExpertRecord, *, priority: int = DEMAND) -> int:
        """Acquire a slot from the pool (waiting if none is free), read the record into it and
        return the slot index; the caller releases it with `pool.release(slot)`."""
        slot = await self.pool.acquire()
        try:
            await self.read_into(record, slot, priority=priority)
        except BaseException:
            self.pool.release(slot)
            raise
        return slot

    async def _read(self, record: ExpertRecord, slot: int) -> None:
        raise NotImplementedError

    def statistics(self) -> ReaderStatistics:
        return ReaderStatistics(
            self.backend,
            self.reason,
            self.direct,
            self.fixed_buffers,
            self.queue_depth,
            self._reads,
            self._bytes,
            self._errors,
            self._retries,
            self._short,
            self._gate.held,
            self._gate.queued,
        )

    async def aclose(self) -> None:
        """Wait for reads in flight, then release the file and the backend's resources."""
        self._closed = True

    async def __aenter__(self) -> Reader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _pread_full(fd: int, buf: memoryview, offset: int) -> tuple[int, int, int]:
    """pread until `buf` is full or EOF; (bytes read, short reads, retries). Runs in a worker."""
    done = short = retries = 0
    n = len(buf)
    while done < n:
        try:
            got = os.preadv(fd, [buf[done : done + min(n - done, MAX_READ_NBYTES)]], offset + done)
        except BlockingIOError:
            retries += 1
            continue
        if got == 0:
            break
        done += got
        if done < n:
            short += 1
    return done, short, retries


class ThreadReader(Reader):
    """pread(2) into the slot from a bounded thread pool (`num_threads`, default
    min(queue_depth, 8)); O_DIRECT when the file system allows it, else buffered."""

    backend = "threads"

    def __init__(
        self,
        path: str,
        pool: SlabPool,
        *,
        queue_depth: int = 32,
        direct: bool = True,
        num_threads: int | None = None,
        reason: str = "",
    ) -> None:
        num_threads = num_threads or min(queue_depth, 8)
        super().__init__(path, pool, min(queue_depth, num_threads))
        self.queue_depth = queue_depth
        self._fd, self.direct, note = open_direct(self.path, direct)
        self.reason = (reason + "; " if reason else "") + note
        self._executor = concurrent.futures.ThreadPoolExecutor(num_threads, "colibri-pread")

    async def _read(self, record: ExpertRecord, slot: int) -> None:
        buf = memoryview(self.pool.view(slot))[: record.nbytes]
        fut = asyncio.wrap_future(self._executor.submit(_pread_full, self._fd, buf, record.offset))
        try:
            got, short, retries = await wait_io(fut)
        except OSError as exc:
            raise read_error(self.path, record, exc.strerror or str(exc), exc.errno) from None
        self._short += short
        self._retries += retries
        if got < record.nbytes:
            raise read_error(self.path, record, f"file cut short: got {got} bytes")

    async def aclose(self) -> None:
        if self._closed:
            return
        await super().aclose()
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
        os.close(self._fd)


class MmapReader(Reader):
    """Copies the record from a read-only mmap of the file into the slot (page faults and
    read-ahead through the page cache: the llama.cpp-like baseline). The copy runs in a
    bounded thread pool; the file size is checked before each copy so a truncated file gives
    ReadError instead of SIGBUS (a truncation racing with the copy can still fault)."""

    backend = "mmap"

    def __init__(
        self,
        path: str,
        pool: SlabPool,
        *,
        queue_depth: int = 32,
        num_threads: int | None = None,
        reason: str = "",
    ) -> None:
        num_threads = num_threads or min(queue_depth, 8)
        super().__init__(path, pool, num_threads)
        self.queue_depth = queue_depth
        self.reason = reason or "mmap requested"
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        size = os.fstat(self._fd).st_size
        self._mm = mmap.mmap(self._fd, size, prot=mmap.PROT_READ) if size else None
        self._map = np.frombuffer(self._mm, dtype=np.uint8) if self._mm else np.empty(0, np.uint8)
        self._executor = concurrent.futures.ThreadPoolExecutor(num_threads, "colibri-mmap")

    def _copy(self, record: ExpertRecord, dst: np.ndarray) -> None:
        end = record.offset + record.nbytes
        size = os.fstat(self._fd).st_size
        if record.offset < 0 or end > min(size, len(self._map)):
            raise read_error(self.path, record, f"file cut short: file has {size} bytes")
        np.copyto(dst, self._map[record.offset : end])

    async def _read(self, record: ExpertRecord, slot: int) -> None:
        dst = self.pool.view(slot)[: record.nbytes]
        fut = asyncio.wrap_future(self._executor.submit(self._copy, record, dst))
        await wait_io(fut)

    async def aclose(self) -> None:
        if self._closed:
            return
        await super().aclose()
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
        del self._map
        if self._mm is not None:
            self._mm.close()
        os.close(self._fd)


def open_reader(
    path: str | os.PathLike,
    backend: str = "auto",
    *,
    pool: SlabPool,
    queue_depth: int = 32,
    direct: bool = True,
) -> Reader:
    """Open the experts file `path` with the chosen backend.

    Args:
        backend: "auto" (io_uring, else threads), "uring", "threads" or "mmap".
        pool: the SlabPool whose slots reads fill (registered as io_uring fixed buffers).
        queue_depth: reads in flight at most (io_uring ring size; thread reads are capped at 8).
        direct: use O_DIRECT when the file system accepts it (else buffered, reported).
    Returns: a Reader; `reader.backend` / `reader.reason` say what was chosen and why.
    Raises: OSError when the file cannot be opened; ValueError when queue_depth is outside
    [1, MAX_QUEUE_DEPTH]; with backend="uring", ReadError when io_uring is unavailable (the
    message says why).
    """
    path = os.fspath(path)
    check_queue_depth(queue_depth)
    if backend == "mmap":
        return MmapReader(path, pool, queue_depth=queue_depth)
    if backend == "threads":
        return ThreadReader(
            path, pool, queue_depth=queue_depth, direct=direct, reason="threads requested"
        )
    if backend not in ("auto", "uring"):
        raise ValueError(f"unknown IO backend {backend!r} (auto, uring, threads, mmap)")
    from colibri.io.uring import UringReader, uring_unavailable_reason

    why = uring_unavailable_reason(queue_depth)
    if why is None:
        return UringReader(path, pool, queue_depth=queue_depth, direct=direct)
    if backend == "uring":
        raise ReadError(f"{path}: io_uring backend unavailable: {why}")
    return ThreadReader(
        path, pool, queue_depth=queue_depth, direct=direct, reason=f"io_uring unavailable ({why})"
    )
