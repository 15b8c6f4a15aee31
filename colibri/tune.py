"""`colibri tune [STORE] [--mirror DIR ...]`: measure this machine once and save a profile.

Measures each drive that holds the store's experts file or a mirror of it (random
record-sized reads with colibri's own reader at queue depths 1..64), the memory read bandwidth
(colibri.machine.memory_read_gbps) and the fastest kernel thread count (a Q4_0 matvec at
1..N threads), then writes the machine profile (colibri.machine.profile_path(), atomically).
run, chat and plan take their defaults from it (threads, queue depth, budget) unless
`--no-profile` is given; their statistics line says when a profile was used.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any

from colibri import machine

QDS = (1, 2, 4, 8, 16, 32, 64)


def measure(
    store_path: Path,
    mirrors: list[str] = (),  # type: ignore[assignment]
    *,
    seconds: float = 0.5,
    qds: tuple[int, ...] = QDS,
    reserve_nbytes: int | None = None,
    log: Any = None,
) -> machine.MachineProfile:
    """Measure and return a MachineProfile (not saved). `reserve_nbytes`: RAM left to the OS
    (default max(1 GiB, 10% of MemTotal)); the profile's memory_nbytes is MemAvailable now
    minus that. Raises StoreError / OSError when the store or a mirror cannot be read."""
    from colibri.compute import ops
    from colibri.io.format import open_store

    def say(msg: str) -> None:
        if log is not None:
            print(msg, file=log, flush=True)

    store = open_store(store_path)
    files = [store.experts_path]
    if mirrors:
        from colibri.io.mirror import open_mirror

        files += [open_mirror(store, d).experts_path for d in mirrors]
    drives: dict[str, dict[str, Any]] = {}
    for f in files:
        mount = machine.mount_of(f)
        if mount.device in drives:
            continue
        sweep = machine.store_sweep(store, f, qds=qds, seconds=seconds)
        drives[mount.device] = {
            "mountpoint": mount.mountpoint,
            "fstype": mount.fstype,
            "source": mount.source,
            "file": str(f),
            "record_nbytes": sweep.record_nbytes,
            "backend": sweep.backend,
            "direct": sweep.direct,
            "gbps": {str(q): round(v, 4) for q, v in sweep.gbps.items()},
            "queue_depth": sweep.best_qd,
        }
        figs = ", ".join(f"QD{q} {v:.2f}" for q, v in sweep.gbps.items())
        where = f"{mount.device} {mount.source} ({mount.fstype})"
        say(f"drive {where}: {figs} GB/s -> QD {sweep.best_qd}")
    mem_gbps = machine.memory_read_gbps(256 << 20, repeat=3)
    say(f"memory read {mem_gbps:.1f} GB/s ({machine.MEMORY_READ_METHOD})")
    per_threads = machine.best_threads()
    top = max(per_threads.values())
    threads = min(t for t, v in per_threads.items() if v >= 0.95 * top)
    figs = ", ".join(f"{t}: {v:.1f}" for t, v in per_threads.items())
    say(f"Q4_0 matvec GB/s by threads {figs} -> {threads} threads")
    mem = machine.meminfo()
    reserve = reserve_nbytes
    if reserve is None:
        reserve = max(1 << 30, mem.get("MemTotal", 0) // 10)
    return machine.MachineProfile(
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        cpu=machine.cpu_model(),
        isa=ops.isa().name.lower(),
        threads=threads,
        memory_read_gbps=round(mem_gbps, 3),
        memory_read_method=machine.MEMORY_READ_METHOD,
        memory_nbytes=max(0, mem.get("MemAvailable", 0) - reserve),
        drives=drives,
    )


def configure_parser(p: argparse.ArgumentParser) -> None:
    from colibri.options import number, size_arg

    p.add_argument("model", nargs="?", default=None, help="a store (default: the demo model)")
    p.add_argument(
        "--mirror",
        action="append",
        default=[],
        metavar="DIR",
        help="a mirror of the store (colibri mirror) whose drive to measure too",
    )
    p.add_argument(
        "--seconds", type=number(0, lo_open=True), default=0.5, help="seconds per queue depth"
    )
    p.add_argument("--reserve", type=size_arg, help="RAM to leave to the OS (default 10%%, >= 1G)")
    p.add_argument("--out", help="profile path (default: $XDG_CONFIG_HOME/colibri/machine.json)")
    p.add_argument("--dry-run", action="store_true", help="measure and print, do not write")


def run_cli(args: argparse.Namespace) -> int:
    from colibri.run import DEMO_STORE

    profile = measure(
        Path(args.model) if args.model else DEMO_STORE,
        args.mirror,
        seconds=args.seconds,
        reserve_nbytes=args.reserve,
        log=sys.stdout,
    )
    print(f"memory for colibri: {profile.memory_nbytes / (1 << 30):.2f} GiB")
    if not args.dry_run:
        print(f"wrote {machine.save_profile(profile, args.out)}")
    return 0
