"""`colibri doctor`: a store on tmpfs, io_uring blocked, a damaged store, exit statuses."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from colibri import SyncEngine, doctor, machine
from colibri.errors import ColibriError
from colibri.io import uring
from colibri.run import DEMO_STORE

SHM = Path("/dev/shm")


@pytest.fixture
def shm_store():
    if not SHM.is_dir() or machine.mount_of(SHM).fstype != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    root = Path(tempfile.mkdtemp(dir=SHM, prefix="colibri-doctor-"))
    shutil.copytree(DEMO_STORE, root / "demo")
    yield root / "demo"
    shutil.rmtree(root)


def by_name(checks: list[doctor.Check]) -> dict[str, doctor.Check]:
    return {c.name: c for c in checks}


def test_store_on_tmpfs_reports_o_direct_not_enforced(shm_store):
    checks = by_name(doctor.run_checks(shm_store))
    c = checks["O_DIRECT"]
    assert c.status == "ok" and c.found.startswith("not enforced: tmpfs at /dev/shm"), c.line()
    assert "not a drive" in checks["drive"].found
    # the demo on the checkout's own file system, for contrast
    state, _ = machine.o_direct_state(DEMO_STORE / "experts.bin")
    assert state == (
        "not enforced" if machine.mount_of(DEMO_STORE).fstype == "tmpfs" else "enforced"
    )


def test_io_uring_blocked_reports_the_thread_fallback(monkeypatch):
    monkeypatch.setattr(
        uring,
        "uring_unavailable_reason",
        lambda qd=4: "io_uring_setup failed: Operation not permitted",
    )
    real = machine.read_text
    monkeypatch.setattr(
        machine,
        "read_text",
        lambda p, d="": "2" if p == "/proc/sys/kernel/io_uring_disabled" else real(p, d),
    )
    checks = by_name(doctor.run_checks(DEMO_STORE))
    c = checks["io_uring"]
    assert c.status == "warn"
    assert "Operation not permitted" in c.found and "thread pool (pread)" in c.found
    assert "io_uring_disabled is 2" in c.found and c.fix == "sysctl kernel.io_uring_disabled=0"
    # the drive was measured through the fallback reader
    assert "(threads," in checks["drive"].found
    assert doctor.exit_status(list(checks.values())) >= 1


def test_damaged_store_fails_verify_and_exits_2(tmp_path):
    store = tmp_path / "demo"
    shutil.copytree(DEMO_STORE, store)
    with open(store / "experts.bin", "r+b") as f:
        f.seek(5 * 196608 + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    checks = by_name(doctor.run_checks(store, verify=True))
    c = checks["integrity"]
    assert c.status == "fail" and "layer/expert: 0/5" in c.found, c.line()
    res = subprocess.run(
        [sys.executable, "-m", "colibri", "doctor", str(store), "--verify"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert any(line.startswith("fail integrity:") for line in res.stdout.splitlines())


def test_missing_store_and_exit_statuses(tmp_path):
    checks = doctor.run_checks(tmp_path / "nothing")
    assert by_name(checks)["store"].status == "fail"
    assert doctor.exit_status(checks) == 2
    ok = doctor.Check("ok", "a", "fine")
    warn = doctor.Check("warn", "b", "slow", "buy a disk")
    assert doctor.exit_status([ok]) == 0 and doctor.exit_status([ok, warn]) == 1
    assert warn.line() == "warn b: slow — fix: buy a disk" and ok.line() == "ok   a: fine"


def test_memory_check_fails_when_the_plan_does_not_fit():
    plan = {
        "memory": {
            "dense_nbytes": 1 << 30,
            "kv_nbytes": 1 << 30,
            "expert_cache_nbytes": 4 << 30,
            "runtime_nbytes": 0,
            "budget_nbytes": 4 << 30,
            "available_nbytes": 2 << 30,
        },
        "warnings": [],
    }
    c = doctor.check_memory(plan)
    assert c.status == "fail" and "needs 6.00 GiB" in c.found and "--budget" in c.fix


def test_a_budget_the_engine_refuses_fails():
    """`doctor --budget 1` said "all ok" while `run --budget 1` refuses the budget."""
    from colibri import cli

    checks = by_name(doctor.run_checks(DEMO_STORE, budget=1))
    c = checks["memory"]
    assert c.status == "fail" and "budget 1 bytes holds 0 records" in c.found, c
    assert "--budget" in c.fix
    with (
        pytest.raises(ColibriError, match="budget 1 bytes is too small"),
        SyncEngine(DEMO_STORE, budget=1, io="threads"),
    ):
        pass
    assert cli.main(["doctor", "--budget", "1"]) == 2
