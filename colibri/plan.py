"""`colibri plan [STORE]`: before loading, what a run will keep in RAM and how fast it can go.

The memory split: resident dense weights, the KV cache at --ctx, the expert cache budget,
pinned experts, and what is left for the OS. The expected hit rate: the offline replay
simulator (colibri/io/replay.py `simulate`, the cache's own policy code) on a routing trace
(--trace), else the store's recorded usage counts (usage.json: the share of accesses that
fall on the most used records the budget holds, i.e. a static hot set with independent
routing), else uniform routing (budget records / all records); the report says which.
The expected decode tok/s from DESIGN.md §8's bounds:
  storage bound = disk GB/s / (expert bytes per token x miss rate)
  compute bound = memory read GB/s / bytes of weights touched per token
with this machine's figures from the profile (`colibri tune`), else a quick measurement.
`--json` prints the plan as one JSON object (schema in docs/OPERATIONS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from colibri.engine import DEFAULT_N_CTX, available_memory, default_budget
from colibri.errors import ColibriError
from colibri.io.cache import POLICIES, ExpertCache, hot_set, load_usage
from colibri.io.format import BLOCK_QTYPES, Store, open_store, tensor_nbytes
from colibri.machine import (
    MachineProfile,
    bounds,
    load_profile,
    meminfo,
    memory_read_gbps,
    mount_of,
    profile_budget,
    store_sweep,
)
from colibri.registry import model_spec

SCHEMA = "colibri.plan/1"
RUNTIME_NBYTES = 256 << 20  # Python, numpy, the kernels and buffers: measured ~60-200 MiB
OS_RESERVE_NBYTES = 1 << 30  # less than this left for the OS (page cache, other programs): warn


def dense_resident_nbytes(store: Store) -> tuple[int, int]:
    """(bytes the dense weights occupy once loaded, bytes of the embedding table): quantized
    tensors stay as stored, float ones are widened to f32 (as Store.dense() loads them)."""
    total = embed = 0
    spec = model_spec(store.config)
    for name in store.dense_names():
        m = store.manifest["dense"][name]
        qtype, shape = m["qtype"], [int(s) for s in m["shape"]]
        n = tensor_nbytes(qtype, shape) if qtype in BLOCK_QTYPES else 4 * math.prod(shape)
        total += n
        if name == f"{spec.embed}.weight":
            embed = n
    return total, embed


def kv_nbytes(store: Store, n_ctx: int, kv_dtype: str) -> int:
    """Bytes of one sequence's KV cache at `n_ctx` tokens (model.KVCache.allocate's arrays)."""
    spec = model_spec(store.config)
    n_ctx = min(n_ctx, spec.max_position_embeddings)
    item = 2 if kv_dtype == "f16" else 4
    total = 0
    for layer in spec.layers:
        a = layer.attention
        if a.mla is not None:
            total += n_ctx * (a.mla.kv_lora_rank + a.rot_dim) * item
        else:
            total += n_ctx * a.n_kv_heads * (a.head_dim + a.v_head_dim) * item
        if a.indexer is not None and not a.indexer.shared:  # DSA indexer keys
            total += n_ctx * a.indexer.index_head_dim * item
    return total


def expected_hit_rate(
    store: Store, capacity: int, policy: str = "nextuse", trace: str | None = None
) -> tuple[float, str, str]:
    """(hit rate, source "trace" | "usage" | "uniform", detail) for an expert cache of
    `capacity` records. Raises ColibriError when the trace does not match the store."""
    num_records = len(store.records)
    if trace:
        from colibri.io.replay import load_trace, simulate

        t = load_trace(trace)
        layers_ok = t.num_layers in (len(model_spec(store.config).layers), len(store.moe_layers))
        if t.num_experts != store.num_experts or not layers_ok:
            raise ColibriError(
                f"{trace}: trace has {t.num_layers} layers x {t.num_experts} experts, the store "
                f"{len(store.moe_layers)} MoE layers x {store.num_experts} experts"
            )
        steps = list(t.steps())
        hits, misses = simulate(steps, capacity, policy)
        return (
            hits / max(1, hits + misses),
            "trace",
            f"{policy} replayed offline on {t.num_tokens} tokens of {trace}",
        )
    usage = load_usage(store.path / "usage.json")
    if usage and sum(usage.values()) > 0:
        top = hot_set(usage, capacity)
        total = sum(usage.values())
        return (
            sum(usage[k] for k in top) / total,
            "usage",
            f"the {len(top)} most used of {len(usage)} records in usage.json hold that share "
            f"of its {total} accesses (independent routing assumed)",
        )
    return (
        min(1.0, capacity / max(1, num_records)),
        "uniform",
        f"{min(capacity, num_records)} of {num_records} records cached, every expert "
        "equally likely",
    )


def make_plan(
    store: Store,
    *,
    budget: int | None = None,
    n_ctx: int = DEFAULT_N_CTX,
    kv_dtype: str = "f32",
    policy: str = "nextuse",
    trace: str | None = None,
    profile: MachineProfile | None = None,
    measure: bool = True,
    mirrors: Seq[str] = (),
) -> dict[str, Any]:
    """The plan as a JSON-able dict (schema: docs/OPERATIONS.md). Measures the disk (a short
    sweep of the store's own records) and memory bandwidth when the profile lacks them and
    `measure` is true; bounds are None when a figure is missing. mirrors: mirror directories
    (colibri mirror) whose drives add their bandwidth to the storage bound."""
    spec = model_spec(store.config)
    mem = meminfo()
    total_ram, avail = mem.get("MemTotal", 0), available_memory()
    dense, embed = dense_resident_nbytes(store)
    kv = kv_nbytes(store, n_ctx, kv_dtype)
    record = int(store.layout.record_nbytes)
    slot = (record + 4095) // 4096 * 4096
    experts_total = sum(r.nbytes for r in store.records)
    budget_source = "--budget"
    if budget is None and profile is not None:
        budget, budget_source = profile_budget(profile, experts_total, dense + kv), "profile"
    elif budget is None:
        budget, budget_source = default_budget(store, dense), "default"
    capacity = ExpertCache.slots_for_budget(budget, record)
    cached = min(capacity, len(store.records))
    warnings: list[str] = []
    top_k = spec.moe.router.top_k
    if capacity < top_k:
        warnings.append(
            f"budget {budget} bytes holds {capacity} records; one layer's top-{top_k} needs "
            f"{top_k * slot} bytes: the engine will refuse it"
        )
    hit, source, detail = expected_hit_rate(store, max(capacity, top_k), policy, trace)
    cache_nbytes = cached * slot  # slots past the last record are mapped but never touched
    pinned = 0  # the engine pins no hot set yet (ExpertCache supports it)
    need = dense + kv + cache_nbytes + RUNTIME_NBYTES
    left = total_ram - need
    if avail and need > avail:
        warnings.append(
            f"needs {_gib(need)} but {_gib(avail)} is available: the run will swap or be "
            f"killed; lower --budget to at most {_gib(max(0, avail - dense - kv - RUNTIME_NBYTES - OS_RESERVE_NBYTES))}"  # noqa: E501
        )
    elif total_ram and left < max(OS_RESERVE_NBYTES, total_ram // 10):
        warnings.append(
            f"leaves the OS {_gib(left)} of {_gib(total_ram)} (page cache, other programs): "
            "lower --budget"
        )
    moe_layers = len(store.moe_layers)
    expert_per_token = moe_layers * top_k * record
    read_per_token = expert_per_token * (1 - hit)
    touched = dense - embed + embed // max(1, spec.vocab_size) + expert_per_token
    if spec.lm_head == spec.embed:
        touched += embed - embed // max(1, spec.vocab_size)  # tied: the table is the lm_head
    qd = min(32, max(1, top_k))
    files = [store.experts_path]
    if mirrors:
        from colibri.io.mirror import open_mirror

        files += [open_mirror(store, d).experts_path for d in mirrors]
    copies, per_device = [], {}
    for f in files:
        device = mount_of(f).device
        g, src = None, "not measured"
        if read_per_token == 0:  # every record fits the budget: no read once the cache is warm
            src = (
                f"not needed: all {len(store.records)} expert records fit the "
                f"{_gib(cache_nbytes)} cache (held in RAM), nothing is read once it is warm"
            )
        if profile is not None and (g := profile.drive_gbps(f, qd)) is not None:
            src = f"profile {profile.path}"
        elif measure and read_per_token > 0:
            sweep = store_sweep(store, f, qds=(qd,), seconds=0.3)
            g = sweep.gbps[qd]
            src = f"measured now ({sweep.backend}, {'O_DIRECT' if sweep.direct else 'buffered'})"
        copies.append({"file": str(f), "device": device, "gbps": g, "source": src})
        if device not in per_device or (g or 0) > (per_device[device] or 0):
            per_device[device] = g  # copies on one drive share it
    disk = None if None in per_device.values() else sum(per_device.values())
    disk_source = (
        copies[0]["source"]
        if len(copies) == 1
        else (f"{len(copies)} copies on {len(per_device)} drive(s), summed per drive")
    )
    mem_bw, mem_source = None, "not measured"
    if profile is not None:
        mem_bw, mem_source = profile.memory_read_gbps, f"profile {profile.path}"
    elif measure:
        mem_bw, mem_source = memory_read_gbps(128 << 20, repeat=2), "measured now (SIMD read)"
    tok_s: dict[str, float | None] = dict.fromkeys(("storage", "compute", "combined", "serial"))
    if mem_bw is not None and (disk is not None or read_per_token == 0):
        b = bounds(read_per_token, disk or 1.0, touched / (mem_bw * 1e9))
        tok_s = {k: _finite(b[k]) for k in tok_s}
    if read_per_token > 0 and disk is None:
        warnings.append("no disk figure: run `colibri tune` (or drop --no-measure)")
    return {
        "schema": SCHEMA,
        "store": str(store.path),
        "model_type": store.model_type,
        "memory": {
            "total_nbytes": total_ram,
            "available_nbytes": avail,
            "dense_nbytes": dense,
            "kv_nbytes": kv,
            "n_ctx": min(n_ctx, spec.max_position_embeddings),
            "kv_dtype": kv_dtype,
            "budget_nbytes": budget,
            "budget_source": budget_source,
            "expert_cache_nbytes": cache_nbytes,
            "expert_cache_records": cached,
            "experts_nbytes": experts_total,
            "experts_records": len(store.records),
            "pinned_nbytes": pinned,
            "pinned_records": 0,
            "runtime_nbytes": RUNTIME_NBYTES,
            "os_left_nbytes": left,
        },
        "hit_rate": {"value": hit, "source": source, "policy": policy, "detail": detail},
        "per_token": {
            "expert_nbytes": expert_per_token,
            "read_nbytes": read_per_token,
            "touched_nbytes": touched,
        },
        "bandwidth": {
            "disk_gbps": disk,
            "disk_queue_depth": qd,
            "disk_source": disk_source,
            "disk_copies": copies,
            "memory_read_gbps": mem_bw,
            "memory_source": mem_source,
        },
        "decode_tok_s": tok_s,
        "warnings": warnings,
    }


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x


def _gib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB" if abs(n) < (1 << 30) else f"{n / (1 << 30):.2f} GiB"


def format_plan(p: dict[str, Any]) -> str:
    """The plan as the lines `colibri plan` prints."""
    m, h, t, b, s = p["memory"], p["hit_rate"], p["per_token"], p["bandwidth"], p["decode_tok_s"]

    def ts(x: float | None, what: str = "") -> str:
        if x is not None:
            return f"{x:.1f} tok/s"
        if what == "storage" and not t["read_nbytes"]:
            return "none (the experts are all in RAM)"
        return "? (no figure)"

    def row(label: str, n: int, note: str = "") -> str:
        return f"  {label:<30} {_gib(n):>11}" + (f"  {note}" if note else "")

    lines = [
        f"plan for {p['store']} ({p['model_type']})",
        "memory:",
        row("dense weights (resident)", m["dense_nbytes"]),
        row(f"KV cache ({m['n_ctx']} tokens, {m['kv_dtype']})", m["kv_nbytes"]),
        row(
            "expert cache",
            m["expert_cache_nbytes"],
            f"({m['expert_cache_records']} of {m['experts_records']} records; budget "
            f"{_gib(m['budget_nbytes'])} from {m['budget_source']})",
        ),
        row("pinned experts", m["pinned_nbytes"]),
        row("runtime (estimate)", m["runtime_nbytes"]),
        row(
            "left for the OS",
            m["os_left_nbytes"],
            f"of {_gib(m['total_nbytes'])} ({_gib(m['available_nbytes'])} available now)",
        ),
        f"hit rate: {h['value']:.1%} ({h['source']}: {h['detail']})",
        f"per token: {_gib(t['expert_nbytes'])} of experts, {_gib(t['read_nbytes'])} read from "
        f"disk, {_gib(t['touched_nbytes'])} of weights touched",
        "bandwidth: disk "
        + (
            f"{b['disk_gbps']:.2f} GB/s at QD {b['disk_queue_depth']} ({b['disk_source']})"
            if b["disk_gbps"]
            else b["disk_source"]
            if not t["read_nbytes"]
            else f"? ({b['disk_source']})"
        )
        + "; memory read "
        + (f"{b['memory_read_gbps']:.1f} GB/s" if b["memory_read_gbps"] else "?")
        + f" ({b['memory_source']})",
        f"decode: storage bound {ts(s['storage'], 'storage')}, compute bound {ts(s['compute'])} -> "
        f"at most {ts(s['combined'])} (reads overlapped; {ts(s['serial'])} if not)",
    ]
    lines += [f"warning: {w}" for w in p["warnings"]]
    return "\n".join(lines)


def configure_parser(p: argparse.ArgumentParser) -> None:
    from colibri.options import ctx_tokens, number, positive_size

    p.add_argument("model", nargs="?", default=None, help="a store (default: the demo model)")
    p.add_argument(
        "--budget",
        "--ram-budget",
        dest="budget",
        type=positive_size,
        help="expert cache bytes (default: the profile's, else run's)",
    )
    p.add_argument(
        "--ctx",
        dest="n_ctx",
        type=ctx_tokens,
        default=None,
        help=f"context tokens (default {DEFAULT_N_CTX}, or the model's maximum when smaller)",
    )
    p.add_argument("--kv", dest="kv_dtype", choices=("f32", "f16"), default="f32")
    p.add_argument("--policy", choices=(*POLICIES, "belady"), default="nextuse")
    p.add_argument("--trace", metavar="FILE", help="routing trace (.npz or Mixtral .jsonl)")
    p.add_argument(
        "--mirror",
        action="append",
        default=[],
        metavar="DIR",
        help="a mirror of the store (repeatable): its drive adds to the disk figure",
    )
    p.add_argument(
        "--cluster",
        metavar="NODES|ADDRESS",
        help="also plan experts sharded over NODES machines like this one (or the alive "
        "nodes of the Ray cluster at ADDRESS): placement and the network-bound tok/s",
    )
    p.add_argument(
        "--network-gbit",
        type=number(0, lo_open=True),
        default=25.0,
        help="--cluster: the coordinator's link, Gbit/s (default 25)",
    )
    p.add_argument(
        "--call-ms",
        type=number(0),
        default=1.0,
        help="--cluster: per-layer round trip of a call, ms (default 1; `colibri bench "
        "--sections cluster` measures it)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--no-profile", action="store_true", help="ignore the machine profile")
    p.add_argument(
        "--no-measure",
        action="store_true",
        help="do not measure what the profile lacks (bounds left out)",
    )


def run_cli(args: argparse.Namespace) -> int:
    from colibri.run import DEMO_STORE

    store = open_store(Path(args.model) if args.model else DEMO_STORE)
    limit = model_spec(store.config).max_position_embeddings
    if args.n_ctx is None:
        args.n_ctx = DEFAULT_N_CTX  # lowered to the model's maximum, as run does
    elif args.n_ctx > limit:
        raise ColibriError(
            f"--ctx {args.n_ctx} exceeds the model's context length {limit} "
            "(max_position_embeddings)"
        )
    profile = None if args.no_profile else load_profile()
    plan = make_plan(
        store,
        budget=args.budget,
        n_ctx=args.n_ctx,
        kv_dtype=args.kv_dtype,
        policy=args.policy,
        trace=args.trace,
        profile=profile,
        measure=not args.no_measure,
        mirrors=args.mirror,
    )
    if args.cluster:
        plan["cluster"] = _cluster(args, store, plan)
    if args.json:
        json.dump(plan, sys.stdout, indent=1)
        print()
    else:
        print(format_plan(plan))
        if args.cluster:
            from colibri.cluster.plan import format_cluster_plan

            print(format_cluster_plan(plan["cluster"]))
    return 1 if plan["warnings"] else 0


def _cluster(args: argparse.Namespace, store: Store, plan: dict[str, Any]) -> dict[str, Any]:
    """plan["cluster"]: colibri/cluster/plan.py's placement and bounds for --cluster."""
    from colibri.cluster.plan import cluster_plan

    if args.cluster.isdigit():
        nodes = int(args.cluster)
    else:
        try:
            import ray
        except ImportError:
            raise ColibriError(
                f"--cluster {args.cluster}: reading a Ray cluster needs Ray: pip install "
                "'colibri[cluster]' (or give a number of nodes)"
            ) from None
        ray.init(address=args.cluster, log_to_driver=False, logging_level="ERROR")
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        ray.shutdown()
    if nodes < 1:
        raise ColibriError(f"--cluster {args.cluster}: needs at least one node")
    if args.network_gbit <= 0 or args.call_ms < 0:
        raise ColibriError("--network-gbit must be > 0 and --call-ms >= 0")
    b, m = plan["bandwidth"], plan["memory"]
    if not b["memory_read_gbps"] or (not b["disk_gbps"] and plan["per_token"]["read_nbytes"]):
        raise ColibriError("--cluster: no disk or memory figure (run `colibri tune`)")
    return cluster_plan(
        store,
        nodes,
        budget=m["budget_nbytes"],
        disk_gbps=b["disk_gbps"] or 1.0,
        memory_gbps=b["memory_read_gbps"],
        dense_touched_nbytes=plan["per_token"]["touched_nbytes"]
        - plan["per_token"]["expert_nbytes"],
        network_gbit=args.network_gbit,
        call_ms=args.call_ms,
        usage=load_usage(store.path / "usage.json"),
    )
