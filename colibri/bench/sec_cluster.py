"""Section "cluster": experts sharded over a local multi-node Ray cluster (issue 19).

A synthetic OLMoE-1B-7B-shaped Q4_0 store (tools/synth_store.py: real layer shapes, 2 layers in
quick mode, 4 in full; 64 experts of 3.4 MiB, top-8) decoded greedily at batch 1 by the
single-process engine and by the same engine with --cluster on a `ray.cluster_utils.Cluster` of
2 nodes on this machine (head + 1; one expert owner each, every record cached on its owner, the
coordinator keeping attention and routing), its layer calls going through the Ray Compiled
Graph ("cluster"), as plain actor calls ("cluster-plain"), or by whichever of the two is
measured cheaper ("cluster-auto", the default; ClusterExperts.transport). Rounds are
interleaved; medians quoted. Figures: decode tok/s and the ratio to the single process (target:
the cluster within 1.5x of the single-process time), the per-layer round trip of the owners'
calls and its overhead over the slowest owner's own time (target <= 1 ms), Ray's floor in the
same run (a no-op plain actor call and a no-op 2-node compiled graph execution, one f32 row
each), bytes on the wire per token, and whether the tokens are identical. On paper: GLM-5
(744B, tools/synth_store.py's shape) on 2, 4 and 8 nodes with NVMe and 25 / 100 GbE, from
colibri/cluster/plan.py's bounds with the measured per-layer overhead.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import numpy as np

from colibri.bench import decode as bench_decode
from colibri.bench.report import Context, Headline, Section, interleave, median, table
from colibri.engine import open_engine

TITLE = "Past one machine: experts on a local Ray cluster"
MODEL = "olmoe-1b-7b"
PROMPT = list(range(100, 116))
# GLM-5 on paper: Q4_0 experts (3 x 6144 x 2048 weights at 18 bytes / 32), 75 MoE layers of
# 256 experts, top-8; NVMe at 6 GB/s per node; 200 GB/s of memory per node; every node's
# expert cache holding 1/8 of the 426 GB of experts (so 2 nodes miss, 8 nodes hold them all)
GLM5 = dict(moe_layers=75, top_k=8, d_model=6144, record_nbytes=3 * 6144 * 2048 * 18 // 32,
            experts=75 * 256, dense_touched_nbytes=9 << 30)  # fmt: skip
GLM5_DISK_GBPS, GLM5_MEMORY_GBPS = 6.0, 200.0
TRANSPORT = {"cluster": "graph", "cluster-plain": "plain", "cluster-auto": "auto"}
LEGS = ("calls", "submit", "to_owner", "owner_wake", "owner_busy", "owner_return", "from_owner",
        "wake")  # fmt: skip


def _wire(engine: Any) -> tuple[int, float, float, int]:
    """(layer calls, summed round trip ms, summed overhead ms, wire bytes) so far."""
    c = engine.statistics(components=False).cluster
    if c is None:
        return 0, 0.0, 0.0, 0
    n = c.layer_calls
    return n, c.round_trip_ms * n, c.overhead_ms * n, c.bytes_sent + c.bytes_received


# cluster decode-only deltas of _wire, by mode ("cluster": compiled graph, "cluster-plain",
# "cluster-auto")
DECODE: dict[str, list[tuple[int, float, float, int]]] = {}


async def _decode(engine: Any, n: int, mode: str = "cluster") -> tuple[list[int], float]:
    """(greedy tokens, seconds per decoded token) of one sequence: PROMPT, then n tokens.
    Appends the decode steps' _wire delta to DECODE[mode] for a cluster engine."""
    seq = engine.new_sequence()
    logits = await engine.forward(seq, PROMPT)
    before = _wire(engine)
    out, seconds, _ = await bench_decode.timed_greedy(engine, seq, logits, n)
    dt = seconds / n
    if engine.cluster is not None:
        delta = tuple(a - b for a, b in zip(_wire(engine), before, strict=True))
        DECODE.setdefault(mode, []).append(delta)  # type: ignore[arg-type]
    return out, dt


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its descendants (the local cluster's
    raylets, GCS and workers), psutil (a Ray dependency)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # gone meanwhile
            continue
        total += t.user + t.system
    return total


def _ray_floor(ray: Any, node_id: str, calls: int = 200) -> float:
    """Median ms of a no-op Ray actor call to an actor on `node_id` (Ray's own floor, with
    an f32 [1, 2048] argument like one row of activations)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    class Echo:
        async def echo(self, x: Any) -> Any:
            return x

    a = Echo.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    ).remote()
    x = np.zeros((1, 2048), dtype=np.float32)

    async def run() -> list[float]:
        await a.echo.remote(x)
        out = []
        for _ in range(calls):
            t0 = time.perf_counter()
            await a.echo.remote(x)
            out.append(time.perf_counter() - t0)
        return out

    times = asyncio.run(run())
    ray.kill(a)
    return 1000 * float(np.median(times))


def _graph_floor(ray: Any, node_ids: list[str], calls: int = 200) -> float:
    """Median ms of one execution of a compiled graph over a no-op sync actor on each of
    `node_ids` (an f32 [1, 2048] row to each), driven as client.py does (results dropped
    before the next execution)."""
    from ray.dag import InputNode, MultiOutputNode
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from colibri.cluster.client import _numpy_channels

    @ray.remote(num_cpus=0)
    class Echo:
        def __init__(self) -> None:
            _numpy_channels()  # as client.py's owners

        def echo(self, x: Any) -> Any:
            return x

    _numpy_channels()
    actors = [
        Echo.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
        for n in node_ids
    ]
    with InputNode() as inp:
        dag = MultiOutputNode([a.echo.bind(inp[i]) for i, a in enumerate(actors)])
    compiled = dag.experimental_compile()
    x = np.zeros((1, 2048), dtype=np.float32)
    times = []
    try:
        ray.get(compiled.execute(*[x] * len(actors)), timeout=180)  # warm-up
        for _ in range(calls):
            t0 = time.perf_counter()
            ray.get(compiled.execute(*[x] * len(actors)), timeout=60)
            times.append(time.perf_counter() - t0)
    finally:
        compiled.teardown()
        for a in actors:
            ray.kill(a)
    return 1000 * float(np.median(times))


def _glm5_table(overhead_ms: float) -> tuple[str, list[dict[str, Any]]]:
    from colibri.cluster.plan import cluster_bounds

    g = GLM5
    total = g["experts"] * g["record_nbytes"]
    rows, data = [], []
    for nodes, gbit, call_ms in itertools.product((2, 4, 8), (25, 100), (overhead_ms, 1.0)):
        cached = min(1.0, (total / 8) / (total / nodes))  # each node caches 1/8 of all experts
        b = cluster_bounds(
            moe_layers=g["moe_layers"], top_k=g["top_k"], d_model=g["d_model"],
            record_nbytes=g["record_nbytes"], dense_touched_nbytes=g["dense_touched_nbytes"],
            shares=[1 / nodes] * nodes, hit_rates=[cached] * nodes,
            disk_gbps=[GLM5_DISK_GBPS] * nodes, memory_gbps=GLM5_MEMORY_GBPS,
            network_gbit=gbit, call_ms=call_ms,
        )  # fmt: skip
        t = b["tok_s"]
        rows.append((nodes, f"{gbit} GbE", call_ms, f"{cached:.0%}", t["storage"],
                     t["memory"], t["network"], t["combined"]))  # fmt: skip
        data.append({"nodes": nodes, "gbit": gbit, "call_ms": call_ms, "hit_rate": cached,
                     **t})  # fmt: skip
    md = table(
        ["nodes", "network", "call ms", "hit rate", "storage tok/s", "memory tok/s",
         "network tok/s", "expected tok/s"],
        rows,
    )  # fmt: skip
    return md, data


def run(ctx: Context) -> Section:
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        return Section("cluster", TITLE, "Ray is not installed: pip install 'colibri[cluster]'.")
    layers, n = (2, 16) if ctx.quick else (4, 48)
    store = ctx.work / f"{MODEL}-L{layers}-q4_0"
    bench_decode.ensure_store(store, MODEL, layers, run=ctx.run)
    budget = bench_decode.store_expert_nbytes(store) + (64 << 20)
    ctx.log(f"  starting a 2-node Ray cluster; store {store}")
    head = {"num_cpus": 1, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    loop = asyncio.new_event_loop()
    opts = dict(threads=ctx.threads, budget=budget, n_ctx=256)
    try:
        local_cm = open_engine(store, **opts)
        remote_cm = open_engine(store, cluster=cluster.address, **opts)
        local = loop.run_until_complete(local_cm.__aenter__())
        remote = loop.run_until_complete(remote_cm.__aenter__())
        # the rounds of the other engines leave the graph idle: keep it (in use a graph is
        # torn down after ClusterExperts.graph_idle seconds without an execution)
        remote.cluster.graph_idle = float("inf")
        try:
            ref, _ = loop.run_until_complete(_decode(local, n))  # warm-up: every record read
            graph = loop.run_until_complete(remote.cluster.wait_graph())
            got, _ = loop.run_until_complete(_decode(remote, n))
            remote.cluster.transport = "plain"
            got_plain, _ = loop.run_until_complete(_decode(remote, n, "cluster-plain"))
            DECODE.clear()
            remote.cluster.clear_breakdown()
            cpu = {m: [0.0, 0] for m in TRANSPORT}  # CPU seconds, layer calls by mode

            def timed(engine: Any, mode: str = "single"):
                def f() -> float:
                    c = engine.cluster
                    if c is not None:
                        if mode == "cluster" and c.graph_state() != "ready":  # auto tore it down
                            loop.run_until_complete(c.wait_graph())
                        c.transport = TRANSPORT[mode]
                        calls, cpu0 = c.layer_calls, _cpu_seconds()
                    _, sec = loop.run_until_complete(_decode(engine, n, mode))
                    if c is not None:
                        cpu[mode][0] += _cpu_seconds() - cpu0
                        cpu[mode][1] += c.layer_calls - calls
                    return 1 / sec

                return f

            modes = {
                "single": timed(local),
                "cluster": timed(remote, "cluster"),
                "cluster-plain": timed(remote, "cluster-plain"),
                "cluster-auto": timed(remote, "cluster-auto"),
            }
            rounds = interleave(modes, ctx.rounds, ctx.log)
            after = remote.statistics(components=False).cluster
            legs = remote.cluster.breakdown()
            floor = _ray_floor(ray, after.owners[1].node_id)
            graph_floor = _graph_floor(ray, [o.node_id for o in after.owners])
        finally:
            loop.run_until_complete(remote_cm.__aexit__(None, None, None))
            loop.run_until_complete(local_cm.__aexit__(None, None, None))
    finally:
        loop.close()
        ray.shutdown()
        cluster.shutdown()
    single = median(rounds["single"])
    figures = {}
    for mode in TRANSPORT:
        calls, rt, over, wire = (sum(d[i] for d in DECODE.get(mode, [])) for i in range(4))
        tok_s = median(rounds[mode])
        figures[mode] = {
            "tok_s": tok_s,
            "ratio": single / tok_s if single and tok_s else None,
            "round_trip_ms": rt / max(calls, 1),
            "overhead_ms": over / max(calls, 1),
            # decode steps only (not the prompt's)
            "wire_per_token": wire / max(1, n * len(DECODE.get(mode, []))),
            # CPU of every process of the cluster (this one, raylets, owners, GCS...) per layer
            # call of the decode rounds: what the load moves least
            "cpu_ms_per_layer_call": 1000 * cpu[mode][0] / max(cpu[mode][1], 1),
        }
    f, fp, fa = figures["cluster"], figures["cluster-plain"], figures["cluster-auto"]
    # the headlines: the default transport (auto)
    over_ms, per_token, ratio = fa["overhead_ms"], fa["wire_per_token"], fa["ratio"]
    owners = [
        (o.index, o.node_id[:8], o.records, o.calls, o.mean_ms, o.max_ms, o.busy_ms, o.errors)
        for o in after.owners
    ]
    glm_md, glm = _glm5_table(over_ms)

    def x(v: float | None) -> str:
        return f"{v:.2f}x" if v is not None else "n/a"

    md = "\n\n".join(
        [
            f"Store: `{store.name}` ({layers} MoE layers, batch 1, {n} decode tokens a pass, "
            f"{ctx.rounds} interleaved rounds, kernel threads {ctx.threads}, each owner "
            f"{after.owners[0].threads}: its node's CPU resource); the 2 Ray nodes "
            f"and the coordinator share this machine's cores. Compiled graph: {graph}.",
            table(
                [
                    "engine",
                    "decode tok/s",
                    "ms/token",
                    "x single time",
                    "round trip ms",
                    "overhead ms",
                    "CPU ms / layer call",
                ],
                [
                    ("single process", single, 1000 / single if single else None, *[None] * 4),
                    *(
                        (
                            f"2-node cluster, {label}",
                            figures[m]["tok_s"],
                            1000 / figures[m]["tok_s"] if figures[m]["tok_s"] else None,
                            figures[m]["ratio"],
                            figures[m]["round_trip_ms"],
                            figures[m]["overhead_ms"],
                            figures[m]["cpu_ms_per_layer_call"],
                        )
                        for m, label in (
                            ("cluster", "compiled graph"),
                            ("cluster-plain", "plain actor calls"),
                            ("cluster-auto", "auto (default)"),
                        )
                    ),
                ],
            ),
            f"Tokens identical: **{got == ref and got_plain == ref}** (both transports). "
            f"Cluster decode time / single-process: **{x(ratio)}** auto (the default), "
            f"{x(f['ratio'])} with the compiled graph, {x(fp['ratio'])} with plain calls "
            "(target <= 1.5x). Per MoE layer, auto: round trip "
            f"{fa['round_trip_ms']:.2f} ms, overhead over the slowest owner's own time "
            f"**{over_ms:.2f} ms** (target <= 1 ms; compiled graph {f['overhead_ms']:.2f} ms, "
            f"plain calls {fp['overhead_ms']:.2f} ms). "
            f"Ray's floor in this run: a no-op plain actor call with one row "
            f"{floor:.2f} ms, a no-op 2-node compiled graph execution {graph_floor:.2f} ms. "
            f"Bytes on the wire: **{per_token / 1024:.1f} KiB per token** ({layers} layers; "
            "f32 rows out, top-k weighted outputs back).",
            table(
                ["owner", "node", "records", "calls", "mean ms", "max ms", "busy ms", "errors"],
                owners,
            ),
            "Where an owner call's time goes (ClusterExperts.breakdown(): perf_counter stamps "
            "on both sides, one machine; mean ms per owner call over the timed rounds; the "
            "graph's submit / wake are its coordinator-side hand-offs per layer call). CPU ms "
            "/ layer call above: user + system CPU of every process of the cluster, this one "
            "included, per MoE layer call; a built graph's cross-node channels keep Ray "
            "threads polling (client.py), which shows there and in the plain rounds too.",
            table(["transport", *LEGS], [(k, *(v.get(g) for g in LEGS)) for k, v in legs.items()]),
            "GLM-5 on paper (colibri/cluster/plan.py; per-layer call time: the overhead "
            f"measured here, and the 1 ms target; NVMe {GLM5_DISK_GBPS:g} GB/s and "
            f"{GLM5_MEMORY_GBPS:g} GB/s of memory per node, 9 GiB of dense weights touched per "
            "token on the coordinator, each node caching 1/8 of the 426 GB of Q4_0 experts):",
            glm_md,
        ]
    )
    heads = [
        Headline("cluster decode, 2 local nodes", "x single-process time", ratio, target="<= 1.5x"),
        Headline("cluster per-layer overhead, batch 1", "ms", over_ms, target="<= 1 ms"),
    ]
    data = {
        "store": str(store),
        "graph": graph,
        "single_tok_s": rounds["single"],
        "cluster_tok_s": rounds["cluster"],
        "cluster_plain_tok_s": rounds["cluster-plain"],
        "cluster_auto_tok_s": rounds["cluster-auto"],
        "identical": got == ref and got_plain == ref,
        "round_trip_ms": fa["round_trip_ms"],
        "graph_figures": f,
        "ray_noop_call_ms": floor,
        "ray_noop_graph_ms": graph_floor,
        "overhead_ms": over_ms,
        "plain": fp,
        "auto": fa,
        "wire_nbytes_per_token": per_token,
        "breakdown": legs,
        "owners": [list(o) for o in owners],
        "glm5": glm,
    }
    return Section("cluster", TITLE, md, data=data, headlines=heads)
