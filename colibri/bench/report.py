"""The `colibri bench` report: what every section gets (Context), what it gives back (Section),
the machine record, interleaved A/B runs, and the Markdown + JSON + PNG writer.

A section is a module `colibri/bench/sec_<name>.py` with

    TITLE = "Disk and memory limits"
    def run(ctx: Context) -> Section

It measures, logs each external command through `ctx.run` (so the report lists the exact
commands), saves plots with `ctx.figure(name)` and returns its raw numbers (`data`, JSON-able),
a Markdown body and headline rows. Sections run in the order of `suite.SECTIONS`; a later one
reads what an earlier one left in `ctx.results` (e.g. the measured disk and memory limits).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tools/ is there


def tool(name: str) -> str:
    """The path of the checkout's tools/`name` (synth_store.py: the synthetic stores). Raises
    FileNotFoundError naming it when colibri runs without its source checkout."""
    path = ROOT / "tools" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the benchmarks' helper scripts are in colibri's source "
            "checkout (tools/); run colibri bench from a checkout (./run.sh installs it)"
        )
    return str(path)


@dataclass
class Headline:
    """One row of the report's headline table: colibri vs llama.cpp and ik_llama.cpp vs the
    physical limit.

    value/peer (llama.cpp)/ik (ik_llama.cpp, its faster variant)/limit are in `unit` (None:
    not measured); peer_note / ik_note stand in the peer's cell when its figure is missing
    (e.g. "< 0.05 (did not finish 6 tokens in 100 s; read 43 GB)"); `note` says what the limit
    is or why a figure is missing. ratio_peer = value / the best peer's figure, ratio_limit =
    value / limit."""

    scenario: str
    unit: str
    value: float | None
    peer: float | None = None
    limit: float | None = None
    limit_name: str = ""
    target: str = ""
    note: str = ""
    ik: float | None = None
    peer_note: str = ""
    ik_note: str = ""

    @property
    def best_peer(self) -> float | None:
        have = [x for x in (self.peer, self.ik) if x]
        return max(have) if have else None

    @property
    def ratio_peer(self) -> float | None:
        best = self.best_peer
        return self.value / best if self.value and best else None

    @property
    def ratio_limit(self) -> float | None:
        return self.value / self.limit if self.value and self.limit else None


@dataclass
class Section:
    """What a section returns. markdown: body without its title; figures: file names in the
    results folder (already saved); data: raw numbers, JSON-serialisable."""

    key: str
    title: str
    markdown: str
    data: dict[str, Any] = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)
    headlines: list[Headline] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""


@dataclass
class Context:
    """Shared by every section of one `colibri bench` run.

    out: results folder (report.md, results.json, *.png); work: scratch folder for big files
    (stores, GGUFs, fio files), kept between runs so a second run reuses them; quick: the
    under-10-minutes mode; threads: compute threads for both engines; results: the data of the
    sections run so far, by key."""

    out: Path
    work: Path
    quick: bool
    threads: int
    rounds: int
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    log_file: Any = None

    def log(self, msg: str) -> None:
        """Progress line on stderr and in the run log."""
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, file=sys.stderr, flush=True)
        if self.log_file:
            print(line, file=self.log_file, flush=True)

    def run(
        self, cmd: Sequence[str], *, check: bool = True, timeout: float | None = None, **kw: Any
    ) -> subprocess.CompletedProcess:
        """subprocess.run with the exact command recorded for the report (text output captured
        unless the caller passes stdout/stderr). Raises CalledProcessError / TimeoutExpired."""
        self.record(cmd)
        kw.setdefault("capture_output", "stdout" not in kw and "stderr" not in kw)
        kw.setdefault("text", True)
        return subprocess.run(list(cmd), check=check, timeout=timeout, **kw)

    def record(self, cmd: Sequence[str] | str) -> None:
        """Note a command that was run some other way (e.g. inside a cgroup helper)."""
        text = cmd if isinstance(cmd, str) else shlex.join(str(c) for c in cmd)
        self.commands.append(text)
        if self.log_file:
            print(f"$ {text}", file=self.log_file, flush=True)

    def figure(self, name: str) -> Path:
        """Path for a PNG in the results folder; pass the bare name to Section.figures."""
        return self.out / name

    def free_bytes(self) -> int:
        """Free bytes on the scratch folder's file system."""
        return shutil.disk_usage(self.work).free


def interleave(
    runs: dict[str, Callable[[], float]], rounds: int, log: Callable[[str], None] | None = None
) -> dict[str, list[float]]:
    """Run each callable once per round, alternating A, B, ... then A, B again (a noisy machine
    drifts; interleaving spreads the drift over every contestant). Returns the values by name.
    Pass the medians (`median`) and their ratios to the report."""
    out: dict[str, list[float]] = {name: [] for name in runs}
    for rnd in range(rounds):
        names = list(runs) if rnd % 2 == 0 else list(reversed(runs))
        for name in names:
            out[name].append(float(runs[name]()))
            if log:
                log(f"  round {rnd + 1}/{rounds} {name}: {out[name][-1]:.4g}")
    return out


def median(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "absent"


def machine_info(work: Path) -> dict[str, Any]:
    """Cores, CPU model and ISA, RAM, the disk under `work`, kernel, versions, git commit."""
    cpuinfo = _read("/proc/cpuinfo")
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if
                  ln.startswith("model name")), platform.processor())  # fmt: skip
    # a VM's model name may be just "AMD EPYC": family / model / stepping tell the generation
    # (AMD family 25 is Zen 3 / Zen 4, 26 is Zen 5; Intel family 6 models by number)
    fms = {k: next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines()
                    if ln.split(":", 1)[0].strip() == k), "")
           for k in ("cpu family", "model", "stepping")}  # fmt: skip
    if fms["cpu family"]:
        model += (f" (family {fms['cpu family']} model {fms['model']} "
                  f"stepping {fms['stepping']})")  # fmt: skip
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if
                  ln.startswith("flags")), [])  # fmt: skip
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni",
                       "amx_int8") if f in flags]  # fmt: skip
    mem_kb = next((int(ln.split()[1]) for ln in _read("/proc/meminfo").splitlines() if
                   ln.startswith("MemTotal")), 0)  # fmt: skip
    disk: dict[str, Any] = {"path": str(work)}
    try:
        src = subprocess.run(["findmnt", "-no", "SOURCE,FSTYPE", "-T", str(work)],
                             capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
        disk["device"], disk["fstype"] = src[0], src[1]
        dev = Path(src[0]).name.rstrip("0123456789")
        rot = _read(f"/sys/block/{dev}/queue/rotational").strip()
        disk["rotational"] = rot == "1" if rot else None
        disk["model"] = _read(f"/sys/block/{dev}/device/model").strip() or None
    except (OSError, subprocess.CalledProcessError, IndexError):
        pass
    disk["free_gib"] = round(shutil.disk_usage(work).free / 2**30, 1)
    try:
        from colibri.compute import ops

        colibri_isa = ops.isa().name.lower() + (" + amx" if ops.amx() else "")
    except Exception as exc:  # the report still records the machine
        colibri_isa = f"unavailable ({exc})"
    git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                         capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    fio = shutil.which("fio")
    fio_v = subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip() \
        if fio else "absent"  # fmt: skip
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": model,
        "cores": os.cpu_count(),
        "isa": isa,
        "colibri_isa": colibri_isa,
        "ram_gib": round(mem_kb / 2**20, 1),
        "disk": disk,
        "kernel": platform.release(),
        "loadavg_start": os.getloadavg(),
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in ("numpy", "cffi", "gguf", "matplotlib")},
        "fio": fio_v,
        "colibri_commit": git or "unknown",
        "argv": sys.argv,
    }


def fmt(x: float | None, digits: int = 3) -> str:
    """Number for a Markdown table; '—' when missing."""
    if x is None:
        return "—"
    return f"{x:.{digits}g}" if abs(x) < 10**digits else f"{x:.0f}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; floats go through `fmt`."""
    cell = lambda v: fmt(v) if isinstance(v, float) or v is None else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def headline_table(heads: Sequence[Headline]) -> str:
    rows = []
    for h in heads:
        rp, rl = h.ratio_peer, h.ratio_limit
        rows.append([
            h.scenario, h.unit, h.value, h.peer_note if h.peer is None and h.peer_note
            else h.peer, h.ik_note if h.ik is None and h.ik_note else h.ik,
            "—" if rp is None else f"{rp:.2f}×",
            f"{fmt(h.limit)} ({h.limit_name})" if h.limit is not None else "—",
            "—" if rl is None else f"{rl:.0%}" + (" (noise: limit measured apart)" if rl > 1.05
                                                   else ""),
            h.target or "—", h.note,
        ])  # fmt: skip
    header = ["scenario", "unit", "colibri", "llama.cpp", "ik_llama.cpp", "colibri / best peer",
              "limit", "of limit", "target", "note"]  # fmt: skip
    return table(header, rows)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_report(ctx: Context, machine: dict[str, Any], sections: list[Section]) -> Path:
    """report.md + results.json into ctx.out (each written to a temporary, then renamed)."""
    heads = [h for s in sections for h in s.headlines]
    md = [
        "# colibri benchmark report",
        "",
        f"{machine['date']} · {machine['cpu']} · {machine['cores']} cores "
        f"({', '.join(machine['isa'])}; colibri kernels: {machine['colibri_isa']}) · "
        f"{machine['ram_gib']} GiB RAM · disk {machine['disk'].get('device', '?')} "
        f"({machine['disk'].get('fstype', '?')}) · Linux {machine['kernel']} · "
        f"colibri {machine['colibri_commit']} · {'quick' if ctx.quick else 'full'} mode, "
        f"{ctx.threads} threads, {ctx.rounds} interleaved rounds (medians shown)",
        "",
        "## Headline: colibri vs llama.cpp and ik_llama.cpp vs the limits",
        "",
        headline_table(heads) if heads else "_no headline figures (see sections)_",
        "",
    ]
    for s in sections:
        md += [f"## {s.title}", ""]
        if s.error:
            md += [f"**This section failed:** `{s.error}`", ""]
        md += [s.markdown.strip(), ""]
        md += [f"![{name}]({name})\n" for name in s.figures]
        md += [f"_({s.seconds:.0f} s)_", ""]
    md += ["## Machine and versions", "", "```json", json.dumps(machine, indent=2), "```", ""]
    md += ["## Exact commands", "", "```", *ctx.commands, "```", ""]
    _atomic_write(ctx.out / "report.md", "\n".join(md))
    raw = {
        "machine": machine,
        "quick": ctx.quick,
        "threads": ctx.threads,
        "headlines": [
            asdict(h) | {"ratio_peer": h.ratio_peer, "ratio_limit": h.ratio_limit} for h in heads
        ],
        "sections": {
            s.key: {
                "title": s.title,
                "seconds": s.seconds,
                "error": s.error,
                "figures": s.figures,
                "data": s.data,
            }
            for s in sections
        },
        "commands": ctx.commands,
    }
    _atomic_write(ctx.out / "results.json", json.dumps(raw, indent=2, default=str))
    return ctx.out / "report.md"
