"""`colibri tune` writes a machine profile that run / chat / plan take their defaults from;
`--no-profile` ignores it; the statistics line says when it was used."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from colibri import machine
from colibri.errors import ColibriError
from colibri.run import DEMO_STORE, configure_parser, engine_options
from colibri.tune import QDS


def colibri(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri", *args], capture_output=True, text=True, timeout=300
    )


def run_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure_parser(p)
    return p.parse_args(list(argv))


def test_tune_writes_a_profile_run_uses(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    res = colibri("tune", "--seconds", "0.05")
    assert res.returncode == 0, res.stderr
    path = tmp_path / "colibri" / "machine.json"
    assert f"wrote {path}" in res.stdout
    prof = machine.load_profile()
    assert prof is not None and prof.path == str(path)
    assert 1 <= prof.threads <= (os.cpu_count() or 1)
    assert prof.memory_read_gbps > 0 and 0 < prof.memory_nbytes < machine.meminfo()["MemTotal"]
    drive = prof.drive(DEMO_STORE / "experts.bin")
    assert drive is not None and drive["record_nbytes"] == 196608
    assert [int(q) for q in drive["gbps"]] == list(QDS)
    assert drive["queue_depth"] in QDS and all(v > 0 for v in drive["gbps"].values())
    assert not list(path.parent.glob(".*tmp*"))  # written through a temporary, renamed

    with_profile = colibri("run", "-n", "6", "--temperature", "0")
    without = colibri("run", "-n", "6", "--temperature", "0", "--no-profile")
    assert with_profile.returncode == 0 and without.returncode == 0, with_profile.stderr
    assert f"; profile {path}]" in with_profile.stderr.splitlines()[-1]
    assert "profile" not in without.stderr.splitlines()[-1]
    assert with_profile.stdout == without.stdout  # defaults change speed, never tokens


def test_profile_defaults_fill_what_the_command_line_left_out(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    dev = machine.mount_of(DEMO_STORE).device
    resident = 1337088 + 3145728  # the demo's dense weights + KV cache at 1024 tokens, f32
    prof = machine.MachineProfile(
        "now",
        "cpu",
        "avx2",
        3,
        10.0,
        "test",
        resident + 10**6,
        {dev: {"gbps": {"1": 1.0}, "queue_depth": 16}},
    )
    machine.save_profile(prof)
    opts, used = engine_options(run_args(), DEMO_STORE)
    assert used == str(tmp_path / "colibri" / "machine.json")
    assert (opts["threads"], opts["queue_depth"], opts["budget"]) == (3, 16, 10**6)
    opts, _ = engine_options(
        run_args("--threads", "1", "--queue-depth", "4", "--budget", "2M"), DEMO_STORE
    )
    assert (opts["threads"], opts["queue_depth"], opts["budget"]) == (1, 4, 2 << 20)
    opts, used = engine_options(run_args("--no-profile"), DEMO_STORE)
    assert used == "" and opts["threads"] == 0 and opts["budget"] is None
    assert "queue_depth" not in opts


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "unreadable machine profile"),
        ('{"version": 9}', "version 9, this colibri reads 1"),
        (
            '{"version": 1, "created": "x", "cpu": "c", "isa": "a", "threads": 0, '
            '"memory_read_gbps": 1, "memory_read_method": "m", "memory_nbytes": 1, "drives": {}}',
            "'threads' must be >= 1",
        ),
        (
            '{"version": 1, "created": "x", "cpu": "c", "isa": "a", "threads": 1, '
            '"memory_read_gbps": 1, "memory_read_method": "m", "memory_nbytes": 1, '
            '"drives": {"1:2": {}}}',
            "drives['1:2'].gbps missing",
        ),
    ],
)
def test_a_bad_profile_is_refused_naming_it(tmp_path, monkeypatch, text, message):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "colibri").mkdir()
    (tmp_path / "colibri" / "machine.json").write_text(text)
    with pytest.raises(ColibriError, match=r"machine\.json") as exc:
        machine.load_profile()
    assert message in str(exc.value)
    res = colibri("run", "-n", "2")
    assert res.returncode == 1 and message in res.stderr and "Traceback" not in res.stderr
    assert colibri("run", "-n", "2", "--no-profile").returncode == 0


def test_profile_round_trips(tmp_path):
    prof = machine.MachineProfile(
        "t",
        "cpu",
        "avx512",
        2,
        12.5,
        "m",
        1 << 30,
        {"8:1": {"gbps": {"1": 0.5, "8": 2.5}, "queue_depth": 8}},
    )
    out = machine.save_profile(prof, tmp_path / "p.json")
    back = machine.load_profile(out)
    assert back is not None and back.to_json() == prof.to_json()
    assert json.loads(out.read_text())["version"] == machine.PROFILE_VERSION


def test_memory_read_is_the_kernels_streaming_read(monkeypatch):
    """memory_read_gbps times ops.mem_read (the SIMD read the bench's limits section calls the
    memory bound) over the whole buffer, not a numpy reduction that reads slower."""
    from colibri.compute import ops

    calls = []
    real = ops.mem_read

    def spy(buf, nthreads=0):
        calls.append((memoryview(buf).nbytes, nthreads))
        return real(buf, nthreads)

    monkeypatch.setattr(ops, "mem_read", spy)
    gbps = machine.memory_read_gbps(8 << 20, nthreads=2, repeat=2)
    assert calls == [(8 << 20, 2)] * 3  # a warm-up and two timed reads
    assert gbps > 0
    assert "mem_read" in machine.MEMORY_READ_METHOD
