#!/usr/bin/env python
"""Decode benchmark: tok/s, TTFT and where the time goes, next to the storage and compute
bounds measured in the same run.

(a) a store that fits in the expert budget (warm: every expert resident after a warm-up);
(b) a Qwen3-30B-A3B-shaped store (synthetic, ~17 GB in q4_0) with a budget well below its
    size and a cold page cache (O_DIRECT reads bypass it; with --io mmap caches are dropped
    first when running as root).

Bounds (DESIGN.md §8): storage = disk GB/s (fio, io_uring, O_DIRECT, record-sized random reads
at the queue depth one layer's misses give) / bytes read per token; compute = 1 / compute
seconds per token (the kernels' time in this same run, i.e. tok/s with every expert resident).

    python bench/decode.py                     # makes the synthetic stores under /tmp/stores
    python bench/decode.py --big PATH --budget 4G --tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from colibri.engine import open_engine  # noqa: E402
from colibri.io.format import open_store  # noqa: E402
from colibri.run import parse_size, size_arg  # noqa: E402

STORES = Path("/tmp/stores")


def ensure_store(path: Path, model: str, layers: int | None, quant: str = "q4_0") -> Path:
    """Make a synthetic store with tools/synth_store.py unless it is already there."""
    if (path / "manifest.json").exists():
        return path
    cmd = [sys.executable, str(ROOT / "tools/synth_store.py"), model, str(path), "--quant", quant]
    if layers:
        cmd += ["--layers", str(layers)]
    print("making", path, "...", flush=True)
    subprocess.run(cmd, check=True)
    return path


def drop_page_cache() -> bool:
    if os.geteuid() != 0:
        return False
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    return True


def fio_gbps(path: Path, record: int, qd: int, total: int) -> float:
    """fio: random O_DIRECT reads of `record` bytes at queue depth qd, io_uring (GB/s)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_io", ROOT / "bench" / "io.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.run_fio(str(path), record, qd, total, path.stat().st_size, seed=1)


def memory_gbps(nbytes: int = 1 << 30) -> float:
    """Copy bandwidth of one large numpy copy, read + write bytes counted (GB/s)."""
    a = np.ones(nbytes // 8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


@dataclass
class DecodeFigures:
    """Decode phase only (prefill excluded): per generated token."""

    backend: str
    ttft: float  # seconds: prefill of the prompt + the first token
    tok_s: float
    hit_rate: float
    bytes_per_token: float
    wait_io: float  # seconds per token awaiting records that were not ready
    compute: float  # seconds per token in kernels
    prefetch: object


async def decode(path: Path, budget: int, n_prompt: int, n_tokens: int, warm: bool, **opts):
    async with open_engine(path, budget=budget, n_ctx=n_prompt + n_tokens + 8, **opts) as eng:
        rng = np.random.default_rng(0)
        prompt = rng.integers(10, eng.spec.vocab_size, n_prompt).tolist()
        if warm:  # one pass of the same tokens loads what decode will touch
            await eng.generate(prompt, max_tokens=n_tokens, temperature=0)
        seq = eng.new_sequence()
        t0 = time.perf_counter()
        logits = await eng.forward(seq, prompt)
        ttft = time.perf_counter() - t0
        times, c0 = eng.pipeline.times, eng.cache.statistics()
        io0, comp0 = times.wait_io, times.compute
        t1 = time.perf_counter()
        for _ in range(n_tokens):
            logits = await eng.forward(seq, [int(np.argmax(logits))])
        dt = time.perf_counter() - t1
        c1 = eng.cache.statistics()
        gets = (c1.hits - c0.hits) + (c1.misses - c0.misses)
        return DecodeFigures(
            backend=eng.reader.statistics().backend,
            ttft=ttft,
            tok_s=n_tokens / dt,
            hit_rate=(c1.hits - c0.hits) / gets if gets else 1.0,
            bytes_per_token=(c1.bytes_read - c0.bytes_read) / n_tokens,
            wait_io=(times.wait_io - io0) / n_tokens,
            compute=(times.compute - comp0) / n_tokens,
            prefetch=eng.prefetcher.statistics() if eng.prefetcher else None,
        )


def report(name: str, f: DecodeFigures, disk: float) -> None:
    storage_bound = disk * 1e9 / f.bytes_per_token if f.bytes_per_token else float("inf")
    compute_bound = 1.0 / f.compute
    bound = min(storage_bound, compute_bound)
    print(f"\n== {name} ({f.backend})")
    print(
        f"  decode {f.tok_s:8.2f} tok/s   TTFT {f.ttft * 1e3:8.0f} ms   "
        f"hit rate {f.hit_rate:6.1%}   read {f.bytes_per_token / 2**20:8.1f} MiB/token"
    )
    print(
        f"  per token: waiting on disk {f.wait_io * 1e3:7.1f} ms, computing "
        f"{f.compute * 1e3:7.1f} ms, other {(1 / f.tok_s - f.wait_io - f.compute) * 1e3:7.1f} ms"
    )
    if f.prefetch is not None:
        p = f.prefetch
        print(
            f"  prefetch: recall {p.recall:.1%} precision {p.precision:.1%} "
            f"enabled {p.enabled} backoffs {p.backoffs}"
        )
    print(
        f"  storage bound {storage_bound:8.2f} tok/s   compute bound {compute_bound:8.2f} "
        f"tok/s   -> colibri at {f.tok_s / bound:6.1%} of the lower bound"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=Path, default=STORES / "qwen3-30b-a3b-L4-q4_0")
    ap.add_argument("--big", type=Path, default=STORES / "qwen3-30b-a3b-q4_0")
    ap.add_argument(
        "--budget",
        type=size_arg,
        default=parse_size("4G"),
        help="expert cache for the big store (default 4G)",
    )
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--io", default="auto")
    ap.add_argument("--skip-big", action="store_true")
    args = ap.parse_args()

    small = ensure_store(args.small, "qwen3-30b-a3b", layers=4)
    s = open_store(small)
    k = s.config["num_experts_per_tok"]
    mem = memory_gbps()
    print(f"memory copy bandwidth {mem:.1f} GB/s (read+write)")

    all_small = sum(r.nbytes for r in s.records)
    fig = asyncio.run(
        decode(small, all_small, args.prompt_tokens, args.tokens, warm=True, io=args.io)
    )
    disk = fio_gbps(small / "experts.bin", s.layout.record_nbytes, k, 1 << 30)
    print(
        f"disk (fio io_uring O_DIRECT, {s.layout.record_nbytes >> 10} KiB, QD {k}): {disk:.2f} GB/s"
    )
    report(f"(a) fits: {small.name}, budget = all experts, warm", fig, disk)

    if args.skip_big:
        return 0
    free = shutil.disk_usage(STORES if STORES.exists() else "/tmp").free
    if not (args.big / "manifest.json").exists() and free < 20 << 30:
        print(f"\n(b) skipped: {free >> 30} GiB free, the big store needs ~17 GiB")
        return 0
    big = ensure_store(args.big, "qwen3-30b-a3b", layers=None)
    b = open_store(big)
    size = sum(r.nbytes for r in b.records)
    dropped = drop_page_cache()
    disk = fio_gbps(big / "experts.bin", b.layout.record_nbytes, k, 2 << 30)
    print(
        f"\nbig store: {size / 2**30:.1f} GiB of experts, budget {args.budget / 2**30:.1f} GiB;"
        f" page cache dropped: {dropped}; disk (fio, QD {k}): {disk:.2f} GB/s"
    )
    fig = asyncio.run(
        decode(big, args.budget, args.prompt_tokens, args.tokens, warm=False, io=args.io)
    )
    report(f"(b) out of core: {big.name}, cold", fig, disk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
