"""Experts sharded across a local multi-node Ray cluster (issue 19): logits bit-identical to
the single-process engine for every family's tiny model, whatever the shard map (1, 2, 3
owners, balanced or random); an owner killed mid-generation fails that request with a clear
error, Ray restarts it and the next request gets the single-process tokens again."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from colibri.cluster.placement import place, save_shard_map
from colibri.convert import convert
from colibri.engine import open_engine
from colibri.errors import ColibriError
from colibri.io.format import open_store
from colibri.registry import model_spec
from tests import hf_models

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

PROMPT = list(range(3, 19))
N_TOKENS = 8


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine (one CPU each), joined by this process (yields the
    ray.cluster_utils.Cluster; tests pass cluster.address)."""
    c = cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
    yield c
    ray.shutdown()
    c.shutdown()


async def _greedy(path, n=N_TOKENS, **options):
    """(greedy tokens, stacked logits f32 [n + 1, vocab], engine statistics)."""
    async with open_engine(path, threads=1, **options) as engine:
        seq = engine.new_sequence()
        logits = await engine.forward(seq, PROMPT)
        out, rows = [], [logits]
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            logits = await engine.forward(seq, [out[-1]])
            rows.append(logits)
        return out, np.stack(rows), engine.statistics()


def _store(root, case: str, seed: int = 3):
    model = hf_models.build(case, seed=seed)
    out = root / "store"
    convert(hf_models.save(model, root / "hf"), out, quant="q4_0", dense_quant="q8_0")
    return out


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return _store(tmp_path_factory.mktemp("cluster-mixtral"), "mixtral", seed=11)


@pytest.mark.parametrize("case", hf_models.BASE_CASES)
def test_every_family_is_bit_identical_on_two_nodes(cluster, tmp_path, case):
    store = _store(tmp_path, case)
    tokens, logits, _ = asyncio.run(_greedy(store))
    c_tokens, c_logits, st = asyncio.run(_greedy(store, cluster=cluster.address, n=4))
    assert c_tokens == tokens[:4]
    assert np.array_equal(c_logits, logits[:5])  # every bit, not just the argmax
    owners = st.cluster.owners
    assert len({o.node_id for o in owners}) == 2  # one owner on each node
    assert all(o.calls > 0 and o.bytes_received > 0 for o in owners)
    assert st.cluster.layer_calls == 5 * len(open_store(store).moe_layers)


@pytest.mark.parametrize("owners", ["one", "two", "three", "random"])
def test_any_shard_map_gives_the_same_logits(cluster, mixtral, tmp_path, owners):
    s = open_store(mixtral)
    layers, experts = len(model_spec(s.config).layers), s.num_experts
    n = {"one": 1, "two": 2, "three": 3, "random": 3}[owners]
    if owners == "random":
        shard = np.random.default_rng(0).integers(0, n, (layers, experts)).astype(np.int32)
    else:
        shard = place(s.moe_layers, layers, experts, n, s.layout.record_nbytes)
    path = tmp_path / "shards.json"
    save_shard_map(path, shard, [str(mixtral)] * n)
    tokens, logits, _ = asyncio.run(_greedy(mixtral, budget=None))
    c_tokens, c_logits, st = asyncio.run(
        _greedy(mixtral, cluster=cluster.address, shard_map=str(path))
    )
    assert c_tokens == tokens
    assert np.array_equal(c_logits, logits)
    assert len(st.cluster.owners) == n
    assert all(o.threads == 1 for o in st.cluster.owners)  # its node's CPU resource (1)
    held = [o.records for o in st.cluster.owners]
    assert sum(held) == len(s.records) and all(held)
    assert all(o.calls > 0 for o in st.cluster.owners)
    # the owners' caches served the routed experts (their counts reach the statistics)
    assert st.expert_hits + st.expert_misses > 0 and st.bytes_read > 0


def test_killed_owner_fails_the_request_and_the_next_succeeds(cluster, mixtral):
    async def main():
        async with open_engine(mixtral, threads=1, cluster=cluster.address) as engine:
            alone = [t.token_id async for t in engine.stream(PROMPT, max_tokens=6, temperature=0)]
            got = []
            with pytest.raises(ColibriError, match=r"expert owner 1 on node .* failed during MoE"):
                async for t in engine.stream(PROMPT, max_tokens=40, temperature=0, ignore_eos=True):
                    got.append(t.token_id)
                    if len(got) == 2:
                        ray.kill(engine.cluster.handles()[1], no_restart=False)
            assert 2 <= len(got) < 40
            again = [t.token_id async for t in engine.stream(PROMPT, max_tokens=6, temperature=0)]
            st = engine.statistics().cluster
            return alone, again, st

    alone, again, st = asyncio.run(main())
    assert again == alone
    owner = st.owners[1]
    assert owner.errors >= 1 and owner.restarts == 1
    assert owner.pid != 0 and st.owners[0].errors == 0


def test_shard_writes_per_node_stores_that_give_the_same_logits(cluster, mixtral, tmp_path):
    from colibri.cluster.shard import shard_store

    target = shard_store(mixtral, tmp_path / "shards", 2)
    s = open_store(mixtral)
    held = []
    for k in range(2):
        node = open_store(tmp_path / "shards" / f"node-{k}")
        assert node.manifest["shard"]["index"] == k and node.num_experts == s.num_experts
        node.verify_all()  # every copied record and dense tensor checks out
        held.append({(r.layer, r.expert) for r in node.records})
    assert held[0].isdisjoint(held[1])
    assert held[0] | held[1] == {(r.layer, r.expert) for r in s.records}
    tokens, logits, _ = asyncio.run(_greedy(mixtral))
    c_tokens, c_logits, st = asyncio.run(
        _greedy(mixtral, cluster=cluster.address, shard_map=str(target))
    )
    assert c_tokens == tokens and np.array_equal(c_logits, logits)
    assert [o.records for o in st.cluster.owners] == [len(h) for h in held]
    # a map that sends an owner experts its node store lacks: one clear error per request
    data = json.loads(target.read_text())
    data["owner"] = [[1 - o if o >= 0 else o for o in row] for row in data["owner"]]
    target.write_text(json.dumps(data))
    with pytest.raises(ColibriError, match=r"expert owner \d on node .*node-\d: expert \d+ of "):
        asyncio.run(_greedy(mixtral, cluster=cluster.address, shard_map=str(target)))


def test_owner_store_missing_is_one_clear_error(cluster, mixtral, tmp_path):
    s = open_store(mixtral)
    shard = place(s.moe_layers, len(model_spec(s.config).layers), s.num_experts, 2, 4096)
    path = tmp_path / "shards.json"
    save_shard_map(path, shard, [str(mixtral), str(tmp_path / "nowhere")])
    with pytest.raises(ColibriError, match=r"expert owner cannot start: .*nowhere"):
        asyncio.run(_greedy(mixtral, cluster=cluster.address, shard_map=str(path)))


def test_run_cli_with_cluster_prints_the_same_text(cluster):
    """`colibri run --cluster ADDRESS` (a separate process joining the cluster) prints the
    demo model's greedy text of a single-process run, and the per-owner statistics line."""

    def run(*extra):
        cmd = [sys.executable, "-m", "colibri", "run", "-n", "8", "--temperature", "0"]
        out = subprocess.run(
            [*cmd, "--threads", "1", *extra], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr
        return out

    alone, remote = run(), run("--cluster", cluster.address)
    assert remote.stdout == alone.stdout and len(alone.stdout) > len("The for statement")
    line = next(s for s in remote.stderr.splitlines() if s.startswith("[cluster:"))
    assert "owner 0 @" in line and "owner 1 @" in line and "0 errors" in line


def test_serve_with_cluster_answers_as_one_process(cluster):
    """The OpenAI-compatible server on a --cluster engine: concurrent chat completions equal
    the single-process engine's, and /metrics has one latency series per expert owner."""
    import concurrent.futures

    import httpx2 as httpx
    import openai

    from colibri import SyncEngine
    from tests.serve_util import DEMO, running_server

    chats = [[{"role": "user", "content": f"Write a for statement {i}"}] for i in range(3)]
    with SyncEngine(DEMO, io="threads", threads=1) as eng:
        expected = [eng.generate(c, max_tokens=8, temperature=0) for c in chats]
    opts = {"cluster": cluster.address, "threads": 1}
    with running_server(parallel=3, engine_options=opts) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=120, max_retries=0)

        def ask(c):
            r = oai.chat.completions.create(
                model="colibri-demo", messages=c, max_tokens=8, temperature=0
            )
            return r.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            assert list(pool.map(ask, chats)) == expected
        text = httpx.get(srv.url + "/metrics", timeout=10).text
    calls = [ln for ln in text.splitlines() if ln.startswith("colibri_cluster_owner_calls_total")]
    assert len(calls) == 2 and all(float(ln.rpartition(" ")[2]) > 0 for ln in calls)
    assert any(ln.startswith("colibri_cluster_owner_latency_ms{") for ln in text.splitlines())


def test_a_node_that_leaves_fails_the_request_and_its_owner_moves(cluster, mixtral):
    """A third node joins, gets an owner, and leaves mid-generation: that request fails
    naming the owner; the owner is started again on a node still there and the next request
    gets the single-process tokens."""
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()

    async def main():
        async with open_engine(mixtral, threads=1, cluster=cluster.address) as engine:
            handles = engine.cluster.handles()
            assert len(handles) == 3
            st = engine.statistics().cluster
            leaving = next(o.index for o in st.owners if o.node_id == node.node_id)
            alone = [t.token_id async for t in engine.stream(PROMPT, max_tokens=6, temperature=0)]
            got = []
            with pytest.raises(ColibriError, match=rf"expert owner {leaving} on node .* failed"):
                async for t in engine.stream(PROMPT, max_tokens=40, temperature=0, ignore_eos=True):
                    got.append(t.token_id)
                    if len(got) == 2:
                        cluster.remove_node(node)
            again = [t.token_id async for t in engine.stream(PROMPT, max_tokens=6, temperature=0)]
            return alone, again, engine.statistics().cluster, leaving

    alone, again, st, leaving = asyncio.run(main())
    assert again == alone
    moved = st.owners[leaving]
    assert moved.restarts == 1 and moved.node_id != node.node_id


def test_compiled_graph_serves_decode_bit_identical_and_is_rebuilt_after_a_kill(cluster, mixtral):
    """Decode's layer calls through the Ray Compiled Graph (once built) give the
    single-process logits bit for bit; an owner killed while the graph serves fails that
    request naming the owner, and the graph is built again over the restarted owner."""

    async def decode(engine, n=N_TOKENS):
        seq = engine.new_sequence()
        logits = await engine.forward(seq, PROMPT)
        out, rows = [], [logits]
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            logits = await engine.forward(seq, [out[-1]])
            rows.append(logits)
        return out, np.stack(rows)

    tokens, logits, _ = asyncio.run(_greedy(mixtral))
    moe_layers = len(open_store(mixtral).moe_layers)

    async def main():
        async with open_engine(mixtral, threads=1, cluster=cluster.address) as engine:
            experts = engine.cluster
            assert await experts.wait_graph() == "ready"
            experts.transport = "graph"  # every small call through the graph
            before = experts.statistics().graph_calls
            got = await decode(engine)
            graphed = experts.statistics().graph_calls - before
            experts.transport = "auto"  # each transport measured, the cheaper one taken
            auto = await decode(engine)
            st = experts.statistics()
            assert st.graph_overhead_ms > 0 and st.plain_overhead_ms > 0
            experts.transport = "graph"
            with pytest.raises(ColibriError, match=r"expert owner 1 on node .* failed during MoE"):
                seq = engine.new_sequence()
                await engine.forward(seq, PROMPT)
                for k in range(40):
                    if k == 2:
                        ray.kill(experts.handles()[1], no_restart=False)
                    await engine.forward(seq, [5])
            again = await decode(engine)  # plain calls while the graph is rebuilt
            assert await experts.wait_graph() == "ready"
            before = experts.statistics().graph_calls
            rebuilt = await decode(engine)
            regraphed = experts.statistics().graph_calls - before
            # idle: torn down (its channels' poll threads stop); plain calls serve on
            experts.graph_idle = 0.5
            await asyncio.sleep(7)  # the check armed at GRAPH_IDLE (5 s) finds 0.5 s idle
            assert experts.graph_state() == "waiting"
            assert experts.statistics().graph_teardowns == 1
            idle = await decode(engine)
            assert experts.graph_state() == "waiting"  # not rebuilt before GRAPH_AFTER calls
            return got, auto, graphed, again, rebuilt, regraphed, idle

    (g_tokens, g_logits), auto, graphed, again, rebuilt, regraphed, idle = asyncio.run(main())
    assert idle[0] == tokens and np.array_equal(idle[1], logits)
    assert g_tokens == tokens and np.array_equal(g_logits, logits)
    assert auto[0] == tokens and np.array_equal(auto[1], logits)
    assert graphed >= N_TOKENS * moe_layers  # every decode step went through the graph
    assert again[0] == tokens and np.array_equal(again[1], logits)
    assert rebuilt[0] == tokens and np.array_equal(rebuilt[1], logits)
    assert regraphed >= N_TOKENS * moe_layers


def test_plain_actor_calls_when_the_graph_is_off(cluster, mixtral):
    tokens, logits, _ = asyncio.run(_greedy(mixtral))
    c_tokens, c_logits, st = asyncio.run(
        _greedy(mixtral, cluster=cluster.address, cluster_graph=False)
    )
    assert c_tokens == tokens and np.array_equal(c_logits, logits)
    assert st.cluster.graph == "off" and st.cluster.graph_calls == 0
    assert st.cluster.layer_calls == (N_TOKENS + 1) * len(open_store(mixtral).moe_layers)


def test_a_node_that_leaves_while_the_graph_serves_fails_the_request_and_the_graph_is_rebuilt(
    cluster, mixtral
):
    """As above with decode going through the compiled graph: the node of one of its owners
    leaves mid-generation; that request fails naming the owner (within bounded waits), the
    next one gets the single-process tokens (plain calls, the owner started on a node still
    there), and a new graph over the owners as they are now serves bit-identical decode."""
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    tokens, logits, _ = asyncio.run(_greedy(mixtral))
    moe_layers = len(open_store(mixtral).moe_layers)

    async def decode(engine, n=N_TOKENS):
        seq = engine.new_sequence()
        out, rows = [], [await engine.forward(seq, PROMPT)]
        for _ in range(n):
            out.append(int(np.argmax(rows[-1])))
            rows.append(await engine.forward(seq, [out[-1]]))
        return out, np.stack(rows)

    async def main():
        async with open_engine(mixtral, threads=1, cluster=cluster.address) as engine:
            experts = engine.cluster
            experts.graph_timeout = experts.restart_timeout = 60.0  # bounded, well under CI's
            assert len(experts.handles()) == 3
            owners = experts.statistics().owners
            leaving = next(o.index for o in owners if o.node_id == node.node_id)
            assert await asyncio.wait_for(experts.wait_graph(), 240) == "ready"
            experts.transport = "graph"
            before = experts.statistics().graph_calls
            first = await decode(engine)
            assert experts.statistics().graph_calls - before >= N_TOKENS * moe_layers
            t0 = time.monotonic()
            with pytest.raises(ColibriError, match=rf"expert owner {leaving} on node .* failed"):
                seq = engine.new_sequence()
                await engine.forward(seq, PROMPT)
                for k in range(40):
                    if k == 2:
                        cluster.remove_node(node)
                    await engine.forward(seq, [5])
            failed_after = time.monotonic() - t0
            assert experts.graph_state() != "ready"  # the broken graph was dropped
            again = await decode(engine)  # plain calls; the owner comes back elsewhere
            assert await asyncio.wait_for(experts.wait_graph(), 240) == "ready"
            before = experts.statistics().graph_calls
            rebuilt = await decode(engine)
            st = experts.statistics()
            return first, again, rebuilt, st.graph_calls - before, st, leaving, failed_after

    first, again, rebuilt, regraphed, st, leaving, failed_after = asyncio.run(main())
    for got_tokens, got_logits in (first, again, rebuilt):
        assert got_tokens == tokens and np.array_equal(got_logits, logits[: N_TOKENS + 1])
    assert regraphed >= N_TOKENS * moe_layers  # the new graph served every decode step
    moved = st.owners[leaving]
    assert moved.restarts == 1 and moved.errors >= 1 and moved.node_id != node.node_id
    assert failed_after < 120  # graph timeout (60 s) plus the dead owner's probe at most


def test_auto_tears_down_a_graph_that_stays_costlier():
    """The transport policy alone (no Ray): "auto" takes the cheaper transport, probes the
    other every PROBE_EVERY calls, and after GRAPH_LOSSES probes in a row that found the
    graph costlier tears it down (its channels' poll threads spin) and builds the next one only
    after GRAPH_RETRY more small calls; one probe where the graph wins resets the count."""
    from colibri.cluster import client

    class Graph:  # what _pick_graph and _retire_graph touch
        ready, busy, error = True, False, None

        def close(self):
            self.closed = True

    experts = client.ClusterExperts([], np.zeros((1, 1), np.int32), False, False, None, 1 << 20)
    try:
        graph = experts._graph = Graph()
        experts._cost = {"graph": 2e-3, "plain": 1e-3}
        picks = [experts._pick_graph() for _ in range(client.PROBE_EVERY * 2)]
        assert picks.count(True) == 2 and experts._graph is graph  # two probes, kept
        experts._cost["graph"] = 0.5e-3  # a probe finds it cheaper: the count starts again
        assert experts._pick_graph() is True and experts._graph_losses == 0
        experts._cost["graph"] = 2e-3
        picks = []
        while experts._graph is not None and len(picks) < 10 * client.PROBE_EVERY:
            picks.append(experts._pick_graph())  # (ffn asks only while there is a graph)
        assert graph.closed and len(picks) == client.PROBE_EVERY * client.GRAPH_LOSSES - 1
        assert picks.count(True) == client.GRAPH_LOSSES - 1  # the last probe tore it down
        st = experts.statistics()
        assert st.graph == "waiting" and st.graph_teardowns == 1
        assert experts._build_after == client.GRAPH_RETRY and "graph" not in experts._cost
    finally:
        experts._graph_thread.shutdown()
