#!/usr/bin/env python
"""Micro-benchmark of one coordinator-to-owners round trip on Ray: a plain actor call against
a Ray Compiled Graph (ray.dag InputNode / MultiOutputNode, experimental_compile) that sends
each of two echo actors one f32 [1, 2048] row (one decode token's activations) per execution.

Each case runs in its own process (a Compiled Graph that hangs or crashes Ray -- a raylet
check failure, a segfault of the driver -- must not take the others with it) on its own
local ray.cluster_utils.Cluster, with a wall timeout; a case that fails prints its error.

    python tools/ray_round_trip.py               # every case, one JSON line each
    python tools/ray_round_trip.py --calls 500 --timeout 180

Cases: actor-1node / actor-2nodes (two async echo actors, one call each in parallel, as
colibri/cluster/client.py does per MoE layer), cgraph-1node / cgraph-2nodes (the same two
actors in one compiled graph, execute() then ray.get). Figures: median ms per round trip.

Measured 2026-12-01 (2-core AMD EPYC, load average 7-11 from other jobs; two runs, ms):
actor-1node 2.75 / 4.09, actor-2nodes 3.00 / 3.68, cgraph-1node 0.81 / 1.06, cgraph-2nodes
1.47 / 1.46 (compile 1.3-3.7 s, first execution 3-6 s). Earlier probes on the same machine
also saw a 2-node compiled graph stop after its first execution (RayChannelTimeoutError
"Timed out acquiring the read lock" after RAY_CGRAPH_get_timeout = 10 s, then a raylet
check failure in MutableObjectProvider::HandlePushMutableObject and a driver segfault at
teardown), and an enable_asyncio graph over an async actor whose method waited on the
actor's event loop (asyncio.run_coroutine_threadsafe) hang: not yet safe for client.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

CASES = ("actor-1node", "actor-2nodes", "cgraph-1node", "cgraph-2nodes")


def _case(name: str, calls: int) -> dict[str, Any]:
    """Run one case in this process; returns {"case", "median_ms", ...}."""
    import asyncio

    import numpy as np
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    two = name.endswith("2nodes")
    head = {"num_cpus": 1 if two else 2, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    if two:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    try:
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))

        @ray.remote(num_cpus=0)
        class Echo:
            def echo(self, x: Any) -> Any:
                return x

            async def aecho(self, x: Any) -> Any:
                return x

        actors = [
            Echo.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], False)
            ).remote()
            for i in range(2)
        ]
        x = np.zeros((1, 2048), dtype=np.float32)
        times: list[float] = []
        if name.startswith("actor"):
            ray.get([a.echo.remote(x) for a in actors])

            async def run() -> None:
                for _ in range(calls):
                    t0 = time.perf_counter()
                    await asyncio.gather(*(a.echo.remote(x) for a in actors))
                    times.append(time.perf_counter() - t0)

            asyncio.run(run())
            extra: dict[str, Any] = {}
        else:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:
                dag = MultiOutputNode([a.echo.bind(inp[i]) for i, a in enumerate(actors)])
            t0 = time.perf_counter()
            compiled = dag.experimental_compile()
            extra = {"compile_s": time.perf_counter() - t0}
            t0 = time.perf_counter()
            ray.get(compiled.execute(x, x), timeout=60)
            extra["first_s"] = time.perf_counter() - t0
            try:
                for _ in range(calls):
                    t0 = time.perf_counter()
                    ray.get(compiled.execute(x, x), timeout=30)
                    times.append(time.perf_counter() - t0)
            finally:
                compiled.teardown()
        return {
            "case": name,
            "median_ms": 1000 * float(np.median(times)),
            "p90_ms": 1000 * float(np.percentile(times, 90)),
            "calls": calls,
            **extra,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200, help="timed round trips a case")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds a case may take")
    p.add_argument("--case", choices=CASES, help="run one case in this process")
    a = p.parse_args()
    if a.case:
        print(json.dumps(_case(a.case, a.calls)), flush=True)
        return
    for name in CASES:
        cmd = [sys.executable, __file__, "--case", name, "--calls", str(a.calls)]
        # its own process group: a case that hangs is ended with its Ray processes
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            out, err = proc.communicate(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            print(json.dumps({"case": name, "error": f"no answer within {a.timeout:.0f} s"}))
            continue
        with contextlib.suppress(ProcessLookupError):  # Ray processes a crash left behind
            os.killpg(proc.pid, signal.SIGKILL)
        r = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith('{"case"')), None)
        if line is not None and r.returncode == 0:
            print(line, flush=True)
            continue
        errors = [ln.strip() for ln in r.stderr.splitlines() if "Error" in ln or "failed" in ln]
        print(json.dumps({"case": name, "returncode": r.returncode, "error": errors[-3:]}))


if __name__ == "__main__":
    main()
