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
