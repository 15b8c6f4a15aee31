"""ClusterExperts: the coordinator's provider of routed-expert outputs computed on Ray actors.

    experts = open_cluster_experts(store, EngineOptions(cluster="auto", threads=1))
    pipeline.experts = experts        # each MoE layer now awaits experts.ffn(...)
    ...
    await experts.aclose()

The coordinator (the engine's process) keeps the dense weights, attention, routing, the KV
cache and sampling. Each owner (an ExpertOwner inside a Ray actor, one or more per node) holds
a shard of the (layer, expert) records (colibri/cluster/placement.py). Per MoE layer, `ffn`
groups the batch's (row, slot) pairs by owner, sends each owner the rows it needs in one call
(all owners in parallel, with its share of the next layer's prediction to prefetch), and
scatters the returned outputs into per-slot arrays that the pipeline sums in the fixed slot
order: the tokens are those of one machine, whatever the shard map.

Transport: a layer whose calls are small (decode: at most GRAPH_ROWS rows an owner, fitting the
channel buffers) goes to every owner at once through one Ray Compiled Graph (ray.dag InputNode
-> each owner's ffn_graph -> MultiOutputNode, `experimental_compile`); the rest (prefill, the
graph not built yet, busy or broken) goes as plain actor calls, one per owner, in parallel. A
no-op round trip to 2 owners on 2 local nodes (tools/ray_round_trip.py) takes 0.8-1.5 ms
through a graph against 2.7-4 ms as plain calls on this machine lightly loaded; at a load
average of 16-22 on its 2 cores both take 2-7 ms and either may win. So which of the two a
small call takes is measured, not assumed (`ClusterExperts.transport`, default "auto": the one
whose moving mean overhead is lower, the other tried again every PROBE_EVERY calls). The graph
is built once GRAPH_AFTER small layer calls went plain (or wait_graph() asks), so a short run
never compiles one; it is driven from one dedicated thread (`compiled.execute` and `ray.get`
block; the coroutine awaits the thread's future), and on the actor its method is sync: Ray runs
it on the actor's `_ray_system` thread, and it hands the work to the actor's event loop (where
the plain calls and the owner's IO stack live) with asyncio.run_coroutine_threadsafe. Two rules
of Compiled Graphs make it work
(https://docs.ray.io/en/latest/ray-core/compiled-graph/troubleshooting.html): numpy results are
zero-copy views of the channel's buffer, and the next execution waits until the last one's
arrays are gone, so the thread copies every result array before the next call (keeping them
hung the earlier 2-node probes at their second execution, RayChannelTimeoutError, then a raylet
check failure at teardown); and the first execution after compiling takes 3-17 s on a
loaded machine (more than RAY_CGRAPH_get_timeout's 10 s), so the graph is compiled and warmed
up in the background while plain calls serve. Most of that first execution was Ray importing
torch in every graph process (ChannelContext.torch_available, py-spy: 55-80% of an owner's
samples meanwhile, GIL held while it served plain calls) and then entering a torch device
context around every channel read and write; only numpy crosses these channels, so each
process tells Ray there is no torch (_numpy_channels). The graph's price: each cross-node
channel keeps a Ray thread polling it with sched_yield (perf: MutableObjectProvider::
PollWriterClosure -> MutableObjectManager::ReadAcquire), measured at 40-70% of a core in the
coordinator and 6-14% in each owner while the graph is built, executing or not; on the
2-core test machine a decode layer call cost 23-35 CPU ms over all the cluster's processes
with a graph built against 19-20 without. So a graph idle for `graph_idle` seconds
(GRAPH_IDLE) is torn down, and "auto" tears it down when GRAPH_LOSSES probes in a row find it
costlier (rebuilt after GRAPH_AFTER resp. GRAPH_RETRY small calls). breakdown() splits an
owner call into its legs (time.perf_counter() stamps on both sides: send, wake-ups, the
owner's work, the way back).

Failures: an owner whose actor dies fails the layer's call with a ColibriError naming the owner
and its node (the request that needed it ends with it); the compiled graph is torn down; Ray
restarts the actor, and the next call first waits for it to answer again (or, if its node left,
starts it on another node); a new graph over the owners as they are now follows after
GRAPH_AFTER more small calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from colibri.cluster.owner import ExpertOwner
from colibri.cluster.placement import place
from colibri.errors import ColibriError

if TYPE_CHECKING:
    from colibri.engine import EngineOptions

RESTART_TIMEOUT = 120.0  # seconds an owner may take to come back after failing
GRAPH_ROWS = 16  # rows an owner's share of a layer may have to go through the compiled graph
GRAPH_AFTER = 64  # small layer calls (plain) before the graph is built: short runs never pay
PROBE_EVERY = 32  # small layer calls between two tries of the transport measured slower
COST_ALPHA = 0.1  # weight of the newest call in each transport's moving mean overhead
GRAPH_TIMEOUT = 300.0  # seconds one compiled-graph execution may take (cold reads included)
# a graph's cross-node channels each keep a Ray thread polling with sched_yield (measured: 40-70%
# of a core in the coordinator and 6-14% in each owner, whether or not the graph executes), so
# a graph is torn down after GRAPH_IDLE seconds without an execution (built again after
# GRAPH_AFTER small calls), and "auto" tears it down once GRAPH_LOSSES probes in a row found it
# costlier than plain calls (built again after GRAPH_RETRY small calls, to measure again)
GRAPH_IDLE = 5.0
GRAPH_LOSSES = 4
GRAPH_RETRY = 4096
GRAPH_WARMUP_TIMEOUT = 180.0  # seconds the first execution after compiling may take


@dataclass(frozen=True)
class OwnerStatistics:
    """One owner's figures. node: its node's IP; node_id: its Ray node id; pid: its process;
    records: (layer, expert) records it owns; calls / errors / restarts: ffn calls answered,
    failed, and the times it came back after failing; mean_ms / max_ms / last_ms: call
    round-trip latency seen by the coordinator, milliseconds; busy_ms: mean time inside the
    owner per call (reads and kernels); bytes_sent / bytes_received: array bytes to / from
    it; hits, misses, bytes_read: its expert cache's counters; prefetch_issued /
    prefetch_useful_reads / prefetch_wasted_reads: its prefetcher's reads of the predictions
    that travel with the calls, and those a later call used / never used; threads: its kernel
    threads (EngineOptions.owner_threads)."""

    index: int
    node: str
    node_id: str
    pid: int
    records: int
    calls: int
    errors: int
    restarts: int
    mean_ms: float
    max_ms: float
    last_ms: float
    busy_ms: float
    bytes_sent: int
    bytes_received: int
    hits: int
    misses: int
    bytes_read: int
    prefetch_issued: int = 0
    prefetch_useful_reads: int = 0
    prefetch_wasted_reads: int = 0
    threads: int = 0


@dataclass(frozen=True)
class ClusterStatistics:
    """layer_calls: MoE layers sent out; round_trip_ms: mean wall time of a layer's calls
    (submit to the last answer); overhead_ms: its mean excess over the slowest owner's own
    time (serialization, scheduling, network); bytes_sent / bytes_received: array bytes over
    all owners; owners: OwnerStatistics each. graph_calls: the layer calls that went through
    the compiled graph (the rest were plain actor calls); graph: its state, "off" (not asked
    for), "waiting" (built after GRAPH_AFTER small calls), "building", "ready", or
    "failed: <why>" (plain calls only). graph_overhead_ms / plain_overhead_ms: the moving
    mean overhead of the small calls by each transport (what "auto" picks by; 0: none yet).
    graph_teardowns: healthy graphs torn down, idle for ClusterExperts.graph_idle seconds or
    measured slower than plain calls by "auto" (see GRAPH_IDLE)."""

    layer_calls: int
    round_trip_ms: float
    overhead_ms: float
    bytes_sent: int
    bytes_received: int
    owners: tuple[OwnerStatistics, ...] = field(default=())
    graph_calls: int = 0
    graph: str = "off"
    graph_overhead_ms: float = 0.0
    plain_overhead_ms: float = 0.0
    graph_teardowns: int = 0


class _Owner:
    """The coordinator's record of one owner: its actor handle and figures."""

    def __init__(self, index: int, handle: Any, node_id: str, node: str, path: str) -> None:
        self.index, self.handle, self.node_id, self.node, self.path = (
            index, handle, node_id, node, path,
        )  # fmt: skip
        self.pid = self.threads = 0
        self.records = 0
        self.calls = self.errors = self.restarts = 0
        self.seconds = self.max_seconds = self.last_seconds = self.busy_seconds = 0.0
        self.bytes_sent = self.bytes_received = 0
        self.counts: dict[str, Any] = {}
        self.down = False


def _owner_actor_class() -> Any:
    """The Ray actor class around ExpertOwner (made on first use: importing this module must
    not import ray before a cluster is asked for)."""
    import ray

    @ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
    class ExpertOwnerActor:
        def __init__(self, path: str, options: EngineOptions, pad: int) -> None:
            self.owner = ExpertOwner(path, options, pad)
            self.loop: asyncio.AbstractEventLoop | None = None

        async def open(self) -> dict[str, Any]:
            self.loop = asyncio.get_running_loop()  # the loop ffn_graph hands its work to
            _numpy_channels()
            return await self.owner.open()

        def ffn_graph(self, call: tuple[int, list | None, Any] | None) -> Any:
            """The compiled graph's node (sync: Ray runs it on its _ray_system thread).
            call: None (nothing for this owner this layer), (layer, parts, predicted) as
            ffn, or (layer, None, (next layer, experts)) to prefetch only. Returns None,
            ffn's (outs, stamps, counts) with stamps[0] and [3] taken on this thread, or the
            str of the error it raised (a value, so the graph itself stays healthy)."""
            t_in = time.perf_counter()
            if call is None:
                return None
            if self.loop is None:
                return "the owner was not opened before the compiled graph ran"
            layer, parts, predicted = call
            work = self.prefetch(*predicted) if parts is None else self.ffn(layer, parts, predicted)
            try:
                answer = asyncio.run_coroutine_threadsafe(work, self.loop).result()
            except Exception as exc:  # the owner's own error, sent back as a value
                return str(exc) or type(exc).__name__
            if answer is None:
                return None
            outs, stamps, counts = answer
            return outs, (t_in, stamps[1], stamps[2], time.perf_counter()), counts

        async def ffn(self, layer: int, parts: list, predicted: Any) -> Any:
            """ExpertOwner.ffn's (outs, counts or None) with the stamps (time.perf_counter()
            on arrival in the actor, start, end, departure) between them."""
            t0 = time.perf_counter()
            outs, counts = await self.owner.ffn(layer, parts, predicted)
            t1 = time.perf_counter()
            return outs, (t0, t0, t1, t1), counts or None

        async def prefetch(self, layer: int, experts: list[int]) -> None:
            await self.owner.prefetch(layer, experts)

        async def aclose(self) -> None:
            await self.owner.aclose()

    return ExpertOwnerActor


class _Graph:
    """One Ray Compiled Graph over every owner's ffn_graph (InputNode -> one node per owner
    -> MultiOutputNode), compiled, warmed up, executed and torn down on `thread` (one
    ThreadPoolExecutor worker shared by every graph of a ClusterExperts, so a graph's teardown
    ends before the next one compiles: an actor runs one compiled graph at a time).
    buffer_nbytes: each channel's buffer; calls whose arrays would not fit go as plain calls
    (a cross-node channel is never resized)."""

    def __init__(self, handles: list[Any], buffer_nbytes: int, thread: ThreadPoolExecutor) -> None:
        self.buffer_nbytes, self.thread = buffer_nbytes, thread
        self.compiled: Any = None
        self.ready = self.busy = False
        self.error: str | None = None
        self.executions = 0
        self.stamps = (0.0, 0.0)  # the last execution's perf_counter: execute(), results got
        thread.submit(self._compile, handles)

    @property
    def state(self) -> str:
        return f"failed: {self.error}" if self.error else "ready" if self.ready else "building"

    def _compile(self, handles: list[Any]) -> None:
        try:
            from ray.dag import InputNode, MultiOutputNode

            _numpy_channels()
            with InputNode() as inp:
                dag = MultiOutputNode([h.ffn_graph.bind(inp[o]) for o, h in enumerate(handles)])
            self.compiled = dag.experimental_compile(_buffer_size_bytes=self.buffer_nbytes)
            self._execute([None] * len(handles), GRAPH_WARMUP_TIMEOUT)  # 3-17 s here
            self.ready = True
        except Exception as exc:  # plain actor calls serve on
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._teardown()

    def _execute(self, calls: list[Any], timeout: float) -> list[Any]:
        """One execution (on the graph's thread): each owner's answer, its arrays copied out
        of the channel (a zero-copy array still alive blocks the next execution)."""
        import ray

        t_exec = time.perf_counter()
        refs = self.compiled.execute(*calls)
        answers = ray.get(refs, timeout=timeout)
        t_got = time.perf_counter()
        self.executions += 1
        out = []
        for a in answers:
            if isinstance(a, tuple):
                outs, stamps, counts = a
                a = ([np.array(x, copy=True) for x in outs], stamps, counts)
            out.append(a)
        del answers
        self.stamps = (t_exec, t_got)
        return out

    async def run(self, calls: list[Any], timeout: float = GRAPH_TIMEOUT) -> list[Any]:
        """Execute once with each owner's call (None: nothing for it); each owner's answer
        within `timeout` seconds. Raises Ray's errors (an owner died, a timeout): the graph
        is then unusable."""
        self.busy = True
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.thread, self._execute, calls, timeout)
        finally:
            self.busy = False

    def _teardown(self) -> None:
        compiled, self.compiled = self.compiled, None
        self.ready = False
        if compiled is not None:
            with contextlib.suppress(Exception):  # a graph an owner's death broke
                compiled.teardown()

    def close(self) -> Any:
        """Tear the graph down on its thread (a concurrent.futures.Future)."""
        self.ready = False
        return self.thread.submit(self._teardown)


class ClusterExperts:
    """The expert-FFN provider over Ray actors (see the module docstring); made by
    open_cluster_experts(). `shard`: int32 [num_layers, num_experts] owner of each record."""

    prefetch: bool

    def __init__(
        self,
        owners: list[_Owner],
        shard: np.ndarray,
        prefetch: bool,
        ray_owned: bool,
        spawn: Any,
        graph_buffer_nbytes: int = 0,
    ) -> None:
        self._owners, self.shard, self.prefetch = owners, shard, prefetch
        self._ray_owned, self._spawn = ray_owned, spawn
        for o in owners:
            o.records = int((shard == o.index).sum())
        self.layer_calls = self.graph_calls = 0
        self.round_trip_seconds = self.overhead_seconds = 0.0
        self.restart_timeout = RESTART_TIMEOUT
        self.graph_timeout = GRAPH_TIMEOUT  # seconds a graph execution may take, then it fails
        self._closed = False
        # the compiled graph (0: plain actor calls only), rebuilt after an owner comes back
        self.graph_buffer_nbytes = graph_buffer_nbytes
        self._graph_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="colibri-cgraph")
            if graph_buffer_nbytes
            else None
        )
        self._graph: _Graph | None = None
        self._graph_error: str | None = None
        # "auto": each small layer call by the transport whose mean overhead (wall time over
        # the slowest owner's own) is lower, the other tried every PROBE_EVERY calls;
        # "graph": the graph whenever it is ready; "plain": plain calls only
        self.transport = "auto"
        self._cost: dict[str, float] = {}  # transport: moving mean overhead, seconds
        self._legs: dict[str, dict[str, float]] = {}  # breakdown(): summed seconds by leg
        self._graph_calls_at_clear = 0
        self._since_probe = 0
        self._small_calls = 0  # small layer calls gone plain while there was no graph
        self._build_after = GRAPH_AFTER  # ... before the graph is built (again)
        self.graph_idle = GRAPH_IDLE  # seconds without an execution before it is torn down
        self._graph_losses = 0  # probes in a row that found the graph costlier ("auto")
        self._last_graph_use = 0.0  # time.monotonic() of the watched graph's last execution
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_graph: _Graph | None = None  # the graph the idle timer watches
        self.graph_teardowns = 0  # graphs torn down for being idle or slower

    def _build_graph(self) -> None:
        """Start building the graph (in the background) unless there is one, it is off, or
        an owner is down."""
        if (
            self._graph is None
            and self._graph_thread is not None
            and not self._closed
            and not any(o.down for o in self._owners)
        ):
            self._graph = _Graph(self.handles(), self.graph_buffer_nbytes, self._graph_thread)

    def _drop_graph(self) -> None:
        if self._graph is not None:
            self._graph_error = self._graph.error
            self._graph.close()
            self._graph = None

    def _retire_graph(self, build_after: int) -> None:
        """Tear a healthy graph down (idle, or slower than plain calls): its channels' poll
        threads stop; a new one is built after `build_after` more small calls."""
        self._drop_graph()
        self.graph_teardowns += 1
        self._small_calls, self._build_after, self._graph_losses = 0, build_after, 0
        self._cost.pop("graph", None)

    def _watch_idle(self) -> None:
        """Arm the idle check of the ready graph (on the running loop), once per graph."""
        graph = self._graph
        if graph is None or self.graph_idle == float("inf"):
            return
        if self._idle_timer is not None:
            if self._idle_graph is graph:
                return
            self._idle_timer.cancel()  # it watched a graph gone since
        self._idle_graph, self._last_graph_use = graph, time.monotonic()
        loop = asyncio.get_running_loop()
        self._idle_timer = loop.call_later(self.graph_idle, self._idle_check, graph)

    def _idle_check(self, graph: _Graph) -> None:
        self._idle_timer = self._idle_graph = None
        if graph is not self._graph or not graph.ready or self._closed:
            return
        if self.graph_idle == float("inf"):
            return
        idle = time.monotonic() - self._last_graph_use
        if idle >= self.graph_idle and not graph.busy:
            self._retire_graph(GRAPH_AFTER)
            return
        self._idle_graph = graph
        loop = asyncio.get_running_loop()
        wait = max(self.graph_idle - idle, 0.05)
        self._idle_timer = loop.call_later(wait, self._idle_check, graph)

    async def wait_graph(self, timeout: float = GRAPH_WARMUP_TIMEOUT + 60) -> str:
        """Build the compiled graph now if it is not (GRAPH_AFTER not reached yet) and wait
        until it is ready (or failed); its state (see ClusterStatistics.graph). Layers are
        served by plain calls meanwhile."""
        self._build_graph()
        deadline = time.monotonic() + timeout
        while self._graph is not None and self._graph.state == "building":
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        return self.graph_state()

    def graph_state(self) -> str:
        if self._graph is not None:
            return self._graph.state
        if self._graph_thread is None:
            return "off"
        return f"failed: {self._graph_error}" if self._graph_error else "waiting"

    @property
    def num_owners(self) -> int:
        return len(self._owners)

    def handles(self) -> list[Any]:
        """The owners' Ray actor handles, by owner index (tests kill them)."""
        return [o.handle for o in self._owners]

    async def ffn(
        self,
        layer: int,
        routed: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
        predicted: tuple[int, list[int]] | None,
    ) -> list[np.ndarray]:
        """Per entry (h f32 [n, d_model], ids int [n, top_k], weights f32 [n, top_k]) of
        routed: f32 [n, top_k, d_model], slot [t, j] = weights[t, j] * FFN_ids[t, j](h[t]),
        computed by the owners of layer's experts in parallel. predicted: (next MoE layer,
        expert ids), sent to their owners to prefetch. Raises ColibriError when an owner
        fails (naming it and its node) or does not come back within restart_timeout."""
        if self._closed:
            raise ColibriError("the cluster's expert owners are closed")
        await self._revive()
        own = self.shard[layer]
        slots = [np.zeros((*ids.shape, h.shape[1]), dtype=np.float32) for h, ids, _ in routed]
        work: dict[int, list[tuple[int, np.ndarray, tuple[np.ndarray, ...]]]] = {}
        for s, (h, ids, w) in enumerate(routed):
            who = own[ids]
            for o in np.unique(who).tolist():
                mask = who == o
                rows = np.flatnonzero(mask.any(axis=1))
                part = (
                    np.ascontiguousarray(h[rows], dtype=np.float32),
                    np.where(mask[rows], ids[rows], -1).astype(np.int32),
                    np.ascontiguousarray(w[rows], dtype=np.float32),
                )
                work.setdefault(o, []).append((s, mask, part))
        guesses: dict[int, tuple[int, list[int]]] = {}
        if predicted is not None:
            nxt, experts = predicted
            ex = np.asarray(experts, dtype=np.int64)
            by = self.shard[nxt][ex]
            guesses = {o: (nxt, ex[by == o].tolist()) for o in np.unique(by).tolist()}
        parts = {o: [p for _, _, p in items] for o, items in work.items()}
        graph = self._graph
        t0 = time.perf_counter()
        usable = graph is not None and graph.ready and not graph.busy and self._fits(parts, graph)
        if graph is not None and graph.ready:
            self._watch_idle()
        via = "graph" if usable and self._pick_graph() else "plain"
        if via == "graph":
            self._last_graph_use = time.monotonic()
            results: list[Any] = await self._graph_call(graph, layer, parts, guesses)
        else:
            # every owner's call is sent before the first await (this coroutine's first step):
            # the coordinator's own work for the layer starts after them (Pipeline)
            t0 = time.perf_counter()
            handles = {o: self._owners[o].handle for o in work}
            refs = {o: h.ffn.remote(layer, parts[o], guesses.get(o)) for o, h in handles.items()}
            for o, guess in guesses.items():
                if o not in work and not self._owners[o].down:
                    self._owners[o].handle.prefetch.remote(*guess)  # nothing to wait for
            calls = [self._call(o, layer, t0, ref, parts[o]) for o, ref in refs.items()]
            results = await asyncio.gather(*calls, return_exceptions=True)
            error = next((r for r in results if isinstance(r, BaseException)), None)
            if error is not None:
                raise error
            small = all(sum(len(h) for h, _, _ in ps) <= GRAPH_ROWS for ps in parts.values())
            if (
                graph is None
                and self._graph_thread is not None
                and small
                and self.transport != "plain"
            ):
                self._small_calls += 1
                if self._small_calls >= self._build_after:
                    self._build_graph()
        wall = time.perf_counter() - t0
        busy = 0.0
        for items, (outs, call_seconds) in zip(work.values(), results, strict=True):
            busy = max(busy, call_seconds)
            for (s, mask, _), out in zip(items, outs, strict=True):
                rr, ss = np.nonzero(mask)
                slots[s][rr, ss] = out
        self.layer_calls += 1
        self.round_trip_seconds += wall
        self.overhead_seconds += max(0.0, wall - busy)
        if usable:  # a call either transport could have made: its cost, for _pick_graph
            old = self._cost.get(via)
            over = max(0.0, wall - busy)
            self._cost[via] = over if old is None else old + COST_ALPHA * (over - old)
        return slots

    def _pick_graph(self) -> bool:
        """Whether a small layer call goes through the (ready) graph; see `transport`."""
        if self.transport != "auto":
            return self.transport == "graph"
        graph, plain = self._cost.get("graph"), self._cost.get("plain")
        if graph is None or plain is None:
            return graph is None  # measure each once
        if graph <= plain:
            self._graph_losses = 0
        self._since_probe += 1
        if self._since_probe >= PROBE_EVERY:  # try the slower one again
            self._since_probe = 0
            if graph > plain:
                self._graph_losses += 1
                if self._graph_losses >= GRAPH_LOSSES:  # it stays slower: stop its spinning
                    self._retire_graph(GRAPH_RETRY)
                    return False
            return graph > plain
        return graph <= plain

    def _fits(self, parts: dict[int, list[tuple[np.ndarray, ...]]], graph: _Graph) -> bool:
        """Whether every owner's share goes through the graph: at most GRAPH_ROWS rows, its
        arrays (and the outputs coming back) well inside the channel buffer."""
        room = graph.buffer_nbytes - (16 << 10)  # pickle framing, the counts dict
        for ps in parts.values():
            if sum(len(h) for h, _, _ in ps) > GRAPH_ROWS:
                return False
            sent = sum(a.nbytes + 256 for p in ps for a in p)
            back = sum(int((ids >= 0).sum()) * h.shape[1] * 4 + 256 for h, ids, _ in ps)
            if max(sent, back) > room:
                return False
        return True

    async def _graph_call(
        self,
        graph: _Graph,
        layer: int,
        parts: dict[int, list[tuple[np.ndarray, ...]]],
        guesses: dict[int, tuple[int, list[int]]],
    ) -> list[tuple[list[np.ndarray], float]]:
        """One compiled-graph execution: the owners of `parts` compute, the others only
        prefetch their guesses. The answers of parts' owners, in parts' order."""
        calls: list[Any] = []
        for o in range(len(self._owners)):
            if o in parts:
                calls.append((layer, parts[o], guesses.get(o)))
            elif o in guesses:
                calls.append((layer, None, guesses[o]))
            else:
                calls.append(None)
        t0 = time.perf_counter()
        try:
            answers = await graph.run(calls, self.graph_timeout)
        except Exception as exc:
            self._drop_graph()
            owner = await self._dead_owner(exc)
            if owner is None:
                raise ColibriError(
                    f"the compiled graph of the expert owners failed during MoE layer {layer} "
                    f"({type(exc).__name__}): this request is failed; the next one uses plain "
                    "calls until it is rebuilt"
                ) from None
            owner.errors += 1
            owner.down = True
            raise ColibriError(
                f"expert owner {owner.index} on node {owner.node} failed during MoE layer "
                f"{layer} ({type(exc).__name__}): this request is failed; Ray restarts the "
                "owner and the next request waits for it"
            ) from None
        t1 = time.perf_counter()
        self.graph_calls += 1
        t_exec, t_got = graph.stamps
        self._leg("graph", "submit", t_exec - t0)  # the loop's hand-off to the graph thread
        self._leg("graph", "wake", t1 - t_got)  # the graph thread's back to the loop
        results = []
        for o in parts:
            answer = answers[o]
            owner = self._owners[o]
            if isinstance(answer, str):
                owner.errors += 1
                raise ColibriError(f"expert owner {o} on node {owner.node}: {answer}")
            outs, stamps, counts = answer
            busy = self._account(
                "graph", owner, t_exec, t_got, parts[o], outs, stamps, counts, t1 - t0
            )  # fmt: skip
            results.append((outs, busy))
        return results

    async def _dead_owner(self, exc: BaseException) -> _Owner | None:
        """The owner whose actor a compiled-graph error names (RayActorError.actor_id), or,
        when it names none, the first that does not answer or answers from a new process;
        None if all are well."""
        actor_id = getattr(exc, "actor_id", None)
        for owner in self._owners:
            if actor_id and owner.handle._actor_id.hex() == actor_id:
                return owner
        refs = [o.handle.open.remote() for o in self._owners]
        for owner, ref in zip(self._owners, refs, strict=True):
            try:
                info = await asyncio.wait_for(ref, 10)
            except Exception:
                return owner
            if info["pid"] != owner.pid:
                return owner
        return None

    async def _call(
        self, o: int, layer: int, t0: float, ref: Any, parts: list[tuple[np.ndarray, ...]]
    ) -> tuple[list[np.ndarray], float]:
        """The answer of owner o's plain ffn call `ref` (sent at t0) for MoE layer `layer`:
        (outs, its busy seconds). Raises ColibriError naming the owner when it failed."""
        import ray

        owner = self._owners[o]
        try:
            outs, stamps, counts = await ref
        except _gone(ray) as exc:
            owner.errors += 1
            owner.down = True
            self._drop_graph()
            raise ColibriError(
                f"expert owner {o} on node {owner.node} failed during MoE layer {layer} "
                f"({type(exc).__name__}): this request is failed; Ray restarts the owner and "
                "the next request waits for it"
            ) from None
        except ray.exceptions.RayTaskError as exc:
            owner.errors += 1
            raise ColibriError(f"expert owner {o} on node {owner.node}: {exc.cause}") from None
        busy = self._account(
            "plain", owner, t0, time.perf_counter(), parts, outs, stamps, counts
        )  # fmt: skip
        return outs, busy

    def _account(
        self,
        via: str,
        owner: _Owner,
        t_send: float,
        t_recv: float,
        parts: list[tuple[np.ndarray, ...]],
        outs: list[np.ndarray],
        stamps: tuple[float, float, float, float],
        counts: dict[str, Any] | None,
        round_trip: float | None = None,
    ) -> float:
        """Count one answered call of `owner` (sent at t_send, its answer in at t_recv,
        time.perf_counter(); stamps: the owner's arrival, start, end, departure; round_trip:
        the coordinator's wall time for it, default t_recv - t_send). Returns the owner's own
        busy time, seconds."""
        dt = t_recv - t_send if round_trip is None else round_trip
        owner.calls += 1
        owner.seconds += dt
        owner.last_seconds = dt
        owner.max_seconds = max(owner.max_seconds, dt)
        arrive, start, end, leave = stamps
        busy = end - start
        owner.busy_seconds += busy
        # the legs (one machine: the owner's perf_counter is this process's clock, so
        # they are meaningful only when the owner runs on the coordinator's host)
        for key in (via, f"{via}/{owner.index}"):
            self._leg(key, "to_owner", arrive - t_send, count=True)
            self._leg(key, "owner_wake", start - arrive)
            self._leg(key, "owner_busy", busy)
            self._leg(key, "owner_return", leave - end)
            self._leg(key, "from_owner", t_recv - leave)
        owner.bytes_sent += sum(a.nbytes for p in parts for a in p)
        owner.bytes_received += sum(a.nbytes for a in outs)
        if counts:
            owner.counts = counts
            owner.pid = counts.get("pid", owner.pid)
        return busy

    def _leg(self, via: str, name: str, seconds: float, count: bool = False) -> None:
        legs = self._legs.setdefault(via, {"calls": 0})
        legs[name] = legs.get(name, 0.0) + seconds
        if count:
            legs["calls"] += 1

    def clear_breakdown(self) -> None:
        """Start breakdown()'s sums again."""
        self._legs.clear()
        self._graph_calls_at_clear = self.graph_calls

    def breakdown(self) -> dict[str, dict[str, float]]:
        """Where an owner call's time went, by transport ("graph", "plain") and by transport
        and owner ("graph/0", ...): mean ms per owner call of each leg, with
        time.perf_counter() stamps taken on both sides (so only meaningful with owners on
        the coordinator's machine, as bench's local cluster): to_owner (submit to the
        actor's arrival: serialisation, Ray's channel or RPC, scheduling), owner_wake (the
        graph's system thread to the actor's event loop), owner_busy (the owner's ffn: reads
        and kernels), owner_return (back to the system thread), from_owner (its departure to
        the answer in the coordinator: serialisation, channel, deserialisation); for the
        graph also submit (the coordinator's loop to its graph thread) and wake (the graph
        thread back to the loop), per layer call. "calls": owner calls counted."""
        out = {}
        for via, legs in self._legs.items():
            n = max(legs["calls"], 1)
            layers = max(self.graph_calls - self._graph_calls_at_clear, 1)
            out[via] = {
                k: (v if k == "calls" else 1000 * v / (layers if k in ("submit", "wake") else n))
                for k, v in legs.items()
            }
        return out

    async def _revive(self) -> None:
        """Wait for every owner that failed to answer again (Ray restarts its actor); an
        actor dead for good (its node left) is started again on another node."""
        import ray

        for owner in self._owners:
            if not owner.down:
                continue
            deadline = time.monotonic() + self.restart_timeout
            while True:
                try:
                    info = await owner.handle.open.remote()
                    break
                except _gone(ray) as exc:
                    gone = owner.node_id not in {n["NodeID"] for n in _alive_nodes()}
                    dead = (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnschedulableError)
                    if isinstance(exc, dead) or gone:
                        # dead for good, or its node left: start it on a node still there
                        with contextlib.suppress(Exception):
                            ray.kill(owner.handle, no_restart=True)
                        owner.handle, owner.node_id, owner.node = self._spawn(owner.path, None)
                except ray.exceptions.RayTaskError as exc:
                    raise ColibriError(
                        f"expert owner {owner.index} on node {owner.node}: {exc.cause}"
                    ) from None
                if time.monotonic() > deadline:
                    raise ColibriError(
                        f"expert owner {owner.index} on node {owner.node} did not come back "
                        f"within {self.restart_timeout:.0f} s after failing"
                    )
                await asyncio.sleep(0.1)
            owner.pid, owner.threads = info["pid"], info.get("threads", 0)
            owner.restarts += 1
            owner.down = False
            self._small_calls = 0  # a new graph over the owners as they are now, later
            self._build_after = GRAPH_AFTER

    def counts(self) -> dict[str, Any]:
        """The owners' expert cache counts (ExpertCache.counts() keys) summed, as each owner
        last sent them (every owner.COUNTS_EVERY seconds at most)."""
        total: dict[str, Any] = {}
        for owner in self._owners:
            for k, v in owner.counts.items():
                if k != "pid":
                    total[k] = total.get(k, 0) + v
        return total

    def statistics(self) -> ClusterStatistics:
        """A snapshot of the figures (ClusterStatistics); never blocks."""
        n = max(self.layer_calls, 1)
        owners = tuple(
            OwnerStatistics(
                index=o.index,
                node=o.node,
                node_id=o.node_id,
                pid=o.pid,
                records=o.records,
                calls=o.calls,
                errors=o.errors,
                restarts=o.restarts,
                mean_ms=1000 * o.seconds / max(o.calls, 1),
                max_ms=1000 * o.max_seconds,
                last_ms=1000 * o.last_seconds,
                busy_ms=1000 * o.busy_seconds / max(o.calls, 1),
                bytes_sent=o.bytes_sent,
                bytes_received=o.bytes_received,
                hits=int(o.counts.get("hits", 0)),
                misses=int(o.counts.get("misses", 0)),
                bytes_read=int(o.counts.get("bytes_read", 0)),
                prefetch_issued=int(o.counts.get("prefetch_issued", 0)),
                prefetch_useful_reads=int(o.counts.get("prefetch_useful_reads", 0)),
                prefetch_wasted_reads=int(o.counts.get("prefetch_wasted_reads", 0)),
                threads=o.threads,
            )
            for o in self._owners
        )
        return ClusterStatistics(
            layer_calls=self.layer_calls,
            round_trip_ms=1000 * self.round_trip_seconds / n,
            overhead_ms=1000 * self.overhead_seconds / n,
            bytes_sent=sum(o.bytes_sent for o in owners),
            bytes_received=sum(o.bytes_received for o in owners),
            owners=owners,
            graph_calls=self.graph_calls,
            graph=self.graph_state(),
            graph_overhead_ms=1000 * self._cost.get("graph", 0.0),
            plain_overhead_ms=1000 * self._cost.get("plain", 0.0),
            graph_teardowns=self.graph_teardowns,
        )

    async def aclose(self) -> None:
        """Close the owners' IO stacks, end their actors, and disconnect from Ray if
        open_cluster_experts connected."""
        if self._closed:
            return
        self._closed = True
        import ray

        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = self._idle_graph = None
        if self._graph is not None:
            done = self._graph.close()
            self._graph = None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.wrap_future(done), 60)
        if self._graph_thread is not None:
            self._graph_thread.shutdown(wait=False)
        for owner in self._owners:
            with contextlib.suppress(Exception):  # a dead owner has nothing left to close
                await asyncio.wait_for(owner.handle.aclose.remote(), 10)
            ray.kill(owner.handle, no_restart=True)
        if self._ray_owned:
            ray.shutdown()


def _numpy_channels() -> None:
    """Tell this process's compiled-graph channels that no torch tensor crosses them (only
    numpy arrays and Python values do). Where torch is installed, Ray otherwise imports it
    in every graph process on the first execution (seconds of CPU with the GIL held, while
    that owner serves plain calls) and enters a torch device context around each channel
    read and write of every execution (ray.dag.compiled_dag_node._device_context_manager);
    without torch installed this is already Ray's path. A private field: if a Ray version
    lacks it, nothing changes."""
    with contextlib.suppress(Exception):
        from ray.experimental.channel.common import ChannelContext

        ctx = ChannelContext.get_current()
        if hasattr(ctx, "_torch_available"):
            ctx._torch_available = False


def _gone(ray: Any) -> tuple[type[BaseException], ...]:
    """The errors of an owner that died, restarts, or whose node left (no answer to wait for)."""
    return (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError)


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])


def open_cluster_experts(
    store: Any,
    options: EngineOptions,
    *,
    pad: int = 1,
    shard: np.ndarray | None = None,
    node_stores: Sequence[str] | None = None,
    hosts: Sequence[str] | None = None,
    popularity: Mapping[tuple[int, int], float] | None = None,
) -> ClusterExperts:
    """Connect to the Ray cluster at options.cluster ("auto": the running one; a
    "host:port"; or an address already joined by ray.init), start the expert owners and wait
    until each has opened its store.

    store: the coordinator's Store (its config and record size). options: the coordinator's
    EngineOptions, which the owners share (ExpertOwner: budget is each owner's expert cache
    bytes, None: every record of its store that fits in half its node's memory; threads and
    activations its kernels; io, policy, verify, prefetch, queue_depth its IO stack;
    cluster_graph: send small layer calls, decode's, through a Ray Compiled Graph built in
    the background, False: plain actor calls only, see the module docstring). pad: the
    coordinator's Model.pad. Owners: options.owners_per_node on each alive node, or one per
    entry of node_stores (each owner's store directory on its node; default: store.path on
    every node), owner k on the node whose IP is hosts[k] when given, else on the alive nodes
    in turn (Ray node id order). shard: the shard map (placement.py); default place() by
    `popularity` over the owners.
    Raises ColibriError when Ray is not installed, the cluster cannot be reached, or an
    owner cannot open its store.
    """
    try:
        import ray
    except ImportError:
        raise ColibriError(
            "--cluster needs Ray: pip install 'colibri[cluster]' (or pip install ray)"
        ) from None
    address = options.cluster
    ray_owned = not ray.is_initialized()
    if ray_owned:
        try:
            ray.init(
                address=address,
                log_to_driver=False,
                logging_level="ERROR",
                configure_logging=True,
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ColibriError(
                f"--cluster {address}: cannot join the Ray cluster ({exc})"
            ) from None
    nodes = _alive_nodes()
    per_node = options.owners_per_node
    paths = list(node_stores) if node_stores else [str(store.path)] * (len(nodes) * per_node)
    actor = _owner_actor_class()

    def spawn(path: str, node: dict[str, Any] | None) -> tuple[Any, str, str]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if node is None:  # anywhere alive
            node = _alive_nodes()[0]
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=True)
        else:
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        handle = actor.options(scheduling_strategy=strategy).remote(path, options, pad)
        return handle, node["NodeID"], node["NodeManagerAddress"]

    owners = []
    for o, path in enumerate(paths):
        node = nodes[o % len(nodes)]
        if hosts is not None:
            node = next((n for n in nodes if n["NodeManagerAddress"] == hosts[o]), None)
            if node is None:
                for w in owners:
                    ray.kill(w.handle, no_restart=True)
                if ray_owned:
                    ray.shutdown()
                raise ColibriError(
                    f"--shard-map: owner {o}'s host {hosts[o]} is not an alive node of the "
                    f"cluster ({', '.join(sorted({n['NodeManagerAddress'] for n in nodes}))})"
                )
        owners.append(_Owner(o, *spawn(path, node), path))
    from colibri.registry import model_spec

    spec_layers = len(model_spec(store.config).layers)
    if shard is None:
        shard = place(
            store.moe_layers,
            spec_layers,
            store.num_experts,
            len(owners),
            store.layout.record_nbytes,
            popularity=popularity,
        )
    try:
        infos = ray.get([o.handle.open.remote() for o in owners])
    except ray.exceptions.RayTaskError as exc:
        for o in owners:
            ray.kill(o.handle, no_restart=True)
        if ray_owned:
            ray.shutdown()
        raise ColibriError(f"--cluster: an expert owner cannot start: {exc.cause}") from None
    for o, info in zip(owners, infos, strict=True):
        o.pid, o.threads = info["pid"], info.get("threads", 0)
    spec = model_spec(store.config)
    # a channel holds GRAPH_ROWS rows in, their top_k outputs back, and the framing
    nbytes = GRAPH_ROWS * (spec.moe.router.top_k + 1) * spec.d_model * 4 + (256 << 10)
    nbytes = nbytes if options.cluster_graph else 0
    return ClusterExperts(
        owners, shard, options.prefetch, ray_owned, spawn, graph_buffer_nbytes=nbytes
    )
