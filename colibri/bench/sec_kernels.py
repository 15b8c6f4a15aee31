"""`colibri bench` section "kernels": matvec / batch-8 matmul per weight format against the
memory bandwidth from the limits section, the latency of one small expert FFN call, and the
prefill GEMM (Q4_0 / Q8_0 x Q8_0 activations, 16-512 tokens) in GMAC/s with and without AMX.

Weights bigger than the L3 cache (quick 64 MiB, full 128 MiB per format, 4096 columns) are read
once per call, so matvec GB/s of weights / memory GB/s says how close a kernel runs to memory
speed. The functions come from colibri/bench/kernels.py (make_weights, best_time_cpu, latency_us).

The quantized formats (Q4_0, Q8_0 and issue 15's Q4_K, Q5_K, Q6_K, Q5_1, MXFP4, FP8) run both
paths (Q4_K, Q5_K, Q6_K also Q8_K activations, `ops.matmul_q8k`, the engine's default for
K-quant experts): f32 activations (exact) and Q8_0 activations with integer dot products
(`ops.quantize_act` + `ops.matmul_q8`, `expert_ffn(..., act_q8=True)`; the engine's default, as
llama.cpp's CPU path; FP8 dots the Q8_0 values in f32); the activation quantization is inside
the timed call. The expert-FFN latency also runs a Q4_K_M-style record (gate/up Q4_K, down
Q6_K) and an FP8 one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from colibri.bench import kernels as bench_kernels
from colibri.bench import sec_limits
from colibri.bench.report import Context, Headline, Section, fmt, interleave, median, table
from colibri.compute import ops

TITLE = "Kernels vs memory bandwidth"

FORMATS = ("q4_0", "q8_0", "f16", "f32", "q4_k", "q5_k", "q6_k", "q5_1", "mxfp4", "fp8")
FFN_TYPES = ("q4_0", "q8_0", "q4_k/q4_k/q6_k", "fp8")  # expert (gate/up/down) types timed
COLS = 4096
BATCH = 8
REPEAT = 3  # calls per round (best taken, after a warm-up); medians over rounds are reported
FFN_SHAPE = (2048, 768)  # Qwen3-30B-A3B expert: hidden_size, moe_intermediate_size
TARGET = 0.8  # Q4_0 matvec at >= 80% of the memory read bandwidth (issue 23)
GEMM_SHAPE = (4096, 4096)  # prefill GEMM weights [rows, cols]: a Mixtral attention projection
GEMM_TOKENS = (16, 64, 512)  # x rows (prompt tokens, or tokens routed to one expert)
GEMM_TYPES = ("q4_0", "q8_0")


def weight_mib(quick: bool) -> int:
    """MiB of weights per format: bigger than any L3 cache here."""
    return 64 if quick else 128


X16 = "q8_0 x16"  # the Q8_0 path on the X16 decode layout (ops.pack_x16, ops.matmul_q8_x16)


def _acts(qt: ops.QType) -> tuple[str, ...]:
    """Activation paths timed for weight type qt: f32, q8_0 (ops.matmul_q8) where the type has
    it, q8_k (ops.matmul_q8k: the engine's default for K-quant experts) for Q8K_ACT_TYPES, and
    X16 (the same Q8_0 dots on X16-packed weights: the engine's layout for resident experts,
    the LM head and attention projections) for X16_TYPES where this CPU packs."""
    if qt not in ops.Q8_ACT_TYPES:
        return ("f32",)
    if qt in ops.Q8K_ACT_TYPES:
        return ("f32", "q8_0", "q8_k")
    return ("f32", "q8_0", X16) if qt in ops.X16_TYPES and ops.x16_fast() else ("f32", "q8_0")


def _matmul_runner(
    w: np.ndarray,
    qt: ops.QType,
    n: int,
    act: str,
    t: int,
    rng: np.random.Generator,
    evict: Callable[[], Any] | None = None,
) -> Callable[[], tuple[float, float]]:
    """A callable timing one (format, activation type, n, threads) point: (wall, CPU) seconds
    of the best of REPEAT calls after a warm-up (colibri/bench/kernels.py best_time_cpu),
    `evict` (untimed) before each (bench_kernels.l3_evictor)."""
    rows = w.shape[0]
    x = rng.standard_normal((n, COLS)).astype(np.float32)
    y = np.empty((n, rows), np.float32)
    if act == "f32":
        call = lambda: ops.matmul(w, qt, x, y, nthreads=t)  # noqa: E731
    elif act == "q8_k":
        xk = np.empty((n, COLS // 256 * ops.Q8K_BLOCK_NBYTES), np.uint8)
        call = lambda: ops.matmul_q8k(w, qt, ops.quantize_q8_k(x, xk), y, nthreads=t)  # noqa: E731
    elif act == X16:  # w: the X16-packed weights
        xq = np.empty((n, ops.row_nbytes(ops.QType.Q8_0, COLS)), np.uint8)
        call = lambda: ops.matmul_q8_x16(w, qt, ops.quantize_act(x, xq), y, nthreads=t)  # noqa: E731
    else:
        xq = np.empty((n, ops.row_nbytes(ops.QType.Q8_0, COLS)), np.uint8)
        call = lambda: ops.matmul_q8(w, qt, ops.quantize_act(x, xq), y, nthreads=t)  # noqa: E731
    return lambda: bench_kernels.best_time_cpu(call, REPEAT, evict)


def _matmul_runner_call(w: np.ndarray, qt: ops.QType, rng: np.random.Generator) -> Callable:
    """One 1-thread Q8_0-activation matvec call on w (untimed: the caller times it)."""
    x = rng.standard_normal((1, COLS)).astype(np.float32)
    y = np.empty((1, w.shape[0]), np.float32)
    xq = np.empty((1, ops.row_nbytes(ops.QType.Q8_0, COLS)), np.uint8)
    return lambda: ops.matmul_q8(w, qt, ops.quantize_act(x, xq), y, nthreads=1)


def _ffn_runner(qt: str, q8: bool, t: int, rng: np.random.Generator, repeat: int) -> Callable:
    """Median microseconds per expert_ffn call (n = 1 token, Qwen3-30B-A3B expert shape); qt is
    one type or "gate/up/down" types (a mixed record)."""
    d_model, d_ff = FFN_SHAPE
    qs = [ops.QType.parse(p) for p in (qt.split("/") * 3)[:3]]
    gate, up = (bench_kernels.make_weights(qs[i], d_ff, d_model, rng) for i in range(2))
    down = bench_kernels.make_weights(qs[2], d_model, d_ff, rng)
    x = rng.standard_normal(d_model).astype(np.float32)
    y, scratch = np.zeros_like(x), np.empty(2 * d_ff, np.float32)
    extra: dict[str, Any] = {"act_q8": True} if q8 else {}
    if len(set(qs)) > 1:
        extra["qtypes"] = tuple(qs)
    call = lambda: ops.expert_ffn(y, x, gate, up, down, qs[0], d_model, d_ff, scratch=scratch,  # noqa: E731
                                  nthreads=t, **extra)  # fmt: skip
    return lambda: bench_kernels.latency_us(call, repeat)[0]


def _gemm_paths() -> tuple[str, ...]:
    """The Q8_0-activation GEMM paths to time: AMX tiles and the AVX-512 VNNI kernels where AMX
    is usable, else the current level's kernels alone."""
    return ("amx", "avx512") if ops.amx_supported() else (ops.isa().name.lower(),)


def _gemm_runner(
    w: np.ndarray, qt: ops.QType, n: int, path: str, t: int, rng: np.random.Generator
) -> Callable[[], tuple[float, float]]:
    """(wall, CPU) seconds of the best of REPEAT `ops.matmul_q8` calls on n pre-quantized x
    rows (quantization not timed: this is the GEMM), on the AMX path or without it."""
    x = rng.standard_normal((n, GEMM_SHAPE[1])).astype(np.float32)
    xq, y = ops.quantize_act(x), np.empty((n, w.shape[0]), np.float32)
    amx = ops.amx_supported()

    def call() -> None:
        if amx:
            ops.set_amx(path == "amx")
        ops.matmul_q8(w, qt, xq, y, nthreads=t)

    return lambda: bench_kernels.best_time_cpu(call, REPEAT)


def _gemm(ctx: Context, threads: list[int], rounds: int, rng: np.random.Generator):
    """Prefill GEMM rows: GMAC/s per (weights, tokens, threads, path), interleaved; and the
    markdown table. The AMX flag is restored after."""
    rows_w, cols = GEMM_SHAPE
    paths = _gemm_paths()
    weights = {f: bench_kernels.make_weights(ops.QType.parse(f), rows_w, cols, rng)
               for f in GEMM_TYPES}  # fmt: skip
    points = [(f, n, p, t) for f in GEMM_TYPES for n in GEMM_TOKENS for p in paths
              for t in threads]  # fmt: skip
    runners = {pt: _gemm_runner(weights[pt[0]], ops.QType.parse(pt[0]), pt[1], pt[2], pt[3], rng)
               for pt in points}  # fmt: skip
    cpu: dict[tuple, list[float]] = {pt: [] for pt in points}
    cpu_s: dict[tuple, list[float]] = {pt: [] for pt in points}

    def wall(pt: tuple) -> Callable[[], float]:
        def f() -> float:
            s, c = runners[pt]()
            cpu[pt].append(c / s / pt[3])
            cpu_s[pt].append(c)
            return s

        return f

    before = ops.amx()
    ctx.log(f"kernels: {len(points)} prefill GEMM points x {rounds} rounds ({', '.join(paths)})")
    try:
        res = interleave({pt: wall(pt) for pt in points}, rounds)
    finally:
        if ops.amx_supported():
            ops.set_amx(before)
    out = []
    for (f, n, p, t), secs in res.items():
        s = median(secs)
        out.append({"qtype": f, "n": n, "path": p, "threads": t, "ms": s * 1e3,
                    "gmacs": n * rows_w * cols / s / 1e9, "cpu_share": median(cpu[(f, n, p, t)]),
                    "gmacs_per_cpu_s": n * rows_w * cols / median(cpu_s[(f, n, p, t)]) / 1e9,
                    "runs_s": secs})  # fmt: skip
    by = {(r["qtype"], r["n"], r["path"], r["threads"]): r for r in out}
    trows = []
    for f in GEMM_TYPES:
        for n in GEMM_TOKENS:
            for t in threads:
                g = [by[(f, n, p, t)]["gmacs"] for p in paths]
                gc = [by[(f, n, p, t)]["gmacs_per_cpu_s"] for p in paths]
                cs = min(by[(f, n, p, t)]["cpu_share"] for p in paths)
                trows.append([f.upper(), n, t, *g]
                             + ([f"{g[0] / g[1]:.2f}x", f"{gc[0] / gc[1]:.2f}x"]
                                if len(paths) == 2 else [])
                             + [f"{cs:.0%}"])  # fmt: skip
    head = ["weights", "tokens", "threads", *[f"{p} GMAC/s" for p in paths]]
    head += (["amx / avx512", "same, per CPU second"] if len(paths) == 2 else []) + ["cpu"]
    md = ["", f"Prefill GEMM: `ops.matmul_q8` of weights [{rows_w}, {cols}] on n Q8_0 x rows "
          "(quantized beforehand; multiply-adds n x rows x cols per call), "
          + ("on AMX int8 tiles (`tdpbssd`, csrc/arch/amx_gemm.c) and without them "
             "(AVX512-VNNI); the same bits either way. " if len(paths) == 2 else
             "(no usable AMX on this machine). ")
          + f"Best of {REPEAT} calls, median of {rounds} interleaved rounds; *cpu* as above, "
          "the lower of the paths'; *per CPU second*: the ratio of multiply-adds per second of "
          "process CPU time, which other work on a busy machine disturbs less.", "",
          table(head, trows)]  # fmt: skip
    return out, md


def _label(qt: str, act: str) -> str:
    return qt.upper() + ("" if act == "f32" else f" ({act} act)")


def _plot(ctx: Context, rows: list[dict[str, Any]], threads: list[int]) -> str:
    import matplotlib.pyplot as plt

    mv = [r for r in rows if r["n"] == 1]
    mm = [r for r in rows if r["n"] == BATCH]
    labels = list(dict.fromkeys(_label(r["qtype"], r["act"]) for r in mv))
    fig, (ax, axb) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(threads)
    xs = np.arange(len(labels))
    for i, t in enumerate(threads):
        for a, data, key, scale in ((ax, mv, "of_mem", 100), (axb, mm, "gflops", 1)):
            vals = [next((r[key] * scale for r in data if r["threads"] == t and
                          _label(r["qtype"], r["act"]) == lab), 0) for lab in labels]  # fmt: skip
            bars = a.bar(xs + (i - (len(threads) - 1) / 2) * width, vals, width,
                         label=f"{t} thread{'s' * (t > 1)}")  # fmt: skip
            a.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.axhline(100, ls="--", color="k", lw=1, label="memory read bandwidth (SIMD read)")
    ax.axhline(TARGET * 100, ls=":", color="gray", lw=1, label=f"target {TARGET:.0%} (Q4_0)")
    ax.set_ylim(0, max([115.0] + [r["of_mem"] * 115 for r in mv]))
    ax.set_ylabel("% of memory bandwidth (same thread count)")
    ax.set_title(f"Matvec, {weight_mib(ctx.quick)} MiB of weights: weight GB/s vs memory GB/s")
    axb.set_ylabel("GFLOP/s")
    axb.set_title(f"Batch-{BATCH} matmul")
    for a in (ax, axb):
        a.set_xticks(xs, labels, rotation=20, fontsize=8)
        a.grid(axis="y", alpha=0.3)
        a.legend(fontsize=8, loc="upper right", ncol=2)
    fig.tight_layout()
    name = "kernels_membw.png"
    fig.savefig(ctx.figure(name), dpi=110)
    plt.close(fig)
    return name


def run(ctx: Context) -> Section:
    """Measure matvec / batch-8 matmul per format and threads, interleaved, against the memory
    bandwidth (colibri.bench.sec_limits.memory_gbps), and the expert-FFN call latency."""
    threads = sorted({1, ctx.threads})
    rounds = max(sec_limits.MIN_ROUNDS, ctx.rounds)  # this shared machine is noisy
    mem_limits = {ctx.threads: sec_limits.memory_gbps(ctx)}
    mem_limits[1] = float(ctx.results["limits"]["mem_gbps_1t"])
    rng = np.random.default_rng(0)
    mib = weight_mib(ctx.quick)
    weights = {}
    for name in FORMATS:
        qt = ops.QType.parse(name)
        nrows = (mib << 20) // ops.row_nbytes(qt, COLS) // 16 * 16  # whole X16 tiles
        weights[name] = bench_kernels.make_weights(qt, nrows, COLS, rng)
    points = [(f, a, n, t) for f in FORMATS for a in _acts(ops.QType.parse(f))
              for n in (1, BATCH) for t in threads]  # fmt: skip
    packed = {f: ops.pack_x16(weights[f], ops.QType.parse(f), COLS)
              for f, a, _, _ in points if a == X16}  # fmt: skip
    # weights an L3 could hold (480 MiB reported on some VMs) are evicted before each call
    evict = {f: bench_kernels.l3_evictor(w) for f, w in weights.items()}
    evict |= {(f, X16): bench_kernels.l3_evictor(w) for f, w in packed.items()}
    runners = {p: _matmul_runner(packed[p[0]] if p[1] == X16 else weights[p[0]],
                                 ops.QType.parse(p[0]), p[2], p[1], p[3], rng,
                                 evict[(p[0], X16) if p[1] == X16 else p[0]])
               for p in points}  # fmt: skip
    cpu: dict[tuple, list[float]] = {p: [] for p in points}

    def wall(p: tuple) -> Callable[[], float]:
        def f() -> float:
            s, c = runners[p]()
            cpu[p].append(c / s / p[3])
            return s

        return f

    ctx.log(f"kernels: {len(points)} matmul points x {rounds} rounds, {mib} MiB weights")
    # the read bound again, interleaved with the kernels: this machine's bandwidth drifts with
    # its load
    read = bench_kernels.read_bandwidth
    copies = {("copy", t): (lambda t=t: read(sec_limits.MEM_READ_NBYTES, t, REPEAT))
              for t in threads}  # fmt: skip
    res = interleave({**copies, **{p: wall(p) for p in points}}, rounds)
    mem_here = {t: median(res.pop(("copy", t))) for t in threads}
    bw = {t: max(mem_limits[t], mem_here[t]) for t in threads}  # the higher: never flatter
    bw[ctx.threads] = max(bw[ctx.threads], bw[1])  # N threads can do what one does
    mem, mem_1t = bw[ctx.threads], bw[1]
    rows: list[dict[str, Any]] = []
    for (f, a, n, t), secs in res.items():
        s, w = median(secs), weights[f]
        gbs = w.nbytes / s / 1e9
        rows.append({"qtype": f, "act": a, "n": n, "threads": t, "ms": s * 1e3, "gbps": gbs,
                     "of_mem": gbs / bw[t], "gflops": 2 * n * w.shape[0] * COLS / s / 1e9,
                     "cpu_share": median(cpu[(f, a, n, t)]), "runs_s": secs})  # fmt: skip
    # one core's compute ceiling: the Q4_0 matvec on 1 MiB of the same weights, hot in L2
    w4 = weights["q4_0"]
    hot = np.ascontiguousarray(w4[: (1 << 20) // w4.shape[1]])
    s_hot = bench_kernels.best_time_cpu(_matmul_runner_call(hot, ops.QType.Q4_0, rng), 50)[0]
    hot_gbps = hot.nbytes / s_hot / 1e9
    del weights, packed

    ffn_points = [(q, q8, t) for q in FFN_TYPES for q8 in (False, True) for t in threads]
    reps = 200 if ctx.quick else 500
    ffn_res = interleave({p: _ffn_runner(*p, rng, reps) for p in ffn_points}, rounds)
    ffn = [{"qtype": q, "act": "q8_0" if q8 else "f32", "threads": t, "us": median(v), "runs_us": v}
           for (q, q8, t), v in ffn_res.items()]  # fmt: skip

    gemm, gemm_md = _gemm(ctx, threads, rounds, rng)

    # ---- report ----
    d_model, d_ff = FFN_SHAPE
    md = [
        f"Matvec (n = 1) and batch-{BATCH} matmul through `ops.matmul` on {mib} MiB of random "
        f"weights per format ([rows, {COLS}], each byte read once per call; "
        + (
            f"the L3 reported here ({bench_kernels.l3_nbytes() >> 20} MiB) could hold them, so "
            "each is flushed from every cache level (clflush, untimed) before each timed call); "
            if evict["q4_0"] is not None
            else "bigger than the L3); "
        )
        + "f32 activations, and Q8_0 activations with integer dots (`ops.matmul_q8`, quantization "
        "of x included; the engine's default); *q8_0 x16*: the same dots on the weights packed "
        "into the X16 decode layout (`ops.pack_x16`, `ops.matmul_q8_x16`: 16-row tiles stored as "
        "the matvec reads them, the same bits), the engine's layout for the LM head, attention "
        "projections and experts that all stay resident. Time per point: "
        f"best of {REPEAT} calls after "
        f"a warm-up, median over {rounds} interleaved rounds. *of mem* = weight GB/s / memory "
        "read GB/s (streaming SIMD read in C, same thread count, the higher of the limits "
        f"section's figure and a read interleaved with these runs: {fmt(mem_1t)} GB/s at 1 thread, "
        f"{fmt(mem)} GB/s at {ctx.threads}). *cpu* = process CPU time / (wall x threads): "
        "below 100% the machine was busy with other work.",
    ]
    by = {(r["qtype"], r["act"], r["n"], r["threads"]): r for r in rows}
    trows = []
    for f in FORMATS:
        for a in _acts(ops.QType.parse(f)):
            for t in threads:
                r1, r8 = by[(f, a, 1, t)], by[(f, a, BATCH, t)]
                trows.append([f.upper(), a, t, r1["ms"], r1["gbps"], f"{r1['of_mem']:.0%}",
                              f"{r1['cpu_share']:.0%}", r8["gflops"]])  # fmt: skip
    md += ["", table(["weights", "activations", "threads", "matvec ms", "weight GB/s",
                      "of mem", "cpu", f"batch-{BATCH} GFLOP/s"], trows)]  # fmt: skip

    q4 = [r for r in rows if r["qtype"] == "q4_0" and r["n"] == 1 and r["threads"] == ctx.threads]
    best = max(q4, key=lambda r: r["gbps"])
    if best["of_mem"] < TARGET:
        one = max((r for r in rows if r["qtype"] == "q4_0" and r["n"] == 1 and r["threads"] == 1),
                  key=lambda r: r["gbps"])  # fmt: skip
        scale = best["gbps"] / one["gbps"]
        compute_bound = hot_gbps < 1.15 * one["gbps"]
        md += ["", f"Q4_0 matvec reaches {best['of_mem']:.0%} of the memory bandwidth at "
               f"{ctx.threads} threads (target {TARGET:.0%}). Where the time goes: one core "
               f"decodes {one['gbps']:.2f} GB/s of Q4_0 from memory ({one['of_mem']:.0%} of a "
               f"1-thread read) and {hot_gbps:.1f} GB/s from its L2 (1 MiB of the same "
               f"weights, hot), and {ctx.threads} threads give {scale:.2f}x the 1-thread "
               "figure: "
               + ("one core's unpacking and dots (compute) bound it, not DRAM" if compute_bound
                  else "from memory it runs below what its compute allows, so the loss is in "
                  "how the kernel's loads meet DRAM (a tile of 8 or 16 rows read as that "
                  "many streams, and the software prefetch of the next tile), not in the "
                  "arithmetic")
               + "."]  # fmt: skip
        if min(best["cpu_share"], one["cpu_share"]) < 0.8:
            md[-1] += (f" Caveat: these points got only {one['cpu_share']:.0%} (1 thread) and "
                       f"{best['cpu_share']:.0%} ({ctx.threads} threads) of their CPU time; the "
                       "rest went to other work on the machine.")  # fmt: skip

    busy = [r for r in rows if r["cpu_share"] < 0.8]
    if busy:
        worst = min(r["cpu_share"] for r in busy)
        md += ["", f"{len(busy)} of {len(rows)} points got less than 80% of their threads' CPU "
               f"time (down to {worst:.0%}): other work on this shared machine took the rest, "
               "so those GB/s understate the kernels."]  # fmt: skip

    frows = [[r["qtype"].upper(), r["act"], r["threads"], r["us"]] for r in ffn]
    wbytes = 3 * d_model * d_ff
    md += ["", f"Small-call latency: one `ops.expert_ffn` call on one token, Qwen3-30B-A3B "
           f"expert shape (gate/up [{d_ff}, {d_model}], down [{d_model}, {d_ff}], "
           f"{wbytes / 1e6:.1f} M weights, cache-resident after the first call), median µs over "
           f"{reps} back-to-back calls, median of {rounds} rounds (the engine makes ~8 such "
           "calls per layer per token).", "",
           table(["weights", "activations", "threads", "µs per call"], frows)]  # fmt: skip
    md += gemm_md

    heads = [Headline(
        scenario="Q4_0 matvec", unit="GB/s", value=best["gbps"], limit=mem,
        limit_name=f"memory read, {ctx.threads} threads (SIMD read)", target="≥ 80%",
        note=f"{mib} MiB weights, "
        + ("q8_0 activations, X16 layout" if best["act"] == X16 else f"{best['act']} activations")
        + f", {ctx.threads} threads",
    )]  # fmt: skip
    data = {"weight_mib": mib, "cols": COLS, "mem_gbps": mem, "mem_gbps_1t": mem_1t,
            "q4_0_matvec_l2_gbps_1t": hot_gbps,
            "mem_gbps_limits": {str(t): v for t, v in mem_limits.items()},
            "mem_gbps_interleaved": {str(t): v for t, v in mem_here.items()},
            "matmul": rows,
            "expert_ffn": ffn, "ffn_shape": list(FFN_SHAPE),
            "prefill_gemm": gemm, "gemm_shape": list(GEMM_SHAPE), "amx": ops.amx()}  # fmt: skip
    return Section(key="kernels", title=TITLE, markdown="\n".join(md), data=data,
                   figures=[_plot(ctx, rows, threads)], headlines=heads)  # fmt: skip
