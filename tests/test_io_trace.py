"""Routing traces (own format, the real Mixtral JSONL) and replay: offline policies against
brute force and Belady, online replay through the real reader + cache."""

from __future__ import annotations

import asyncio
import itertools
import os
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from colibri.io.replay import SyntheticStore, offline_report, replay, simulate
from colibri.io.trace import RoutingTrace, RoutingTraceWriter, TraceError, load_mixtral_jsonl

MIXTRAL = Path(__file__).resolve().parents[2] / "shared/data/routing/mixtral_8x7b_pertoken"
MIXTRAL_JSONL = MIXTRAL / "humaneval_2_routing.jsonl"
needs_mixtral = pytest.mark.skipif(
    not MIXTRAL_JSONL.exists(), reason=f"real Mixtral trace not found at {MIXTRAL_JSONL}"
)


def test_trace_roundtrip_and_errors(tmp_path):
    w = RoutingTraceWriter(3, 2, 4, keep_scores=True, meta={"model_type": "mixtral"})
    w.new_sequence()
    rng = np.random.default_rng(0)
    want = {}
    for t in range(5):
        for layer in (0, 2):  # layer 1 dense: missing
            s = rng.random(4).astype(np.float32)
            e = np.argsort(-s)[:2]
            w.record(t, layer, e.tolist(), s[e].tolist(), s.tolist())
            want[t, layer] = (e.tolist(), s)
    w.save(tmp_path / "t.npz")
    tr = RoutingTrace.load(tmp_path / "t.npz")
    assert (tr.num_tokens, tr.num_layers, tr.top_k, tr.num_experts) == (5, 3, 2, 4)
    assert tr.meta == {"model_type": "mixtral", "boundaries": [0]}
    steps = list(tr.steps())
    assert [(t, la) for t, la, _ in steps] == [(t, la) for t in range(5) for la in (0, 2)]
    for t, layer, experts in steps:
        assert experts == want[t, layer][0]
        np.testing.assert_array_equal(tr.scores[t, layer], want[t, layer][1])
    assert (tr.experts[:, 1] == -1).all()
    with pytest.raises(ValueError, match="expected 2 experts"):
        w.record(0, 0, [1], [1.0])
    np.savez(tmp_path / "bad.npz", experts=np.zeros((1, 1, 1)))
    with pytest.raises(TraceError, match=r"bad\.npz"):
        RoutingTrace.load(tmp_path / "bad.npz")
    with pytest.raises(TraceError):
        RoutingTrace.load(tmp_path / "missing.npz")
    # not numpy's "pickled data ... allow_pickle" advice for a file that is no .npz at all
    (tmp_path / "notes.json").write_text('{"a": 1}')
    with pytest.raises(TraceError, match=r"notes\.json: not a colibri routing trace \(an \.npz"):
        RoutingTrace.load(tmp_path / "notes.json")
    with pytest.raises(TraceError, match="is a directory"):
        RoutingTrace.load(tmp_path)


@needs_mixtral
def test_real_mixtral_trace_loads():
    import json

    lines = [json.loads(x) for x in MIXTRAL_JSONL.read_text().splitlines() if x.strip()]
    tr = load_mixtral_jsonl(MIXTRAL_JSONL)
    assert (tr.num_layers, tr.top_k, tr.num_experts) == (32, 2, 8)
    assert tr.num_tokens == len({(r["problem_id"], r["token_idx"]) for r in lines})
    assert int((tr.experts[:, :, 0] >= 0).sum()) == len(lines)  # some layers are missing
    assert len(tr.meta["boundaries"]) == 2
    present = tr.experts[:, :, 0] >= 0
    np.testing.assert_allclose(tr.weights.sum(-1)[present], 1.0, atol=1e-5)
    r = lines[100]
    t = sorted({(x["problem_id"], x["token_idx"]) for x in lines}).index(
        (r["problem_id"], r["token_idx"])
    )
    assert tr.experts[t, r["layer"]].tolist() == r["experts"]


# ---- offline policies --------------------------------------------------------------------
def brute_force_best(seq, capacity):
    """Most hits any eviction choice can get (exhaustive search), demand caching."""

    @cache
    def go(i, resident):
        if i == len(seq):
            return 0
        k = seq[i]
        if k in resident:
            return 1 + go(i + 1, resident)
        if len(resident) < capacity:
            return go(i + 1, resident | {k})
        return max(go(i + 1, (resident - {v}) | {k}) for v in resident)

    return go(0, frozenset())


def test_belady_is_optimal_and_bounds_every_policy():
    rng = np.random.default_rng(3)
    for trial in range(30):
        seq = [int(x) for x in rng.integers(0, 5, 14)]
        steps = [(i, 0, [k]) for i, k in enumerate(seq)]
        cap = 2 + trial % 2
        best = brute_force_best(tuple(seq), cap)
        assert simulate(steps, cap, "belady")[0] == best
        for p in ("lru", "lfu", "lfru", "nextuse"):
            assert simulate(steps, cap, p)[0] <= best


def reference_lru(steps, capacity):
    """List-based LRU; the layer being processed is never evicted (it is leased)."""
    resident, hits = [], 0
    for _, layer, experts in steps:
        now = {(layer, e) for e in experts}
        for e in experts:
            key = (layer, e)
            if key in resident:
                hits += 1
                resident.remove(key)
            elif len(resident) >= capacity:
                resident.remove(next(k for k in resident if k not in now))
            resident.append(key)
    return hits


@needs_mixtral
def test_real_mixtral_offline_policies():
    steps = list(load_mixtral_jsonl(MIXTRAL_JSONL).steps())
    reads = sum(len(s[2]) for s in steps)
    rows = offline_report(steps, [16, 64, 128, 256])
    for row in rows:
        for p in ("lru", "lfu", "lfru", "nextuse"):
            assert row[p] <= row["belady"] + 1e-12
            assert 0 <= row[f"{p}/belady"] <= 1
        # the default policy: at least as many hits as each other one at every budget
        assert row["nextuse"] >= max(row["lru"], row["lfu"], row["lfru"])
    assert rows[2]["nextuse/belady"] > rows[2]["lfru/belady"] + 0.03  # half the records
    assert rows[-1]["belady"] == rows[-1]["lru"] == rows[-1]["lfu"] == 1 - 256 / reads
    assert rows[0]["lru"] == 0.0  # 16 records < one token's 64 reads: LRU always thrashes
    assert rows[0]["lfu"] > 0.05 and rows[1]["belady"] > 0.5
    sub = steps[:2000]
    for cap in (20, 64, 100):
        assert simulate(sub, cap, "lru")[0] == reference_lru(sub, cap)


# ---- online replay -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixtral_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "experts.bin"
    return SyntheticStore.create(path, 32, 8, 4096, seed=1)


@needs_mixtral
@pytest.mark.parametrize("io", ["auto", "threads"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "nextuse"])
def test_online_replay_matches_offline(mixtral_store, io, policy):
    tr = load_mixtral_jsonl(MIXTRAL_JSONL)
    tokens = 40
    cap = 48
    r = asyncio.run(
        replay(
            tr,
            mixtral_store,
            budget_nbytes=cap * 4096,
            policy=policy,
            io=io,
            max_tokens=tokens,
            queue_depth=8,
        )
    )
    steps = [s for s in tr.steps() if s[0] < tokens]
    hits, misses = simulate(steps, cap, policy)
    assert (r.cache.hits, r.cache.misses) == (hits, misses)
    assert r.bytes_read == misses * 4096 and r.reader.errors == 0
    assert r.cache.resident_nbytes <= cap * 4096


@needs_mixtral
def test_online_replay_oracle_prefetch_helps(mixtral_store):
    tr = load_mixtral_jsonl(MIXTRAL_JSONL)
    kw = dict(budget_nbytes=48 * 4096, policy="lru", max_tokens=30, queue_depth=8)
    base = asyncio.run(replay(tr, mixtral_store, **kw))
    pre = asyncio.run(replay(tr, mixtral_store, prefetch="oracle", **kw))
    assert pre.hit_rate > base.hit_rate + 0.3
    assert pre.prefetch.recall > 0.9 and pre.prefetch.useful_reads > 0


@needs_mixtral
def test_replay_cli(capsys, tmp_path):
    from colibri.cli import main

    assert main(["replay", str(MIXTRAL_JSONL), "--offline", "--budget-records", "32"]) == 0
    out = capsys.readouterr().out
    assert "338 tokens" in out and "belady" in out
    assert (
        main(
            [
                "replay",
                str(MIXTRAL_JSONL),
                "--record-nbytes",
                "8K",
                "--budget",
                "512K",
                "--max-tokens",
                "5",
                "--synthetic-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "hit rate" in out and "tokens/s" in out
    assert not os.listdir(tmp_path)  # the synthetic file is removed


def test_synthetic_store_records(tmp_path):
    import xxhash

    s = SyntheticStore.create(tmp_path / "x.bin", 2, 3, 8192, seed=2)
    data = np.fromfile(s.experts_path, np.uint8)
    for layer, e in itertools.product(range(2), range(3)):
        r = s.record(layer, e)
        assert xxhash.xxh3_64_intdigest(data[r.offset : r.offset + r.nbytes]) == r.xxh3
    with pytest.raises(KeyError):
        s.record(2, 0)


def test_lookahead_spans_policy_to_belady():
    """Told no future, simulate is the policy itself; told the whole future, it is Belady's
    MIN (the brute-force optimum); in between, a small trace of several layers."""
    rng = np.random.default_rng(7)
    for trial in range(20):
        seq = [int(x) for x in rng.integers(0, 5, 14)]
        steps = [(i, 0, [k]) for i, k in enumerate(seq)]
        cap = 2 + trial % 2
        best = brute_force_best(tuple(seq), cap)
        assert simulate(steps, cap, "nextuse", lookahead=len(steps))[0] == best
        assert simulate(steps, cap, "lru", lookahead=len(steps))[0] == best
    steps = [
        (t, layer, sorted({int(x) for x in rng.integers(0, 6, 2)}))
        for t in range(60)
        for layer in range(3)
    ]
    for cap in (3, 6, 9):
        belady = simulate(steps, cap, "belady")
        assert simulate(steps, cap, "nextuse", lookahead=len(steps)) == belady
        assert simulate(steps, cap, "nextuse", lookahead=0) == simulate(steps, cap, "nextuse")
        for n in (1, 3, 12):
            assert simulate(steps, cap, "nextuse", lookahead=n)[0] <= belady[0]
    with pytest.raises(ValueError, match="lookahead"):
        simulate(steps, 3, "lru", lookahead=-1)
