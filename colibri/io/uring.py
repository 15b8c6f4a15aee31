"""UringReader: expert records through io_uring (liburing via the cffi shim `colibri.io._uring`).

O_DIRECT file (buffered if refused), the slab pool registered as fixed buffers (one per slot,
IORING_OP_READ_FIXED; plain IORING_OP_READ if registration is refused), an eventfd registered
with the ring and watched by the running loop (`loop.add_reader`, default asyncio loop or
uvloop). Reads started in the same loop iteration (a layer's misses) go to the kernel in one
io_uring_submit; on each wake every ready completion is drained. Short reads are continued for
the remainder, -EINTR/-EAGAIN resubmitted, other errors (or a read returning 0 before the record
ends: file cut short) fail the awaiting task with ReadError; the ring keeps serving the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os

from colibri.errors import ReadError
from colibri.io.format import ExpertRecord
from colibri.io.reader import MAX_READ_NBYTES, Reader, open_direct, read_error, wait_io
from colibri.io.slab import SlabPool

try:
    from colibri.io._uring import ffi, lib
except ImportError:  # the shim was not built
    ffi = lib = None

_REAP_MAX = 64


def uring_unavailable_reason(queue_depth: int = 4) -> str | None:
    """None when io_uring works here, else why not (not built, ENOSYS, EPERM, ...)."""
    if lib is None:
        return "the colibri.io._uring module is not built (scripts/dev-build uring)"
    if not lib.clb_uring_built():
        return "colibri was built without liburing (install liburing-dev and rebuild)"
    ring = ffi.new("clb_ring **")
    rc = lib.clb_ring_open(ring, queue_depth)
    if rc < 0:
        return f"io_uring_setup failed: {os.strerror(-rc)} (blocked by a seccomp/sysctl policy?)"
    lib.clb_ring_close(ring[0])
    return None


class _Op:
    __slots__ = ("buf", "done", "fut", "record")

    def __init__(self, record: ExpertRecord, buf: int, fut: asyncio.Future) -> None:
        self.record, self.buf, self.fut, self.done = record, buf, fut, 0


class UringReader(Reader):
    """io_uring reader over `pool` (see module docstring). Use `open_reader(..., "uring")`.

    Raises ReadError at construction when io_uring cannot be set up (message says why).
    """

    backend = "uring"

    def __init__(
        self,
        path: str,
        pool: SlabPool,
        *,
        queue_depth: int = 32,
        direct: bool = True,
        fixed_buffers: bool = True,
    ) -> None:
        super().__init__(path, pool, queue_depth)
        why = uring_unavailable_reason(queue_depth)
        if why is not None:
            raise ReadError(f"{self.path}: io_uring unavailable: {why}")
        self._fd, self.direct, note = open_direct(self.path, direct)
        ring = ffi.new("clb_ring **")
        rc = lib.clb_ring_open(ring, queue_depth)
        if rc < 0:
            os.close(self._fd)
            raise ReadError(f"{self.path}: io_uring_setup: {os.strerror(-rc)}")
        self._ring = ring[0]
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        rc = lib.clb_ring_register_eventfd(self._ring, self._efd)
        if rc < 0:
            self._close_now()
            raise ReadError(f"{self.path}: io_uring_register_eventfd: {os.strerror(-rc)}")
        fixed = "plain reads"
        if fixed_buffers:
            rc = lib.clb_ring_register_buffers(
                self._ring, ffi.cast("void *", pool.address), pool.slot_nbytes, pool.num_slots
            )
            self.fixed_buffers = rc >= 0
            fixed = (
                "fixed buffers"
                if rc >= 0
                else f"plain reads (register_buffers: {os.strerror(-rc)})"
            )
        self.reason = f"io_uring, {note}, {fixed}"
        self._ops: dict[int, _Op] = {}
        self._next_id = 1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unsubmitted = 0
        self._flush_scheduled = False
        self._ud = ffi.new("uint64_t[]", _REAP_MAX)
        self._res = ffi.new("int32_t[]", _REAP_MAX)

    def _attach(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            loop.add_reader(self._efd, self._on_wake)
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError(f"{self.path}: UringReader used from two event loops")
        return loop

    async def _read(self, record: ExpertRecord, slot: int) -> None:
        loop = self._attach()
        op_id = self._next_id
        self._next_id += 1
        op = _Op(record, slot, loop.create_future())
        self._ops[op_id] = op
        self._prep(op_id, op)
        await wait_io(op.fut)

    def _prep(self, op_id: int, op: _Op) -> None:
        rec = op.record
        n = min(rec.nbytes - op.done, MAX_READ_NBYTES)
        addr = self.pool.slot_address(op.buf) + op.done
        index = op.buf if self.fixed_buffers else -1
        while True:
            rc = lib.clb_ring_prep_read(
                self._ring,
                self._fd,
                ffi.cast("void *", addr),
                n,
                rec.offset + op.done,
                index,
                op_id,
            )
            if rc != -errno.EBUSY:
                break
            self._flush()  # submission queue full: hand what is queued to the kernel first
        self._unsubmitted += 1
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._unsubmitted:
            return
        rc = lib.clb_ring_submit(self._ring)
        if rc >= 0:
            self._unsubmitted = max(0, self._unsubmitted - rc)
            if self._unsubmitted:  # the kernel took only part: try again next iteration
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)
        elif rc in (-errno.EAGAIN, -errno.EBUSY, -errno.EINTR):
            self._retries += 1
            self._flush_scheduled = True
            self._loop.call_later(0.0005, self._flush)
        else:  # the ring itself failed: fail every read not yet completed
            for op in self._ops.values():
                if not op.fut.done():
                    op.fut.set_exception(
                        read_error(
                            self.path, op.record, f"io_uring_submit: {os.strerror(-rc)}", -rc
                        )
                    )
            self._ops.clear()

    def _on_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._efd)
        while True:
            n = lib.clb_ring_reap(self._ring, self._ud, self._res, _REAP_MAX)
            for i in range(n):
                self._complete(int(self._ud[i]), int(self._res[i]))
            if n < _REAP_MAX:
                break

    def _complete(self, op_id: int, res: int) -> None:
        op = self._ops.get(op_id)
        if op is None:
            return
        rec = op.record
        if res in (-errno.EINTR, -errno.EAGAIN):
            self._retries += 1
            self._prep(op_id, op)
            return
        if res < 0:
            del self._ops[op_id]
            op.fut.set_exception(read_error(self.path, rec, os.strerror(-res), -res))
            return
        if res == 0:
            del self._ops[op_id]
            op.fut.set_exception(read_error(self.path, rec, f"file cut short: got {op.done} bytes"))
            return
        op.done += res
        if op.done < rec.nbytes:
            self._short += 1
            self._prep(op_id, op)
            return
        del self._ops[op_id]
        op.fut.set_result(None)

    def _close_now(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._efd)
        lib.clb_ring_close(self._ring)
        self._ring = ffi.NULL
        os.close(self._efd)
        os.close(self._fd)

    async def aclose(self) -> None:
        """Wait for reads in flight (the kernel owns their buffers), then close the ring."""
        if self._closed:
            return
        await super().aclose()
        pending = [op.fut for op in self._ops.values()]
        if pending:
            await asyncio.wait(pending)
        self._close_now()
