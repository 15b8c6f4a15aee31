"""`python -m colibri bench`: colibri against llama.cpp and this machine's limits, one report.

One run measures everything side by side and writes a Markdown report with PNG plots and the
raw numbers as JSON.

    python -m colibri bench --quick              # under 10 minutes
    python -m colibri bench                      # the full suite
    python -m colibri bench --sections limits,replay --out results/today

Sections (colibri/bench/sec_<name>.py, run in this order; later ones use the limits measured first):
limits (disk with fio, memory bandwidth), kernels (matvec GB/s as a fraction of memory
bandwidth), decode (colibri decode/prefill, stores that fit the budget and 2-3x bigger, cold and
warm, next to the storage and compute bounds), replay (the real Mixtral-8x7B routing trace per
policy x budget x prefetch vs Belady; prefetcher recall on colibri's own runs), llama (llama.cpp
on the same GGUF weights: in RAM, and both engines under one cgroup memory limit), types
(in-RAM decode/prefill per expert type, Q4_0 / Q4_K / Q6_K / MXFP4 / FP8, beside llama.cpp
where GGUF has the type), mirror
(expert reads spread over copies of the experts file on several drives), quality
(perplexity, KL and routing agreement of every expert format against the f32 store), serve
(`colibri serve` at 1-8 concurrent clients in RAM and out of core; the prefix cache's TTFT),
cluster (experts on a local 2-node Ray cluster vs the single-process engine; needs Ray).

Big files (synthetic stores, GGUFs, the fio file) go to --work and are kept for the next run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from pathlib import Path

from colibri.options import whole

ROOT = Path(__file__).resolve().parents[2]  # the checkout

# key -> module; the order is the run order
SECTIONS: dict[str, str] = {
    "limits": "colibri.bench.sec_limits",
    "kernels": "colibri.bench.sec_kernels",
    "decode": "colibri.bench.sec_decode",
    "replay": "colibri.bench.sec_replay",
    "llama": "colibri.bench.sec_llama",
    "types": "colibri.bench.sec_types",
    "mirror": "colibri.bench.sec_mirror",
    "quality": "colibri.bench.sec_quality",
    "serve": "colibri.bench.sec_serve",
    "cluster": "colibri.bench.sec_cluster",
}


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer rounds (< 10 min)")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of: {','.join(SECTIONS)} (default: all)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="results folder (default: results/bench-YYYYmmdd-HHMMSS under the current directory)",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path(os.environ.get("COLIBRI_BENCH_WORK", "/var/tmp/colibri-bench")),
        help="scratch folder for stores, GGUFs and the fio file, on the disk to measure "
        "(default: $COLIBRI_BENCH_WORK or /var/tmp/colibri-bench; kept between runs)",
    )
    p.add_argument(
        "--threads", type=whole(1), help="compute threads for both engines (default: cores)"
    )
    p.add_argument("--rounds", type=whole(1), help="interleaved A/B rounds (default 3, quick 2)")
    p.add_argument(
        "--decode-model",
        default=None,
        choices=("qwen3-30b-a3b", "deepseek-v4-flash"),  # sec_decode.MODELS
        help="decode section: the synthetic store's tools/synth_store.py preset "
        "(qwen3-30b-a3b, default; deepseek-v4-flash)",
    )
    p.add_argument("--mirror", action="append", default=[], metavar="DIR",
                   help="mirror section: a directory on another drive for a copy (repeatable; "
                   "default: /dev/shm standing in for a second drive)")  # fmt: skip


def run_cli(args: argparse.Namespace) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print("colibri bench: matplotlib is missing: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    from colibri.bench.report import Context, Section, machine_info, write_report

    keys = [k.strip() for k in args.sections.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SECTIONS]
    if unknown or not keys:
        print(f"colibri bench: unknown section(s) {unknown}; choose from {list(SECTIONS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    out = args.out or Path("results") / time.strftime("bench-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    from colibri.compute import ops

    threads = args.threads or ops.default_threads()
    ctx = Context(out=out.resolve(), work=args.work.resolve(), quick=args.quick, threads=threads,
                  rounds=args.rounds or (2 if args.quick else 3))  # fmt: skip
    ctx.mirrors = args.mirror
    ctx.decode_model = args.decode_model
    sections: list[Section] = []
    machine = machine_info(ctx.work)
    t_start = time.perf_counter()
    with open(out / "run.log", "a") as ctx.log_file:
        for key in keys:
            mod = importlib.import_module(SECTIONS[key])
            ctx.log(f"== {key}: {mod.TITLE}")
            t0 = time.perf_counter()
            try:
                sec = mod.run(ctx)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # one failed section must not lose the others' figures
                ctx.log(f"{key} failed: {exc!r}")
                print(traceback.format_exc(), file=ctx.log_file)
                sec = Section(key=key, title=mod.TITLE, markdown="", error=f"{exc!r}")
            sec.seconds = time.perf_counter() - t0
            ctx.results[key] = sec.data
            sections.append(sec)
            write_report(ctx, machine, sections)  # a partial report survives an interrupt
    machine["loadavg_end"] = os.getloadavg()
    machine["total_seconds"] = round(time.perf_counter() - t_start, 1)
    path = write_report(ctx, machine, sections)
    failed = [s.key for s in sections if s.error]
    print(f"report: {path}" + (f" (failed sections: {', '.join(failed)})" if failed else ""))
    return 1 if failed else 0
