"""Kernel benchmark: matvec, batch-8 and batch-64 matmul per storage format over a weight matrix
larger than the L3 cache, at 1 thread and all threads, against the memory bandwidth measured in the
same run; plus small-call latencies (the engine makes ~300 kernel calls a token).

    .venv/bin/python -m colibri.bench.kernels [--mib 128] [--isa avx2] [--repeat 5]

Weight GB/s = weight bytes / time (each weight byte is read once per call). Memory bandwidth
= a streaming SIMD read in C of 1 GiB (ops.mem_read), the read bound a matvec can reach, at 1
and N threads; beside it a large numpy copy (np.copyto), counted as read + write (its write
allocate makes the real traffic higher: a copy understates reads). Times are the best of
--repeat runs (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from colibri.compute import ops, ref


def best_time(fn, repeat: int) -> float:
    """Best wall time of `repeat` runs (after one warm-up run)."""
    return best_time_cpu(fn, repeat)[0]


def best_time_cpu(fn, repeat: int, before=None) -> tuple[float, float]:
    """(wall, process CPU seconds) of the fastest of `repeat` runs, after a warm-up run;
    `before` (if given) runs untimed before each timed run (an L3 eviction: l3_evictor)."""
    fn()  # warm up (page faults, thread pool start)
    runs = []
    for _ in range(repeat):
        if before is not None:
            before()
        t, c = time.perf_counter(), time.process_time()
        fn()
        runs.append((time.perf_counter() - t, time.process_time() - c))
    return min(runs)


def copy_bandwidth(nbytes: int, nthreads: int, repeat: int) -> float:
    """GB/s of read + write bytes for nthreads concurrent numpy copies of nbytes in total."""
    per = nbytes // nthreads // 4
    src = [np.ones(per, np.float32) for _ in range(nthreads)]
    dst = [np.zeros(per, np.float32) for _ in range(nthreads)]

    def run() -> None:
        threads = [
            threading.Thread(target=np.copyto, args=(d, s)) for d, s in zip(dst, src, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return 2 * per * 4 * nthreads / best_time(run, repeat) / 1e9


def l3_nbytes(cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Bytes of the largest cache sysfs reports under cache_dir (cpu0's; 0 when it reports
    none). Virtual machines may report the host socket's whole L3 (480 MiB seen here)."""
    best = 0
    for d in Path(cache_dir).glob("index*"):
        try:
            size = (d / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best


def l3_evictor(w: np.ndarray, l3: int | None = None):
    """A callable that evicts w from every cache level (ops.cache_flush), or None when w is
    more than half the L3 (l3 bytes, default l3_nbytes()) and calls over it read memory
    anyway: timings of a working set the L3 could hold would be cache figures, not memory
    ones."""
    l3 = l3_nbytes() if l3 is None else l3
    if not l3 or 2 * w.nbytes > l3:
        return None
    return lambda: ops.cache_flush(w)


def read_bandwidth(nbytes: int, nthreads: int, repeat: int) -> float:
    """GB/s of a streaming SIMD read (ops.mem_read: vector loads, no stores) of an nbytes
    buffer on nthreads kernel-pool threads: the memory read bound (DESIGN.md §8). Best of
    `repeat` after a warm-up; nbytes should be far larger than the L3 cache."""
    buf = np.ones(nbytes, np.uint8)
    return nbytes / best_time(lambda: ops.mem_read(buf, nthreads), repeat) / 1e9


def make_weights(qt: ops.QType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row_nbytes] bytes: 256 properly quantized random rows, tiled (same speed); for
    the import-only types (no quantizer: q2_k, q3_k, iq4_nl, iq4_xs) random valid blocks."""
    if qt not in ops.QUANTIZE_TYPES:
        base = ref.random_blocks(rng, int(qt), 256, cols)
        return np.ascontiguousarray(np.tile(base, (rows // 256 + 1, 1))[:rows])
    base = ops.quantize(rng.standard_normal((256, cols)).astype(np.float32), qt)
    return np.ascontiguousarray(np.tile(base, (rows // 256 + 1, 1))[:rows])


def latency_us(fn, repeat: int = 2000) -> tuple[float, float]:
    """(median, best) microseconds per call over `repeat` back-to-back calls."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6, min(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=128, help="weight matrix size (default 128 MiB)")
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--isa", choices=[i.name.lower() for i in ops.ISA], default=None)
    p.add_argument(
        "--formats",
        default="q4_0,q8_0,q4_1,f16,bf16,f32,q4_k,q5_k,q6_k,q5_0,q5_1,q2_k,q3_k,mxfp4,iq4_nl,"
        "iq4_xs,fp8",
    )
    args = p.parse_args()
    if args.isa:
        ops.set_isa(args.isa)
    nt = ops.default_threads()
    rng = np.random.default_rng(0)
    print(f"ISA {ops.isa().name}, default threads {nt} (os.cpu_count {os.cpu_count()}), "
          f"weights {args.mib} MiB, cols {args.cols}, best of {args.repeat}, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip

    cp = {t: copy_bandwidth(256 << 20, t, args.repeat) for t in sorted({1, nt})}
    bw = {t: read_bandwidth(1 << 30, t, args.repeat) for t in sorted({1, nt})}
    for t, v in bw.items():
        print(
            f"memory bandwidth, {t} thread(s): SIMD read of 1 GiB {v:6.2f} GB/s "
            f"(the bound below); numpy copy of 256 MiB {cp[t]:6.2f} GB/s (read+write)"
        )
    print()
    print("cpu% = process CPU time / (wall x threads): below 100% the machine was busy.")
    print("act q8_0: activations quantized to Q8_0 (included in the time), integer dots.")
    print(f"{'format':<6} {'act':<4} {'n':>3} {'thr':>3} {'ms':>8} {'weight GB/s':>12}"
          f" {'of mem bw':>10} {'GFLOP/s':>8} {'cpu%':>5}")  # fmt: skip
    for name in args.formats.split(","):
        qt = ops.QType.parse(name)
        rows = (args.mib << 20) // ops.row_nbytes(qt, args.cols)
        w = make_weights(qt, rows, args.cols, rng)
        evict = l3_evictor(w)  # matvecs read memory, not an L3 holding w
        acts = ("f32", "q8_0") if qt in ops.Q8_ACT_TYPES else ("f32",)
        for n, act, t in ((n, a, t) for n in (1, 8, 64) for a in acts for t in sorted({1, nt})):
            x = rng.standard_normal((n, args.cols)).astype(np.float32)
            y = np.empty((n, rows), np.float32)
            xq = np.empty((n, ops.row_nbytes("q8_0", args.cols)), np.uint8)

            def run(x=x, y=y, xq=xq, act=act, t=t) -> None:
                if act == "f32":
                    ops.matmul(w, qt, x, y, nthreads=t)  # noqa: B023
                else:
                    ops.matmul_q8(w, qt, ops.quantize_act(x, xq), y, nthreads=t)  # noqa: B023

            s, cpu = best_time_cpu(run, args.repeat, evict if n == 1 else None)
            gbs = w.nbytes / s / 1e9
            print(f"{qt.name:<6} {act:<4} {n:>3} {t:>3} {s * 1e3:8.2f} {gbs:12.2f} "
                  f"{gbs / bw[t]:9.0%} {2 * n * rows * args.cols / s / 1e9:8.1f}"
                  f" {cpu / s / t:5.0%}")  # fmt: skip
        del w

    print("\nsmall-call latency (median / best us per call through ops.*, cache-resident):")
    for qt, rows, cols in [("q4_0", 128, 2048), ("q4_0", 2048, 2048), ("q8_0", 2048, 2048)]:
        w = make_weights(ops.QType.parse(qt), rows, cols, rng)
        x = rng.standard_normal(cols).astype(np.float32)
        y = np.empty(rows, np.float32)
        for t in sorted({1, nt}):
            med, best = latency_us(lambda: ops.matmul(w, qt, x, y, nthreads=t))  # noqa: B023
            print(f"  matmul {qt} [{rows}x{cols}] n=1, {t} thr: {med:7.1f} / {best:7.1f}")
    d_model, d_ff = 2048, 768  # a Qwen3-30B-A3B expert
    # (gate, up, down) types: "q4_k/q4_k/q6_k" is a Q4_K_M layer with its down in Q6_K
    for types in ("q4_0", "q8_0", "q4_k/q4_k/q6_k", "q5_1", "mxfp4", "fp8"):
        qts = [ops.QType.parse(q) for q in (types.split("/") * 3)[:3]]
        gate, up = (make_weights(qts[i], d_ff, d_model, rng) for i in range(2))
        down = make_weights(qts[2], d_model, d_ff, rng)
        for n, q8, t in ((n, q8, t) for n in (1, 8, 64) for q8 in (False, True) for t in {1, nt}):
            x = rng.standard_normal((n, d_model)).astype(np.float32)
            y, scratch = np.zeros_like(x), np.empty(2 * n * d_ff, np.float32)
            med, best = latency_us(
                lambda: ops.expert_ffn(y, x, gate, up, down, qts[0], d_model, d_ff,  # noqa: B023
                                       scratch=scratch, act_q8=q8, nthreads=t,  # noqa: B023
                                       qtypes=tuple(qts)),  # noqa: B023
                repeat=500 if n < 64 else 30,
            )  # fmt: skip
            act = "q8_0" if q8 else "f32"
            print(
                f"  expert_ffn {types} {d_model}x{d_ff} act {act:<4} n={n}, {t} thr: "
                f"{med:7.1f} / {best:7.1f}"
            )


if __name__ == "__main__":
    main()
