"""bench/sec_serve.py's pure parts: the real-routing sharing figures (offline LRU model over the
real Mixtral-8x7B trace in ../shared/data/routing)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.bench import sec_serve
from colibri.io.trace import load_mixtral_jsonl

if not sec_serve.TRACE.exists():
    pytest.skip(f"shared data missing: {sec_serve.TRACE}", allow_module_level=True)


def test_routing_sharing_counts_reads_of_the_union():
    rows = sec_serve.routing_sharing((1.0, 0.25))
    ex = load_mixtral_jsonl(sec_serve.TRACE).experts
    for n in sec_serve.CONCURRENCY:
        # a cache holding every record only misses each (layer, expert) once, batched or not
        windows = [ex[w : w + sec_serve.WINDOW_LEN] for w in sec_serve.WINDOWS[:n]]
        first = np.concatenate(windows).reshape(-1, ex.shape[1], ex.shape[2])
        distinct = {(layer, int(e)) for t in first for layer in range(ex.shape[1])
                    for e in t[layer] if e >= 0}  # fmt: skip
        full = next(r for r in rows if r["budget"] == 1.0 and r["streams"] == n)
        want = len(distinct) / (n * sec_serve.WINDOW_LEN)
        assert full["serial_reads_per_token"] == pytest.approx(want)
        assert full["batched_reads_per_token"] == pytest.approx(want)
        small = next(r for r in rows if r["budget"] == 0.25 and r["streams"] == n)
        assert small["serial_reads_per_token"] > want  # 64 of 256 records: evictions
        # a batch step reads at most its union: top-2 of 8 per stream, 8 per layer at most
        assert small["batched_reads_per_token"] <= min(2 * n, 8) * ex.shape[1] / n
    one = [r for r in rows if r["streams"] == 1]
    assert all(r["serial_reads_per_token"] == r["batched_reads_per_token"] for r in one)


def test_cpu_seconds_reads_the_server_process_cpu_time():
    """HttpServer.cpu_seconds (the serve rows' CPU ms / token) against the child's own
    time.process_time() after it burns ~0.3 s of CPU, then sleeps."""
    import subprocess
    import sys

    code = (
        "import time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass\n"
        "print(time.process_time(), flush=True)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        srv = object.__new__(sec_serve.HttpServer)  # no server: only the process handle
        srv.proc = proc
        own = float(proc.stdout.readline())
        measured = srv.cpu_seconds()
        assert measured == pytest.approx(own, abs=0.05)  # clock ticks are 10 ms
        assert own >= 0.3
    finally:
        proc.kill()
        proc.wait()
    assert srv.cpu_seconds() is None  # reaped: no /proc entry


def test_budget_label():
    assert [sec_serve.budget_label(f) for f in (0.25, 0.75, 0.5, 1 / 16)] == [
        "1/4", "3/4", "1/2", "1/16",
    ]  # fmt: skip


def test_scenario_interleaves_rounds_and_keeps_the_median_round(monkeypatch):
    """_scenario runs the concurrency levels ctx.rounds times in turn (1, 2, 4, 8, 1, ...),
    each row being the round of median tok/s with every round's figure; a capped load test
    stops that level and the higher ones in later rounds."""
    from types import SimpleNamespace

    order = []
    speeds = {1: [5.0, 1.0, 3.0], 2: [2.0, 8.0, 4.0], 4: [9.0, 7.0, 8.0], 8: [1.0]}

    def fake_load_test(srv, n, requests, prompt, tokens, vocab):
        order.append(n)
        k = sum(1 for m in order if m == n) - 1
        return {
            "clients": n,
            "tok_s": speeds[n][k],
            "capped": n == 8,
            "itl_p50_ms": None,
            "itl_p99_ms": None,
        }

    class FakeServer:
        cgroup = None

        def stream(self, prompt, tokens):
            return 0.0, []

        def close(self):
            pass

    monkeypatch.setattr(sec_serve, "load_test", fake_load_test)
    ctx = SimpleNamespace(rounds=3, log=lambda msg: None)
    plan = {"requests": 1, "prompt": 4, "tokens": 2}
    rows = sec_serve._scenario(ctx, "s", FakeServer, plan, 100)
    assert order == [1, 2, 4, 8, 1, 2, 4, 1, 2, 4]
    assert [(r["clients"], r["tok_s"]) for r in rows] == [(1, 3.0), (2, 4.0), (4, 8.0), (8, 1.0)]
    assert rows[0]["tok_s_rounds"] == [5.0, 1.0, 3.0] and rows[3]["tok_s_rounds"] == [1.0]
    # paired by round: 2 / 5, 8 / 1, 4 / 3 -> median 4 / 3; 4 clients: 9 / 5, 7 / 1, 8 / 3
    assert rows[1]["x_one_client"] == pytest.approx(4 / 3)
    assert rows[2]["x_one_client"] == pytest.approx(8 / 3)
    assert rows[3]["x_one_client"] == pytest.approx(1 / 5)


def test_add_bounds_is_the_slower_of_disk_and_cpu():
    """Out-of-core colibri rows get min(disk / bytes per token, cores / CPU per token) and the
    fraction reached; other rows (in RAM, the peer, rows without a figure) are left alone."""
    from colibri.bench.sec_serve import add_bounds

    rows = [
        # disk: 4e9 / 40e6 = 100 tok/s; CPU: 2 cores / 10 ms = 200 tok/s -> disk, 100
        {"scenario": "OLMoE shape, out of core 1/4: colibri", "clients": 4, "tok_s": 80.0,
         "bytes_read_per_token": 40e6, "cpu_ms_per_token": 10.0},
        # disk: 4e9 / 10e6 = 400; CPU: 2 / 25 ms = 80 -> CPU, 80
        {"scenario": "OLMoE shape, out of core 3/4: colibri", "clients": 1, "tok_s": 40.0,
         "bytes_read_per_token": 10e6, "cpu_ms_per_token": 25.0},
        {"scenario": "OLMoE shape, in RAM: colibri", "clients": 1, "tok_s": 90.0,
         "bytes_read_per_token": 0.0, "cpu_ms_per_token": 10.0},
        {"scenario": "OLMoE shape, out of core 1/4: llama-server", "clients": 4, "tok_s": 9.0,
         "bytes_read_per_token": None, "cpu_ms_per_token": 50.0},
    ]  # fmt: skip
    add_bounds(rows, 4.0, 2)
    assert rows[0]["bound_tok_s"] == pytest.approx(100.0) and rows[0]["bound_by"] == "disk"
    assert rows[0]["of_bound"] == pytest.approx(0.8)
    assert rows[1]["bound_tok_s"] == pytest.approx(80.0) and rows[1]["bound_by"] == "CPU"
    assert rows[1]["of_bound"] == pytest.approx(0.5)
    assert "bound_tok_s" not in rows[2] and "bound_tok_s" not in rows[3]
