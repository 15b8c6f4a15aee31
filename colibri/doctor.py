"""`colibri doctor [STORE]`: why a run is slow (or will fail), one line per check.

Each line is `ok`, `warn` or `fail`, what was found, and for warn/fail the fix. Checks:
io_uring (and why not: kernel version, seccomp, /proc/sys/kernel/io_uring_disabled), O_DIRECT
on the store's file system (tmpfs does not enforce alignment), huge pages (reserved, THP mode),
free memory against the plan (colibri/plan.py), the store's drive (a short queue-depth sweep
of random records with colibri's own reader), memory read bandwidth, the CPU's instruction
set and the kernels that will run, and with --verify every record's checksum.
Exit status: 0 all ok, 1 warnings, 2 failures.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from colibri import machine
from colibri.errors import ColibriError

STATUS_CODE = {"ok": 0, "warn": 1, "fail": 2}
SLOW_DISK_GBPS = 0.5  # below this a storage-bound run is slow (NVMe does 2-7 GB/s)
SLOW_MEMORY_GBPS = 2.0  # one DDR4 channel does ~20 GB/s; shared machines read 3-10 here


@dataclass(frozen=True)
class Check:
    """One finding: status "ok" | "warn" | "fail", the check's name, what was found and (for
    warn/fail) the fix."""

    status: str
    name: str
    found: str
    fix: str = ""

    def line(self) -> str:
        fix = f" — fix: {self.fix}" if self.fix and self.status != "ok" else ""
        return f"{self.status:<4} {self.name}: {self.found}{fix}"


def check_io_uring() -> Check:
    from colibri.io import uring

    why = uring.uring_unavailable_reason()
    if why is None:
        return Check("ok", "io_uring", f"usable (kernel {platform.release()})")
    causes = []
    disabled = machine.read_text("/proc/sys/kernel/io_uring_disabled", "")
    if disabled in ("1", "2"):
        causes.append(f"/proc/sys/kernel/io_uring_disabled is {disabled}")
    for line in machine.read_text("/proc/self/status").splitlines():
        if line.startswith("Seccomp:") and line.split()[1] != "0":
            causes.append(f"a seccomp filter is active (Seccomp: {line.split()[1]})")
    release = platform.release()
    try:
        if tuple(int(x) for x in release.split(".")[:2]) < (5, 6):
            causes.append(f"kernel {release} is older than 5.6")
    except ValueError:
        pass
    fix = (
        "sysctl kernel.io_uring_disabled=0"
        if disabled in ("1", "2")
        else "allow io_uring_setup in the container's seccomp profile (docker: "
        "--security-opt seccomp=unconfined) or use a kernel >= 5.6"
    )
    if "not built" in why or "without liburing" in why:
        fix = "install liburing-dev and rebuild (scripts/dev-build)"
    cause = f"; {', '.join(causes)}" if causes else ""
    return Check(
        "warn",
        "io_uring",
        f"unavailable ({why}{cause}); expert reads fall back to a thread pool (pread)",
        fix,
    )


def check_o_direct(path: Path) -> Check:
    state, why = machine.o_direct_state(path)
    if state == "enforced":
        return Check("ok", "O_DIRECT", f"enforced on {why}")
    if state == "not enforced":
        return Check(
            "ok",
            "O_DIRECT",
            f"not enforced: {why} (reads are memory copies; alignment errors would not show)",
        )
    return Check(
        "warn",
        "O_DIRECT",
        f"{why}: buffered reads, the page cache holds a second copy of what is read",
        "put the store on ext4, xfs or btrfs",
    )


def check_huge_pages(slab_nbytes: int) -> Check:
    mem = machine.meminfo()
    total, free = mem.get("HugePages_Total", 0), mem.get("HugePages_Free", 0)
    need = -(-slab_nbytes // (2 << 20))
    thp = machine.read_text("/sys/kernel/mm/transparent_hugepage/enabled", "[unknown]")
    mode = thp[thp.find("[") + 1 : thp.find("]")] if "[" in thp else thp
    found = f"{total} reserved ({free} free; the slab pool needs {need}), THP {mode}"
    if free >= need:
        return Check("ok", "huge pages", found + ": the slab pool uses reserved huge pages")
    if mode in ("always", "madvise"):
        return Check("ok", "huge pages", found + ": the slab pool asks for transparent ones")
    return Check(
        "warn",
        "huge pages",
        found + ": the slab pool gets normal 4 KiB pages (more TLB misses)",
        f"echo madvise > /sys/kernel/mm/transparent_hugepage/enabled, or sysctl "
        f"vm.nr_hugepages={need}",
    )


def check_memory(plan: dict) -> Check:
    m = plan["memory"]
    need = m["dense_nbytes"] + m["kv_nbytes"] + m["expert_cache_nbytes"] + m["runtime_nbytes"]
    gib = 1 << 30
    found = (
        f"the plan needs {need / gib:.2f} GiB (budget {m['budget_nbytes'] / gib:.2f} GiB), "
        f"{m['available_nbytes'] / gib:.2f} GiB available"
    )
    swap = [w for w in plan["warnings"] if "swap" in w or "leaves the OS" in w]
    refused = [w for w in plan["warnings"] if "the engine will refuse it" in w]
    if refused:  # --budget below one layer's top-k records: `colibri run` stops at once
        return Check("fail", "memory", refused[0], "raise --budget (see `colibri plan`)")
    if m["available_nbytes"] and need > m["available_nbytes"]:
        return Check("fail", "memory", found, "lower --budget (see `colibri plan`)")
    if swap:
        return Check("warn", "memory", found + f"; {swap[0]}", "lower --budget")
    return Check("ok", "memory", found)


def check_drive(store) -> Check:
    sweep = machine.store_sweep(store, qds=(1, 8, 32), seconds=0.2)
    figs = ", ".join(f"QD{q} {v:.2f}" for q, v in sweep.gbps.items())
    m = sweep.mount
    found = (
        f"{m.source} ({m.fstype}), {sweep.record_nbytes >> 10} KiB records: {figs} GB/s "
        f"({sweep.backend}, {'O_DIRECT' if sweep.direct else 'buffered'})"
    )
    if m.fstype in machine.RAM_FILESYSTEMS or not sweep.direct:
        return Check("ok", "drive", found + "; that is memory (or the page cache), not a drive")
    best = max(sweep.gbps.values())
    if best < SLOW_DISK_GBPS:
        return Check(
            "warn",
            "drive",
            found + f"; below {SLOW_DISK_GBPS} GB/s, a storage-bound run will crawl",
            "a bigger --budget, an NVMe drive, or `colibri mirror` onto a second drive",
        )
    return Check("ok", "drive", found)


def check_memory_bandwidth() -> Check:
    gbps = machine.memory_read_gbps(128 << 20, repeat=2)
    found = f"{gbps:.1f} GB/s read ({machine.MEMORY_READ_METHOD})"
    if gbps < SLOW_MEMORY_GBPS:
        return Check("warn", "memory bandwidth", found, "another process is using the memory bus?")
    return Check("ok", "memory bandwidth", found)


def check_cpu() -> Check:
    from colibri.compute import ops

    flags = machine.cpu_flags()
    have = [
        f
        for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8")
        if f in flags
    ]
    cur, best = ops.isa(), ops.best_isa()
    found = (
        f"{machine.cpu_model()}, {os.cpu_count()} CPUs ({', '.join(have) or 'no AVX'}); "
        f"{cur.name.lower()} kernels will run, {ops.default_threads()} threads"
    )
    if ops.amx():
        found += "; AMX tiles for the prefill GEMM (Q4_0/Q8_0)"
    elif ops.amx_supported() and cur == ops.ISA.AVX512:
        found += "; AMX usable but off (COLIBRI_AMX=0)"
    if cur < best:
        return Check(
            "warn",
            "cpu",
            found + f" (this CPU can run {best.name.lower()})",
            "unset COLIBRI_ISA",
        )
    if cur == ops.ISA.SCALAR:
        return Check("warn", "cpu", found + " (no AVX2: slow scalar kernels)", "an AVX2 CPU")
    return Check("ok", "cpu", found)


def check_integrity(store) -> Check:
    try:
        store.verify_all()
    except ColibriError as exc:
        return Check(
            "fail", "integrity", str(exc), "re-convert the store, or copy it again from a mirror"
        )
    return Check("ok", "integrity", f"all {len(store.records)} records match their checksums")


def run_checks(path: Path, *, verify: bool = False, **plan_options) -> list[Check]:
    """Every check on the store at `path`, in order. A check that raises becomes a "fail"."""
    from colibri.io.format import open_store
    from colibri.plan import make_plan

    checks: list[Check] = [check_io_uring()]

    def guarded(name: str, fn: Callable[[], Check]) -> None:
        try:
            checks.append(fn())
        except (ColibriError, OSError, ValueError) as exc:
            checks.append(Check("fail", name, f"{exc}"))

    try:
        store = open_store(path)
    except (ColibriError, OSError) as exc:
        checks.append(Check("fail", "store", str(exc), "check the path, or convert again"))
        guarded("memory bandwidth", check_memory_bandwidth)
        guarded("cpu", check_cpu)
        return checks
    profile = None
    try:
        profile = machine.load_profile()
        found = f"{profile.path} ({profile.created})" if profile else "none: run/chat use defaults"
        checks.append(Check("ok", "profile", found + ("" if profile else "; `colibri tune`")))
    except ColibriError as exc:
        checks.append(Check("warn", "profile", str(exc), "rerun `colibri tune`"))
    plan = make_plan(store, profile=profile, measure=False, **plan_options)
    guarded("O_DIRECT", lambda: check_o_direct(store.experts_path))
    guarded("huge pages", lambda: check_huge_pages(plan["memory"]["expert_cache_nbytes"]))
    guarded("memory", lambda: check_memory(plan))
    guarded("drive", lambda: check_drive(store))
    guarded("memory bandwidth", check_memory_bandwidth)
    guarded("cpu", check_cpu)
    if verify:
        guarded("integrity", lambda: check_integrity(store))
    return checks


def exit_status(checks: list[Check]) -> int:
    """0 when every check is ok, 1 with warnings, 2 with a failure."""
    return max((STATUS_CODE[c.status] for c in checks), default=0)


def configure_parser(p: argparse.ArgumentParser) -> None:
    from colibri.options import ctx_tokens, positive_size

    p.add_argument("model", nargs="?", default=None, help="a store (default: the demo model)")
    p.add_argument("--verify", action="store_true", help="also check every record's checksum")
    p.add_argument("--budget", type=positive_size, help="expert cache budget the run will use")
    p.add_argument(
        "--ctx", dest="n_ctx", type=ctx_tokens, default=None, help="context length, tokens"
    )
    p.add_argument("--kv", dest="kv_dtype", choices=("f32", "f16"), default="f32")


def run_cli(args: argparse.Namespace) -> int:
    from colibri.run import DEMO_STORE

    opts = {"budget": args.budget, "kv_dtype": args.kv_dtype}
    if args.n_ctx:
        opts["n_ctx"] = args.n_ctx
    checks = run_checks(Path(args.model) if args.model else DEMO_STORE, verify=args.verify, **opts)
    for c in checks:
        print(c.line())
    status = exit_status(checks)
    print(["all ok", "warnings", "failures"][status], file=sys.stderr)
    return status
