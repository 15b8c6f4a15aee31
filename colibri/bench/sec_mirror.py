"""Mirror section: expert reads spread over several copies of the experts file.

A synthetic experts file of 1 MiB checksummed records (512 MiB in quick mode, 1 GiB in full)
under --work (the disk measured), copied to each `--mirror DIR` given to `colibri bench`, else
to /dev/shm (tmpfs: RAM standing in for a second drive; this machine has one disk) and to a
second file on the same disk (two copies on one drive: no gain expected). Each figure reads
every record PASSES times (2 quick, 4 full) in random order at queue depth 32 through
colibri's UringReader (O_DIRECT) per copy alone, and through io/mirror.py's MirrorReader over
the copies, with equal weights and with weights from each copy's own GB/s measured in the
same round. Checksums are off in every contestant (this measures reads, not hashing). Rounds
are interleaved; medians are quoted.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from colibri.bench.report import Context, Headline, Section, interleave, median, table
from colibri.io.mirror import MirrorReader
from colibri.io.reader import open_reader
from colibri.io.replay import SyntheticStore
from colibri.io.slab import SlabPool

TITLE = "Several drives: reads over mirrored experts files"
RECORD = 1 << 20
QD = 32
PASSES = 2


def _read_pass(loop: Any, reader: Any, records: list, seed: int) -> float:
    """GB/s of reading every record once, in a seeded random order, `QD` in flight, on `loop`
    (one loop for the section: a UringReader serves the loop it first ran on)."""
    order = records * PASSES
    random.Random(seed).shuffle(order)

    async def run() -> float:
        it = iter(order)

        async def worker(slot: int) -> None:
            for rec in it:
                await reader.read_into(rec, slot)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(s) for s in range(QD)))
        return sum(r.nbytes for r in order) / (time.perf_counter() - t0) / 1e9

    return loop.run_until_complete(run())


def _copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    finally:  # interrupted: no partial copy left behind
        tmp.unlink(missing_ok=True)


def run(ctx: Context) -> Section:
    global PASSES
    n, PASSES = (512, 2) if ctx.quick else (1024, 4)
    base = ctx.work / f"mirror-{n}x{RECORD >> 20}M.bin"
    store = None
    if base.exists() and base.with_suffix(".xxh3.npy").exists():
        import numpy as np

        if base.stat().st_size == n * RECORD:
            sums = np.load(base.with_suffix(".xxh3.npy"))
            store = SyntheticStore(str(base), 1, n, RECORD, sums)
    if store is None:
        ctx.log(f"  writing {n} MiB of records to {base}")
        store = SyntheticStore.create(str(base), 1, n, RECORD)
        import numpy as np

        np.save(base.with_suffix(".xxh3.npy"), store._xxh3)
    records = [store.record(0, e) for e in range(n)]
    copies: dict[str, Path] = {"disk": base}
    cleanup: list[Path] = []
    dirs = [Path(d) for d in getattr(ctx, "mirrors", None) or []]
    if dirs:
        for i, d in enumerate(dirs):
            d.mkdir(parents=True, exist_ok=True)
            copies[f"mirror{i + 1} ({d})"] = d / base.name
            _copy(base, d / base.name)
            cleanup.append(d / base.name)
    else:
        shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="colibri-bench-mirror-"))
        copies["tmpfs"] = shm / base.name
        _copy(base, copies["tmpfs"])
        cleanup.append(shm)
        same = ctx.work / f"mirror-{n}x{RECORD >> 20}M.copy.bin"
        if not same.exists() or same.stat().st_size != base.stat().st_size:
            _copy(base, same)
        copies["disk copy 2"] = same
    loop = asyncio.new_event_loop()
    pool = SlabPool(RECORD, QD)
    readers = {k: open_reader(p, "auto", pool=pool, queue_depth=QD) for k, p in copies.items()}
    names = list(copies)
    seeds = iter(range(10**6))
    solo: dict[str, list[float]] = {k: [] for k in names}

    def single(k: str):
        def f() -> float:
            v = _read_pass(loop, readers[k], records, next(seeds))
            solo[k].append(v)
            return v

        return f

    combos = {"disk + tmpfs": ["disk", "tmpfs"], "disk + disk copy 2": ["disk", "disk copy 2"]}
    if dirs:
        combos = {"disk + " + " + ".join(names[1:]): names}
    mirrors: dict[str, MirrorReader] = {}
    for label, members in combos.items():
        # the same per-copy readers: a MirrorReader only routes (their counters add up)
        mirrors[f"{label}, equal"] = MirrorReader(
            [readers[k] for k in members], store, verify=False
        )
        mirrors[f"{label}, weighted"] = MirrorReader(
            [readers[k] for k in members], store, verify=False
        )
    shares: dict[str, list[float]] = {}

    def mirrored(label: str, members: list[str], weighted: bool):
        def f() -> float:
            m = mirrors[f"{label}, {'weighted' if weighted else 'equal'}"]
            if weighted:  # this round's own figures of each copy
                w = [solo[k][-1] for k in members]
                for c, wi in zip(m.copies, w, strict=True):
                    c.weight = wi / sum(w)
            before = [c.nbytes for c in m.copies]
            v = _read_pass(loop, m, records, next(seeds))
            got = [c.nbytes - b for c, b in zip(m.copies, before, strict=True)]
            shares[f"{label}, {'weighted' if weighted else 'equal'}"] = [g / sum(got) for g in got]
            return v

        return f

    runs: dict[str, Any] = {k: single(k) for k in names}
    for label, members in combos.items():
        runs[f"{label}, equal"] = mirrored(label, members, False)
        runs[f"{label}, weighted"] = mirrored(label, members, True)
    try:
        got = interleave(runs, ctx.rounds, ctx.log)
    finally:
        for r in readers.values():
            loop.run_until_complete(r.aclose())
        loop.close()
        pool.close()
        for p in cleanup:
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    med = {k: median(v) for k, v in got.items()}
    rows = []
    for k in names:
        rows.append([k, "1 copy", med[k], "100%", med[k]])
    for label, members in combos.items():
        own = sum(med[m] or 0 for m in members)
        for mode in ("equal", "weighted"):
            key = f"{label}, {mode}"
            split = " / ".join(f"{s:.0%}" for s in shares.get(key, []))
            rows.append([label, mode, med[key], split, own])
    md = [
        __doc__.split("\n\n", 1)[1].strip(),
        "",
        table(["copies", "weights", "GB/s", "split of bytes", "sum of the copies' own GB/s"], rows),
        "",
        f"{n} records of {RECORD >> 20} MiB read {PASSES} times per figure, {ctx.rounds} "
        f"interleaved rounds, readers: "
        + "; ".join(f"{k}: {r.backend}, {r.reason}" for k, r in readers.items())
        + ".",
        "Two copies on one drive share its bandwidth (their 'sum' is not reachable); copies on "
        "two devices add up to what the slower side lets through.",
    ]
    heads = []
    for label, members in combos.items():
        heads.append(
            Headline(
                f"mirrored reads, {label} (weighted)",
                "GB/s",
                med[f"{label}, weighted"],
                limit=sum(med[m] or 0 for m in members),
                limit_name="sum of the copies alone",
            )
        )
    data = {
        "record_nbytes": RECORD,
        "records": n,
        "gbps": got,
        "median": med,
        "shares": shares,
        "copies": {k: str(p) for k, p in copies.items()},
    }
    return Section("mirror", TITLE, "\n".join(md), data, [], heads)
