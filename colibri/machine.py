"""This machine: what it has (memory, huge pages, mounts, CPU), what it measures (a drive's
record reads per queue depth, memory read bandwidth, the fastest kernel thread count), the
machine profile `colibri tune` writes and run / chat / plan read, and the decode bounds of
DESIGN.md §8 computed from those figures.

Profile: JSON at $XDG_CONFIG_HOME/colibri/machine.json (default ~/.config/colibri/...),
written atomically (temporary file + rename); fields in docs/OPERATIONS.md.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibri.errors import ColibriError

PROFILE_VERSION = 1
GB = 1e9


# ---- facts ---------------------------------------------------------------------------------
def meminfo() -> dict[str, int]:
    """/proc/meminfo as {field: value}; kB fields converted to bytes, counts (HugePages_*) as is."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def read_text(path: str, default: str = "") -> str:
    """A small /proc or /sys file's text, stripped; `default` when it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def cpu_model() -> str:
    for line in read_text("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def cpu_flags() -> set[str]:
    for line in read_text("/proc/cpuinfo").splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@dataclass(frozen=True)
class Mount:
    """The mount holding a path: mount point, file-system type, source device, and the
    device number "major:minor" (st_dev) that names the drive in the profile."""

    mountpoint: str
    fstype: str
    source: str
    device: str


def mount_of(path: str | os.PathLike[str]) -> Mount:
    """The mount that holds `path` (longest mount-point prefix in /proc/self/mounts).
    Raises OSError when `path` does not exist."""
    real = os.path.realpath(path)
    st = os.stat(real)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    best = ("/", "unknown", "unknown")
    for line in read_text("/proc/self/mounts").splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        src, mnt, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best[0]):
            best = (mnt, fstype, src)
    return Mount(best[0], best[1], best[2], device)


# file systems that keep files in RAM: O_DIRECT is accepted or refused but never aligned-checked
RAM_FILESYSTEMS = frozenset(("tmpfs", "ramfs", "hugetlbfs", "devtmpfs"))


def o_direct_state(path: str | os.PathLike[str]) -> tuple[str, str]:
    """("enforced" | "not enforced" | "refused", why) for O_DIRECT reads of the file `path`.
    tmpfs and other RAM file systems do not check alignment (DESIGN.md §4): "not enforced"."""
    m = mount_of(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        return "refused", f"{m.fstype} at {m.mountpoint} refuses O_DIRECT ({exc.strerror})"
    os.close(fd)
    if m.fstype in RAM_FILESYSTEMS:
        return "not enforced", f"{m.fstype} at {m.mountpoint} keeps the file in RAM"
    return "enforced", f"{m.fstype} at {m.mountpoint}"


# ---- measurements --------------------------------------------------------------------------
def memory_read_gbps(nbytes: int = 256 << 20, nthreads: int = 0, repeat: int = 3) -> float:
    """Memory read bandwidth, GB/s (1e9 bytes/s): the best of `repeat` streaming SIMD reads
    (ops.mem_read: vector loads, no stores, GIL released) of an `nbytes` buffer (far above L3)
    on `nthreads` kernel threads (0: os.cpu_count()), after one warm-up read: the memory read
    bound of DESIGN.md §8, measured as `colibri bench`'s limits section measures it."""
    from colibri.compute import ops

    nthreads = nthreads or os.cpu_count() or 1
    buf = np.ones(max(64, nbytes), np.uint8)
    ops.mem_read(buf, nthreads)  # page faults and first touch out of the timing
    best = math.inf
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        ops.mem_read(buf, nthreads)
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / GB


MEMORY_READ_METHOD = "streaming SIMD read (ops.mem_read) of a buffer far above L3, all threads"


@dataclass(frozen=True)
class DiskSweep:
    """Random record-sized reads of one file through colibri's reader: `gbps[qd]` in GB/s,
    the reader's backend and whether O_DIRECT was on (buffered reads may measure the page
    cache), the file's mount, the record size in bytes."""

    path: str
    mount: Mount
    record_nbytes: int
    backend: str
    direct: bool
    gbps: dict[int, float]

    @property
    def best_qd(self) -> int:
        """The smallest queue depth within 5% of the best figure."""
        top = max(self.gbps.values())
        return min(q for q, v in self.gbps.items() if v >= 0.95 * top)

    def at(self, qd: int) -> float:
        """GB/s at the measured queue depth nearest `qd` from below (else the smallest)."""
        below = [q for q in self.gbps if q <= qd]
        return self.gbps[max(below) if below else min(self.gbps)]


def disk_sweep(
    path: str | os.PathLike[str],
    record_nbytes: int,
    offsets: Sequence[int],
    qds: Sequence[int] = (1, 4, 16, 32),
    seconds: float = 0.3,
    io: str = "auto",
) -> DiskSweep:
    """Read random records (`record_nbytes` at the given offsets, each 4096-aligned) of `path`
    with colibri's own reader (io_uring + O_DIRECT, else its fallback) for about `seconds` per
    queue depth. Raises OSError / ReadError when the file cannot be read."""
    from colibri.io.format import ExpertRecord
    from colibri.io.reader import open_reader
    from colibri.io.slab import SlabPool

    if not offsets:
        raise ColibriError(f"{path}: no records to read")
    depth = max(qds)
    rng = random.Random(0)

    async def run() -> tuple[str, bool, dict[int, float]]:
        pool = SlabPool(record_nbytes, depth, backing="normal")
        reader = open_reader(path, io, pool=pool, queue_depth=depth)
        out: dict[int, float] = {}
        try:
            for qd in qds:
                deadline = time.perf_counter() + seconds
                done = [0]

                async def worker(slot: int, done: list[int] = done, deadline: float = deadline):
                    while time.perf_counter() < deadline:
                        off = offsets[rng.randrange(len(offsets))]
                        await reader.read_into(ExpertRecord(-1, -1, off, record_nbytes, 0), slot)
                        done[0] += 1

                t0 = time.perf_counter()
                await asyncio.gather(*(worker(s) for s in range(qd)))
                out[qd] = done[0] * record_nbytes / (time.perf_counter() - t0) / GB
            return reader.backend, reader.direct, out
        finally:
            await reader.aclose()
            pool.close()

    backend, direct, gbps = asyncio.run(run())
    return DiskSweep(os.fspath(path), mount_of(path), record_nbytes, backend, direct, gbps)


def store_sweep(
    store: Any, experts_path: str | os.PathLike[str] | None = None, **kw: Any
) -> DiskSweep:
    """disk_sweep over a store's experts file (or a mirror copy of it) at its record size."""
    offsets = [r.offset for r in store.records]
    path = experts_path or store.experts_path
    return disk_sweep(path, int(store.layout.record_nbytes), offsets, **kw)


def best_threads(
    max_threads: int = 0, rows: int = 4096, cols: int = 4096, repeat: int = 5
) -> dict[int, float]:
    """Q4_0 matvec GB/s at 1..max_threads kernel threads (0: os.cpu_count()) on a weight of
    rows x cols (Q4_0 4096 x 4096 is 9 MiB); the caller picks the best."""
    from colibri.compute import ops

    max_threads = max_threads or os.cpu_count() or 1
    rng = np.random.default_rng(0)
    w = ops.quantize(rng.standard_normal((rows, cols), dtype=np.float32), "q4_0")
    x = rng.standard_normal(cols, dtype=np.float32)
    out = np.empty(rows, np.float32)
    res = {}
    for t in range(1, max_threads + 1):
        ops.matmul(w, "q4_0", x, out, nthreads=t)
        best = math.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(8):
                ops.matmul(w, "q4_0", x, out, nthreads=t)
            best = min(best, (time.perf_counter() - t0) / 8)
        res[t] = w.nbytes / best / GB
    return res


# ---- bounds (DESIGN.md §8) ------------------------------------------------------------------
def storage_seconds(bytes_per_token: float, disk_gbps: float) -> float:
    """Seconds per token to read `bytes_per_token` at `disk_gbps` (1e9 bytes/s)."""
    if disk_gbps <= 0:
        raise ValueError(f"disk bandwidth must be positive, got {disk_gbps} GB/s")
    return bytes_per_token / (disk_gbps * GB)


def rate(seconds: float) -> float:
    """Tokens/s of a per-token time (inf for 0: a bound that does not bind)."""
    return 1.0 / seconds if seconds > 0 else math.inf


def bounds(bytes_per_token: float, disk_gbps: float, compute_s: float) -> dict[str, float]:
    """The per-token bounds in tok/s: storage (1 / t_io), compute (1 / t_c), combined
    (1 / max(t_io, t_c): reads overlap compute) and serial (1 / (t_io + t_c): no overlap)."""
    t_io = storage_seconds(bytes_per_token, disk_gbps)
    return {
        "storage": rate(t_io),
        "compute": rate(compute_s),
        "combined": rate(max(t_io, compute_s)),
        "serial": rate(t_io + compute_s),
        "t_io": t_io,
        "t_compute": compute_s,
    }


# ---- the machine profile ---------------------------------------------------------------------
def profile_path() -> Path:
    """$XDG_CONFIG_HOME/colibri/machine.json (XDG_CONFIG_HOME defaults to ~/.config)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "colibri" / "machine.json"


@dataclass(frozen=True)
class MachineProfile:
    """What `colibri tune` measured. threads: fastest kernel thread count; memory_read_gbps
    (and how it was measured); memory_nbytes: RAM colibri may use in all (MemAvailable at
    tune time minus an OS reserve), from which run/chat/plan derive their default budget;
    drives: {device "major:minor": {"mountpoint", "fstype", "record_nbytes", "backend",
    "direct", "gbps": {qd: GB/s}, "queue_depth": best qd}}; path: where it was read from."""

    created: str
    cpu: str
    isa: str
    threads: int
    memory_read_gbps: float
    memory_read_method: str
    memory_nbytes: int
    drives: dict[str, dict[str, Any]]
    path: str = ""

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "path"}
        return {"version": PROFILE_VERSION, **d}

    def drive(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The measured drive holding `path`, or None."""
        try:
            return self.drives.get(mount_of(path).device)
        except OSError:
            return None

    def drive_gbps(self, path: str | os.PathLike[str], qd: int) -> float | None:
        """GB/s of the drive holding `path` at the measured queue depth nearest `qd` (from
        below), or None when that drive was not measured."""
        d = self.drive(path)
        if d is None:
            return None
        gbps = {int(q): float(v) for q, v in d["gbps"].items()}
        below = [q for q in gbps if q <= qd]
        return gbps[max(below) if below else min(gbps)]


def save_profile(profile: MachineProfile, path: str | os.PathLike[str] | None = None) -> Path:
    """Write the profile as JSON atomically (temporary file in the same directory, fsync,
    rename); returns its path."""
    out = Path(path) if path else profile_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(profile.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out


def load_profile(path: str | os.PathLike[str] | None = None) -> MachineProfile | None:
    """The profile at `path` (default profile_path()), None when there is none. Raises
    ColibriError naming the file and field when it is malformed or of another version."""
    p = Path(path) if path else profile_path()
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ColibriError(
            f"{p}: unreadable machine profile ({exc}); rerun `colibri tune`"
        ) from None
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
        got = data.get("version") if isinstance(data, dict) else None
        raise ColibriError(
            f"{p}: machine profile version {got!r}, this colibri reads {PROFILE_VERSION}; "
            "rerun `colibri tune`"
        )
    kinds: dict[str, Callable[[Any], Any]] = {
        "created": str,
        "cpu": str,
        "isa": str,
        "threads": int,
        "memory_read_gbps": float,
        "memory_read_method": str,
        "memory_nbytes": int,
        "drives": dict,
    }
    fields: dict[str, Any] = {}
    for key, kind in kinds.items():
        try:
            value = data[key]
            if kind is dict and not isinstance(value, dict):
                raise TypeError("not an object")
            fields[key] = kind(value)
        except (KeyError, TypeError, ValueError) as exc:
            raise ColibriError(f"{p}: machine profile field {key!r}: {exc}") from None
    if fields["threads"] < 1:
        raise ColibriError(f"{p}: machine profile field 'threads' must be >= 1")
    for dev, d in fields["drives"].items():
        if not isinstance(d, dict) or not isinstance(d.get("gbps"), dict) or not d["gbps"]:
            raise ColibriError(f"{p}: machine profile drives[{dev!r}].gbps missing")
    return MachineProfile(**fields, path=str(p))


def profile_defaults(
    profile: MachineProfile, experts_path: str | os.PathLike[str]
) -> dict[str, Any]:
    """Engine option defaults from a profile: threads, and queue_depth when the drive holding
    `experts_path` was measured (its best queue depth, at least 4)."""
    out: dict[str, Any] = {"threads": profile.threads}
    d = profile.drive(experts_path)
    if d is not None and d.get("queue_depth"):
        out["queue_depth"] = max(4, int(d["queue_depth"]))
    return out


def profile_budget(profile: MachineProfile, experts_nbytes: int, resident_nbytes: int) -> int:
    """The expert cache budget a profile gives: every expert if they fit in the profile's
    memory_nbytes after the resident bytes (dense weights + KV cache), else what is left
    (never below 0; the engine then refuses a budget too small for one layer's top-k)."""
    return max(0, min(experts_nbytes, profile.memory_nbytes - resident_nbytes))
