"""`colibri plan` on the embedded demo store: the memory split against what the engine really
allocates, the hit rate against the replay simulator on a trace the engine recorded, usage
counts and uniform routing by hand, the bounds from a profile's figures, warnings, refusals."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from colibri import plan as plan_mod
from colibri.engine import open_engine
from colibri.errors import ColibriError
from colibri.io.format import open_store
from colibri.io.replay import simulate
from colibri.io.trace import RoutingTrace
from colibri.machine import MachineProfile, mount_of, save_profile
from colibri.run import DEMO_STORE

SLOT = 196608  # the demo's record: q8_0 gate/up/down of 320 x 192, 4096-aligned


def colibri(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "trace.npz"

    async def run():
        async with open_engine(DEMO_STORE, trace=str(path), io="threads") as eng:
            await eng.generate("The for statement", max_tokens=24, temperature=0)

    asyncio.run(run())
    return path


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_memory_split_matches_the_engine(kv):
    async def run():
        async with open_engine(DEMO_STORE, io="threads", kv_dtype=kv, n_ctx=512) as eng:
            return eng.model.dense_nbytes, eng.new_sequence().kv.nbytes

    dense, kv_nbytes = asyncio.run(run())
    p = plan_mod.make_plan(open_store(DEMO_STORE), n_ctx=512, kv_dtype=kv, measure=False)
    assert p["memory"]["dense_nbytes"] == dense
    assert p["memory"]["kv_nbytes"] == kv_nbytes
    # 4 layers x 512 tokens x 2 kv heads x (48 + 48) dims x itemsize
    assert kv_nbytes == 4 * 512 * 2 * 96 * (2 if kv == "f16" else 4)


def test_hit_rate_equals_the_replay_simulator_on_the_same_trace(trace_file):
    res = colibri(
        "plan",
        "--json",
        "--budget",
        "1M",
        "--trace",
        str(trace_file),
        "--no-profile",
        "--no-measure",
    )
    assert res.returncode in (0, 1), res.stderr
    p = json.loads(res.stdout)
    steps = list(RoutingTrace.load(trace_file).steps())
    assert len(steps) == 4 * 28 - 4  # 4 prompt + 24 tokens x 4 layers; the last is not fed
    capacity = (1 << 20) // SLOT
    hits, misses = simulate(steps, capacity, "nextuse")  # the engine's default policy
    assert p["hit_rate"]["source"] == "trace"
    assert p["hit_rate"]["value"] == pytest.approx(hits / (hits + misses), abs=0)
    assert p["memory"]["expert_cache_records"] == capacity
    h2, m2 = simulate(steps, capacity, "belady")
    pb = plan_mod.make_plan(
        open_store(DEMO_STORE),
        budget=1 << 20,
        policy="belady",
        trace=str(trace_file),
        measure=False,
    )
    assert pb["hit_rate"]["value"] == h2 / (h2 + m2) >= p["hit_rate"]["value"]


def test_hit_rate_from_usage_counts_and_uniform(tmp_path):
    store_dir = tmp_path / "demo"
    shutil.copytree(DEMO_STORE, store_dir)
    store = open_store(store_dir)
    p = plan_mod.make_plan(store, budget=3 * SLOT, measure=False)
    assert p["hit_rate"]["source"] == "uniform" and p["hit_rate"]["value"] == 3 / 32
    counts = [[layer, e, (e + 1) * (layer + 1)] for layer in range(4) for e in range(8)]
    (store_dir / "usage.json").write_text(json.dumps({"counts": counts}))
    p = plan_mod.make_plan(store, budget=3 * SLOT, measure=False)
    top3 = sorted((n for _, _, n in counts), reverse=True)[:3]  # 32, 28, 24
    assert p["hit_rate"]["source"] == "usage"
    assert p["hit_rate"]["value"] == pytest.approx(sum(top3) / sum(n for *_, n in counts))


def test_bounds_from_the_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    dev = mount_of(DEMO_STORE).device
    prof = MachineProfile(
        "now",
        "cpu",
        "avx2",
        1,
        20.0,
        "test",
        8 << 30,
        {dev: {"gbps": {"1": 0.5, "2": 2.0, "8": 3.0}, "queue_depth": 8}},
    )
    path = save_profile(prof)
    assert path == tmp_path / "colibri" / "machine.json"
    res = colibri("plan", "--json", "--budget", "1M", "--no-measure", env=None)
    p = json.loads(res.stdout)
    assert p["bandwidth"]["disk_gbps"] == 2.0  # QD = top-k = 2
    assert p["bandwidth"]["memory_read_gbps"] == 20.0
    t = p["per_token"]
    assert t["expert_nbytes"] == 4 * 2 * SLOT
    assert t["read_nbytes"] == pytest.approx(4 * 2 * SLOT * (1 - 5 / 32))
    assert p["decode_tok_s"]["storage"] == pytest.approx(2.0e9 / t["read_nbytes"])
    assert p["decode_tok_s"]["compute"] == pytest.approx(20.0e9 / t["touched_nbytes"])
    assert p["decode_tok_s"]["combined"] == min(
        p["decode_tok_s"]["storage"], p["decode_tok_s"]["compute"]
    )
    # with the profile, the default budget is the profile's memory (all 32 records fit)
    res = colibri("plan", "--json", "--no-measure")
    q = json.loads(res.stdout)
    assert q["memory"]["budget_source"] == "profile" and q["hit_rate"]["value"] == 1.0
    assert q["decode_tok_s"]["storage"] is None  # nothing read: no storage bound
    res = colibri("plan", "--json", "--no-measure", "--no-profile")
    assert json.loads(res.stdout)["bandwidth"]["memory_read_gbps"] is None


def test_demo_in_ram_says_no_disk_is_needed():
    """The demo's experts all fit the default budget: the plan says the disk is not needed and
    there is no storage bound, instead of an unknown disk and an "unbounded" figure."""
    p = plan_mod.make_plan(open_store(DEMO_STORE), measure=False)
    assert p["per_token"]["read_nbytes"] == 0 and p["bandwidth"]["disk_gbps"] is None
    text = plan_mod.format_plan(p)
    records = len(open_store(DEMO_STORE).records)
    assert f"disk not needed: all {records} expert records fit the" in text, text
    assert "storage bound none (the experts are all in RAM)" in text, text
    assert "unbounded" not in text and "disk ?" not in text and "(none)" not in text, text
    assert "compute bound ? (no figure)" in text, text  # measure=False: no memory figure


def test_warns_when_the_budget_would_swap(monkeypatch):
    monkeypatch.setattr(plan_mod, "available_memory", lambda: 4 << 20)
    p = plan_mod.make_plan(open_store(DEMO_STORE), budget=6 << 20, measure=False)
    assert any("swap" in w for w in p["warnings"]), p["warnings"]
    assert "warning: needs" in plan_mod.format_plan(p)


def test_refuses_a_trace_of_another_model(tmp_path):
    bad = tmp_path / "t.npz"
    e = np.zeros((3, 4, 2), np.int32)
    RoutingTrace(e, np.ones_like(e, dtype=np.float32), 16, None, {}).save(bad)
    with pytest.raises(ColibriError, match="16 experts, the store 4 MoE layers x 8"):
        plan_mod.make_plan(open_store(DEMO_STORE), trace=str(bad), measure=False)
    res = colibri("plan", "--trace", str(bad), "--no-measure")
    assert res.returncode == 1 and res.stderr.startswith("colibri: error: ") and "16" in res.stderr


def test_refuses_a_malformed_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "colibri").mkdir()
    (tmp_path / "colibri" / "machine.json").write_text('{"version": 1, "threads": 2}')
    res = colibri("plan", "--no-measure")
    assert res.returncode == 1
    assert "machine.json: machine profile field 'created'" in res.stderr
    assert colibri("plan", "--no-measure", "--no-profile").returncode == 0


def test_mirrors_on_other_drives_add_their_bandwidth(tmp_path, monkeypatch):
    import tempfile

    from colibri.io.mirror import write_mirror

    demo = open_store(DEMO_STORE)
    same = write_mirror(demo, tmp_path / "same").path  # /tmp: the checkout's drive here?
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="colibri-plan-")
    try:
        write_mirror(demo, shm)
        dev, dev_shm = mount_of(DEMO_STORE).device, mount_of(shm).device
        dev_same = mount_of(same).device
        drives = {
            d: {"gbps": {"2": g}, "queue_depth": 2}
            for d, g in ((dev, 1.5), (dev_shm, 4.0), (dev_same, 1.5))
        }
        prof = MachineProfile("now", "cpu", "avx2", 1, 20.0, "test", 8 << 30, drives)
        p = plan_mod.make_plan(
            demo, budget=1 << 20, profile=prof, measure=False, mirrors=[shm, str(same)]
        )
        b = p["bandwidth"]
        per_drive = {dev: 1.5, dev_shm: 4.0, dev_same: 1.5}  # one figure per distinct drive
        assert b["disk_gbps"] == pytest.approx(sum(per_drive.values()))
        assert [c["device"] for c in b["disk_copies"]] == [dev, dev_shm, dev_same]
        assert p["decode_tok_s"]["storage"] == pytest.approx(
            b["disk_gbps"] * 1e9 / p["per_token"]["read_nbytes"]
        )
        with pytest.raises(ColibriError, match="not a mirror"):
            plan_mod.make_plan(demo, profile=prof, measure=False, mirrors=[str(tmp_path)])
    finally:
        shutil.rmtree(shm)


def test_ctx_is_checked_as_run_checks_it():
    """--ctx 0 and a --ctx above the model's context length are refused naming --ctx, as run
    refuses them; the default (4096) is lowered to the demo's 1024; a budget above the store
    says how many records there are, not more."""
    res = colibri("plan", "--ctx", "0", "--no-measure")
    assert res.returncode == 2
    assert res.stderr == "colibri plan: --ctx must be a whole number >= 1 (got '0')\n"
    res = colibri("plan", "--ctx", "999999", "--no-measure")
    assert res.returncode == 1
    assert res.stderr.strip() == (
        "colibri: error: --ctx 999999 exceeds the model's context length 1024 "
        "(max_position_embeddings)"
    )
    res = colibri("plan", "--json", "--no-measure", "--no-profile", "--budget", "8G")
    p = json.loads(res.stdout)
    assert p["memory"]["n_ctx"] == 1024 and "32 of 32 records cached" in p["hit_rate"]["detail"]
