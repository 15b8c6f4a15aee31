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
colibri/cluster/client.py's plain calls per MoE layer), cgraph-1node / cgraph-2nodes (the same
two actors in one compiled graph, execute() then ray.get), cgraph-loop-2nodes (client.py's
form: the graph executed from a dedicated thread that an asyncio coroutine awaits, and the
actors' sync node handing its work to the actor's event loop with run_coroutine_threadsafe),
cgraph-held-2nodes (the repro of the earlier hang: the driver keeps the last execution's numpy
result alive while it submits the next -- expected to fail). Figures: median ms per round trip.

Measured 2026-12-01 (2-core AMD EPYC, load average 7-11 from other jobs; two runs, ms):
actor-1node 2.75 / 4.09, actor-2nodes 3.00 / 3.68, cgraph-1node 0.81 / 1.06, cgraph-2nodes
1.47 / 1.46 (compile 1.3-3.7 s, first execution 3-6 s). Earlier probes on the same machine
also saw a 2-node compiled graph stop after its first execution (RayChannelTimeoutError
"Timed out acquiring the read lock" after RAY_CGRAPH_get_timeout = 10 s, then a raylet
check failure in MutableObjectProvider::HandlePushMutableObject and a driver segfault at
teardown), and an enable_asyncio graph over an async actor whose method waited on the
actor's event loop (asyncio.run_coroutine_threadsafe) hang.

The cause (found 2026-12-02, case cgraph-held-2nodes): a compiled graph's numpy results are
zero-copy views of the channel buffer, and the next execution's write waits until the reader
has released it, i.e. until those arrays are gone; a caller that keeps `out =
ray.get(compiled.execute(...))` alive across the next execute() hangs there, on 1 node as on
2 (https://docs.ray.io/en/latest/ray-core/compiled-graph/troubleshooting.html, "Return NumPy
arrays"). The raylet check failure and the segfault follow from tearing the stuck graph down.
Separately, the first execution after compiling took 3-12 s here, close to the 10 s default
get timeout. Most of it was Ray importing torch in every graph process
(ChannelContext.torch_available) to enter a torch device context around each channel read and
write; only numpy crosses these channels, so the cases tell Ray so, as client.py does
(--torch-channels: Ray's default). Measured 2026-12-02 (2-core Xeon, load average 10-16,
interleaved, 300 calls): first execution 6-8 ms against 5.5-9.5 s with torch contexts;
cgraph-2nodes median 1.41 / 1.57 ms against 1.14 / 1.19 ms, cgraph-loop-2nodes 1.51 / 1.10
against 1.51 / 1.62 (no steady-state difference above the noise).
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

CASES = (
    "actor-1node",
    "actor-2nodes",
    "cgraph-1node",
    "cgraph-2nodes",
    "cgraph-loop-2nodes",
    "cgraph-held-2nodes",
)


def _case(name: str, calls: int, torch_channels: bool = False) -> dict[str, Any]:
    """Run one case in this process; returns {"case", "median_ms", ...}. Compiled-graph
    processes are told that no torch tensor crosses the channels, as client.py does
    (_numpy_channels), unless torch_channels."""
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
            def __init__(self) -> None:
                self.loop: Any = None

            async def open(self, torch_channels: bool = False) -> None:
                self.loop = asyncio.get_running_loop()
                if not torch_channels:
                    _numpy_channels()

            def echo(self, x: Any) -> Any:
                return x

            async def aecho(self, x: Any) -> Any:
                return x

            def loop_echo(self, x: Any) -> Any:  # client.py's ExpertOwnerActor.ffn_graph
                return asyncio.run_coroutine_threadsafe(self.aecho(x), self.loop).result()

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
            from concurrent.futures import ThreadPoolExecutor

            from ray.dag import InputNode, MultiOutputNode

            form = name.split("-")[1]  # "1node" / "2nodes" (plain), "loop", "held"
            ray.get([a.open.remote(torch_channels) for a in actors])
            if not torch_channels:
                _numpy_channels()
            method = "loop_echo" if form == "loop" else "echo"
            with InputNode() as inp:
                dag = MultiOutputNode(
                    [getattr(a, method).bind(inp[i]) for i, a in enumerate(actors)]
                )
            t0 = time.perf_counter()
            compiled = dag.experimental_compile()
            extra = {"compile_s": time.perf_counter() - t0}
            t0 = time.perf_counter()
            ray.get(compiled.execute(x, x), timeout=120)
            extra["first_s"] = time.perf_counter() - t0
            try:
                if form == "loop":
                    thread = ThreadPoolExecutor(1)

                    def once() -> None:
                        out = ray.get(compiled.execute(x, x), timeout=30)
                        [np.array(o, copy=True) for o in out]  # then the buffers go

                    async def run_loop() -> None:
                        loop = asyncio.get_running_loop()
                        for _ in range(calls):
                            t0 = time.perf_counter()
                            await loop.run_in_executor(thread, once)
                            times.append(time.perf_counter() - t0)

                    asyncio.run(run_loop())
                    thread.shutdown()
                else:
                    held = []
                    for k in range(calls):
                        t0 = time.perf_counter()
                        try:
                            out = ray.get(compiled.execute(x, x), timeout=30)
                        except Exception as exc:
                            raise RuntimeError(
                                f"execution {k + 1}: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}"
                            ) from None
                        times.append(time.perf_counter() - t0)
                        if form == "held":
                            held[:] = [out]  # the last result stays alive: the next hangs
                        del out
            finally:
                compiled.teardown()
        return {
            "case": name,
            "median_ms": 1000 * float(np.median(times)),
            "p90_ms": 1000 * float(np.percentile(times, 90)),
            "calls": calls,
            "torch_channels": torch_channels,
            "load": os.getloadavg()[0],
            **extra,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def _numpy_channels() -> None:
    from colibri.cluster.client import _numpy_channels as tell

    tell()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200, help="timed round trips a case")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds a case may take")
    p.add_argument("--case", choices=CASES, help="run one case in this process")
    p.add_argument("--cases", help="comma-separated cases to run (default: all), in order")
    p.add_argument(
        "--torch-channels",
        action="store_true",
        help="leave Ray's torch device contexts on around channel reads/writes",
    )
    a = p.parse_args()
    if a.case:
        print(json.dumps(_case(a.case, a.calls, a.torch_channels)), flush=True)
        return
    for name in a.cases.split(",") if a.cases else CASES:
        cmd = [sys.executable, __file__, "--case", name, "--calls", str(a.calls)]
        cmd += ["--torch-channels"] if a.torch_channels else []
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
