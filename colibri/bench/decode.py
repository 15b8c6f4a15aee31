#!/usr/bin/env python
"""Decode and prefill benchmark: tok/s, TTFT and where the time goes, next to the storage and
compute bounds measured in the same run. One implementation, used by `colibri bench` (section
"decode", colibri/bench/sec_decode.py) and by this script.

(a) a store that fits in the expert budget (warm: every expert resident after a warm-up);
(b) a Qwen3-30B-A3B-shaped store (synthetic, ~17 GB in q4_0) with a budget well below its
    size and a cold cache (a fresh engine; O_DIRECT reads bypass the page cache).

Bounds (DESIGN.md §8), per token:
  storage  t_io = bytes read per token / disk bytes/s (the higher of fio, io_uring, O_DIRECT,
           and colibri's UringReader: record-sized random reads at the queue depth one
           layer's misses give; a rate below what colibri's reader reaches bounds nothing);
  compute  t_c  = kernel seconds per token with every expert resident (the warm "fits" run);
  combined t_lb = max(t_io, t_c): the pipeline reads a layer's misses while it computes its
           hits and the prefetcher reads the next layer's experts during this one, so reads
           and compute may overlap; no engine can beat the slower of the two. The no-overlap
           figure t_io + t_c is given beside it.
A bound in tok/s is 1 / t: the most an engine can reach (t_lb is the least time per token).

    python -m colibri.bench.decode             # makes the synthetic stores under /tmp/stores
    python -m colibri.bench.decode --big PATH --budget 4G --tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibri.bench.report import tool
from colibri.engine import open_engine
from colibri.io.format import open_store
from colibri.machine import bounds, rate, storage_seconds  # noqa: F401 (bounds live there)
from colibri.options import parse_size, size_arg
from colibri.registry import model_spec

STORES = Path("/tmp/stores")


def synth_command(
    path: Path,
    model: str,
    layers: int | None,
    quant: str = "q4_0",
    scale: float | None = None,
    routing: str | None = None,
) -> list[str]:
    """The tools/synth_store.py command that makes `path` (scale: its --scale; routing: its
    --routing, an OLMoE text domain whose real expert popularity the routers reproduce)."""
    cmd = [sys.executable, tool("synth_store.py"), model, str(path), "--quant", quant]
    cmd += ["--scale", str(scale)] if scale else []
    cmd += ["--routing", routing] if routing else []
    return cmd + (["--layers", str(layers)] if layers else [])


def ensure_store(
    path: Path,
    model: str,
    layers: int | None,
    quant: str = "q4_0",
    run: Callable[[list[str]], Any] | None = None,
    scale: float | None = None,
    routing: str | None = None,
) -> Path:
    """Make a synthetic store with tools/synth_store.py unless it is already there.
    `run(cmd)` runs the command (default subprocess.run, check=True); the tool writes to a
    temporary directory and renames it, so a store that exists is complete."""
    if (path / "manifest.json").exists():
        return path
    cmd = synth_command(path, model, layers, quant, scale, routing)
    if run is None:
        print("making", path, "...", flush=True)
        subprocess.run(cmd, check=True)
    else:
        run(cmd)
    return path


def store_expert_nbytes(path: Path) -> int:
    """Bytes of all expert records of the store at `path`."""
    return sum(r.nbytes for r in open_store(path).records)


def drop_page_cache() -> bool:
    if os.geteuid() != 0:
        return False
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    return True


def disk_gbps(path: Path, record: int, qd: int, total: int) -> tuple[float, str]:
    """(GB/s, which) of random O_DIRECT reads of `record` bytes at queue depth qd, `total` bytes:
    the higher of fio (io_uring) and colibri's UringReader (colibri/bench/sec_limits.py
    best_disk says why), and which one it was."""
    from colibri.bench import io as bench_io
    from colibri.bench import sec_limits

    fio = bench_io.run_fio(str(path), record, qd, total, path.stat().st_size, seed=1)
    reader = sec_limits.reader_gbps(path, record, qd, total, seed=1)
    return sec_limits.best_disk([fio], [reader])


@dataclass
class Phase:
    """One phase (prefill of the prompt, or decode of single tokens) of one run.

    tokens: tokens processed; seconds: wall time; wait_io / compute / verify: seconds summed
    over the phase (awaiting records not ready / in the compute thread / hashing records);
    bytes_read: expert bytes read from disk (demand + prefetch); hits / misses: cache gets;
    head: of compute, the output head's seconds (no expert is read for it)."""

    tokens: int
    seconds: float
    wait_io: float
    compute: float
    verify: float
    bytes_read: int
    reads: int
    hits: int
    misses: int
    head: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        gets = self.hits + self.misses
        return self.hits / gets if gets else 1.0

    def per_token(self) -> dict[str, float]:
        """Seconds per token: total, compute (head: its output head part), wait_io, other
        (= total - compute - wait_io: Python, event loop, hashing, executor hand-offs), and
        bytes read per token."""
        n = max(1, self.tokens)
        total, comp, wait = self.seconds / n, self.compute / n, self.wait_io / n
        return {
            "total": total,
            "compute": comp,
            "head": self.head / n,
            "wait_io": wait,
            "other": max(0.0, total - comp - wait),
            "verify": self.verify / n,
            "bytes": self.bytes_read / n,
        }


@dataclass
class DecodeFigures:
    """One run: a fresh engine, a prompt prefilled (TTFT = prefill + the first token's
    logits) then n_tokens greedy decode steps."""

    backend: str
    budget: int
    warm: bool
    prefill: Phase
    decode: Phase
    prefetch: dict[str, Any] | None  # the prefetcher's counters so far (since the open)

    @property
    def ttft(self) -> float:
        return self.prefill.seconds

    @property
    def tok_s(self) -> float:
        return self.decode.tok_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for ph in ("prefill", "decode"):
            p = getattr(self, ph)
            d[ph] |= {"tok_s": p.tok_s, "hit_rate": p.hit_rate, "per_token": p.per_token()}
        return d


def _snapshot(eng: Any) -> Any:
    return eng.statistics(components=False)  # EngineStatistics


def _phase(eng: Any, s0: Any, tokens: int, seconds: float) -> Phase:
    d = _snapshot(eng).delta(s0)
    return Phase(
        tokens=tokens,
        seconds=seconds,
        wait_io=d.wait_io_seconds,
        compute=d.compute_seconds,
        verify=d.verify_seconds,
        bytes_read=d.bytes_read,
        reads=d.reads,
        hits=d.expert_hits,
        misses=d.expert_misses,
        head=d.head_seconds,
    )


async def timed_greedy(
    eng: Any, seq: Any, logits: np.ndarray, n_tokens: int
) -> tuple[list[int], float, np.ndarray]:
    """n_tokens greedy decode steps of `seq` (one token a forward pass) from `logits`, the last
    forward's f32 [vocab]. Returns (the tokens, wall seconds of the steps, the last logits):
    the decode timing of every bench section (decode, cluster, llama)."""
    out: list[int] = []
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        out.append(int(np.argmax(logits)))
        logits = await eng.forward(seq, [out[-1]])
    return out, time.perf_counter() - t0, logits


async def run_passes(
    path: Path, budget: int, n_prompt: int, n_tokens: int, passes: int = 2, **opts: Any
) -> list[DecodeFigures]:
    """Open a fresh engine on `path` with `budget` expert bytes (EngineOptions `opts`), then
    `passes` times: a new sequence, the same random prompt of n_prompt ids (seed 0) prefilled
    in one forward pass, then n_tokens greedy decode steps (so every pass feeds the same
    tokens). Pass 0 is cold (empty expert cache; O_DIRECT reads bypass the page cache), each
    later pass is warm: the one before it was its warm-up. Raises what open_engine raises."""
    n_ctx = n_prompt + n_tokens + 8
    out = []
    async with open_engine(path, budget=budget, n_ctx=n_ctx, **opts) as eng:
        prompt = np.random.default_rng(0).integers(10, eng.spec.vocab_size, n_prompt).tolist()
        for i in range(passes):
            seq = eng.new_sequence()
            s0 = _snapshot(eng)
            t0 = time.perf_counter()
            logits = await eng.forward(seq, prompt)
            prefill = _phase(eng, s0, n_prompt, time.perf_counter() - t0)
            s1 = _snapshot(eng)
            _, seconds, logits = await timed_greedy(eng, seq, logits, n_tokens)
            dec = _phase(eng, s1, n_tokens, seconds)
            seq.kv = None  # free the KV cache now
            pf = asdict(eng.prefetcher.statistics()) if eng.prefetcher else None
            backend = eng.reader.statistics().backend
            out.append(DecodeFigures(backend, budget, i > 0, prefill, dec, pf))
    return out


async def decode(
    path: Path, budget: int, n_prompt: int, n_tokens: int, warm: bool, **opts: Any
) -> DecodeFigures:
    """One run of run_passes: the cold pass, or (warm) the pass after it."""
    figs = await run_passes(path, budget, n_prompt, n_tokens, 2 if warm else 1, **opts)
    return figs[-1]


# ---- bounds: storage_seconds, rate, bounds are colibri.machine's (tests/test_bench_decode.py) ----


def miss_queue_depth(misses: int, layers: int, tokens: int, cap: int) -> int:
    """Reads one layer's misses put in flight at once: misses per layer per forward pass
    (rounded up to a power of two, at least 1, at most the reader's depth `cap`)."""
    per = misses / max(1, layers * tokens)
    return int(min(cap, max(1, 2 ** math.ceil(math.log2(max(per, 1.0))))))


def report(name: str, f: DecodeFigures, disk: float, compute_s: float | None = None) -> None:
    """Print one run with its bounds (compute_s: kernel seconds per token when every expert
    is resident; default this run's own)."""
    d, pt = f.decode, f.decode.per_token()
    b = bounds(pt["bytes"], disk, compute_s if compute_s is not None else pt["compute"])
    print(f"\n== {name} ({f.backend})")
    print(
        f"  decode {d.tok_s:8.2f} tok/s   prefill {f.prefill.tok_s:8.1f} tok/s (TTFT "
        f"{f.ttft * 1e3:.0f} ms)   hit rate {d.hit_rate:6.1%}   read "
        f"{pt['bytes'] / 2**20:8.1f} MiB/token"
    )
    print(
        f"  per token: waiting on disk {pt['wait_io'] * 1e3:7.1f} ms, computing "
        f"{pt['compute'] * 1e3:7.1f} ms, other {pt['other'] * 1e3:7.1f} ms"
    )
    if f.prefetch is not None:
        p = f.prefetch
        print(f"  prefetch: recall {p['recall']:.1%} precision {p['precision']:.1%}")
    print(
        f"  storage bound {b['storage']:8.2f} tok/s   compute bound {b['compute']:8.2f} "
        f"tok/s   -> colibri at {d.tok_s / b['combined']:6.1%} of the bound 1/max(t_io, t_c)"
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
    k = model_spec(s.config).moe.router.top_k
    from colibri.bench.kernels import copy_bandwidth, read_bandwidth

    mem, cp = read_bandwidth(1 << 30, 0, 3), copy_bandwidth(1 << 30, 1, 3)
    print(f"memory read bandwidth {mem:.1f} GB/s (streaming SIMD read, all threads); "
          f"copy {cp:.1f} GB/s (read+write, 1 thread)")  # fmt: skip

    all_small = store_expert_nbytes(small)
    fits = asyncio.run(
        decode(small, all_small, args.prompt_tokens, args.tokens, warm=True, io=args.io)
    )
    disk, which = disk_gbps(small / "experts.bin", s.layout.record_nbytes, k, 1 << 30)
    print(f"disk ({which}, O_DIRECT, {s.layout.record_nbytes >> 10} KiB, QD {k}): {disk:.2f} GB/s")
    report(f"(a) fits: {small.name}, budget = all experts, warm", fits, disk)

    if args.skip_big:
        return 0
    free = shutil.disk_usage(STORES if STORES.exists() else "/tmp").free
    if not (args.big / "manifest.json").exists() and free < 20 << 30:
        print(f"\n(b) skipped: {free >> 30} GiB free, the big store needs ~17 GiB")
        return 0
    big = ensure_store(args.big, "qwen3-30b-a3b", layers=None)
    b = open_store(big)
    size = store_expert_nbytes(big)
    dropped = drop_page_cache()
    disk, which = disk_gbps(big / "experts.bin", b.layout.record_nbytes, k, 2 << 30)
    print(
        f"\nbig store: {size / 2**30:.1f} GiB of experts, budget {args.budget / 2**30:.1f} GiB;"
        f" page cache dropped: {dropped}; disk ({which}, QD {k}): {disk:.2f} GB/s"
    )
    fig = asyncio.run(
        decode(big, args.budget, args.prompt_tokens, args.tokens, warm=False, io=args.io)
    )
    report(f"(b) out of core: {big.name}, cold", fig, disk)  # its own kernel time
    return 0


if __name__ == "__main__":
    sys.exit(main())
