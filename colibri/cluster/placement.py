"""Placement: which owner (machine) holds each (layer, expert) record.

A shard map is int32 [num_hidden_layers, num_experts]: the owner index of each record, -1 on
dense layers. `place()` balances each MoE layer separately, because every layer's call waits
for its slowest owner: records are taken by popularity, most used first (usage counts from a
routing trace or an expert cache's usage; uniform without), and each goes to the owner whose
expected per-layer time (popularity held / read bandwidth) grows least, among owners with room
left in their byte budget; ties go to the owner holding the fewest bytes so far, then the
lowest index. This is greedy longest-processing-time scheduling (Graham, 1969) on uniform
machines, with capacities. Nothing here imports Ray.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError

Key = tuple[int, int]


def place(
    moe_layers: Sequence[int],
    num_layers: int,
    num_experts: int,
    num_owners: int,
    record_nbytes: int,
    *,
    popularity: Mapping[Key, float] | None = None,
    bandwidth: Sequence[float] | None = None,
    budget: Sequence[int | None] | None = None,
) -> np.ndarray:
    """The shard map (int32 [num_layers, num_experts], -1 on dense layers) over num_owners.

    popularity: (layer, expert) -> uses (missing keys: 0; None: all 1). bandwidth: each
    owner's read speed in any unit (default equal). budget: each owner's bytes of records it
    may hold (None entries: unlimited); each owner takes at most budget // record_nbytes
    records. Raises ColibriError when the budgets cannot hold every record or an argument
    has the wrong length.
    """
    if num_owners < 1:
        raise ColibriError(f"placement: need at least one owner, got {num_owners}")
    bw = np.asarray(bandwidth if bandwidth is not None else [1.0] * num_owners, dtype=np.float64)
    if len(bw) != num_owners or not (bw > 0).all():
        raise ColibriError(f"placement: need {num_owners} positive bandwidths, got {list(bw)}")
    total = len(moe_layers) * num_experts
    cap = np.full(num_owners, total, dtype=np.int64)
    if budget is not None:
        if len(budget) != num_owners:
            raise ColibriError(f"placement: need {num_owners} budgets, got {len(budget)}")
        for o, b in enumerate(budget):
            if b is not None:
                cap[o] = min(total, int(b) // int(record_nbytes))
    if cap.sum() < total:
        raise ColibriError(
            f"placement: the owners' budgets hold {int(cap.sum())} records of {record_nbytes} "
            f"bytes, the store has {total}: add nodes or budget"
        )
    shard = np.full((num_layers, num_experts), -1, dtype=np.int32)
    held = np.zeros(num_owners, dtype=np.int64)  # records so far, all layers
    for layer in moe_layers:
        if popularity is None:
            pop = np.ones(num_experts)
        else:
            pop = np.array([float(popularity.get((layer, e), 0)) for e in range(num_experts)])
        load = np.zeros(num_owners)  # this layer's expected time per owner
        for e in sorted(range(num_experts), key=lambda e: (-pop[e], e)):
            room = held < cap
            after = np.where(room, (load * bw + pop[e]) / bw, np.inf)
            best = min(np.flatnonzero(after == after.min()), key=lambda o: (held[o], o))
            shard[layer, e] = best
            load[best] = after[best]
            held[best] += 1
    return shard


def save_shard_map(
    path: str | os.PathLike[str],
    shard: np.ndarray,
    nodes: Sequence[str],
    hosts: Sequence[str] | None = None,
) -> None:
    """Write a shard map as JSON, atomically: {"nodes": [owner k's store path], "owner":
    [[owner of each expert] per layer], optionally "hosts": [owner k's node IP]}."""
    path = Path(path)
    data: dict = {"nodes": list(nodes), "owner": shard.tolist()}
    if hosts is not None:
        data["hosts"] = list(hosts)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def load_shard_map(
    path: str | os.PathLike[str], num_layers: int, num_experts: int
) -> tuple[np.ndarray, list[str], list[str] | None]:
    """(shard map, owners' store paths, owners' node IPs or None) from a save_shard_map
    file. Raises ColibriError naming the file when it is unreadable or does not match the
    model."""
    try:
        data = json.loads(Path(path).read_text())
        shard = np.asarray(data["owner"], dtype=np.int32)
        nodes = [str(n) for n in data["nodes"]]
        hosts = [str(h) for h in data["hosts"]] if "hosts" in data else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ColibriError(f"{path}: not a shard map ({exc})") from None
    if hosts is not None and len(hosts) != len(nodes):
        raise ColibriError(f"{path}: {len(hosts)} hosts for {len(nodes)} nodes")
    if shard.shape != (num_layers, num_experts):
        raise ColibriError(
            f"{path}: shard map is {list(shard.shape)}, the model has "
            f"[{num_layers}, {num_experts}] (layers, experts)"
        )
    if shard.max(initial=-1) >= len(nodes):
        raise ColibriError(f"{path}: owner {int(shard.max())} but only {len(nodes)} nodes")
    return shard, nodes, hosts
