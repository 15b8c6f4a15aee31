"""`colibri plan --cluster`: the placement over N nodes and the decode bounds it implies.

Per token, with the coordinator's chain of MoE layers sequential and the owners of one layer
working in parallel (reads overlapped with kernels, as on one machine):

    t_token = t_dense + L * (t_call + wire_layer / network) + max over nodes of
              max(t_read_node, t_expert_node)

t_dense: the coordinator's resident weights touched per token / memory bandwidth; L: MoE
layers; t_call: the per-layer round trip of an empty call (measured by `colibri bench
--sections cluster`; 1 ms by default); wire_layer: f32 rows out (h and routing per owner
touched) and the top_k weighted outputs back; t_read_node: the node's expected record bytes
read per token (its share of the routing, times its cache's miss rate) / its disk bandwidth;
t_expert_node: its expected record bytes touched per token / memory bandwidth. A node's share
and hit rate come from usage.json's counts when the store has them, else uniform routing.
Nothing here imports Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from colibri.cluster.placement import place

DEFAULT_CALL_MS = 1.0


def cluster_bounds(
    *,
    moe_layers: int,
    top_k: int,
    d_model: int,
    record_nbytes: int,
    dense_touched_nbytes: int,
    shares: Sequence[float],
    hit_rates: Sequence[float],
    disk_gbps: Sequence[float],
    memory_gbps: float,
    network_gbit: float,
    call_ms: float = DEFAULT_CALL_MS,
) -> dict[str, Any]:
    """The per-token times (seconds) and tok/s bounds of the formula in the module docstring.

    shares[n]: node n's fraction of the routed (token, slot) pairs; hit_rates[n]: its expert
    cache hit rate; disk_gbps[n]: its read GB/s; memory_gbps: each machine's memory read GB/s;
    network_gbit: the coordinator's link, Gbit/s. Returns {"t_dense", "t_network",
    "t_experts", "t_token", "wire_nbytes" (per token), "tok_s": {"storage", "memory",
    "network", "combined"}} (tok/s None where a bound is unlimited)."""
    n = len(shares)
    experts = moe_layers * top_k * np.asarray(shares, dtype=np.float64)  # records per token
    t_read = experts * record_nbytes * (1 - np.asarray(hit_rates)) / (np.asarray(disk_gbps) * 1e9)
    t_expert = experts * record_nbytes / (memory_gbps * 1e9)
    touched = n * (1 - (1 - 1 / n) ** top_k)  # owners one token's layer calls (uniform)
    wire = moe_layers * (touched * (4 * d_model + 8 * top_k) + 4 * d_model * top_k)
    t_net = wire * 8 / (network_gbit * 1e9) + moe_layers * call_ms / 1000
    t_dense = dense_touched_nbytes / (memory_gbps * 1e9)
    t_experts = float(np.max(np.maximum(t_read, t_expert)))
    t_token = t_dense + t_net + t_experts

    def rate(t: float) -> float | None:
        return 1 / t if t > 0 else None

    return {
        "t_dense": t_dense,
        "t_network": t_net,
        "t_experts": t_experts,
        "t_token": t_token,
        "wire_nbytes": float(wire),
        "tok_s": {
            "storage": rate(float(np.max(t_read))),
            "memory": rate(t_dense + float(np.max(t_expert))),
            "network": rate(t_net),
            "combined": rate(t_token),
        },
    }


def cluster_plan(
    store: Any,
    nodes: int,
    *,
    budget: int,
    disk_gbps: float,
    memory_gbps: float,
    dense_touched_nbytes: int,
    network_gbit: float = 25.0,
    call_ms: float = DEFAULT_CALL_MS,
    usage: Mapping[tuple[int, int], int] | None = None,
    shard: np.ndarray | None = None,
) -> dict[str, Any]:
    """The placement of `store`'s records over `nodes` equal nodes (each with `budget` bytes
    of expert cache and `disk_gbps`) and cluster_bounds() for it; JSON-able. usage: (layer,
    expert) -> accesses (usage.json), else uniform routing. shard: a given shard map."""
    from colibri.registry import model_spec

    spec = model_spec(store.config)
    record = int(store.layout.record_nbytes)
    slot = -(-record // 4096) * 4096
    usage = usage or {}
    pop = {(r.layer, r.expert): float(usage.get((r.layer, r.expert), 0)) for r in store.records}
    if sum(pop.values()) == 0:
        pop = {k: 1.0 for k in pop}
    if shard is None:
        shard = place(
            store.moe_layers, len(spec.layers), store.num_experts, nodes, record, popularity=pop
        )
    total = sum(pop.values())
    capacity = budget // slot
    rows, shares, hits = [], [], []
    for n in range(nodes):
        mine = sorted((pop[k] for k in pop if shard[k] == n), reverse=True)
        share = sum(mine) / total
        hit = sum(mine[:capacity]) / sum(mine) if mine and sum(mine) else 1.0
        shares.append(share)
        hits.append(hit)
        rows.append({"node": n, "records": len(mine), "nbytes": len(mine) * record,
                     "share": share, "hit_rate": hit})  # fmt: skip
    b = cluster_bounds(
        moe_layers=len(store.moe_layers),
        top_k=spec.moe.router.top_k,
        d_model=spec.d_model,
        record_nbytes=record,
        dense_touched_nbytes=dense_touched_nbytes,
        shares=shares,
        hit_rates=hits,
        disk_gbps=[disk_gbps] * nodes,
        memory_gbps=memory_gbps,
        network_gbit=network_gbit,
        call_ms=call_ms,
    )
    return {
        "nodes": nodes,
        "budget_nbytes_per_node": budget,
        "network_gbit": network_gbit,
        "call_ms": call_ms,
        "popularity": "usage.json" if usage and sum(usage.values()) else "uniform",
        "placement": rows,
        **b,
    }


def format_cluster_plan(p: dict[str, Any]) -> str:
    """The lines `colibri plan --cluster` adds."""

    def ts(x: float | None) -> str:
        return "unbounded" if x is None else f"{x:.1f} tok/s"

    def size(n: float) -> str:
        return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"

    lines = [
        f"cluster: {p['nodes']} nodes, {size(p['budget_nbytes_per_node'])} expert "
        f"cache each, {p['network_gbit']:g} Gbit/s, {p['call_ms']:g} ms per layer call; "
        f"placement by {p['popularity']} popularity:"
    ]
    for r in p["placement"]:
        lines.append(
            f"  node {r['node']}: {r['records']} records ({size(r['nbytes'])}), "
            f"{r['share']:.1%} of the routing, hit rate {r['hit_rate']:.1%}"
        )
    t = p["tok_s"]
    lines.append(
        f"cluster decode: storage bound {ts(t['storage'])}, memory bound {ts(t['memory'])}, "
        f"network bound {ts(t['network'])} ({p['wire_nbytes'] / 1024:.1f} KiB/token) -> at "
        f"most {ts(t['combined'])}"
    )
    return "\n".join(lines)
