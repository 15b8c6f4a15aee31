"""The dashboard's JSON feeds (docs/DASHBOARD.md): schemas, and their figures checked against
independent sources (the engine's own routing trace, collections.Counter, planted clusters)."""

from __future__ import annotations

import collections
import json

import httpx2 as httpx
import numpy as np
import pytest

from colibri.engine import open_engine
from colibri.errors import ColibriError
from colibri.serve import dashboard
from colibri.serve.dashboard import TOP_SLOTS, RoutingRecorder, spectral_layout
from tests.serve_util import DEMO, running_server

CHAT = {
    "model": "colibri-demo",
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 12,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def server():
    with running_server(parallel=2) as srv:
        yield srv


def check_snapshot(s: dict) -> None:
    """The /v1/experts schema of docs/DASHBOARD.md."""
    assert s["object"] == "experts" and s["model"] == "colibri-demo"
    L, E, k = len(s["moe_layers"]), s["num_experts"], s["top_k"]
    assert (s["num_layers"], E, k, s["recent_window"]) == (4, 8, 2, dashboard.RECENT)
    assert isinstance(s["time"], float) and isinstance(s["routed_tokens"], int)
    for key in ("recent", "tokens", "gets", "hits", "state"):
        rows = s[key]
        assert len(rows) == L and all(len(r) == E for r in rows), key
        assert all(isinstance(v, int) and v >= 0 for r in rows for v in r), key
    assert {v for r in s["state"] for v in r} <= {0, 1, 2}
    for r_h, r_g in zip(s["hits"], s["gets"], strict=True):
        assert all(h <= g for h, g in zip(r_h, r_g, strict=True))
    for row in s["recent"]:
        assert sum(row) <= dashboard.RECENT * k
    st = s["statistics"]
    for key in (
        "expert_hits",
        "expert_misses",
        "bytes_read",
        "compute_seconds",
        "wait_io_seconds",
        "forward_steps",
        "prompt_tokens",
        "generated_tokens",
        "running",
        "cache_used_nbytes",
        "cache_budget_nbytes",
        "hit_rate",
    ):
        assert key in st, key
    assert 0 <= st["cache_used_nbytes"] <= st["cache_budget_nbytes"]


def test_experts_snapshot_counts_every_routed_token(server):
    before = httpx.get(server.url + "/v1/experts").json()
    check_snapshot(before)
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60).json()
    server.wait_idle()
    after = httpx.get(server.url + "/v1/experts").json()
    check_snapshot(after)
    # every token fed (the prompt, then each sampled token but the last) at every MoE layer
    # but the model's last, which routes only the rows whose logits are wanted: of the
    # prompt (one chunk), its last token (Pipeline._kept_rows)
    prompt = r["usage"]["prompt_tokens"]
    fed = prompt + r["usage"]["completion_tokens"] - 1
    eng = server.service.engine
    routed = [fed] * len(after["moe_layers"])
    if after["moe_layers"][-1] == len(eng.spec.layers) - 1:
        routed[-1] = fed - (prompt - 1)
    assert after["routed_tokens"] - before["routed_tokens"] == sum(routed)
    for b, a, n in zip(before["tokens"], after["tokens"], routed, strict=True):
        assert sum(a) - sum(b) == n * after["top_k"]
    # the tier map is the cache's: idle, everything resident is state 2, nothing is read
    resident = {(layer, e) for layer in range(4) for e in range(8) if eng.cache.contains(layer, e)}
    assert {
        (layer, e) for layer, row in enumerate(after["state"]) for e, v in enumerate(row) if v == 2
    } == resident
    assert len(resident) * eng.cache.pool.slot_nbytes == after["statistics"]["cache_used_nbytes"]


def test_experts_stream_sends_snapshots(server):
    times = []
    with httpx.stream("GET", server.url + "/v1/experts/stream?interval=0.05", timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                s = json.loads(line[6:])
                check_snapshot(s)
                times.append(s["time"])
                if len(times) == 3:
                    break
    assert times == sorted(times) and times[0] < times[-1]
    bad = httpx.get(server.url + "/v1/experts/stream?interval=0")
    assert bad.status_code == 400 and "interval" in bad.json()["error"]["message"]


def test_atlas_and_expert_detail(server):
    httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60)
    a = httpx.get(server.url + "/v1/experts/atlas").json()
    assert a["object"] == "expert_atlas" and (a["num_layers"], a["num_experts"]) == (4, 8)
    p = a["points"]
    assert all(len(p[key]) == 32 for key in ("x", "y", "layer", "expert", "tokens"))
    assert all(-1 <= v <= 1 for v in p["x"] + p["y"])
    assert sorted(zip(p["layer"], p["expert"], strict=True)) == [
        (i, e) for i in range(4) for e in range(8)
    ]
    snap = httpx.get(server.url + "/v1/experts").json()
    assert p["tokens"] == [v for row in snap["tokens"] for v in row]
    busiest = int(np.argmax(p["tokens"]))
    layer, expert = p["layer"][busiest], p["expert"][busiest]
    d = httpx.get(f"{server.url}/v1/experts/{layer}/{expert}").json()
    assert d["object"] == "expert" and d["tokens"] == p["tokens"][busiest]
    assert 0 <= d["hit_rate"] <= 1 and d["hits"] <= d["gets"]
    assert 1 <= len(d["top_tokens"]) <= TOP_SLOTS
    tok = server.service.engine.tokenizer
    for t in d["top_tokens"]:
        assert t["text"] == tok.decode([t["token_id"]]) and t["count"] >= 1
    counts = [t["count"] for t in d["top_tokens"]]
    assert counts == sorted(counts, reverse=True)
    missing = httpx.get(server.url + "/v1/experts/9/0")
    assert (
        missing.status_code == 404 and "MoE layers are 0..3" in missing.json()["error"]["message"]
    )


def test_page_and_static_files(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for src in ("/static/app.js", "/static/style.css"):
        assert src in page.text
        assert httpx.get(server.url + src).status_code == 200
    assert httpx.get(server.url + "/static/nope.js").status_code == 404
    assert httpx.get(server.url + "/static/..%2Fapp.py").status_code == 404


async def test_recorder_matches_the_engines_routing_trace(tmp_path):
    """The pipeline hook sees exactly the routing the engine's tracer records."""
    async with open_engine(DEMO, io="threads") as eng:
        spec = eng.spec
        moe = [s.index for s in spec.layers if s.moe]
        rec = RoutingRecorder(len(spec.layers), spec.moe.router.num_experts, 2, moe, eng.cache)
        eng.pipeline.route_observer = rec.observe
        with eng.capture_routing() as writer:
            ids = eng.encode_prompt("The quick brown fox")
            toks = [t.token_id async for t in eng.stream(ids, max_tokens=10, temperature=0)]
        trace = writer.trace()
        fed = ids + [t for t in toks if t is not None][:-1]
        assert trace.num_tokens == len(fed)
        for layer in moe:
            ex = trace.experts[:, layer]
            assert rec.tokens[layer].tolist() == np.bincount(ex.ravel(), minlength=8).tolist()
            last = ex[-dashboard.RECENT :].ravel()
            assert rec.recent()[layer].tolist() == np.bincount(last, minlength=8).tolist()
            for e in range(8):  # top tokens: exact (few distinct tokens per expert here)
                want = collections.Counter(fed[t] for t in range(len(fed)) if e in ex[t].tolist())
                if len(want) <= TOP_SLOTS:
                    assert dict(rec.top_tokens(layer, e, TOP_SLOTS)) == dict(want)
        # a recorder fed the saved trace counts the same tokens
        rec2 = RoutingRecorder(len(spec.layers), 8, 2, moe)
        rec2.load_trace(trace)
        assert (rec2.tokens == rec.tokens).all()
        with pytest.raises(ValueError, match="does not match this model"):
            RoutingRecorder(7, 8, 2, range(7)).load_trace(trace)
        # `colibri serve --atlas-trace FILE`: the app's recorder starts from the saved trace
        from colibri.serve import Service, create_app

        path = tmp_path / "routing.npz"
        trace.save(path)
        service = Service(eng, "colibri-demo")
        create_app(service, atlas_trace=str(path))
        assert (service.recorder.tokens == rec.tokens).all()
        (tmp_path / "bad.npz").write_bytes(b"not a trace")
        with pytest.raises(ColibriError, match=r"bad\.npz"):
            create_app(Service(eng, "colibri-demo"), atlas_trace=str(tmp_path / "bad.npz"))
        eng.pipeline.route_observer = None


def test_space_saving_bounds():
    """More distinct tokens than slots: at most TOP_SLOTS kept, the heavy hitters among them,
    counts never below the true count (Space-Saving's guarantee)."""
    rec = RoutingRecorder(1, 2, 1, [0])
    rng = np.random.default_rng(1)
    stream = np.concatenate([np.full(300, 7), np.full(200, 9), rng.integers(100, 1000, 400)])
    rng.shuffle(stream)
    for chunk in np.array_split(stream, 60):
        rec.observe(0, chunk, np.zeros((len(chunk), 1), np.int32))
    top = dict(rec.top_tokens(0, 0))
    true = collections.Counter(stream.tolist())
    assert len(top) <= TOP_SLOTS and {7, 9} <= set(top)
    assert all(top[t] >= true[t] for t in top)
    assert list(top)[:2] == [7, 9]


def test_spectral_layout_separates_planted_clusters():
    """19,456 experts (GLM-5's 76 x 256) routed by two token populations that use disjoint
    expert halves: the atlas puts the halves apart (and never-routed experts at the centre)."""
    L, E, k = 76, 256, 8
    rec = RoutingRecorder(L, E, k, range(L))
    rng = np.random.default_rng(0)
    n = 400
    group = rng.integers(0, 2, n)
    tokens = np.where(group == 0, 5, 6)
    for layer in range(L):
        ex = np.stack([rng.choice(E // 2 - 8, k, replace=False) for _ in range(n)])
        ex = ex + (group[:, None] * (E // 2))
        rec.observe(layer, tokens, ex)
    out = rec.atlas()
    assert len(out["x"]) == L * E
    xy = np.stack([out["x"], out["y"]], 1)
    e = np.asarray(out["expert"])
    half = e >= E // 2
    unused = (e % (E // 2)) >= E // 2 - 8
    a, b = xy[~half & ~unused], xy[half & ~unused]
    axis = (a.mean(0) - b.mean(0)) / np.linalg.norm(a.mean(0) - b.mean(0))
    pa, pb = a @ axis, b @ axis  # along the line joining the halves' centres
    gap = pa.mean() - pb.mean()
    spread = max(pa.std(), pb.std())
    assert gap > 3 * spread, (gap, spread)
    assert np.abs(xy[unused]).max() <= 0.08 + 1e-6
    assert rec.atlas() is out  # cached until new routing arrives
    tops = [rec.top_tokens(0, e) for e in range(E)]
    assert sum(map(bool, tops)) > E // 2  # subsampled pairs still reach most experts
    assert all({t for t, _ in top} <= ({5} if e < E // 2 else {6}) for e, top in enumerate(tops))


def test_spectral_layout_degenerate_inputs():
    assert spectral_layout(np.zeros((0, 4), np.float32), np.zeros(0)).shape == (0, 2)
    out = spectral_layout(np.ones((2, 4), np.float32), np.array([1, 1]))
    assert out.shape == (2, 2) and np.isfinite(out).all()


def test_observe_ignores_bad_ids():
    rec = RoutingRecorder(2, 4, 2, [0, 1])
    rec.observe(0, np.array([1, 2]), np.array([[0, 9], [-1, 3]]))
    rec.observe(5, np.array([1]), np.array([[0, 1]]))  # no such layer: dropped
    assert rec.tokens[0].tolist() == [1, 0, 0, 1] and rec.tokens[1].sum() == 0


def test_web_opens_no_browser_headless(monkeypatch, capsys):
    import webbrowser

    from colibri.serve import web

    def none(*a, **k):
        raise webbrowser.Error("could not locate runnable browser")

    monkeypatch.setattr(webbrowser, "get", none)
    assert web.open_browser("http://127.0.0.1:1/") is False
    assert "no browser found; open http://127.0.0.1:1/" in capsys.readouterr().err


def test_colibri_web_serves_the_dashboard_without_a_browser():
    """`colibri web` on a machine whose browser cannot start: the URL is printed, the server
    serves the page, SIGTERM stops it cleanly."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.serve_util import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env["BROWSER"] = "/nonexistent/browser"
    proc = subprocess.Popen(
        [sys.executable, "-m", "colibri", "web", "--port", str(port), "--io", "threads"],
        env=env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 60
        while True:
            try:
                page = httpx.get(url, timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
                time.sleep(0.2)
        assert page.status_code == 200 and '<canvas id="heatmap"' in page.text
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert f"dashboard at {url}" in err


def test_a_failing_recorder_never_breaks_generation():
    with running_server() as srv:

        def broken(*a):
            raise RuntimeError("boom")

        srv.service.recorder.observe = broken
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert srv.service.engine.pipeline.route_observer is None
        assert httpx.get(srv.url + "/v1/experts").status_code == 200
