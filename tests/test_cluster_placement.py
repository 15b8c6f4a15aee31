"""Placement of expert records over owners (colibri/cluster/placement.py), and colibri without
Ray: no module imports it, and --cluster without it is one clear error."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from colibri.cluster.placement import load_shard_map, place, save_shard_map
from colibri.errors import ColibriError


def test_uniform_records_are_balanced_per_layer():
    shard = place([1, 2], 3, 10, 3, 4096)
    assert (shard[0] == -1).all()  # a dense layer
    for layer in (1, 2):
        counts = np.bincount(shard[layer], minlength=3)
        assert sorted(counts.tolist()) == [3, 3, 4]


def test_popularity_and_bandwidth_balance_the_expected_time():
    rng = np.random.default_rng(1)
    pop = {(0, e): float(rng.integers(1, 100)) for e in range(64)}
    bw = [2.0, 1.0, 1.0]
    shard = place([0], 1, 64, 3, 4096, popularity=pop, bandwidth=bw)
    per_owner = np.zeros(3)
    for e in range(64):
        per_owner[shard[0, e]] += pop[(0, e)]
    time = per_owner / np.asarray(bw)
    # greedy LPT: no owner's time exceeds another's by more than the largest single record
    assert time.max() - time.min() <= max(pop.values()) / min(bw)
    # the twice-as-fast owner carries about half the traffic
    assert 0.4 < per_owner[0] / per_owner.sum() < 0.6


def test_budgets_cap_each_owner_and_too_small_is_an_error():
    shard = place([0, 1], 2, 8, 2, 1000, budget=[4000, None])
    assert (shard == 0).sum() == 4 and (shard == 1).sum() == 12
    with pytest.raises(ColibriError, match="hold 8 records of 1000 bytes, the store has 16"):
        place([0, 1], 2, 8, 2, 1000, budget=[4000, 4999])


def test_shard_map_file_round_trip_and_errors(tmp_path):
    shard = place([1], 2, 4, 2, 4096)
    path = tmp_path / "map.json"
    save_shard_map(path, shard, ["/a", "/b"])
    got, nodes, hosts = load_shard_map(path, 2, 4)
    assert np.array_equal(got, shard) and nodes == ["/a", "/b"] and hosts is None
    save_shard_map(path, shard, ["/a", "/b"], ["10.0.0.1", "10.0.0.2"])
    assert load_shard_map(path, 2, 4)[2] == ["10.0.0.1", "10.0.0.2"]
    with pytest.raises(ColibriError, match=r"map.json: shard map is \[2, 4\], the model has"):
        load_shard_map(path, 3, 4)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ColibriError, match=r"bad\.json: not a shard map"):
        load_shard_map(tmp_path / "bad.json", 2, 4)


NO_RAY = r"""
import sys
import asyncio
import colibri, colibri.engine, colibri.cli, colibri.serve.app, colibri.cluster.placement
colibri.cli.build_parser()  # imports every command's module
print("ray imported:", "ray" in sys.modules)
sys.modules["ray"] = None  # as if the extra were not installed: `import ray` fails
from colibri.engine import open_engine
from colibri.run import DEMO_STORE
async def main():
    async with open_engine(DEMO_STORE, cluster="auto"):
        pass
try:
    asyncio.run(main())
except colibri.errors.ColibriError as exc:
    print(exc)
"""


def test_without_ray_nothing_imports_it_and_cluster_says_how_to_get_it():
    out = subprocess.run(
        [sys.executable, "-c", NO_RAY], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.splitlines() == [
        "ray imported: False",
        "--cluster needs Ray: pip install 'colibri[cluster]' (or pip install ray)",
    ]


def test_cluster_plan_bounds_follow_the_formula():
    from colibri.cluster.plan import cluster_bounds, cluster_plan
    from colibri.io.format import open_store
    from colibri.run import DEMO_STORE

    store = open_store(DEMO_STORE)
    p = cluster_plan(store, 2, budget=1 << 30, disk_gbps=1.0, memory_gbps=10.0,
                     dense_touched_nbytes=10**6, network_gbit=10.0, call_ms=0.5)  # fmt: skip
    assert sum(r["records"] for r in p["placement"]) == len(store.records)
    assert sum(r["share"] for r in p["placement"]) == pytest.approx(1.0)
    assert all(r["hit_rate"] == 1.0 for r in p["placement"])  # 1 GiB holds every record
    layers, k, d = (
        len(store.moe_layers),
        store.config["num_experts_per_tok"],
        64 * 0 + (store.layout.d_model),
    )
    touched = 2 * (1 - (1 - 1 / 2) ** k)
    wire = layers * (touched * (4 * d + 8 * k) + 4 * d * k)
    assert p["wire_nbytes"] == pytest.approx(wire)
    assert p["t_network"] == pytest.approx(wire * 8 / 10e9 + layers * 0.5e-3)
    assert p["tok_s"]["storage"] is None  # nothing read from disk
    assert p["tok_s"]["combined"] == pytest.approx(1 / p["t_token"])
    # a slower link or call only lowers the bound; misses add the storage term
    b = cluster_bounds(moe_layers=4, top_k=2, d_model=64, record_nbytes=10**6,
                       dense_touched_nbytes=0, shares=[0.5, 0.5], hit_rates=[0.5, 0.0],
                       disk_gbps=[1.0, 1.0], memory_gbps=10.0, network_gbit=1.0,
                       call_ms=1)  # fmt: skip
    # node 1 misses everything: 4 layers x top-2 x half the routing x 1 MB at 1 GB/s
    assert b["tok_s"]["storage"] == pytest.approx(1 / (4 * 2 * 0.5 * 10**6 / 1e9))


def test_plan_cli_prints_the_cluster_placement():
    out = subprocess.run(
        [sys.executable, "-m", "colibri", "plan", "--cluster", "3", "--no-profile"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(ln.startswith("cluster: 3 nodes") for ln in lines)
    assert sum(ln.startswith("  node ") for ln in lines) == 3
    assert any(ln.startswith("cluster decode: ") and "network bound" in ln for ln in lines)


def test_shard_balances_by_a_trace_and_respects_budgets(tmp_path):
    """`colibri shard` on the demo store: placement from a routing trace the engine recorded
    (counts computed here with numpy), and per-node byte budgets on the command line."""
    import asyncio

    from colibri.cluster.shard import shard_store
    from colibri.engine import open_engine
    from colibri.io.format import open_store
    from colibri.io.trace import RoutingTrace
    from colibri.registry import model_spec
    from colibri.run import DEMO_STORE

    async def record():
        async with open_engine(DEMO_STORE, io="threads") as engine:
            with engine.capture_routing() as writer:
                await engine.generate("The for statement", max_tokens=6, temperature=0)
            writer.save(tmp_path / "trace.npz")

    asyncio.run(record())
    trace = RoutingTrace.load(tmp_path / "trace.npz")
    store = open_store(DEMO_STORE)
    spec = model_spec(store.config)
    pop = {}
    for layer in store.moe_layers:
        ids = trace.experts[:, layer].ravel()
        counts = np.bincount(ids[ids >= 0], minlength=store.num_experts)
        pop.update({(layer, e): float(c) for e, c in enumerate(counts) if c})
    target = shard_store(DEMO_STORE, tmp_path / "a", 2, trace=str(tmp_path / "trace.npz"))
    got, nodes, _ = load_shard_map(target, len(spec.layers), store.num_experts)
    want = place(store.moe_layers, len(spec.layers), store.num_experts, 2,
                 store.layout.record_nbytes, popularity=pop)  # fmt: skip
    assert np.array_equal(got, want) and len(nodes) == 2
    record = store.layout.record_nbytes
    out = subprocess.run(
        [sys.executable, "-m", "colibri", "shard", str(DEMO_STORE), "--nodes", "2", "--out",
         str(tmp_path / "b"), "--budget", f"{5 * record},1G", "--gbps", "1,1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    held = [len(open_store(tmp_path / "b" / f"node-{k}").records) for k in range(2)]
    assert held == [5, len(store.records) - 5]


def test_auto_transport_takes_the_cheaper_and_probes_the_other():
    """ClusterExperts.transport "auto": each transport measured once, then the one with the
    lower moving mean overhead, the slower tried again every PROBE_EVERY small calls."""
    from colibri.cluster import client

    experts = client.ClusterExperts([], np.zeros((1, 4), np.int32), False, False, None)
    assert experts.statistics().graph == "off"
    assert experts._pick_graph()  # nothing measured: the graph first
    experts._cost["graph"] = 0.004
    assert not experts._pick_graph()  # then plain once
    experts._cost["plain"] = 0.002
    picks = [experts._pick_graph() for _ in range(3 * client.PROBE_EVERY)]
    assert picks.count(True) == 3  # the slower graph only as a probe
    assert all(not p for i, p in enumerate(picks) if (i + 1) % client.PROBE_EVERY)
    experts._cost["graph"] = 0.001
    assert experts._pick_graph()
    experts.transport = "plain"
    assert not experts._pick_graph()
    experts.transport = "graph"
    assert experts._pick_graph()
    st = experts.statistics()
    assert st.graph_overhead_ms == 1.0 and st.plain_overhead_ms == 2.0
