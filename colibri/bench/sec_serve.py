"""Section "serve": `colibri serve` under 1, 2, 4 and 8 concurrent clients (issue 16, item 8).

A `colibri serve` child process per scenario; each client is a thread streaming
/v1/completions (SSE) requests of a fixed length (ignore_eos), distinct prompts. Per
concurrency: aggregate generated tok/s (all tokens / wall time), p50 and p99 inter-token
latency (gaps between a stream's consecutive tokens), mean TTFT, and expert bytes read per
generated token (from /metrics). The 1-client row is the "one after another" baseline the
issue's targets divide by. Scenarios:
  in RAM: the embedded demo model, every expert cached.
  out of core: a synthetic OLMoE-1B-7B-shaped store (tools/synth_store.py, real layer shapes,
  fewer layers, random blocks), expert budget 1/4 of its experts, O_DIRECT reads.
And the prefix cache: TTFT of a 1,000-token prompt, then of another sharing its first 1,000
tokens (target: the second under 20% of the first).
llama-server --parallel N on the same GGUF is not run yet (tools/build_llama_cpp.sh lists
it; the report says so when its binary is absent).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from colibri.bench import decode as bench_decode
from colibri.bench import llama_cpp
from colibri.bench.report import ROOT, Context, Headline, Section, table

TITLE = "colibri serve: concurrent clients, continuous batching, prefix cache"
DEMO = ROOT / "colibri" / "data" / "demo"
OOC_MODEL = "olmoe-1b-7b"
CONCURRENCY = (1, 2, 4, 8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `colibri serve` child on a free port; stopped with SIGTERM (drains) on exit."""

    def __init__(self, ctx: Context, store: Path, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "colibri", "serve", str(store), "--port", str(self.port),
               "--parallel", "8", "--max-queue", "64", "--threads", str(ctx.threads),
               *extra]  # fmt: skip
        ctx.record(cmd)
        self.log = ctx.out / f"serve-{self.port}.log"  # a pipe nobody reads could fill up
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=log, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = self.log.read_text()[-2000:]
                    raise RuntimeError(f"colibri serve did not start: {err}") from None
                time.sleep(0.2)
        models = json.loads(urllib.request.urlopen(self.url + "/v1/models").read())
        self.model = models["data"][0]["id"]

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def stream(self, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
        """(seconds to the first token, arrival times of every token) of one request."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        req = urllib.request.Request(
            self.url + "/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        t0 = time.perf_counter()
        times = []
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                        times.append(time.perf_counter())
        return (times[0] - t0 if times else float("nan")), times

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


def load_test(srv: Server, clients: int, requests: int, prompt_len: int, tokens: int,
              vocab: int) -> dict[str, Any]:  # fmt: skip
    """`clients` threads, each sending `requests` streaming requests in turn."""
    b0, g0 = (
        srv.metric("colibri_expert_bytes_read_total"),
        srv.metric("colibri_generation_tokens_total"),
    )
    gaps: list[float] = []
    ttfts: list[float] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            seed = 1 + c * 1000 + r * 7
            prompt = [(seed * 31 + i * 17) % (vocab - 10) + 5 for i in range(prompt_len)]
            ttft, times = srv.stream(prompt, tokens)
            with lock:
                ttfts.append(ttft)
                gaps.extend(b - a for a, b in itertools.pairwise(times))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - t0
    generated = srv.metric("colibri_generation_tokens_total") - g0
    read = srv.metric("colibri_expert_bytes_read_total") - b0
    return {
        "clients": clients,
        "tok_s": generated / wall,
        "itl_p50_ms": 1000 * _percentile(gaps, 0.5) if gaps else None,
        "itl_p99_ms": 1000 * _percentile(gaps, 0.99) if gaps else None,
        "ttft_mean_ms": 1000 * sum(ttfts) / len(ttfts),
        "bytes_read_per_token": read / max(1.0, generated),
        "generated": generated,
        "seconds": wall,
    }


def _scenario(ctx: Context, name: str, store: Path, extra: list[str], plan: dict[str, Any],
              vocab: int) -> list[dict[str, Any]]:  # fmt: skip
    srv = Server(ctx, store, *extra)
    rows = []
    try:
        srv.stream([5, 6, 7, 8], 4)  # warm-up: first kernel calls, page faults
        for n in CONCURRENCY:
            r = load_test(srv, n, plan["requests"], plan["prompt"], plan["tokens"], vocab)
            r["scenario"] = name
            ctx.log(f"serve {name}: {n} clients: {r['tok_s']:.1f} tok/s, ITL p50 "
                    f"{r['itl_p50_ms']:.1f} ms p99 {r['itl_p99_ms']:.1f} ms, "
                    f"{r['bytes_read_per_token'] / 2**20:.2f} MiB read/token")  # fmt: skip
            rows.append(r)
    finally:
        srv.close()
    return rows


def prefix_ttft(ctx: Context, pairs: int = 3) -> dict[str, float]:
    """TTFT of a 1,000-token prompt and of a second one sharing its first 1,000 tokens
    (medians over `pairs` pairs, each with its own prefix), and of unrelated prompts."""
    srv = Server(ctx, DEMO, "--prefix-cache", "256M")
    firsts, seconds, colds = [], [], []
    try:
        srv.stream([5, 6, 7], 2)
        for k in range(pairs):
            prefix = [(i * 37 + k * 101) % 1900 + 50 for i in range(1000)]
            firsts.append(srv.stream([*prefix, 11, 12, 13], 2)[0])
            seconds.append(srv.stream([*prefix, 21, 22, 23, 24], 2)[0])
            colds.append(srv.stream([(i * 53 + k * 7) % 1900 + 50 for i in range(1003)], 2)[0])
    finally:
        srv.close()
    first, second = statistics.median(firsts), statistics.median(seconds)
    return {"first_ms": 1000 * first, "second_ms": 1000 * second,
            "cold_ms": 1000 * statistics.median(colds), "ratio": second / first}  # fmt: skip


def run(ctx: Context) -> Section:
    plan = {"requests": 2, "prompt": 32, "tokens": 32 if ctx.quick else 64}
    rows = _scenario(ctx, "in RAM (demo)", DEMO, ["--prefix-cache", "0"], plan, 2048)
    rows += _scenario(ctx, "in RAM (demo), --batch fused", DEMO,
                      ["--prefix-cache", "0", "--batch", "fused"], plan, 2048)  # fmt: skip
    notes = []
    layers = 2 if ctx.quick else 4
    ooc = ctx.work / f"{OOC_MODEL}-L{layers}-q4_0"
    try:
        bench_decode.ensure_store(ooc, OOC_MODEL, layers, run=ctx.run)
        total = bench_decode.store_expert_nbytes(ooc)
        budget = str(total // 4)
        ooc_plan = {**plan, "tokens": plan["tokens"] // 2}
        rows += _scenario(ctx, "out of core (OLMoE shape, budget 1/4)", ooc,
                          ["--budget", budget, "--prefix-cache", "0"], ooc_plan, 50304)  # fmt: skip
    except Exception as exc:  # the in-RAM figures still count
        notes.append(f"out-of-core scenario failed: {exc!r}")
        ctx.log(notes[-1])
    prefix = prefix_ttft(ctx)
    try:
        have_server = (llama_cpp.llama_bin_dir() / "llama-server").exists()
    except Exception:
        have_server = False
    if not have_server:
        notes.append("llama-server is not built (tools/build_llama_cpp.sh): no peer figures yet")
    md = [table(
        ["scenario", "clients", "tok/s", "× 1 client", "ITL p50 ms", "ITL p99 ms",
         "TTFT ms", "MiB read / token"],
        [[r["scenario"], r["clients"], r["tok_s"],
          r["tok_s"] / next(x["tok_s"] for x in rows if x["scenario"] == r["scenario"]),
          r["itl_p50_ms"], r["itl_p99_ms"], r["ttft_mean_ms"],
          r["bytes_read_per_token"] / 2**20] for r in rows],
    )]  # fmt: skip
    md.append(
        f"\nPrefix cache (demo, 1,000-token shared prefix): first request TTFT "
        f"{prefix['first_ms']:.1f} ms, second {prefix['second_ms']:.1f} ms "
        f"({prefix['ratio']:.0%} of the first; target < 20%); an unrelated 1,003-token prompt "
        f"{prefix['cold_ms']:.1f} ms."
    )
    md += [f"\n{n}" for n in notes]
    heads = []
    for scen in dict.fromkeys(r["scenario"] for r in rows):
        base = next(r for r in rows if r["scenario"] == scen and r["clients"] == 1)
        four = next((r for r in rows if r["scenario"] == scen and r["clients"] == 4), None)
        if four:
            heads.append(Headline(
                f"serve {scen}, 4 clients vs one after another", "× tok/s",
                four["tok_s"] / base["tok_s"],
                target="≥ 2.5× out of core" if "out of core" in scen else "",
            ))  # fmt: skip
    heads.append(Headline("serve prefix cache: 2nd TTFT / 1st", "ratio", prefix["ratio"],
                          target="< 0.2"))  # fmt: skip
    return Section(
        key="serve", title=TITLE, markdown="\n".join(md),
        data={"rows": rows, "prefix": prefix, "notes": notes}, headlines=heads,
    )  # fmt: skip
