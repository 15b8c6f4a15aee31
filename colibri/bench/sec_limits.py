"""`colibri bench` section "limits": what this machine's disk and memory can do at best.

Disk: fio (io_uring, O_DIRECT, fixed buffers, batched submission: bench/io.py `run_fio`) reading
uniformly random expert-record-sized blocks of a file under ctx.work, queue depth 1..64; and
colibri's UringReader (bench/io.py `run_reader`) at the same record size and QD 1/8/32, the two
interleaved round by round. Memory: a streaming SIMD read in C (colibri/bench/kernels.py
`read_bandwidth`, the read bound `memory_gbps` returns) and beside it numpy copies
(`copy_bandwidth`, read + write bytes counted), at 1 thread and at ctx.threads.

Later sections ask `disk_gbps(ctx, record_nbytes, qd)` and `memory_gbps(ctx)`, which read these
figures (measuring on demand when this section did not run).
"""

from __future__ import annotations

import asyncio
import bisect
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from colibri.bench import io as bench_io
from colibri.bench import kernels as bench_kernels
from colibri.bench.report import Context, Headline, Section, fmt, interleave, median, table
from colibri.io.format import ExpertLayout

TITLE = "Disk and memory limits"

# One Qwen3-30B-A3B q4_0 expert record (gate + up [768, 2048], down [2048, 768], 4 KiB-padded):
# 2,654,208 bytes = 2.53 MiB.
QWEN3_RECORD_NBYTES = ExpertLayout.build("q4_0", 2048, 768).record_nbytes
# A Mixtral-8x7B q4_0 record is 94.5 MiB (99,090,432 bytes): too big to sweep QD 1..64, so it is
# swept as 4 MiB reads; bigger records are looked up there with the same bytes in flight.
CHUNK_NBYTES = 4 << 20
QDS = (1, 2, 4, 8, 16, 32, 64)
READER_QDS = (1, 8, 32)
HEADLINE_QD = 32
MEM_NBYTES = 256 << 20  # copied per run (split over the threads), far beyond L3
MEM_READ_NBYTES = 1 << 30  # read per run by the kernel pool, far beyond L3
MEM_REPEAT = 5  # copies per round (best taken); the report quotes the median over rounds
MIN_ROUNDS = 3  # this shared disk varies 2-3x run to run: never fewer rounds than this
HEADROOM = 2 << 30  # free space left on the disk after writing the fio file


# the random-read file: quick 2 GiB, full 8 GiB (more than any cache in front of the disk)
QUICK_FILE, FULL_FILE = 2 << 30, 8 << 30


def ensure_file(ctx: Context) -> tuple[Path | None, str]:
    """The fio file under ctx.work, written once (random bytes, temp + rename) and reused: the
    8 GiB file serves both modes (a full run that writes it removes the 2 GiB one to spare the
    shared disk); quick mode writes 2 GiB when there is no 8 GiB file. Returns (path, note);
    path None, with the reason in note, when the disk has no room."""
    small, big = (ctx.work / f"limits-randread-{n >> 30}GiB.bin" for n in (QUICK_FILE, FULL_FILE))
    have = {p: p.exists() and p.stat().st_size == n for p, n in ((small, QUICK_FILE),
                                                                 (big, FULL_FILE))}  # fmt: skip
    if have[big] or (ctx.quick and have[small]):
        return (big if have[big] else small), ""
    path, nbytes = (small, QUICK_FILE) if ctx.quick else (big, FULL_FILE)
    spare = QUICK_FILE if have[small] and not ctx.quick else 0  # removed once the big one exists
    if ctx.free_bytes() + spare < nbytes + HEADROOM and have[small]:
        return small, f"{FULL_FILE >> 30} GiB file does not fit on {ctx.work}: using 2 GiB"
    if ctx.free_bytes() + spare < nbytes + HEADROOM:
        return None, (
            f"disk benchmark skipped: {ctx.free_bytes() / 2**30:.1f} GiB free under {ctx.work}, "
            f"{(nbytes + HEADROOM) / 2**30:.0f} GiB needed"
        )
    if spare:
        small.unlink()
    ctx.log(f"writing {nbytes >> 30} GiB of random bytes to {path} ...")
    bench_io.write_file(str(path), nbytes)
    bench_io.drop_cache(str(path))  # O_DIRECT skips the page cache anyway: give the RAM back
    return path, ""


def fio_gbps(ctx: Context, path: Path, rec: int, qd: int, total: int, seed: int) -> float:
    """GB/s (1e9 B/s) of fio random reads of `rec` bytes at queue depth `qd`, `total` bytes; the
    exact fio command goes to the report (colibri/bench/io.py run_fio runs it)."""
    return bench_io.run_fio(str(path), rec, qd, total, path.stat().st_size, seed, run=ctx.run)


def reader_gbps(
    path: Path, rec: int, qd: int, total: int, seed: int, backing: str = "auto"
) -> float:
    """GB/s of colibri's UringReader reading total // rec distinct random records of `rec` bytes
    with `qd` reads in flight (each record at most once, like fio's random map), into a SlabPool
    with the given backing ("auto": huge pages when it can; "normal": 4 KiB pages, like fio's
    buffers)."""
    num_records = path.stat().st_size // rec
    num_reads = min(num_records, max(qd, total // rec))
    rng = np.random.default_rng(seed)
    offsets = [int(i) * rec for i in rng.permutation(num_records)[:num_reads]]
    gbs, _stats = asyncio.run(bench_io.run_reader(str(path), "uring", rec, qd, offsets, backing))
    return gbs


def best_disk(fio_runs: list[float], reader_runs: list[float]) -> tuple[float, str]:
    """The disk rate a storage bound divides by, from runs of fio and of colibri's UringReader
    measured in the same rounds on the same file: the higher median, and which one it was
    ("fio" | "colibri's reader"). A bound on fio alone can sit below what colibri reached
    (huge-page slabs on a disk that splits reads at 4 KiB-page segments; limits section), and a
    bound below what was reached is not a bound. GB/s; raises ValueError when both are empty."""
    meds = {n: median(r) for n, r in (("fio", fio_runs), ("colibri's reader", reader_runs)) if r}
    if not meds:
        raise ValueError("best_disk: no disk runs")
    name = max(meds, key=meds.get)
    return meds[name], name


def _read_nbytes(ctx: Context, rec: int, qd: int) -> int:
    """Bytes per run: enough for a few hundred ms at this QD (QD 1 is slow; keep it short)."""
    base = (256 if ctx.quick else 1024) << 20
    return max(rec * qd * 4, base // (4 if qd == 1 else 2 if qd == 2 else 1))


def lookup_point(record_nbytes: int, qd: int) -> tuple[int, int]:
    """(record bytes, QD) at which to look up a read of `record_nbytes` at queue depth `qd`:
    records above CHUNK_NBYTES are read by the kernel in pieces anyway, so they map to
    CHUNK_NBYTES at the same bytes in flight (QD x record / chunk, capped at 64)."""
    if record_nbytes <= CHUNK_NBYTES:
        return record_nbytes, qd
    return CHUNK_NBYTES, min(max(QDS), qd * math.ceil(record_nbytes / CHUNK_NBYTES))


def interpolate_qd(points: dict[int, float], qd: float) -> float:
    """GB/s at queue depth `qd` from measured {qd: GB/s}: linear in log2(QD) between the two
    neighbours, clamped to the ends. Raises ValueError when points is empty or qd < 1."""
    if not points or qd < 1:
        raise ValueError(f"need measured points and qd >= 1 (qd={qd}, points={points})")
    qs = sorted(points)
    if qd <= qs[0]:
        return points[qs[0]]
    if qd >= qs[-1]:
        return points[qs[-1]]
    hi = bisect.bisect_left(qs, qd)
    lo = hi - 1
    if qs[hi] == qd:
        return points[qd]
    f = (math.log2(qd) - math.log2(qs[lo])) / (math.log2(qs[hi]) - math.log2(qs[lo]))
    return points[qs[lo]] + f * (points[qs[hi]] - points[qs[lo]])


def nearest_record(disk: list[dict[str, Any]], record_nbytes: int) -> int | None:
    """The measured record size closest to record_nbytes in ratio (None when none is within
    2x: then it is worth measuring)."""
    sizes = {d["record_nbytes"] for d in disk}
    if not sizes:
        return None
    best = min(sizes, key=lambda s: abs(math.log(s / record_nbytes)))
    return best if abs(math.log(best / record_nbytes)) <= math.log(2) else None


def _limits(ctx: Context) -> dict[str, Any]:
    return ctx.results.setdefault("limits", {})


def disk_gbps(ctx: Context, record_nbytes: int, qd: int) -> float:
    """The disk's random-read limit (io_uring, O_DIRECT) in GB/s for records of `record_nbytes`
    bytes with `qd` reads in flight: from the limits section's sweep (nearest record size within
    2x, interpolated in log2 QD; records > 4 MiB via `lookup_point`), at each point the higher
    of fio and UringReader (on a disk that splits reads at 4 KiB-page segments, colibri's
    huge-page slab reads faster than fio: the bound must not be below what was reached); else
    measured now with fio (median of >= 3 runs) and remembered in ctx.results["limits"]["disk"].
    Raises RuntimeError when it must measure and the disk has no room for the file."""
    rec, q = lookup_point(record_nbytes, qd)
    disk = _limits(ctx).setdefault("disk", [])
    best: dict[tuple[int, int], float] = {}
    for d in disk + _limits(ctx).get("reader", []):
        key = (d["record_nbytes"], d["qd"])
        best[key] = max(best.get(key, 0.0), d["gbps"])
    near = nearest_record(disk, rec)
    if near is not None:
        pts = {q_: g for (r_, q_), g in best.items() if r_ == near}
        if min(pts) <= q <= max(pts) or q in pts:
            return interpolate_qd(pts, q)
    rec = max(4096, rec // 4096 * 4096)
    path, note = ensure_file(ctx)
    if path is None:
        raise RuntimeError(f"disk_gbps({record_nbytes}, {qd}): {note}")
    ctx.log(f"limits: measuring the disk on demand, {rec} B reads at QD {q}")
    runs = [fio_gbps(ctx, path, rec, q, _read_nbytes(ctx, rec, q), 7000 + r)
            for r in range(max(MIN_ROUNDS, ctx.rounds))]  # fmt: skip
    gbps = float(median(runs))
    disk.append({"record_nbytes": rec, "qd": q, "gbps": gbps, "runs": runs, "on_demand": True})
    return gbps


def _measure_memory(ctx: Context) -> dict[str, Any]:
    """Interleaved 1-thread / ctx.threads streaming SIMD reads (colibri/bench/kernels.py
    `read_bandwidth`, the bound) and numpy copies beside them; medians of at least 3 rounds."""
    threads = sorted({1, ctx.threads})
    copy, read = bench_kernels.copy_bandwidth, bench_kernels.read_bandwidth
    runs = {f"{t}t": (lambda t=t: read(MEM_READ_NBYTES, t, MEM_REPEAT)) for t in threads}
    runs |= {f"copy {t}t": (lambda t=t: copy(MEM_NBYTES, t, MEM_REPEAT)) for t in threads}
    res = interleave(runs, max(MIN_ROUNDS, ctx.rounds), ctx.log)
    one, all_ = median(res["1t"]), median(res[f"{ctx.threads}t"])
    c1, cn = median(res["copy 1t"]), median(res[f"copy {ctx.threads}t"])
    return {
        "mem_gbps": max(one, all_),  # N threads can always do what one does
        "mem_gbps_1t": one,
        "mem_gbps_nt_measured": all_,
        "mem_read_nbytes": MEM_READ_NBYTES,
        "copy_gbps_1t": c1,
        "copy_gbps_nt": cn,
        "mem_runs": res,
        "mem_copy_nbytes": MEM_NBYTES,
    }


def memory_gbps(ctx: Context) -> float:
    """Memory read bandwidth in GB/s (streaming SIMD read in C, ctx.threads threads; the
    compute bound's limit, DESIGN.md §8) from the limits section, else measured now and
    remembered in ctx.results["limits"]."""
    lim = _limits(ctx)
    if lim.get("mem_gbps") is None:
        lim.update(_measure_memory(ctx))
    return float(lim["mem_gbps"])


def _plot(ctx: Context, disk: list[dict], reader: list[dict], small_pages: list[dict],
          mem: dict[str, Any]) -> str:  # fmt: skip
    import matplotlib.pyplot as plt

    fig, (ax, axm) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [3, 1]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    peak = max((d["gbps"] for d in disk), default=None)
    for i, rec in enumerate(sorted({d["record_nbytes"] for d in disk})):
        pts = sorted((d["qd"], d["gbps"]) for d in disk if d["record_nbytes"] == rec)
        c = colors[i % len(colors)]
        ax.plot(*zip(*pts, strict=True), "o-", color=c, label=f"fio, {rec / 2**20:.2f} MiB reads")
        rp = sorted((r["qd"], r["gbps"]) for r in reader if r["record_nbytes"] == rec)
        if rp:
            ax.plot(*zip(*rp, strict=True), "s--", color=c, ms=8, mfc="none",
                    label=f"colibri UringReader, {rec / 2**20:.2f} MiB")  # fmt: skip
        sp = [(r["qd"], r["gbps"]) for r in small_pages if r["record_nbytes"] == rec]
        if sp:
            ax.plot(*zip(*sp, strict=True), "x", color=c, ms=9,
                    label=f"UringReader, 4 KiB-page slab, {rec / 2**20:.2f} MiB")  # fmt: skip
    if peak:
        ax.axhline(peak, ls=":", color="gray", label=f"best fio {peak:.2f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(QDS, [str(q) for q in QDS])
    ax.set_xlabel("queue depth (reads in flight)")
    ax.set_ylabel("GB/s (10⁹ B/s)")
    ax.set_ylim(bottom=0)
    ax.set_title("Random expert-record reads, O_DIRECT, io_uring")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    labels = ["1 thread", f"{ctx.threads} threads"]
    vals = [mem["mem_gbps_1t"], mem["mem_gbps_nt_measured"]]
    bars = axm.bar(labels, vals, color=[colors[2], colors[3]])
    axm.bar_label(bars, fmt="%.1f")
    axm.set_ylabel("GB/s (read)")
    axm.set_title("Memory (streaming SIMD read)")
    axm.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    name = "limits_disk.png"
    fig.savefig(ctx.figure(name), dpi=110)
    plt.close(fig)
    return name


def run(ctx: Context) -> Section:
    """Measure the disk sweep, the reader beside it and the memory bandwidth; see the module
    docstring. Returns the Section (data keys mem_gbps, mem_gbps_1t, disk, reader)."""
    data: dict[str, Any] = {"qwen3_record_nbytes": QWEN3_RECORD_NBYTES,
                            "chunk_nbytes": CHUNK_NBYTES}  # fmt: skip
    md: list[str] = []
    heads: list[Headline] = []
    ctx.log("limits: memory bandwidth")
    mem = _measure_memory(ctx)
    data.update(mem)

    recs = [QWEN3_RECORD_NBYTES] if ctx.quick else [QWEN3_RECORD_NBYTES, CHUNK_NBYTES]
    path, note = (None, "fio not found (apt-get install fio)")
    if shutil.which("fio"):
        path, note = ensure_file(ctx)
    disk: list[dict[str, Any]] = []
    reader: list[dict[str, Any]] = []
    small_pages: list[dict[str, Any]] = []  # UringReader into a 4 KiB-page slab
    if path is not None:
        runs = {}
        seed = iter(range(1, 1 << 30))
        for rec in recs:  # each reader run next to fio's at the same QD
            for qd in QDS:
                n = _read_nbytes(ctx, rec, qd)
                runs[f"fio {rec} {qd}"] = lambda rec=rec, qd=qd, n=n: fio_gbps(
                    ctx, path, rec, qd, n, next(seed))  # fmt: skip
                if qd in READER_QDS:
                    runs[f"uring {rec} {qd}"] = lambda rec=rec, qd=qd, n=n: reader_gbps(
                        path, rec, qd, n, next(seed))  # fmt: skip
                if qd == HEADLINE_QD:
                    runs[f"uring4k {rec}"] = lambda rec=rec, n=n: reader_gbps(
                        path, rec, HEADLINE_QD, n, next(seed), backing="normal")  # fmt: skip
        rounds = max(MIN_ROUNDS, ctx.rounds)
        ctx.log(f"limits: disk sweep on {path} ({len(runs)} configurations x {rounds})")
        res = interleave(runs, rounds)
        for rec in recs:
            for qd in QDS:
                r = res[f"fio {rec} {qd}"]
                disk.append({"record_nbytes": rec, "qd": qd, "gbps": median(r), "runs": r})
            for qd in READER_QDS:
                r = res[f"uring {rec} {qd}"]
                fio = median(res[f"fio {rec} {qd}"])
                reader.append({"record_nbytes": rec, "qd": qd, "gbps": median(r), "runs": r,
                               "fio_gbps": fio, "ratio": median(r) / fio})  # fmt: skip
            r = res[f"uring4k {rec}"]
            small_pages.append({"record_nbytes": rec, "qd": HEADLINE_QD, "gbps": median(r),
                                "runs": r})  # fmt: skip
        data.update(file=str(path), file_nbytes=path.stat().st_size)
    data.update(disk=disk, reader=reader, reader_small_pages=small_pages, disk_note=note)
    ctx.results["limits"] = data  # later sections (and disk_gbps) read it from here

    md.append(
        "**Disk**: fio (`ioengine=io_uring`, `direct=1`, fixed buffers, batched submit/reap) "
        "reads uniformly random blocks of one expert record's size from a "
        + (f"{data['file_nbytes'] / 2**30:.0f} GiB file on {ctx.work}" if path else "file")
        + f" at queue depth 1–64; colibri's `UringReader` reads the same record size at QD "
        f"{', '.join(map(str, READER_QDS))}, interleaved with fio "
        f"({max(MIN_ROUNDS, ctx.rounds)} rounds, medians). Record sizes: one Qwen3-30B-A3B "
        "q4_0 expert "
        f"({QWEN3_RECORD_NBYTES:,} B = {QWEN3_RECORD_NBYTES / 2**20:.2f} MiB)"
        + ("" if ctx.quick else "; Mixtral-8x7B q4_0 records (94.5 MiB) as 4 MiB reads")
        + ". GB/s = 10⁹ B/s."
    )
    if note:
        md += ["", f"_{note}_"]
    if disk:
        header = ["record", *[f"QD {q}" for q in QDS]]
        rows = [[f"fio {rec / 2**20:.2f} MiB"]
                + [next(d["gbps"] for d in disk if d["record_nbytes"] == rec and d["qd"] == q)
                   for q in QDS] for rec in recs]  # fmt: skip
        for rec in recs:
            by = {r["qd"]: r for r in reader if r["record_nbytes"] == rec}
            rows.append([f"UringReader {rec / 2**20:.2f} MiB"]
                        + [by[q]["gbps"] if q in by else "" for q in QDS])  # fmt: skip
            rows.append(["  reader / fio"] + [f"{by[q]['ratio']:.0%}" if q in by else ""
                                              for q in QDS])  # fmt: skip
            sp = {r["qd"]: r["gbps"] for r in small_pages if r["record_nbytes"] == rec}
            rows.append([f"UringReader, 4 KiB-page slab {rec / 2**20:.2f} MiB"]
                        + [sp.get(q, "") for q in QDS])  # fmt: skip
        md += ["", table(header, rows)]
        head = next(r for r in reader if r["record_nbytes"] == recs[0] and r["qd"] == HEADLINE_QD)
        spread = max(max(d["runs"]) / min(d["runs"]) for d in disk)
        if spread > 1.3:
            md += ["", f"Runs at the same setting varied up to {spread:.1f}x between rounds "
                   "(a shared, virtualised disk): read the medians as ±that much."]  # fmt: skip
        if any(r["ratio"] > 1.1 for r in reader):
            sp = small_pages[0]["gbps"] if small_pages else None
            md += [
                "",
                "The reader beat fio, so fio is not this disk's ceiling here: "
                "`disk_gbps` (the bound later sections use) takes the higher of fio and the "
                "reader at each measured point. The likely reason: fio's buffers are 4 KiB "
                "pages, so the block layer splits each record into several requests (at most "
                "`max_segments` pages each), while colibri's slab sits on huge pages and a "
                "record goes down in fewer, larger requests. Check: the same reader into a "
                f"4 KiB-page slab read {fmt(sp)} GB/s at QD {HEADLINE_QD}, against "
                f"{fmt(head['gbps'])} on huge pages and {fmt(head['fio_gbps'])} for fio.",
            ]
        short = [r for r in reader if r["ratio"] < 0.9]
        if short:
            md += ["", "Where the reader falls short of fio (< 90%), per record:"]
        fio_runs = {(d["record_nbytes"], d["qd"]): d["runs"] for d in disk}
        for r in short:
            extra = r["record_nbytes"] / 1e3 * (1 / r["gbps"] - 1 / r["fio_gbps"])
            if max(r["runs"]) >= min(fio_runs[r["record_nbytes"], r["qd"]]):
                why = "within the run-to-run noise (the reader's best run beat fio's worst)"
            else:
                why = (
                    "beyond the round-to-round spread; with few reads in flight each read "
                    "waits on the last, so colibri's per-read work (asyncio wake-up, Python "
                    "submit and completion) adds straight to every record's time"
                )
            md.append(f"- {r['record_nbytes'] / 2**20:.2f} MiB at QD {r['qd']}: {r['ratio']:.0%} "
                      f"of fio, +{extra:.0f} µs per record: {why}")  # fmt: skip
        heads.append(Headline(
            scenario="Expert reads (UringReader)", unit="GB/s", value=head["gbps"],
            limit=head["fio_gbps"], limit_name=f"fio io_uring O_DIRECT QD {HEADLINE_QD}",
            target="≥ 90% of fio",
            note=f"random {head['record_nbytes'] / 2**20:.2f} MiB records (Qwen3-30B-A3B q4_0)",
        ))  # fmt: skip
    md += [
        "",
        f"**Memory read** (the bound later sections use): a streaming SIMD read in C "
        f"(`ops.mem_read`, vector loads, no stores) of {MEM_READ_NBYTES >> 20} MiB on 1 or "
        f"{ctx.threads} threads of the kernel pool; median of {len(mem['mem_runs']['1t'])} "
        f"interleaved rounds: **{fmt(mem['mem_gbps_1t'])} GB/s** at 1 thread, "
        f"**{fmt(mem['mem_gbps_nt_measured'])} GB/s** at {ctx.threads} threads (best of "
        f"{MEM_REPEAT} reads per round). Beside it, `np.copyto` of {MEM_NBYTES >> 20} MiB "
        "counting read + write bytes (its write-allocate traffic is not counted, so a copy "
        f"understates reads): {fmt(mem.get('copy_gbps_1t'))} GB/s at 1 thread, "
        f"{fmt(mem.get('copy_gbps_nt'))} GB/s at {ctx.threads} threads.",
    ]
    if mem["mem_gbps_nt_measured"] < mem["mem_gbps_1t"]:
        md += ["", f"{ctx.threads} threads read slower than one: the other cores were busy "
               "with other work. The memory limit later sections use (`memory_gbps`) is the "
               f"higher figure, {fmt(mem['mem_gbps'])} GB/s."]  # fmt: skip
    figures = [_plot(ctx, disk, reader, small_pages, mem)]
    return Section(key="limits", title=TITLE, markdown="\n".join(md), data=data,
                   figures=figures, headlines=heads)  # fmt: skip
