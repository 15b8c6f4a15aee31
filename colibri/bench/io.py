"""Random expert-record reads: colibri's readers next to fio, in the same run.

    nice .venv/bin/python -m colibri.bench.io [--record-nbytes 1M] [--file-nbytes 4G] \
        [--queue-depth 32]

Writes a file of random bytes (bigger than the reads' working set; removed afterwards unless
--keep), then reads `--read-nbytes` worth of uniformly random records with:
  fio        ioengine=io_uring, direct=1, bs=record, iodepth=QD, fixedbufs (the disk's limit here)
  uring      colibri UringReader (O_DIRECT, fixed buffers, QD reads in flight)
  threads    colibri ThreadReader (O_DIRECT pread, 8 threads)
  mmap       colibri MmapReader (page cache; the file's cached pages are dropped first with
             posix_fadvise(DONTNEED), so it reads from disk)
and prints GB/s and each as a fraction of fio. Also measures XXH3-64 (record verification)
throughput on one record. Needs fio (Debian package `fio`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable

import numpy as np
import xxhash

from colibri.io.format import ExpertRecord
from colibri.io.reader import open_reader
from colibri.io.replay import parse_nbytes
from colibri.io.slab import SlabPool


def write_file(path: str, nbytes: int) -> None:
    chunk = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            left = nbytes
            while left > 0:
                left -= f.write(chunk[: min(left, len(chunk))])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:  # Ctrl-C, SIGTERM (cli.CLEAN_UP_ON_SIGNAL), a full disk: no 8 GiB leftover
        if os.path.exists(tmp):
            os.unlink(tmp)


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_fio(
    path: str,
    rec: int,
    qd: int,
    total: int,
    file_nbytes: int,
    seed: int,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> float:
    """GB/s (1e9 B/s) of fio random O_DIRECT reads (io_uring) of `rec` bytes at queue depth `qd`,
    `total` bytes from the first `file_nbytes` of `path`. `run` runs the command (the bench suite
    passes its recording runner). Raises CalledProcessError when fio fails."""
    cmd = [
        "fio",
        "--name=colibri",
        f"--filename={path}",
        "--rw=randread",
        f"--bs={rec}",
        f"--iodepth={qd}",
        # submit and reap in batches, as UringReader does: a weaker fio would flatter us
        f"--iodepth_batch_submit={qd}",
        "--iodepth_batch_complete_min=1",
        f"--iodepth_batch_complete_max={qd}",
        "--ioengine=io_uring",
        "--direct=1",
        "--fixedbufs=1",
        f"--size={file_nbytes}",
        f"--io_size={total}",
        "--numjobs=1",
        f"--randseed={seed}",
        "--output-format=json",
    ]
    out = run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]["read"]
    return job["io_bytes"] / (job["runtime"] / 1000) / 1e9


async def run_reader(
    path: str, backend: str, rec: int, qd: int, offsets: list[int], backing: str = "auto"
) -> tuple:
    """(GB/s, reader statistics) of `backend` reading `rec` bytes at each offset, `qd` in flight,
    into a SlabPool of the given backing ("auto": huge pages when possible, "normal": 4 KiB)."""
    pool = SlabPool(rec, qd, backing=backing)
    reader = open_reader(path, backend, pool=pool, queue_depth=qd)
    it = iter(offsets)

    async def worker(slot: int) -> None:
        for off in it:
            await reader.read_into(ExpertRecord(0, 0, off, rec, 0), slot)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in range(qd)))
    dt = time.perf_counter() - t0
    stats = reader.statistics()
    await reader.aclose()
    pool.close()
    return len(offsets) * rec / dt / 1e9, stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", default="/tmp/colibri-bench-experts.bin")
    p.add_argument("--file-nbytes", type=parse_nbytes, default=parse_nbytes("4G"))
    p.add_argument("--record-nbytes", type=parse_nbytes, default=parse_nbytes("1M"))
    p.add_argument("--read-nbytes", type=parse_nbytes, default=parse_nbytes("2G"))
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--backends", default="fio,uring,threads,mmap")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--keep", action="store_true", help="keep the file for the next run")
    p.add_argument("--uvloop", action="store_true")
    args = p.parse_args()
    rec, qd = args.record_nbytes, args.queue_depth
    if rec % 4096:
        p.error("--record-nbytes must be a multiple of 4096")
    if shutil.which("fio") is None and "fio" in args.backends:
        p.error("fio not found (apt-get install fio)")
    have = os.path.exists(args.file) and os.path.getsize(args.file) == args.file_nbytes
    free = shutil.disk_usage(os.path.dirname(args.file)).free
    if not have and free < args.file_nbytes + (2 << 30):
        p.error(
            f"{free / 2**30:.1f} GiB free on {os.path.dirname(args.file)}: not enough for "
            f"a {args.file_nbytes / 2**30:.1f} GiB file plus 2 GiB headroom"
        )
    if not have:
        print(f"writing {args.file_nbytes / 2**30:.1f} GiB to {args.file} ...", flush=True)
        write_file(args.file, args.file_nbytes)
    num_records = args.file_nbytes // rec
    num_reads = min(num_records, max(qd, args.read_nbytes // rec))
    print(
        f"{num_reads} random reads of {rec} bytes from {num_records} records "
        f"({args.file_nbytes / 2**30:.1f} GiB), queue depth {qd}; {args.rounds} rounds, "
        "backends interleaved, fresh offsets each run (median shown)"
    )
    runs: dict[str, list[float]] = {}
    notes: dict[str, str] = {}
    try:
        for rnd in range(args.rounds):
            for i, b in enumerate(args.backends.split(",")):
                drop_cache(args.file)
                rng = np.random.default_rng(1000 * rnd + i)
                # each record at most once per run, like fio's random map
                offsets = [int(x) * rec for x in rng.permutation(num_records)[:num_reads]]
                if b == "fio":
                    gbs = run_fio(
                        args.file, rec, qd, num_reads * rec, args.file_nbytes, 1000 * rnd + i
                    )
                    notes[b] = "io_uring, O_DIRECT, fixedbufs"
                else:
                    run = run_reader(args.file, b, rec, qd, offsets)
                    if args.uvloop:
                        import uvloop

                        gbs, st = uvloop.run(run)
                    else:
                        gbs, st = asyncio.run(run)
                    notes[b] = st.reason
                runs.setdefault(b, []).append(gbs)
                print(f"  round {rnd}: {b:8s} {gbs:6.2f} GB/s", flush=True)
        results = {b: float(np.median(v)) for b, v in runs.items()}
        for b, gbs in results.items():
            ratio = f"{gbs / results['fio']:6.1%} of fio" if "fio" in results else ""
            print(f"  {b:8s} {gbs:6.2f} GB/s  {ratio:14s} ({notes[b]})", flush=True)
    finally:
        if not args.keep:
            os.unlink(args.file)
    buf = np.random.default_rng(2).integers(0, 256, rec, dtype=np.uint8)
    times = []
    for _ in range(20):  # best of 20: the machine is shared
        t0 = time.perf_counter()
        xxhash.xxh3_64_intdigest(buf)
        times.append(time.perf_counter() - t0)
    hash_gbs = rec / min(times) / 1e9
    disk = results.get("uring") or results.get("fio")
    extra = f", {disk / hash_gbs:.1%} of a record's read time at {disk:.2f} GB/s" if disk else ""
    print(f"  xxh3_64 verify: {hash_gbs:.1f} GB/s on one core{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
