#!/usr/bin/env python
"""llama.cpp as the peer: run its own tools on a GGUF (colibri.export_gguf writes one with the
store's very bytes) and return tok/s and peak memory, optionally under a memory limit.

The binaries come from tools/build_llama_cpp.sh (cached under ~/.cache/colibri), or from
$COLIBRI_LLAMA_CPP_BIN. Nothing here runs in CI.

    python -m colibri.bench.llama_cpp MODEL.gguf --threads 2                 # llama-bench pp + tg
    python -m colibri.bench.llama_cpp MODEL.gguf --completion 64 --memory-limit 2G

Memory limits use a cgroup made for the benchmark's own child process: a child of this
process's cgroup (v2 `memory.max` if the memory controller is enabled there, else v1
`memory.limit_in_bytes`), removed afterwards. Page cache is charged to the cgroup that first
touches a page, so the GGUF's cached pages are dropped first (posix_fadvise DONTNEED), and
llama.cpp's default mmap then has to live within the limit. Note: llama.cpp's CPU weight
repacking (on by default for Q4_0 with AVX2) copies weights into anonymous memory, so a model
larger than the limit is OOM-killed unless `extra=["--no-repack"]` keeps it on the mmap.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tools/ is there


def llama_bin_dir() -> Path:
    """Directory holding llama-bench / llama-completion: $COLIBRI_LLAMA_CPP_BIN, else the cached
    build of tools/build_llama_cpp.sh. Raises FileNotFoundError saying how to build it."""
    env = os.environ.get("COLIBRI_LLAMA_CPP_BIN")
    if env:
        return Path(env)
    res = subprocess.run(
        ["bash", str(ROOT / "tools/build_llama_cpp.sh"), "--print"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if res.returncode != 0:
        raise FileNotFoundError("llama.cpp is not built: run tools/build_llama_cpp.sh")
    return Path(res.stdout.strip())


def ik_llama_bin_dir() -> Path | None:
    """Directory holding ik_llama.cpp's llama-bench (github.com/ikawrakow/ik_llama.cpp, the
    second CPU peer of issue 23): $COLIBRI_IK_LLAMA_CPP_BIN, else the cached build of
    tools/build_ik_llama_cpp.sh; None when neither exists (it is never built by CI)."""
    env = os.environ.get("COLIBRI_IK_LLAMA_CPP_BIN")
    if env:
        return Path(env) if (Path(env) / "llama-bench").is_file() else None
    res = subprocess.run(
        ["bash", str(ROOT / "tools/build_ik_llama_cpp.sh"), "--print"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    path = Path(res.stdout.strip())
    return path if res.returncode == 0 and (path / "llama-bench").is_file() else None


def _exe(name: str, bindir: Path | None = None) -> str:
    path = (bindir or llama_bin_dir()) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: rebuild with tools/build_llama_cpp.sh")
    return str(path)


def drop_file_cache(path: str | os.PathLike[str]) -> None:
    """Ask the kernel to drop the clean page-cache pages of `path` (posix_fadvise DONTNEED), so
    the next reader pays for them again and, under a cgroup, is charged for them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def group_read_bytes(pgid: int, seen: dict[int, int]) -> int:
    """Bytes the processes of process group `pgid` have had read from storage so far
    (/proc/PID/io `read_bytes`: page-cache misses, mmap faults included), summed over every
    process seen in the group: `seen` ({pid: bytes}) keeps the last figure of processes that
    have since exited. 0 where /proc/PID/io is not readable."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            io = (d / "io").read_text()
        except (OSError, IndexError, ValueError):
            continue
        for line in io.splitlines():
            if line.startswith("read_bytes:"):
                seen[int(d.name)] = max(seen.get(int(d.name), 0), int(line.split()[1]))
    return sum(seen.values())


def run_capped(
    cmd: list[str],
    time_limit: float | None,
    preexec_fn: Any = None,
    stats: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[subprocess.CompletedProcess, bool]:
    """Run `cmd` (text output captured, bytes that are not UTF-8 replaced: a model with
    random weights prints any bytes; stdin /dev/null) in a session of its own; past
    `time_limit` seconds of wall clock (None: no limit) its whole process group is ended,
    SIGTERM then SIGKILL after 5 s (a thrashing peer under a memory limit may not even get to
    handle the first), so no grandchild (e.g. llama.cpp under /usr/bin/time) outlives it.
    With `stats`, its "read_bytes" is set to what the group read from storage
    (group_read_bytes, sampled every 0.5 s and at the end: a lower bound).
    Returns (the CompletedProcess with what it wrote, timed_out)."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        text=True, errors="replace", start_new_session=True, preexec_fn=preexec_fn, **kwargs,
    )  # fmt: skip
    timed_out = False
    seen: dict[int, int] = {}
    deadline = None if time_limit is None else time.monotonic() + time_limit
    try:
        while True:
            wait = None if stats is None else 0.5
            if deadline is not None:
                left = max(0.0, deadline - time.monotonic())
                wait = left if wait is None else min(wait, left)
            try:
                out, err = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                if stats is not None:
                    stats["read_bytes"] = group_read_bytes(proc.pid, seen)
                if deadline is not None and time.monotonic() >= deadline:
                    raise
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                out, err = proc.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # the leader gone, a straggler left
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), timed_out


# ---- llama-bench ------------------------------------------------------------------------


def run_llama_bench(
    gguf: str | os.PathLike[str],
    threads: int,
    n_prompt: int | Sequence[int] = 512,
    n_gen: int = 128,
    repetitions: int = 3,
    extra: list[str] | None = None,
    bindir: Path | None = None,
    depth: int = 0,
    ik: bool = False,
) -> dict[str, Any]:
    """Prefill and decode speed of `gguf` from llama-bench's JSON output (the llama-bench in
    `bindir`, default llama.cpp's; ik_llama.cpp's llama-bench takes the same options and JSON).

    Runs `llama-bench -m GGUF -t threads -p n_prompt -n n_gen -r repetitions -o json` (one pp
    test per prompt size in n_prompt, one tg test generating n_gen tokens after an empty
    context; llama-bench warms up first). With `depth` > 0 it runs the tg test only, after a
    context of `depth` tokens: llama.cpp's `-p 0 -n n_gen -d depth`, or with `ik` (the binary
    is ik_llama.cpp's, which has no -d) its `-p 0 -n 0 -gp depth,n_gen`. Returns {"pp_tok_s",
    "tg_tok_s" (means; pp_tok_s of the first prompt size), "pp_samples", "tg_samples" (tok/s
    per repetition), "pp_by_n" ({prompt size: mean tok/s}), "build_commit", "cpu_info",
    "model_size" (bytes), "model_n_params", "cmd"}. A side is None when its count is 0.
    Raises FileNotFoundError (no build), subprocess.CalledProcessError (llama-bench failed)."""
    sizes = [n_prompt] if isinstance(n_prompt, int) else list(n_prompt)
    if depth and ik:
        tests = ["-p", "0", "-n", "0", "-gp", f"{depth},{n_gen}"]
    elif depth:
        tests = ["-p", "0", "-n", str(n_gen), "-d", str(depth)]
    else:
        tests = ["-p", ",".join(str(n) for n in sizes), "-n", str(n_gen)]
    cmd = [_exe("llama-bench", bindir), "-m", str(gguf), "-t", str(threads), *tests, "-r",
           str(repetitions), "-o", "json", *(extra or [])]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise subprocess.CalledProcessError(res.returncode, cmd, res.stdout, res.stderr)
    rows = json.loads(res.stdout)
    out: dict[str, Any] = {"pp_tok_s": None, "tg_tok_s": None, "pp_by_n": {}, "cmd": cmd}
    for row in rows:
        side = "tg" if row["n_gen"] > 0 else "pp"
        if side == "pp":
            out["pp_by_n"][int(row["n_prompt"])] = float(row["avg_ts"])
            if out["pp_tok_s"] is not None:  # the first size keeps pp_tok_s / pp_samples
                continue
        out[f"{side}_tok_s"] = float(row["avg_ts"])
        out[f"{side}_samples"] = [float(x) for x in row.get("samples_ts", [])]
        for key in ("build_commit", "cpu_info", "model_size", "model_n_params", "n_threads"):
            out[key] = row.get(key)
    return out


# ---- memory-limited runs ----------------------------------------------------------------


def _own_memory_cgroup() -> tuple[int, Path]:
    """(cgroup version, directory) of this process's memory cgroup."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:  # v1: "N:memory:/path"
        _, ctrl, rel = line.split(":", 2)
        if "memory" in ctrl.split(","):
            return 1, Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
    for line in lines:  # v2: "0::/path", memory enabled for children of that path
        _, ctrl, rel = line.split(":", 2)
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        if ctrl == "" and "memory" in (base / "cgroup.subtree_control").read_text().split():
            return 2, base
    raise PermissionError("no memory cgroup controller available to this process")


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[dict[str, Any]]:
    """A fresh memory cgroup limited to `limit_bytes` (swap included where the kernel counts
    it), as a child of this process's own cgroup. Yields {"version", "path", "procs"}: write a
    pid to `procs` (see `_join`) to move a process in. On exit, after its processes are gone,
    reads the peak usage into the dict ("peak_bytes", page cache included) and the number of
    processes the kernel's OOM killer ended in it ("oom_kills"), then removes it.
    Raises PermissionError if cgroups are not writable here."""
    version, parent = _own_memory_cgroup()
    path = parent / f"colibri-bench-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        path.mkdir()
    except OSError as exc:
        raise PermissionError(f"cannot create cgroup {path}: {exc}") from None
    info: dict[str, Any] = {
        "version": version,
        "path": str(path),
        "procs": str(path / "cgroup.procs"),
    }
    try:
        if version == 2:
            (path / "memory.max").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        yield info
    finally:
        peak = path / ("memory.peak" if version == 2 else "memory.max_usage_in_bytes")
        with contextlib.suppress(OSError, ValueError):
            info["peak_bytes"] = int(peak.read_text())
        events = path / ("memory.events" if version == 2 else "memory.oom_control")
        with contextlib.suppress(OSError, ValueError):  # "oom_kill N" (kernels >= 4.13)
            for line in events.read_text().splitlines():
                if line.startswith("oom_kill "):
                    info["oom_kills"] = int(line.split()[1])
        for _ in range(50):  # the last exiting task may linger a moment
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _join(procs: str):
    """preexec_fn moving the child into a cgroup before it execs (so all its memory counts)."""

    def join() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    return join


# ---- llama-completion -------------------------------------------------------------------

_PERF = re.compile(
    r"(prompt eval|eval) time =\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)"
    r".*?([\d.]+) tokens per second"
)
_RSS = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")


def run_completion(
    gguf: str | os.PathLike[str],
    prompt: str,
    n: int,
    threads: int,
    memory_limit: int | None = None,
    drop_cache: bool = True,
    extra: list[str] | None = None,
    time_limit: float | None = 3600,
    ik_bindir: Path | None = None,
) -> dict[str, Any]:
    """Generate `n` tokens greedily after `prompt` with `llama-completion -no-cnv` (llama.cpp's
    default mmap loading; with `ik_bindir`, ik_llama.cpp's `llama-cli` from there, whose
    default is not conversation mode), under `/usr/bin/time -v`, optionally inside a memory
    cgroup of `memory_limit` bytes.

    Returns {"wall_s", "wall_tok_s" (n / wall time, loading included), "decode_tok_s" and
    "prompt_tok_s" (llama.cpp's own eval timings), "n_prompt", "n_gen", "peak_rss_bytes"
    (max RSS, file-backed mapped pages included), "cgroup_peak_bytes" (with a limit: peak of
    the cgroup, page cache included), "oom_kills" (with a limit: processes the OOM killer
    ended), "timed_out" (ended after `time_limit` s of wall clock, see run_capped),
    "read_bytes" (read from storage by its processes, a lower bound: group_read_bytes), "cmd",
    "returncode"}; a run killed by the limit or the clock has a non-zero returncode and None
    timings. Raises FileNotFoundError (no build),
    PermissionError (memory_limit given but cgroups are not writable)."""
    if drop_cache:
        drop_file_cache(gguf)
    exe = [_exe("llama-cli", ik_bindir)] if ik_bindir else [_exe("llama-completion"), "-no-cnv"]
    cmd = ["/usr/bin/time", "-v", *exe, "-m", os.path.abspath(gguf), "-p", prompt, "-n", str(n),
           "-t", str(threads), "--temp", "0", "--ignore-eos", "-c", "4096",
           *(extra or [])]  # fmt: skip
    ctx = memory_cgroup(memory_limit) if memory_limit else contextlib.nullcontext(None)
    stats: dict[str, Any] = {}
    # in a directory of its own: ik_llama.cpp's llama-cli writes main.log where it runs
    with ctx as cg, tempfile.TemporaryDirectory(prefix="colibri-peer-") as cwd:
        t0 = time.perf_counter()
        res, timed_out = run_capped(cmd, time_limit, _join(cg["procs"]) if cg else None, stats,
                                    cwd=cwd)  # fmt: skip
        wall = time.perf_counter() - t0
    perf = {m[0]: (float(m[1]), int(m[2]), float(m[3])) for m in _PERF.findall(res.stderr)}
    rss = _RSS.search(res.stderr)
    ok = res.returncode == 0 and "eval" in perf and not timed_out
    return {
        "wall_s": wall,
        "wall_tok_s": n / wall if ok else None,
        "decode_tok_s": perf["eval"][2] if ok else None,
        "prompt_tok_s": perf["prompt eval"][2] if ok and "prompt eval" in perf else None,
        "n_prompt": perf["prompt eval"][1] if "prompt eval" in perf else None,
        "n_gen": perf["eval"][1] + 1 if "eval" in perf else None,  # +1: sampled after prefill
        "peak_rss_bytes": int(rss[1]) * 1024 if rss else None,
        "cgroup_peak_bytes": cg.get("peak_bytes") if cg else None,
        "oom_kills": cg.get("oom_kills") if cg else None,
        "memory_limit": memory_limit,
        "timed_out": timed_out,
        "time_limit_s": time_limit,
        "read_bytes": stats.get("read_bytes"),
        "returncode": res.returncode,
        "cmd": cmd,
        "stderr_tail": res.stderr[-1500:] if not ok else "",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--completion", type=int, metavar="N", help="llama-completion of N tokens")
    ap.add_argument("--prompt", default="The history of the hummingbird begins")
    ap.add_argument("--memory-limit", help="e.g. 2G (completion only; needs writable cgroups)")
    args = ap.parse_args(argv)
    if args.completion:
        limit = None
        if args.memory_limit:
            from colibri.options import parse_size

            limit = parse_size(args.memory_limit)
        out = run_completion(args.gguf, args.prompt, args.completion, args.threads, limit)
    else:
        out = run_llama_bench(args.gguf, args.threads, args.n_prompt, args.n_gen, args.reps)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
