"""SlabPool: fixed-size, O_DIRECT-aligned slots that expert records are read into.

One anonymous mapping holds every slot, so it can be registered with io_uring as fixed
buffers (one per slot) and its resident memory measured. Backing, in order of preference:
MAP_HUGETLB when huge pages are reserved (/proc/meminfo HugePages_Free), else transparent huge
pages (madvise(MADV_HUGEPAGE), failure tolerated), else normal pages; `statistics()` says which
and why. Slots are plain indices handed out as leases: `acquire_nowait()` / `await acquire()`,
then `release(slot)`; a slot is never handed out twice before it is released.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import mmap
import os
from dataclasses import dataclass

import numpy as np

SLOT_ALIGN = 4096  # O_DIRECT: buffers aligned to the logical block size; 4096 is always safe
HUGE_PAGE_NBYTES = 2 << 20
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)  # x86-64 / arm64 value


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _hugepages_free() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("HugePages_Free:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass(frozen=True, slots=True)
class SlabStatistics:
    """backing: "hugetlb" | "thp" | "normal" (and why, in backing_reason).
    mapping_nbytes: bytes mapped; resident_nbytes: bytes of the mapping actually in RAM
    (measured from /proc/self/smaps, not computed)."""

    backing: str
    backing_reason: str
    slot_nbytes: int
    num_slots: int
    num_free: int
    num_waiting: int
    mapping_nbytes: int
    resident_nbytes: int


class SlabPool:
    """`num_slots` slots of `slot_nbytes` bytes (rounded up to 4096), each 4096-aligned.

    Args:
        slot_nbytes: bytes per slot (the largest record); rounded up to SLOT_ALIGN.
        num_slots: number of slots (>= 1).
        backing: "auto" (hugetlb > thp > normal), or force "hugetlb" | "thp" | "normal".
    Raises:
        ValueError: bad sizes; OSError: the mapping failed (or forced hugetlb unavailable).
    """

    def __init__(self, slot_nbytes: int, num_slots: int, *, backing: str = "auto") -> None:
        if slot_nbytes <= 0 or num_slots <= 0:
            raise ValueError(
                f"SlabPool: slot_nbytes={slot_nbytes} and num_slots={num_slots} must be positive"
            )
        self.slot_nbytes = _round_up(slot_nbytes, SLOT_ALIGN)
        self.num_slots = num_slots
        self._mm, self.backing, self.backing_reason = self._map(backing)
        self._array = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = self._array.ctypes.data  # base address (for fixed-buffer registration)
        self._free: collections.deque[int] = collections.deque(range(num_slots))
        self._leased = bytearray(num_slots)
        self._waiters: collections.deque[asyncio.Future[int]] = collections.deque()

    @staticmethod
    def mapping_nbytes_for(slot_nbytes: int, num_slots: int, backing: str) -> int:
        """Bytes the mapping of such a pool occupies (hugetlb rounds up to 2 MiB)."""
        n = _round_up(slot_nbytes, SLOT_ALIGN) * num_slots
        return _round_up(n, HUGE_PAGE_NBYTES) if backing == "hugetlb" else n

    def _map(self, backing: str) -> tuple[mmap.mmap, str, str]:
        if backing not in ("auto", "hugetlb", "thp", "normal"):
            raise ValueError(f"SlabPool: unknown backing {backing!r}")
        size = self.slot_nbytes * self.num_slots
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        reason = ""
        if backing in ("auto", "hugetlb"):
            need = _round_up(size, HUGE_PAGE_NBYTES) // HUGE_PAGE_NBYTES
            free = _hugepages_free()
            if free >= need:
                try:
                    mm = mmap.mmap(-1, need * HUGE_PAGE_NBYTES, flags=flags | _MAP_HUGETLB)
                    return mm, "hugetlb", f"{need} of {free} reserved huge pages"
                except OSError as exc:
                    reason = f"MAP_HUGETLB failed ({exc.strerror}); "
            else:
                reason = f"{free} huge pages reserved, {need} needed; "
            if backing == "hugetlb":
                raise OSError(f"SlabPool: hugetlb backing unavailable: {reason.rstrip('; ')}")
        mm = mmap.mmap(-1, size, flags=flags)
        if backing in ("auto", "thp"):
            try:
                mm.madvise(mmap.MADV_HUGEPAGE)
                mode = _thp_mode()
                if mode != "never":
                    return mm, "thp", reason + f"madvise(MADV_HUGEPAGE), THP mode {mode}"
                reason += "transparent huge pages disabled; "
            except (OSError, AttributeError) as exc:
                reason += f"madvise(MADV_HUGEPAGE) refused ({exc}); "
        return mm, "normal", (reason + "normal pages").strip()

    # -- slots ---------------------------------------------------------------------------------
    def view(self, slot: int) -> np.ndarray:
        """uint8 [slot_nbytes] view of one slot (valid while the pool is open)."""
        start = slot * self.slot_nbytes
        return self._array[start : start + self.slot_nbytes]

    def slot_address(self, slot: int) -> int:
        return self.address + slot * self.slot_nbytes

    def acquire_nowait(self) -> int | None:
        """A free slot index, or None when every slot is leased. Never blocks."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._leased[slot] = 1
        return slot

    async def acquire(self) -> int:
        """A free slot, waiting (FIFO) until one is released. Cancellation is safe: a slot handed
        to a waiter that was cancelled meanwhile goes back to the pool."""
        slot = self.acquire_nowait()
        if slot is not None:
            return slot
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())
            else:
                self._waiters.remove(fut)
            raise

    def release(self, slot: int) -> None:
        """Give a leased slot back. Raises RuntimeError on a double release."""
        if not self._leased[slot]:
            raise RuntimeError(f"SlabPool: slot {slot} released twice")
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(slot)  # stays leased, handed over
                return
        self._leased[slot] = 0
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def resident_nbytes(self) -> int:
        """Bytes of this pool's mapping resident in RAM, measured page by page (mincore(2))."""
        return _resident_nbytes(self.address, len(self._mm))

    def statistics(self) -> SlabStatistics:
        return SlabStatistics(
            self.backing,
            self.backing_reason,
            self.slot_nbytes,
            self.num_slots,
            len(self._free),
            len(self._waiters),
            len(self._mm),
            self.resident_nbytes(),
        )

    def close(self) -> None:
        """Unmap. Views handed out must be gone (numpy keeps the buffer exported otherwise)."""
        del self._array
        # a view still alive keeps the mapping: it goes when the last view does
        with contextlib.suppress(BufferError):
            self._mm.close()


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
        return text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        return "unknown"


_libc = ctypes.CDLL(None, use_errno=True)


def _resident_nbytes(address: int, nbytes: int) -> int:
    """Bytes of [address, address + nbytes) resident in RAM, from mincore(2). (Rss in
    /proc/self/smaps is per mapping, and the kernel may merge this mapping with a neighbour.)
    Raises OSError when mincore fails."""
    page = mmap.PAGESIZE
    vec = (ctypes.c_ubyte * ((nbytes + page - 1) // page))()
    if _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore on the slab pool: {os.strerror(err)}")
    return int(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1)) * page
