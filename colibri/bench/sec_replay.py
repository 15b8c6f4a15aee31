"""Replay section: the real Mixtral-8x7B routing trace against a Mixtral-8x7B-shaped store.

- Offline (no IO): hit rate of LRU, LFU, LFRU, NEXTUSE (the default) and Belady's MIN (the
  optimum for demand caching, Belady 1966) over the whole trace for cache budgets from 8 to
  256 of the 256 records (32 layers x 8 experts), each policy also as a fraction of Belady.
- Lookahead (no IO): how much exact future the default policy would need to be told to reach
  a fraction of Belady (colibri.io.replay.simulate's lookahead: 1 step = the next layer, what a
  router-based prediction gives; 32 steps = one token).
- Online: `colibri.io.replay.replay` through the real UringReader + ExpertCache + Prefetcher
  over a synthetic experts file (Mixtral-8x7B q4_0 records: 3 x 4096 x 14336 weights, 99 MB;
  scaled 1/16 in quick mode) for policy x budget x prefetch (none, oracle, repeat), after a
  warm-up, with no compute between layers (compute_ms = 0: the IO-only ceiling). Tokens/s and
  GB/s next to the disk's limit (colibri.bench.sec_limits.disk_gbps); the no-prefetch hit rate is
  checked against the offline simulation of the same window (they must be equal).
- Prefetcher recall/precision on colibri's own runs: the engine with prefetch on (the next
  layer's router on this layer's hidden state) on the embedded demo model and on a synthetic
  OLMoE-shaped store, decode tokens only, next to a previous-token baseline and chance (k/E).
"""

from __future__ import annotations

import asyncio
import lzma
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from colibri.bench.report import (
    ROOT,
    Context,
    Headline,
    Section,
    interleave,
    median,
    table,
    tool,
)
from colibri.io.format import ExpertLayout
from colibri.io.replay import (
    SyntheticStore,
    lookahead_report,
    offline_report,
    replay,
    simulate,
)
from colibri.io.trace import RoutingTrace, load_mixtral_jsonl

TITLE = "Real Mixtral-8x7B routing trace: cache policies, prefetch, Belady"

DATA = ROOT.parent / "shared" / "data"
TRACE = DATA / "routing" / "mixtral_8x7b_pertoken" / "humaneval_2_routing.jsonl"
TEXT = DATA / "text" / "olmoe_routing_c4_texts.txt.xz"
POLICIES = ("lru", "lfu", "lfru", "nextuse")
PREFETCH = ("none", "oracle", "repeat")
QD = 32
SLAB_MAX = 8 << 30  # slab pool ceiling in full mode (the machine's RAM is shared)


def mixtral_record_nbytes(scale: int = 1) -> int:
    """Bytes of one Mixtral-8x7B q4_0 expert record (gate, up, down of 4096 x 14336, padded to
    4096) divided by `scale`, rounded down to 4096 bytes (O_DIRECT alignment)."""
    full = ExpertLayout.build("q4_0", 4096, 14336).record_nbytes
    return full if scale == 1 else max(4096, full // scale // 4096 * 4096)


def synthetic_store(ctx: Context, rec: int, trace: RoutingTrace) -> tuple[SyntheticStore, float]:
    """The synthetic experts file for records of `rec` bytes under ctx.work (reused when it and
    its checksums exist; else written temp + rename). Returns (store, seconds spent making it)."""
    path = ctx.work / f"replay-mixtral-8x7b-{rec}.bin"
    sums = path.with_suffix(".xxh3.npy")
    L, E = trace.num_layers, trace.num_experts
    if path.exists() and sums.exists() and path.stat().st_size == L * E * rec:
        return SyntheticStore(str(path), L, E, rec, np.load(sums), trace.top_k), 0.0
    t0 = time.perf_counter()
    ctx.log(f"replay: writing {L * E} random records of {rec} bytes to {path}")
    store = SyntheticStore.create(path, L, E, rec, top_k=trace.top_k)
    tmp = sums.with_name(sums.stem + ".tmp.npy")
    np.save(tmp, store._xxh3)
    os.replace(tmp, sums)
    return store, time.perf_counter() - t0


def _disk_limit(ctx: Context, rec: int) -> tuple[float | None, str]:
    try:
        from colibri.bench.sec_limits import disk_gbps

        return disk_gbps(ctx, rec, QD), ""
    except Exception as exc:  # the section still reports hit rates and GB/s
        return None, f"disk limit unavailable ({exc!r})"


def online(
    ctx: Context,
    trace: RoutingTrace,
    steps: list,
    store: SyntheticStore,
    budgets: list[int],
    grid: list[tuple[str, str]],
    warmup: int,
    measured: int,
    label: str,
) -> list[dict[str, Any]]:
    """Interleaved online replays, per budget (records) of each (policy, prefetch) in `grid`.
    Rows: medians of tokens/s, GB/s, hit rate, and the offline hit rates of the same window."""
    rec = store.layout.record_nbytes
    n = warmup + measured
    window = [s for s in steps if s[0] < n]
    start = sum(1 for s in window if s[0] < warmup)
    rows = []
    for cap in budgets:
        bh, bm = simulate(window, cap, "belady", start)
        runs, results = {}, {}
        for pol, pf in grid:
            key = f"{pol}/{pf}"
            results[key] = []

            def one(pol: str = pol, pf: str = pf, key: str = key, cap: int = cap,
                    out: dict = results) -> float:  # fmt: skip
                r = asyncio.run(replay(trace, store, budget_nbytes=cap * rec, policy=pol,
                                       prefetch=pf, queue_depth=QD, max_tokens=n,
                                       warmup_tokens=warmup))  # fmt: skip
                out[key].append(r)
                return r.tokens_per_second

            runs[key] = one
        ctx.log(f"replay online ({label}): {cap} records x {len(grid)} configurations")
        interleave(runs, ctx.rounds, ctx.log)
        for pol, pf in grid:
            rs = results[f"{pol}/{pf}"]
            h, m = simulate(window, cap, pol, start)
            p = rs[-1].prefetch
            rows.append({
                "records": label, "record_nbytes": rec, "budget_records": cap,
                "budget_nbytes": cap * rec, "policy": pol, "prefetch": pf,
                "tokens_per_second": median([r.tokens_per_second for r in rs]),
                "gb_per_second": median([r.gb_per_second for r in rs]),
                "hit_rate": median([r.hit_rate for r in rs]),
                "hit_rates": [r.hit_rate for r in rs],
                "offline_hit_rate": h / (h + m), "belady_hit_rate": bh / (bh + bm),
                "bytes_read_per_token": median([r.bytes_read / r.tokens for r in rs]),
                "reader": rs[-1].reader.backend, "slab": rs[-1].pool.backing,
                "prefetch_recall": p.recall if p else None,
                "prefetch_precision": p.precision if p else None,
                "warmup_tokens": warmup, "tokens": measured,
            })  # fmt: skip
    return rows


def _prompts(count: int) -> list[str]:
    """Real text (C4 lines from ../shared/data/text), cut to ~40 words each."""
    lines = lzma.decompress(TEXT.read_bytes()).decode().splitlines()
    return [" ".join(ln.split()[:40]) for ln in lines[:count]]


async def _engine_recall(path: Path, prompts: list[str], max_tokens: int, trace: Path) -> dict:
    """Prefetcher statistics over decode tokens only (differences between the first token of
    each prompt and its end), and the previous-token baseline's recall from the trace."""
    from colibri.engine import open_engine
    from colibri.io.format import open_store

    store = open_store(path)
    total = sum(r.nbytes for r in store.records)
    acc = dict.fromkeys(("predicted", "useful", "demanded", "useful_reads", "wasted_reads"), 0)
    base_hit = base_n = decode = 0
    backoffs = 0
    for i, prompt in enumerate(prompts):
        tpath = trace.with_name(f"{trace.stem}-{i}.npz")
        async with open_engine(path, budget=total // 4, prefetch=True, trace=str(tpath)) as eng:
            before = None
            async for tok in eng.stream(prompt, max_tokens=max_tokens, temperature=0.0):
                if before is None:
                    before = eng.statistics().prefetch
                stats = tok.statistics
            after = eng.statistics().prefetch
        for k in acc:
            acc[k] += getattr(after, k) - getattr(before, k)
        backoffs += after.backoffs
        decode += stats.generated_tokens
        tr = RoutingTrace.load(tpath)
        ex = tr.experts[stats.prompt_tokens - 1 :]  # the last prompt token, then decode tokens
        for t in range(1, ex.shape[0]):
            for layer in range(ex.shape[1]):
                now, prev = set(ex[t, layer][ex[t, layer] >= 0]), set(ex[t - 1, layer])
                base_hit += len(now & prev)
                base_n += len(now)
    return {
        "store": path.name, "decode_tokens": decode,
        "layers": tr.num_layers, "top_k": tr.top_k, "num_experts": tr.num_experts,
        **acc,
        "recall": acc["useful"] / acc["demanded"] if acc["demanded"] else None,
        "precision": acc["useful"] / acc["predicted"] if acc["predicted"] else None,
        "previous_token_recall": base_hit / base_n if base_n else None,
        "chance_recall": tr.top_k / tr.num_experts, "backoffs": backoffs,
    }  # fmt: skip


def prefetch_recall(ctx: Context) -> tuple[list[dict[str, Any]], list[str]]:
    """Recall/precision of the router-based prefetcher on the demo model and a synthetic
    OLMoE-1B-7B-shaped store (made with tools/synth_store.py under ctx.work)."""
    notes: list[str] = []
    stores = [ROOT / "colibri" / "data" / "demo"]
    layers = 4 if ctx.quick else 16
    olmoe = ctx.work / f"replay-olmoe-1b-7b-L{layers}-q4_0"
    if not (olmoe / "manifest.json").exists():
        need = (0.3 + 0.22 * layers) * 2**30
        if ctx.free_bytes() > need + 2**30:
            ctx.run([sys.executable, tool("synth_store.py"), "olmoe-1b-7b",
                     str(olmoe), "--layers", str(layers), "--force"])  # fmt: skip
        else:
            notes.append(f"synthetic OLMoE store skipped: {ctx.free_bytes() / 2**30:.1f} GiB free")
    if (olmoe / "manifest.json").exists():
        stores.append(olmoe)
    prompts = _prompts(3 if ctx.quick else 8)
    rows = []
    for path in stores:
        ctx.log(f"replay: prefetcher recall on {path.name}")
        ctx.record(f"# engine in-process: open_engine({path}, budget=1/4 of the experts, "
                   f"prefetch=True, trace=...), {len(prompts)} C4 prompts, greedy")  # fmt: skip
        trace = ctx.work / f"replay-trace-{path.name}.npz"
        small = ctx.quick and path != stores[0]  # the OLMoE store decodes ~10x slower
        n = 24 if small else 48 if ctx.quick else 128
        rows.append(asyncio.run(_engine_recall(path, prompts[: 2 if small else None], n, trace)))
    return rows, notes


def _series(ax: Any, sub: list[dict], key: str) -> None:
    """`key` per policy x prefetch: lines over the budget, or grouped bars for one budget."""
    budgets = sorted({r["budget_records"] for r in sub})
    colors = dict(zip(POLICIES, ("C0", "C1", "C2", "C3"), strict=True))
    if len(budgets) == 1:
        width = 0.8 / len(PREFETCH)
        for j, pf in enumerate(PREFETCH):
            for i, p in enumerate(POLICIES):
                v = [r[key] for r in sub if r["policy"] == p and r["prefetch"] == pf]
                if v:
                    ax.bar(i + (j - 1) * width, v[0], width, color=colors[p],
                           hatch=("", "//", "..")[j], edgecolor="k",
                           label=f"prefetch {pf}" if i == 0 else None)  # fmt: skip
        ax.set_xticks(range(len(POLICIES)), [p.upper() for p in POLICIES])
        ax.set_xlabel(f"policy (budget {budgets[0]} of 256 records; hatch = prefetch)")
        return
    for p in POLICIES:
        for pf, ls in zip(PREFETCH, ("-", "--", ":"), strict=True):
            pts = sorted((r["budget_records"], r[key]) for r in sub
                         if r["policy"] == p and r["prefetch"] == pf)  # fmt: skip
            if pts:
                ax.plot(*zip(*pts, strict=True), color=colors[p], ls=ls, marker="o",
                        label=f"{p}, prefetch {pf}")  # fmt: skip
    ax.set_xlabel("cache budget (records of 256)")


def _plots(ctx: Context, offline: list[dict], rows: list[dict], disk: dict) -> list[str]:
    import matplotlib.pyplot as plt

    figs = []
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    caps = [r["capacity"] for r in offline]
    total = 256
    ax.plot(caps, [r["belady"] for r in offline], "k--", lw=2, label="Belady MIN (optimum)")
    for p, mk in zip(POLICIES, "osd^", strict=True):
        ax.plot(caps, [r[p] for r in offline], marker=mk, label=p.upper())
    ax.set_xlabel(f"cache budget (records of {total}; 1 record = 1 expert of 1 layer)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1.02)
    ax.set_title("Mixtral-8x7B real routing trace (338 decode tokens): hit rate vs budget")
    sec = ax.secondary_xaxis("top", functions=(lambda x: x / total, lambda f: f * total))
    sec.set_xlabel("fraction of all experts cached")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(ctx.figure("replay_hit_rate.png"), dpi=110)
    plt.close(fig)
    figs.append("replay_hit_rate.png")

    labels = sorted({r["records"] for r in rows}, key=lambda s: s != "scaled")
    fig, axes = plt.subplots(1, len(labels), figsize=(6.5 * len(labels), 4.5), squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        sub = [r for r in rows if r["records"] == label]
        rec = sub[0]["record_nbytes"]
        _series(ax, sub, "gb_per_second")
        lim = disk.get(label)
        if lim:
            ax.axhline(lim, color="k", ls="--", lw=1.5, label=f"disk limit (fio, QD {QD})")
        tps = sorted({(r["budget_records"], r["tokens_per_second"]) for r in sub})
        ax.set_ylabel("achieved read bandwidth (GB/s)")
        lo, hi = min(t for _, t in tps), max(t for _, t in tps)
        ax.set_title(f"online replay, {rec / 1e6:.1f} MB records ({label}); "
                     f"{lo:.3g}–{hi:.3g} tok/s")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="lower center", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(ctx.figure("replay_online.png"), dpi=110)
    plt.close(fig)
    figs.append("replay_online.png")

    fig, axes = plt.subplots(1, len(labels), figsize=(6.5 * len(labels), 4.5), squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        sub = [r for r in rows if r["records"] == label]
        _series(ax, sub, "tokens_per_second")
        ax.set_ylabel("tokens/s (IO only, compute_ms = 0)")
        ax.set_title(f"online replay tokens/s, {sub[0]['record_nbytes'] / 1e6:.1f} MB records")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="lower center", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(ctx.figure("replay_tokens.png"), dpi=110)
    plt.close(fig)
    figs.append("replay_tokens.png")
    return figs


def _horizon_name(n: int, layers: int) -> str:
    """A lookahead of n steps in words: online, the next layer, or tokens."""
    return "online" if n == 0 else "next layer" if n == 1 else f"{n / layers:g} tok"


def run(ctx: Context) -> Section:
    """The replay section (see the module docstring)."""
    trace = load_mixtral_jsonl(TRACE)
    steps = list(trace.steps())
    notes: list[str] = []
    ctx.log(f"replay: trace {trace.num_tokens} tokens, {len(steps)} (token, layer) steps")
    caps = [8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    t0 = time.perf_counter()
    offline = offline_report(steps, caps)
    offline_s = time.perf_counter() - t0
    horizons = [0, 1, trace.num_layers // 2, trace.num_layers, 2 * trace.num_layers,
                4 * trace.num_layers]  # fmt: skip
    ahead = lookahead_report(steps, [16, 32, 64, 128, 192], horizons)

    # online, scaled records (both modes) and real-size records (full mode, if the disk allows)
    rows: list[dict[str, Any]] = []
    made: dict[str, float] = {}
    disk: dict[str, float] = {}
    grid = [(p, f) for p in POLICIES for f in PREFETCH]
    plans = [("scaled", 16, [128] if ctx.quick else [32, 64, 128, 192], grid,
              (4, 10) if ctx.quick else (8, 24))]  # fmt: skip
    if not ctx.quick:
        real = mixtral_record_nbytes()
        size = real * trace.num_layers * trace.num_experts
        have = (ctx.work / f"replay-mixtral-8x7b-{real}.bin").exists()
        if have or ctx.free_bytes() > size + (4 << 30):
            cap = min(64, SLAB_MAX // real)
            plans.append(("real size", 1, [cap], [(p, f) for p in POLICIES
                          for f in ("none", "oracle")], (2, 4)))  # fmt: skip
        else:
            notes.append(f"real-size run skipped: {size / 1e9:.1f} GB file, "
                         f"{ctx.free_bytes() / 1e9:.1f} GB free")  # fmt: skip
    for label, scale, budgets, g, (warm, meas) in plans:
        rec = mixtral_record_nbytes(scale)
        if ctx.free_bytes() < rec * 256 + (1 << 30) and not (
            ctx.work / f"replay-mixtral-8x7b-{rec}.bin").exists():  # fmt: skip
            notes.append(f"{label} online replay skipped: not enough free disk")
            continue
        store, made[label] = synthetic_store(ctx, rec, trace)
        lim, why = _disk_limit(ctx, rec)
        if lim:
            disk[label] = lim
        elif why:
            notes.append(why)
        rows += online(ctx, trace, steps, store, budgets, g, warm, meas, label)

    recall, rnotes = prefetch_recall(ctx)
    notes += rnotes
    figs = _plots(ctx, offline, rows, disk)

    # headlines: best policy at 50% budget vs Belady; online GB/s vs the disk limit
    half = next(r for r in offline if r["capacity"] == 128)
    best = max(POLICIES, key=lambda p: half[p])
    # what an online policy lacks: nextuse told the exact future N steps ahead, same budget
    look = next((r for r in ahead if r["capacity"] == 128), None)
    told = ""
    if look is not None:
        layers = trace.num_layers
        told = "; told the exact routing " + ", ".join(
            f"{_horizon_name(n, layers)} ahead {look[f'lookahead={n}']:.2f}"
            for n in horizons[1:]) + (" of Belady's hits: the next layer (the router's guess) "
                                      "adds nothing, near Belady takes the next tokens' routing, "
                                      "which no router prediction gives")  # fmt: skip
    heads = [Headline("Mixtral trace, best policy at 50% budget (hit rate)", "hit rate",
                      half[best], limit=half["belady"], limit_name="Belady MIN",
                      target="≥ 90% of Belady",
                      note=f"{best.upper()}, offline over the whole real trace{told}")]  # fmt: skip
    for label in disk:
        sub = [r for r in rows if r["records"] == label and r["prefetch"] == "none"]
        top = max(sub, key=lambda r: r["gb_per_second"])
        heads.append(Headline(
            f"Mixtral trace online replay, {top['record_nbytes'] / 1e6:.0f} MB records",
            "GB/s", top["gb_per_second"], limit=disk[label],
            limit_name=f"disk, {top['record_nbytes'] / 1e6:.1f} MB records, {QD} in flight",
            note=f"{top['policy']}, {top['budget_records']}/256 records, no prefetch, "
                 f"{top['tokens_per_second']:.3g} tok/s IO-only"))  # fmt: skip

    mismatch = [r for r in rows if r["prefetch"] == "none"
                and abs(r["hit_rate"] - r["offline_hit_rate"]) > 1e-9]  # fmt: skip
    md = [
        f"The real per-token routing of Mixtral-8x7B-Instruct on two HumanEval problems "
        f"(`{TRACE.relative_to(DATA.parent)}`: {trace.num_tokens} decode tokens, "
        f"{len(steps)} (token, layer) steps, top-2 of 8 experts in 32 layers = 256 records) "
        "replayed against the cache policies. Offline simulation (no IO, "
        f"{offline_s:.1f} s) covers every budget, with Belady's MIN as the optimum; the "
        "experts of the layer being computed are never evicted in any policy.",
        "",
        table(
            ["budget (records)", "Belady", *[f"{p.upper()} (of MIN)" for p in POLICIES]],
            [
                [
                    r["capacity"],
                    r["belady"],
                    *[f"{r[p]:.3f} ({r[p + '/belady']:.0%})" for p in POLICIES],
                ]
                for r in offline
            ],
        ),
        "",
        "LRU gets almost no hits below 64 records: a token walks its 32 layers x 2 = 64 "
        "records in the same cyclic order, so with fewer slots LRU always evicts the record "
        "wanted next (the classic LRU loop pathology); frequency-based policies keep part of "
        "the set.",
        "",
        "How much of the future would a policy need? The default policy (nextuse) told the "
        "exact next use of every record due within the next N steps (1 step = one layer of "
        "one token; a router predicting the next layer's experts knows N = 1), as a "
        "fraction of Belady's hits:",
        "",
        table(
            [
                "budget (records)",
                "Belady",
                *[f"N = {n} ({_horizon_name(n, trace.num_layers)})" for n in horizons],
            ],
            [
                [r["capacity"], r["belady"], *[f"{r[f'lookahead={n}']:.3f}" for n in horizons]]
                for r in ahead
            ],
        ),
        "",
        "Knowing the next layer (N = 1) changes nothing: the records it protects are the "
        "ones no policy evicts anyway (next in the cycle). Near Belady at half the records "
        "takes the exact routing of the next tokens at every layer, which no router "
        "prediction gives.",
        "",
        "Online replay: the same trace through colibri's UringReader, ExpertCache and "
        "Prefetcher over a synthetic experts file of Mixtral-8x7B q4_0 records "
        f"({mixtral_record_nbytes() / 1e6:.1f} MB each, 3 x 4096 x 14336 weights; "
        f"'scaled' = 1/16 of that, {mixtral_record_nbytes(16) / 1e6:.2f} MB, so tokens/s are ~16x "
        "a real model's for the same hit rate). compute_ms = 0: no FFN time between layers, so "
        "tokens/s is the IO-only ceiling and prefetch has no compute to hide behind (it can "
        "only deepen the queue). Each run warms the cache for the first tokens, then times the "
        "next ones; prefetch oracle = layer L+1's true experts, repeat = the previous token's. "
        "Hit rates with prefetch can exceed Belady (MIN bounds demand caching only). Medians of "
        f"{ctx.rounds} interleaved rounds. Offline hit rate = the simulator on the same window: "
        + (
            "it equals the online no-prefetch hit rate in every run."
            if not mismatch
            else f"**{len(mismatch)} online runs differ from it.**"
        ),
        "",
        table(
            [
                "records",
                "budget",
                "policy",
                "prefetch",
                "tok/s",
                "GB/s",
                "of disk",
                "hit rate",
                "offline",
                "of MIN",
                "MB/token",
            ],
            [
                [
                    r["records"],
                    r["budget_records"],
                    r["policy"],
                    r["prefetch"],
                    r["tokens_per_second"],
                    r["gb_per_second"],
                    f"{r['gb_per_second'] / disk[r['records']]:.0%}"
                    if r["records"] in disk
                    else "—",
                    r["hit_rate"],
                    r["offline_hit_rate"],
                    f"{r['hit_rate'] / r['belady_hit_rate']:.0%}",
                    r["bytes_read_per_token"] / 1e6,
                ]
                for r in rows
            ],
        ),
        "",
        f"Disk limit (fio random reads, QD {QD}): "
        + (", ".join(f"{k} {v:.2f} GB/s" for k, v in disk.items()) or "not available")
        + " (GB/s counts every byte read, prefetches included; on this shared machine the "
        "limit and the replays are measured minutes apart, so 'of disk' above 100% is noise)"
        + ". Files made this run: "
        + (", ".join(f"{k} {v:.0f} s" for k, v in made.items() if v) or "none (reused)")
        + ".",
        "",
        "Router-based prefetcher on colibri's own runs (decode tokens only, budget 1/4 of the "
        "experts, greedy, C4 prompts): recall = predicted experts the token then used / all it "
        "used in predicted layers; precision = used / predicted. Baselines: the previous "
        "token's experts at the same layer, and chance (k/E). Synthetic stores have random "
        "weights, so their routing is not a trained model's.",
        "",
        table(
            [
                "store",
                "layers",
                "top-k of E",
                "decode tokens",
                "recall",
                "precision",
                "previous token",
                "chance",
                "wasted reads",
                "back-offs",
            ],
            [
                [
                    r["store"],
                    r["layers"],
                    f"{r['top_k']} of {r['num_experts']}",
                    r["decode_tokens"],
                    r["recall"],
                    r["precision"],
                    r["previous_token_recall"],
                    r["chance_recall"],
                    r["wasted_reads"],
                    r["backoffs"],
                ]
                for r in recall
            ],
        ),
    ]
    if notes:
        md += ["", *[f"- {n}" for n in notes]]
    data = {
        "trace": {"path": str(TRACE), "tokens": trace.num_tokens, "steps": len(steps)},
        "offline": offline, "lookahead": ahead, "online": rows, "disk_gbps": disk,
        "files_seconds": made,
        "prefetch_recall": recall, "compute_ms": 0.0, "queue_depth": QD, "notes": notes,
        "headline_rows": [asdict(h) for h in heads],
    }  # fmt: skip
    return Section("replay", TITLE, "\n".join(md), data, figs, heads)
