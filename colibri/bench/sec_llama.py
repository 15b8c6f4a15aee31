"""llama.cpp as the peer on the very same weights (issue 8, item 2).

A synthetic Mixtral-8x7B-shaped Q4_0 store (tools/synth_store.py, real layer shapes, fewer
layers) is exported to GGUF with the store's own blocks (colibri/export_gguf.py), so both
engines multiply identical bytes. Two scenarios, same thread count for both engines:

1. Fits in RAM: every expert resident (colibri's budget >= the store). llama.cpp's own
   llama-bench (pp N / tg M) against colibri's engine in a child process (all experts loaded
   first, then prefill of N tokens and decode of M tokens timed separately), rounds
   interleaved. Bound: active weight bytes per token / memory bandwidth.
2. Bigger than the memory limit: a model ~2x a cgroup memory limit (made here for our own child
   processes; the page cache is charged to it). llama.cpp's llama-completion with its default
   mmap, once with its default Q4_0 repack and once with --no-repack; colibri with an expert
   budget that fits under the limit with its dense weights, KV cache and the interpreter. The
   model files' cached pages are dropped before each run. Bound: disk bandwidth / the bytes
   colibri reads per token.

Both colibri runs are child processes (`python -m colibri.bench.sec_llama --child ...`), so their
memory is measured and limited the way llama.cpp's is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from colibri.bench import llama_cpp, sec_limits
from colibri.bench.report import (
    ROOT,
    Context,
    Headline,
    Section,
    fmt,
    interleave,
    median,
    table,
    tool,
)

TITLE = "llama.cpp on the same weights"
MODEL = "mixtral-8x7b"
PROMPT = "The history of the hummingbird begins in the forests of South America, where"
# interpreter, numpy, colibri's modules, thread stacks, KV cache and pipeline buffers: what a
# colibri process holds besides its dense weights and expert slabs (peak RSS minus those two
# measured ~0.1 GB here; the rest is headroom for the page cache the cgroup is charged for)
COLIBRI_OVERHEAD = 192 << 20
# wall-clock limit of one peer's run under the memory limit (quick runs: 120 s):
# llama.cpp's default repack under a cgroup limit thrashed for 13 min, reading 432 GB
PEER_TIME_LIMIT_S = 300
PREFILL_SIZES = (64, 512, 2048)  # prompt tokens of the in-RAM prefill rows (issue 23)
DECODE_DEPTH = 2048  # context tokens before the "decode at depth" row (issue 23)


# ---- pure figures (unit-tested) -----------------------------------------------------------


def ik_commit(bindir: Path | None) -> str | None:
    """The ik_llama.cpp commit that tools/build_ik_llama_cpp.sh recorded beside `bindir`
    (its llama-bench JSON has no build_commit); None when unknown."""
    path = bindir.parent / "COMMIT" if bindir is not None else None
    if path is None or not path.is_file():
        return None
    return path.read_text().strip()[:12] or None


def best_peer(
    med: dict[str, dict[str, Any]],
) -> tuple[dict[str, Any], dict[str | int, str]]:
    """The best peer per figure among the engines of `med` that are not colibri's
    ({name: {"tg", "pp", "pp_by_n": {size: tok/s}}}, medians): ({"tg", "pp", "pp_by_n"} of the
    fastest peer at each, None / absent where no peer ran), ({"tg" or size: that peer's name})."""
    peers = {n: m for n, m in med.items() if not n.startswith("colibri")}
    out: dict[str, Any] = {"tg": None, "pp": None, "pp_by_n": {}}
    names: dict[str | int, str] = {}
    for key in ("tg", "pp"):
        have = [(m[key], n) for n, m in peers.items() if m.get(key)]
        if have:
            out[key], name = max(have)
            names[key] = name
    sizes = {k for m in peers.values() for k in m.get("pp_by_n", {})}
    for size in sorted(sizes):
        have = [(m["pp_by_n"][size], n) for n, m in peers.items() if m["pp_by_n"].get(size)]
        if have:
            out["pp_by_n"][size], names[size] = max(have)
    return out, names


def split_peers(med: dict[str, Any], get: Any) -> dict[str, Any]:
    """The headline's two peer cells from medians {engine name: figures}: llama.cpp's figure
    and ik_llama.cpp's best variant (as built or -rtr 1), `get(figures)` picking the figure
    (None: not measured). Returns {"peer": llama.cpp or None, "ik": ik or None} for
    Headline(**...)."""
    lcpp = get(med["llama.cpp"]) if "llama.cpp" in med else None
    iks = [v for n, m in med.items() if n.startswith("ik_llama") and (v := get(m))]
    return {"peer": lcpp or None, "ik": max(iks) if iks else None}


def pp_n(m: dict[str, Any], n: int) -> float | None:
    """Median figures' prefill tok/s at n tokens (None: not measured)."""
    return m["pp_by_n"].get(n)


def active_bytes_per_token(
    dense_nbytes: dict[str, int],
    embedding: str,
    vocab_size: int,
    num_layers: int,
    top_k: int,
    expert_nbytes: int,
) -> int:
    """Weight bytes one decoded token reads: every dense tensor except the token embedding
    (attention, norms, routers, the LM head), one row of the embedding, and top_k experts per
    layer (expert_nbytes: one expert's gate+up+down bytes, padding excluded).
    Raises KeyError when `embedding` is not among dense_nbytes."""
    emb = dense_nbytes[embedding]
    return sum(dense_nbytes.values()) - emb + emb // vocab_size + num_layers * top_k * expert_nbytes


def outcome(runs: int, ok: int, oom_kills: int, timeouts: int, time_limit_s: float) -> str:
    """The table's outcome of a peer's `runs` runs under the memory limit: "ok", "did not
    finish in N s" (ended by the wall-clock limit), the OOM killer, or other failures."""
    if ok == runs:
        return "ok"
    if timeouts:
        n = f" ({timeouts}×)" if runs > 1 else ""
        return f"did not finish in {time_limit_s:.0f} s{n}"
    if oom_kills:
        return f"killed by the OOM killer ({oom_kills}×)"
    return f"failed {runs - ok}/{runs}"


def thrash_note(m: dict[str, Any], n_gen: int, time_limit_s: float) -> str:
    """What bounds a peer that did not finish under the memory limit (summary figures `m`):
    "< x tok/s (did not finish N tokens in T s; read G GB)" when the clock ended it (it made
    fewer than N tokens in T s; G from its processes' storage reads), else its outcome."""
    if not m["timeouts"]:
        return outcome(m["runs"], m["ok"], m["oom_kills"], 0, time_limit_s)
    read = f"; read {m['read_bytes'] / 1e9:.0f} GB" if m.get("read_bytes") else ""
    return (f"< {n_gen / time_limit_s:.2g} tok/s (did not finish {n_gen} tokens in "
            f"{time_limit_s:.0f} s{read})")  # fmt: skip


def colibri_budget(
    limit: int, dense_nbytes: int, record_nbytes: int, overhead: int = COLIBRI_OVERHEAD
) -> int:
    """Largest expert budget (a whole number of records, bytes) such that dense weights +
    budget + overhead stay within `limit` bytes; 0 when not even one record fits."""
    spare = limit - dense_nbytes - overhead
    return max(0, spare // record_nbytes) * record_nbytes


def per_layer_tok_s(small: float | None, big: float | None) -> float | None:
    """Prefill tok/s of one more full layer: an engine that prefills n tokens at `small` tok/s
    on a model of L layers and at `big` on the same model with L + 1 spends n / big - n / small
    seconds in the extra layer, so the layer alone runs at 1 / (1 / big - 1 / small) tok/s.
    Every engine runs the last layer's FFN only for the tokens whose logits are asked for
    (llama-bench: the last one; llama.cpp's inp_out_ids, colibri's Pipeline.skip_unused_rows),
    and each skips a different share of that layer's attention (llama.cpp none of it but
    the FFN's input rows, colibri all but K and V), so a model's tok/s mixes full and partial
    layers; one more full layer (attention and FFN over every token) is the same work in
    every engine. None when a figure is missing or the bigger model was not slower (noise)."""
    if not small or not big or big >= small:
        return None
    return 1.0 / (1.0 / big - 1.0 / small)


def pp_at(r: dict[str, Any], n: int) -> float | None:
    """A run's prefill tok/s at n prompt tokens (colibri: pp_by_n[n]["tok_s"]; llama.cpp:
    pp_by_n[n]), None when that size was not run."""
    x = (r.get("pp_by_n") or {}).get(n)
    return x["tok_s"] if isinstance(x, dict) else x


def prefill_breakdown(
    runs: list[dict[str, Any]],
    peer: dict[int, float],
    sizes: Sequence[int],
    name: str,
    expert_macs_per_token: int = 0,
    peer_names: dict[Any, str] | None = None,
    moe_layers: int = 0,
) -> list[str]:
    """Markdown lines saying where colibri's prefill time goes (the last run's PartTimer
    split, `name`'s runs) at each size where it is slower than the peer's tok/s (peer:
    {size: tok/s}, named by peer_names[size], default "llama.cpp"; every size when the peer
    did not run). expert_macs_per_token: the routed experts' multiply-adds per token (all
    layers, top-k), to state their GMAC/s (0: not). moe_layers: the MoE layers they are
    summed over, the last of which runs the last token only (Pipeline.skip_unused_rows):
    n tokens then take (moe_layers - 1) n + 1 rows' worth, and a single MoE layer (one
    token's matvec) gets no rate; 0: every layer runs every token."""
    r = runs[-1] if runs else {}
    out = []
    for n in sizes:
        x = (r.get("pp_by_n") or {}).get(n)
        if not x or not x.get("breakdown_s") or (peer.get(n) and x["tok_s"] >= peer[n]):
            continue
        ms = n / x["tok_s"] * 1e3
        who = (peer_names or {}).get(n, "llama.cpp")
        versus = (f"; {who} takes {n / peer[n] * 1e3:.0f} ms "
                  f"({x['tok_s'] / peer[n]:.2f}×)" if peer.get(n) else "")  # fmt: skip
        rate = ""
        macs = expert_macs_per_token * n
        if moe_layers:
            macs = expert_macs_per_token // moe_layers * ((moe_layers - 1) * n + 1)
        if macs and moe_layers != 1 and x["breakdown_s"].get("routed experts"):
            gmacs = macs / x["breakdown_s"]["routed experts"] / 1e9
            rate = f" The routed experts ran at {gmacs:.0f} GMAC/s (wall)."
        split = breakdown_line(x["breakdown_s"], n)
        out.append(f"Where colibri's {n}-token prefill time goes ({name}, last round, "
                   f"{ms:.0f} ms{versus}): {split}.{rate}\n")  # fmt: skip
    return out


# ---- colibri child process ----------------------------------------------------------------


# Parts of a forward pass that the prefill breakdown times (the child wraps these functions):
# label -> (owner, attribute). Nested calls of the same label count once (the outermost).
PARTS = {
    "routed experts": ("model", "expert_ffn"),
    "attention (projections, norm, RoPE)": ("model", "attention_batch"),
    "attention core (QK^T, softmax, PV)": ("ops", "attention"),
    "router": ("model", "route"),
    "LM head": ("model", "logits"),
    "embedding": ("model", "embed"),
}


class PartTimer:
    """Seconds spent in each of PARTS while installed (wraps the functions; uninstall()
    restores them). "attention (projections...)" excludes its attention core."""

    def __init__(self) -> None:
        from colibri import model
        from colibri.compute import ops

        self.seconds = dict.fromkeys(PARTS, 0.0)
        self._depth: dict[str, int] = {}  # calls in progress per label (the compute thread's)
        self._saved: list[tuple[Any, str, Any]] = []
        owners = {"model": model.Model, "ops": ops}
        for label, (owner, name) in PARTS.items():
            obj = owners[owner]
            fn = getattr(obj, name)
            self._saved.append((obj, name, fn))
            setattr(obj, name, self._wrap(label, fn))
        # a trip's ready experts in one call (Model.expert_ffn_group): routed experts too
        self._saved.append((model.Model, "expert_ffn_group", model.Model.expert_ffn_group))
        model.Model.expert_ffn_group = self._wrap("routed experts", model.Model.expert_ffn_group)
        # Model.attention (per sequence) runs inside attention_batch, and both inside
        # attention_rows (the last layer): each is timed only when outermost
        for name in ("attention", "attention_rows"):
            fn = getattr(model.Model, name)
            self._saved.append((model.Model, name, fn))
            setattr(model.Model, name, self._wrap("attention (projections, norm, RoPE)", fn))

    def _wrap(self, label: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth[label] = self._depth.get(label, 0) + 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth[label] -= 1
                if not self._depth[label]:
                    self.seconds[label] += time.perf_counter() - t0

        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)

    def split(self, total_s: float) -> dict[str, float]:
        """Seconds per part of a pass that took total_s, the rest as "other (Python, gathers,
        residual sums, thread hand-offs)"; the attention core is taken out of the attention
        row, which contains it."""
        out = dict(self.seconds)
        out["attention (projections, norm, RoPE)"] -= out["attention core (QK^T, softmax, PV)"]
        out["other (Python, gathers, residual sums, thread hand-offs)"] = max(
            0.0, total_s - sum(out.values())
        )
        return out

    def uninstall(self) -> None:
        for obj, name, fn in reversed(self._saved):
            setattr(obj, name, fn)


def decode_breakdown(
    split: dict[str, float], sf: dict[str, Any], mem_gbps: float | None, name: str
) -> str:
    """Markdown: where a decoded token's time goes (split: PartTimer seconds per token of a
    second decode), each weight-reading part with the GB/s it streamed its weights at (sf:
    store_figures) and its share of the read bound (mem_gbps, GB/s)."""
    nbytes = {"routed experts": sf.get("experts_nbytes_per_token"),
              "LM head": sf.get("lm_head_nbytes"),
              "attention (projections, norm, RoPE)": sf.get("attention_nbytes")}  # fmt: skip
    total = sum(split.values())
    parts = []
    for k, v in sorted(split.items(), key=lambda kv: -kv[1]):
        if v <= 0:
            continue
        txt = f"{k} {v * 1e3:.2f} ms ({v / total:.0%})"
        if nbytes.get(k):
            gbps = nbytes[k] / v / 1e9
            txt += f" at {gbps:.1f} GB/s" + (f" = {gbps / mem_gbps:.0%} of the read bound"
                                             if mem_gbps else "")  # fmt: skip
        parts.append(txt)
    at_bound = ""
    if mem_gbps:
        ms = sf["active_bytes_per_token"] / mem_gbps / 1e6
        at_bound = (
            f"; at the read bound ({mem_gbps:.1f} GB/s) the weight reads alone take {ms:.2f} ms"
        )
    return (
        f"Decode per token by part ({name}, a second decode of the same length under a "
        f"timer, {total * 1e3:.2f} ms a token{at_bound}): " + ", ".join(parts) + "."
    )


def breakdown_line(split: dict[str, float], n_prompt: int) -> str:
    """'part X ms (Y%)' for each part of a prefill of n_prompt tokens, largest first."""
    total = sum(split.values()) or 1.0
    parts = sorted(split.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v * 1e3:.0f} ms ({v / total:.0%})" for k, v in parts if v > 0)


async def _child(a: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from colibri.bench.decode import timed_greedy
    from colibri.engine import open_engine

    opts: dict[str, Any] = dict(budget=a.budget, threads=a.threads, n_ctx=a.n_ctx)
    if a.activations:
        opts["activations"] = a.activations
    if a.kv:
        opts["kv_dtype"] = a.kv
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    async with open_engine(a.store, **opts) as eng:
        out["open_s"] = time.perf_counter() - t0
        if a.warm:  # every expert resident before timing: the "fits in RAM" case
            t1 = time.perf_counter()
            for rec in eng.store.records:
                (await eng.cache.get(rec.layer, rec.expert)).release()
            out["warm_s"] = time.perf_counter() - t1
        rng = np.random.default_rng(0)
        sizes = [int(n) for n in str(a.n_prompt).split(",") if int(n)]
        if sizes:
            prompt = rng.integers(10, eng.spec.vocab_size, max(sizes)).tolist()
            await eng.forward(eng.new_sequence(), prompt[:8])  # kernels and thread pool up
            timer = PartTimer() if a.breakdown else None
            out["pp_by_n"] = {}
            for n in sizes:
                samples, split = [], None
                # untimed first: llama-bench's warmup runs the same prompt size; colibri's
                # first prefill of a size also pays its new buffers' page faults
                await eng.forward(eng.new_sequence(), prompt[:n])
                for _ in range(a.prefill_reps if n <= 512 else 1):
                    seq = eng.new_sequence()
                    if timer:
                        timer.reset()
                    t1 = time.perf_counter()
                    await eng.forward(seq, prompt[:n])
                    dt = time.perf_counter() - t1
                    samples.append(n / dt)
                    split = timer.split(dt) if timer else None
                out["pp_by_n"][n] = {"tok_s": float(np.median(samples)), "samples": samples,
                                     "breakdown_s": split}  # fmt: skip
            if timer:
                timer.uninstall()
            out["pp_samples"] = out["pp_by_n"][sizes[0]]["samples"]
            out["pp_tok_s"] = out["pp_by_n"][sizes[0]]["tok_s"]
        if a.n_gen:
            seq = eng.new_sequence()
            bos = eng.store.config.get("bos_token_id") or 1
            ids = eng.encode_prompt(a.text) if a.text else [bos]
            if a.depth:  # decode at a context of `depth` tokens (llama-bench -d / -gp)
                rng = np.random.default_rng(1)
                ids = [bos, *rng.integers(10, eng.spec.vocab_size, a.depth - 1).tolist()]
            t1 = time.perf_counter()
            logits = await eng.forward(seq, ids)
            out["n_prompt_decode"] = len(ids)
            out["prompt_s"] = time.perf_counter() - t1
            if a.warm:  # one untimed step first, as llama-bench's warmup (test_gen of 1)
                _, _, logits = await timed_greedy(eng, seq, logits, 1)
            c0, io0, comp0 = eng.cache.statistics(), eng.pipeline.times.wait_io, \
                eng.pipeline.times.compute  # fmt: skip
            _, dt, logits = await timed_greedy(eng, seq, logits, a.n_gen)
            c1 = eng.cache.statistics()
            gets = (c1.hits - c0.hits) + (c1.misses - c0.misses)
            out |= {
                "tg_tok_s": a.n_gen / dt,
                "decode_s": dt,
                "hit_rate": (c1.hits - c0.hits) / gets if gets else 1.0,
                "bytes_read_per_token": (c1.bytes_read - c0.bytes_read) / a.n_gen,
                "wait_io_s_per_token": (eng.pipeline.times.wait_io - io0) / a.n_gen,
                "compute_s_per_token": (eng.pipeline.times.compute - comp0) / a.n_gen,
            }
            if a.breakdown:  # a second decode, timed by part (the wrappers cost ~1 us a call)
                timer = PartTimer()
                try:
                    _, dt2, _ = await timed_greedy(eng, seq, logits, a.n_gen)
                    out["decode_breakdown_s"] = {
                        k: v / a.n_gen for k, v in timer.split(dt2).items()
                    }
                finally:
                    timer.uninstall()
        st = eng.cache.statistics()
        out |= {
            "budget": st.budget_nbytes,
            "num_slots": st.num_slots,
            "dense_nbytes": eng.model.dense_nbytes,
            "reader": eng.reader.statistics().backend,
        }
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def child_main(argv: list[str]) -> int:
    """`python -m colibri.bench.sec_llama --child STORE ...`: one colibri measurement, JSON on
    stdout."""
    ap = argparse.ArgumentParser(prog="colibri.bench.sec_llama --child")
    ap.add_argument("store")
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument(
        "--n-prompt",
        default="0",
        help="timed prefill of N random tokens (N,M,...: one prefill per size)",
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="time the parts of each prefill (PARTS) and report them",
    )
    ap.add_argument("--prefill-reps", type=int, default=2)
    ap.add_argument("--n-gen", type=int, default=0, help="timed greedy decode of N tokens")
    ap.add_argument("--text", default="", help="decode after this prompt (default: BOS)")
    ap.add_argument(
        "--depth", type=int, default=0, help="decode after N context tokens (random; untimed)"
    )
    ap.add_argument("--warm", action="store_true", help="load every expert before timing")
    ap.add_argument("--activations", default="")
    ap.add_argument("--kv", default="", help="KV cache dtype (f32, f16; default the engine's)")
    a = ap.parse_args(argv)
    print(json.dumps(asyncio.run(_child(a))), flush=True)
    return 0


def run_colibri(
    ctx: Context, args: list[str], limit: int | None = None, time_limit: float | None = None
) -> dict[str, Any]:
    """Run the colibri child (optionally inside a fresh memory cgroup of `limit` bytes, and
    ended after `time_limit` s of wall clock: llama_cpp.run_capped). Returns its JSON, plus
    "returncode", "cgroup_peak_bytes", "oom_kills", "wall_s", "timed_out"; a failed run has
    "error" (stderr tail) instead of timings."""
    cmd = [sys.executable, "-m", "colibri.bench.sec_llama", "--child", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if limit:
        ctx.record(f"(in a memory cgroup limited to {limit} bytes) " + shlex.join(cmd))
        cm = llama_cpp.memory_cgroup(limit)
    else:
        ctx.record(cmd)
        cm = _null()
    with cm as cg:
        t0 = time.perf_counter()
        res, timed_out = llama_cpp.run_capped(
            cmd, time_limit, llama_cpp._join(cg["procs"]) if cg else None, cwd=ROOT, env=env
        )
        wall = time.perf_counter() - t0
    out: dict[str, Any] = {"returncode": res.returncode, "wall_s": wall, "timed_out": timed_out}
    if timed_out:
        out["error"] = f"did not finish in {time_limit:.0f} s"
        out["returncode"] = res.returncode or -9
    elif res.returncode == 0:
        out |= json.loads(res.stdout.strip().splitlines()[-1])
    else:
        out["error"] = res.stderr[-1500:]
    if cg:
        out["cgroup_peak_bytes"] = cg.get("peak_bytes")
        out["oom_kills"] = cg.get("oom_kills")
    return out


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ---- models -------------------------------------------------------------------------------


def ensure_model(
    ctx: Context, layers: int, want_gguf: bool
) -> tuple[Path | None, Path | None, str]:
    """The Mixtral-shaped Q4_0 store with `layers` layers under ctx.work/llama (made by
    tools/synth_store.py if missing) and its GGUF (colibri export-gguf) when want_gguf.
    Returns (store, gguf, note); a path is None when it could not be made (note says why)."""
    d = ctx.work / "llama"
    d.mkdir(parents=True, exist_ok=True)
    store = d / f"{MODEL}-L{layers}-q4_0"
    gguf = d / f"{store.name}.gguf"
    est = int(0.3e9 + 0.84e9 * layers)  # dense (embeddings, LM head) + per layer
    need = (0 if (store / "manifest.json").exists() else est) + (
        0 if gguf.exists() or not want_gguf else est)  # fmt: skip
    if need and ctx.free_bytes() < need + (2 << 30):
        return None, None, f"not enough free space under {ctx.work} ({need / 1e9:.1f} GB needed)"
    if not (store / "manifest.json").exists():
        ctx.log(f"making {store.name} (~{est / 1e9:.1f} GB)")
        cmd = [sys.executable, tool("synth_store.py"), MODEL, str(store),
               "--layers", str(layers), "--force"]  # fmt: skip
        ctx.run(["nice", *cmd])
    if want_gguf and not gguf.exists():
        ctx.log(f"exporting {gguf.name}")
        ctx.run(["nice", sys.executable, "-m", "colibri", "export-gguf", str(store), str(gguf)],
                cwd=ROOT)  # fmt: skip
    return store, gguf if want_gguf else None, ""


def store_figures(store_path: Path) -> dict[str, Any]:
    """Sizes of a store: total/dense/record bytes, active weight bytes per token and the
    routed experts' multiply-adds per token (Mixtral's config fields)."""
    from colibri.io.format import open_store, tensor_nbytes

    st = open_store(store_path)
    cfg = st.config
    dense = {n: tensor_nbytes(i["qtype"], i["shape"]) for n, i in st.manifest["dense"].items()}
    expert = sum(t.nbytes for t in st.layout.tensors.values())
    moe_layers = len({rec.layer for rec in st.records})
    return {
        "layers": cfg["num_hidden_layers"],
        # K (or V) elements per token per layer: the KV cache a decode step reads
        "kv_dim": (cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        * (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
        "moe_layers": moe_layers,
        # routed experts' multiply-adds per token: gate, up and down of top_k experts per layer
        "expert_macs_per_token": moe_layers
        * cfg["num_experts_per_tok"]
        * 3
        * cfg["hidden_size"]
        * cfg["intermediate_size"],
        # weight bytes per decoded token by part (the decode breakdown's GB/s)
        "lm_head_nbytes": dense.get("lm_head.weight", dense["model.embed_tokens.weight"]),
        "attention_nbytes": sum(v for n, v in dense.items() if ".self_attn." in n),
        "experts_nbytes_per_token": moe_layers * cfg["num_experts_per_tok"] * expert,
        "store_nbytes": sum(dense.values()) + len(st.records) * st.layout.record_nbytes,
        "dense_nbytes": sum(dense.values()),
        "record_nbytes": st.layout.record_nbytes,
        "num_records": len(st.records),
        "active_bytes_per_token": active_bytes_per_token(
            dense,
            "model.embed_tokens.weight",
            cfg["vocab_size"],
            cfg["num_hidden_layers"],
            cfg["num_experts_per_tok"],
            expert,
        ),
    }


def _fio_gbps(ctx: Context, experts: Path) -> float:
    """The disk's limit for colibri's reads, measured in the same rounds: fio random 4 MiB
    O_DIRECT reads (io_uring, QD 32, 512 MiB) of the store's own experts file (read-only);
    records of ~95 MiB are read in such pieces. GB/s. Raises CalledProcessError (fio failed)."""
    return sec_limits.fio_gbps(ctx, experts, 4 << 20, 32, 512 << 20, seed=len(ctx.commands))


# ---- the section --------------------------------------------------------------------------


def decode_at_depth(
    ctx: Context, store: Path, gguf: Path, ik_dir: Path | None, sf: dict[str, Any],
    mem_gbps: float | None, n_gen: int, reps: int, activations: str,
) -> tuple[list[str], Headline, dict[str, Any]]:  # fmt: skip
    """Decode of `n_gen` tokens after DECODE_DEPTH tokens of context, in RAM, every engine in
    interleaved rounds: llama.cpp `llama-bench -d`, ik_llama.cpp `-gp` (as built and -rtr 1),
    colibri's child with --depth. Returns (markdown lines, the headline, raw data)."""
    depth = DECODE_DEPTH
    raw: dict[str, list[dict[str, Any]]] = {}

    def peer(name: str, extra: list[str], bdir: Path | None) -> float:
        r = llama_cpp.run_llama_bench(gguf, ctx.threads, 0, n_gen, reps, extra, bindir=bdir,
                                      depth=depth, ik=bdir is not None)  # fmt: skip
        ctx.record(r.pop("cmd"))
        raw.setdefault(name, []).append(r)
        return r["tg_tok_s"]

    cname = f"colibri ({activations} activations)"
    # the peers keep an f16 KV cache (llama-bench's default -ctk f16); colibri's default is
    # f32 (exact against transformers), so it runs both ways: f16 is the same bytes as theirs
    names = {"f32": f"{cname}, f32 KV", "f16": f"{cname}, f16 KV"}

    def col(kv: str) -> float:
        args = [str(store), "--budget", str(sf["store_nbytes"]), "--threads", str(ctx.threads),
                "--n-ctx", str(depth + 2 * n_gen + 8), "--n-gen", str(n_gen),
                "--depth", str(depth), "--warm", "--activations", activations, "--kv", kv,
                *(["--breakdown"] if kv == "f16" else [])]  # fmt: skip
        r = run_colibri(ctx, args)
        if r["returncode"]:
            raise RuntimeError(f"colibri child failed: {r['error']}")
        raw.setdefault(names[kv], []).append(r)
        return r["tg_tok_s"]

    runs: dict[str, Any] = {"llama.cpp": lambda: peer("llama.cpp", [], None)}
    if ik_dir is not None:
        runs["ik_llama.cpp"] = lambda: peer("ik_llama.cpp", [], ik_dir)
        runs["ik_llama.cpp (-rtr 1)"] = lambda: peer("ik_llama.cpp (-rtr 1)", ["-rtr", "1"],
                                                     ik_dir)  # fmt: skip
    runs[names["f32"]] = lambda: col("f32")
    runs[names["f16"]] = lambda: col("f16")
    ctx.log(f"decode at {depth} tokens of context: {store.name}, {ctx.rounds} rounds")
    interleave(runs, ctx.rounds, ctx.log)
    med = {name: median([r["tg_tok_s"] for r in rs]) for name, rs in raw.items()}
    peers = {n: v for n, v in med.items() if not n.startswith("colibri")}
    best = max(peers, key=lambda n: peers[n]) if peers else None
    # KV bytes read per token at this depth: 2 (K and V) x layers x kv_dim x depth x 2 or 4
    kv16 = 2 * sf["layers"] * sf["kv_dim"] * depth * 2
    bounds = {n: mem_gbps * 1e9 / (sf["active_bytes_per_token"] + kv16 * (2 if "f32" in n else 1))
              for n in med} if mem_gbps else {}  # fmt: skip
    rows = [[n, v, "—" if not best else f"{v / peers[best]:.2f}×",
             f"{v / bounds[n]:.0%}" if bounds else "—"] for n, v in med.items()]  # fmt: skip
    head_name = names["f16"]
    md = [
        f"**Decode at {depth} tokens of context.** {n_gen} greedy tokens after a context of "
        f"{depth} tokens (untimed prefill), medians of {ctx.rounds} interleaved rounds: "
        f"llama.cpp `llama-bench -p 0 -n {n_gen} -d {depth}`, ik_llama.cpp `llama-bench -p 0 "
        f"-n 0 -gp {depth},{n_gen}` (flash attention on, its default; both keep an f16 KV "
        f"cache), colibri's child with `--depth {depth}` and an f32 KV cache (its default, "
        f"exact against transformers) or an f16 one (`--kv f16`, the peers' bytes; the "
        f"headline's figure). Each bound adds the KV reads ({kv16 / 1e6:.0f} MB a token in "
        f"f16, twice that in f32) to the {sf['active_bytes_per_token'] / 1e6:.0f} MB of "
        f"weights at {fmt(mem_gbps) if mem_gbps else '—'} GB/s.",
        "",
        table(["engine", f"decode tok/s at {depth}", "vs best peer", "of bound"], rows),
        "",
    ]
    split = raw[head_name][-1].get("decode_breakdown_s")
    if split:  # where the time goes at this depth (the attention core grows with it)
        md += [decode_breakdown(split, sf, mem_gbps, f"{head_name}, at {depth}, last round"),
               ""]  # fmt: skip
    bound = bounds.get(head_name)
    head = Headline(f"Decode at {depth} tokens of context, model fits in RAM", "tok/s",
                    med[head_name], limit=bound,
                    limit_name="memory bandwidth bound (weights + f16 KV)",
                    target="≥ 1.2× the best peer", note=f"{head_name} (as the peers); f32 KV "
                    f"{fmt(med[names['f32']])}; best peer: {best or 'did not run'}",
                    **split_peers(med, lambda v: v))  # fmt: skip
    return md, head, {"depth": depth, "runs": raw, "medians": med, "bound_tok_s": bound}


def run(ctx: Context) -> Section:
    quick = ctx.quick
    # quick: 1.1 GB in RAM, 1.95 GB under a 0.9 GiB limit; full: 1.95 GB, 3.6 GB under 1.7 GiB
    fits_layers, big_layers = (1, 2) if quick else (2, 4)
    n_gen, reps = (16, 1) if quick else (32, 2)
    sizes = PREFILL_SIZES
    n_prompt = sizes[0]
    big_gen = 6 if quick else 16
    try:
        bindir: Path | None = llama_cpp.llama_bin_dir()
        llama_cpp._exe("llama-bench")
    except FileNotFoundError:
        bindir = None
    have_llama = bindir is not None
    ik_dir = llama_cpp.ik_llama_bin_dir() if have_llama else None
    data: dict[str, Any] = {"llama_cpp_bin": str(bindir) if bindir else None,
                            "threads": ctx.threads}  # fmt: skip
    md: list[str] = []
    if not have_llama:
        md.append("**llama.cpp is not built**, so only colibri's figures are shown. Build it "
                  "once with `tools/build_llama_cpp.sh` (about 30 minutes on this machine; "
                  "cached under ~/.cache/colibri) and rerun.\n")  # fmt: skip
    mem_gbps = sec_limits.memory_gbps(ctx)
    data["mem_gbps"] = mem_gbps
    variants = ["q8_0", "f32"]  # the engine's default first, then the exact path
    vname = {v: f"colibri ({v} activations)" for v in variants}
    heads: list[Headline] = []

    # -- 1. fits in RAM ---------------------------------------------------------------------
    fits: dict[str, Any] = {}
    store, gguf, note = ensure_model(ctx, fits_layers, have_llama)
    if store is None:
        md.append(f"_Fits-in-RAM benchmark skipped: {note}._\n")
    else:
        sf = store_figures(store)
        fits |= {"store": str(store), "gguf": str(gguf) if gguf else None, **sf,
                 "n_prompt": n_prompt, "prefill_sizes": list(sizes), "n_gen": n_gen}  # fmt: skip
        bound = mem_gbps * 1e9 / sf["active_bytes_per_token"] if mem_gbps else None
        fits["bound_tok_s"] = bound
        runs: dict[str, Any] = {}
        raw: dict[str, list[dict[str, Any]]] = {}
        if gguf is not None:

            def llama() -> float:
                r = llama_cpp.run_llama_bench(gguf, ctx.threads, sizes, n_gen, reps)
                ctx.record(r.pop("cmd"))
                raw.setdefault("llama.cpp", []).append(r)
                return r["tg_tok_s"]

            runs["llama.cpp"] = llama
            if ik_dir is not None:
                # ik_llama.cpp as it runs by default, and with its run-time repack of Q4_0
                # into its interleaved rows (-rtr 1), its fastest CPU path
                for name, extra in (("ik_llama.cpp", []), ("ik_llama.cpp (-rtr 1)", ["-rtr", "1"])):

                    def ik(name: str = name, extra: list[str] = extra) -> float:
                        r = llama_cpp.run_llama_bench(gguf, ctx.threads, sizes, n_gen, reps,
                                                      extra, bindir=ik_dir)  # fmt: skip
                        ctx.record(r.pop("cmd"))
                        raw.setdefault(name, []).append(r)
                        return r["tg_tok_s"]

                    runs[name] = ik
        for v in variants:

            def col(v: str = v) -> float:
                # the exact f32 path prefills the first size only (it is ~10x slower)
                pp = sizes if v == variants[0] else sizes[:1]
                args = [str(store), "--budget", str(sf["store_nbytes"]), "--threads",
                        str(ctx.threads), "--n-ctx", str(max(sizes) + n_gen + 8), "--n-prompt",
                        ",".join(map(str, pp)), "--n-gen", str(n_gen), "--warm",
                        "--breakdown", "--activations", v]  # fmt: skip
                r = run_colibri(ctx, args)
                if "pp_by_n" in r:  # JSON object keys are strings
                    r["pp_by_n"] = {int(k): x for k, x in r["pp_by_n"].items()}
                raw.setdefault(vname[v], []).append(r)
                if r["returncode"]:
                    raise RuntimeError(f"colibri child failed: {r['error']}")
                return r["tg_tok_s"]

            runs[vname[v]] = col
        ctx.log(f"fits in RAM: {store.name}, pp{'/'.join(map(str, sizes))} tg{n_gen}, "
                f"{ctx.rounds} rounds")  # fmt: skip
        interleave(runs, ctx.rounds, ctx.log)
        fits["runs"] = raw
        med = {name: {"tg": median([r["tg_tok_s"] for r in rs]),
                      "pp": median([r["pp_tok_s"] for r in rs]),
                      "pp_by_n": {n: median([pp_at(r, n) for r in rs]) for n in sizes}}
               for name, rs in raw.items()}  # fmt: skip
        fits["medians"] = med
        # one more full layer (per_layer_tok_s), from the same engines' prefill of the model
        # with one more layer, rounds interleaved: every engine's pp on `gguf` alone skips
        # most of the last layer (its FFN for all tokens but the last)
        per_layer: dict[str, dict[int, float | None]] = {}
        store2, gguf2, _ = ensure_model(ctx, fits_layers + 1, have_llama)
        if store2 is not None and gguf2 is not None and gguf is not None:
            raw2: dict[str, list[dict[str, Any]]] = {}

            def peer2(name: str, extra: list[str], bdir: Path | None) -> float:
                r = llama_cpp.run_llama_bench(gguf2, ctx.threads, sizes, 0, reps, extra,
                                              bindir=bdir)  # fmt: skip
                ctx.record(r.pop("cmd"))
                raw2.setdefault(name, []).append(r)
                return r["pp_tok_s"]

            def col2() -> float:
                args = [str(store2), "--budget", str(store_figures(store2)["store_nbytes"]),
                        "--threads", str(ctx.threads), "--n-ctx", str(max(sizes) + 8),
                        "--n-prompt", ",".join(map(str, sizes)), "--warm", "--activations",
                        variants[0]]  # fmt: skip
                r = run_colibri(ctx, args)
                if r["returncode"]:
                    raise RuntimeError(f"colibri child failed: {r['error']}")
                r["pp_by_n"] = {int(k): x for k, x in r["pp_by_n"].items()}
                raw2.setdefault(vname[variants[0]], []).append(r)
                return r["pp_tok_s"]

            runs2: dict[str, Any] = {"llama.cpp": lambda: peer2("llama.cpp", [], None)}
            if ik_dir is not None:
                runs2["ik_llama.cpp"] = lambda: peer2("ik_llama.cpp", [], ik_dir)
                runs2["ik_llama.cpp (-rtr 1)"] = lambda: peer2(
                    "ik_llama.cpp (-rtr 1)", ["-rtr", "1"], ik_dir)  # fmt: skip
            runs2[vname[variants[0]]] = col2
            ctx.log(f"prefill of one more layer: {store2.name}, {ctx.rounds} rounds")
            interleave(runs2, ctx.rounds, ctx.log)
            for name, rs in raw2.items():
                per_layer[name] = {
                    n: per_layer_tok_s(med[name]["pp_by_n"][n], median([pp_at(r, n) for r in rs]))
                    for n in sizes
                }
            fits["per_layer"] = {"store": str(store2), "gguf": str(gguf2), "runs": raw2,
                                 "pp_by_n": per_layer}  # fmt: skip
        ours = [n for n in med if n.startswith("colibri")]
        best_tg = max(ours, key=lambda n: med[n]["tg"])
        best_pp = max(ours, key=lambda n: med[n]["pp"])
        peer, peer_names = best_peer(med)
        build = (raw.get("llama.cpp") or [{}])[0].get("build_commit")
        ik_build = next((rs[0].get("build_commit") for n, rs in raw.items()
                         if n.startswith("ik_llama")), None)  # fmt: skip
        if ik_build in (None, "", "unknown"):  # built from a checkout without .git
            ik_build = ik_commit(ik_dir)
        fits |= {"best_decode": best_tg, "best_prefill": best_pp, "llama_cpp_commit": build,
                 "ik_llama_cpp_commit": ik_build, "best_peer": peer_names}  # fmt: skip
        heads += [
            Headline("Decode, model fits in RAM", "tok/s", med[best_tg]["tg"], limit=bound,
                     limit_name="memory bandwidth bound",
                     target="≥ 1.2× the best peer, ≥ 90% of the bound",
                     note=f"{sf['store_nbytes'] / 1e9:.2f} GB Mixtral-shaped Q4_0; {best_tg}; "
                     f"best peer: {peer_names.get('tg') or 'did not run'}",
                     **split_peers(med, lambda m: m["tg"])),
        ]  # fmt: skip
        if gguf is not None:
            deep_md, deep_head, fits["at_depth"] = decode_at_depth(
                ctx, store, gguf, ik_dir, sf, mem_gbps, n_gen, reps, variants[0])  # fmt: skip
            heads.append(deep_head)
        lay_med = {name: {"tg": None, "pp": None, "pp_by_n": {n: v for n, v in pl.items() if v}}
                   for name, pl in per_layer.items()}  # fmt: skip
        lay_peer, lay_names = best_peer(lay_med)
        lay_ours = [n for n in lay_med if n.startswith("colibri")]
        for n in sizes:
            best = max(ours, key=lambda c: med[c]["pp_by_n"][n] or 0.0)
            heads.append(Headline(f"Prefill {n} tokens, model fits in RAM", "tok/s",
                                  med[best]["pp_by_n"][n], target="≥ 1.0× the best peer",
                                  note=f"{best}; every engine runs the last layer's FFN for "
                                  f"the last token only; best peer: "
                                  f"{peer_names.get(n) or 'did not run'}",
                                  **split_peers(med, lambda m, n=n: pp_n(m, n))))  # fmt: skip
        for n in sizes if lay_ours else ():
            v = lay_med[lay_ours[0]]["pp_by_n"].get(n)
            heads.append(Headline(f"Prefill {n} tokens, one full layer (equal work)", "tok/s",
                                  v, target="≥ 1.0× the best peer",
                                  note=f"{lay_ours[0]}; from the {fits_layers}- and "
                                  f"{fits_layers + 1}-layer models; best peer: "
                                  f"{lay_names.get(n) or 'did not run'}",
                                  **split_peers(lay_med, lambda m, n=n: pp_n(m, n))))  # fmt: skip
        rows = []
        for name, m in med.items():
            pp_ratio = " / ".join(
                "—" if not (m["pp_by_n"][n] and peer["pp_by_n"].get(n))
                else f"{m['pp_by_n'][n] / peer['pp_by_n'][n]:.2f}×" for n in sizes
            )  # fmt: skip
            rows.append([name, m["tg"], *(m["pp_by_n"][n] or "—" for n in sizes),
                         "—" if not peer["tg"] else f"{m['tg'] / peer['tg']:.2f}×", pp_ratio,
                         "—" if not bound else f"{m['tg'] / bound:.0%}"])  # fmt: skip
        md += [
            "### Model fits in RAM",
            "",
            f"Model: synthetic {MODEL}-shaped store with {sf['layers']} layers (real layer "
            f"shapes, Q4_0 experts, Q8_0 attention and embeddings), "
            f"{sf['store_nbytes'] / 1e9:.2f} GB; the GGUF holds the same blocks. "
            f"{ctx.threads} threads for both. llama.cpp (commit {build or '?'}, from the "
            f"llama-cpp-python sdist): `llama-bench -p {','.join(map(str, sizes))} -n {n_gen} "
            f"-r {reps}` (its pp and tg tests; tg starts from an empty context)"
            + (
                f"; ik_llama.cpp (commit {ik_build or '?'}, tools/build_ik_llama_cpp.sh): the "
                f"same llama-bench command, as built and with `-rtr 1` (its run-time repack)"
                if ik_dir is not None
                else "; ik_llama.cpp is not built "
                "(tools/build_ik_llama_cpp.sh), so the best peer is llama.cpp"
            )
            + f". Ratios are against the best peer at each figure. colibri: a child "
            f"process opens the store with a budget ≥ the store, loads every expert, then times "
            f"prefills of {', '.join(map(str, sizes))} random tokens (each from an empty "
            f"context after an untimed one of the same size, as llama-bench's warmup run; "
            f"median of 2 up to 512 tokens, one above; the f32 path the first size only) and "
            f"{n_gen} greedy decode steps (after an untimed one, as llama-bench's warmup) "
            f"separately. Medians of {ctx.rounds} interleaved rounds. The bound is "
            f"{sf['active_bytes_per_token'] / 1e6:.0f} MB of weights read per token (top-2 "
            f"experts per layer, all attention, the LM head) at {fmt(mem_gbps)} GB/s.",
            "",
            table(
                [
                    "engine",
                    "decode tok/s",
                    *(f"prefill {n} tok/s" for n in sizes),
                    "decode vs best peer",
                    f"prefill vs best peer ({' / '.join(map(str, sizes))})",
                    "decode of bound",
                ],
                rows,
            ),
            "",
        ]
        if per_layer:
            lay_head = ["engine", *(f"one layer, {n} tok/s" for n in sizes),
                        *(f"vs best peer ({n})" for n in sizes)]  # fmt: skip
            lay_rows = []
            for name, pl in per_layer.items():
                best_n = lay_peer["pp_by_n"]
                lay_rows.append([name, *(pl.get(n) or "—" for n in sizes),
                                 *("—" if not (pl.get(n) and best_n.get(n))
                                   else f"{pl[n] / best_n[n]:.2f}×" for n in sizes)])  # fmt: skip
            md += [
                f"**Prefill of one full layer.** Every engine above runs the last layer's MoE "
                f"only for the tokens whose logits are asked for, the last one here "
                f"(llama.cpp and ik_llama.cpp: `inp_out_ids`, the rows cut after the "
                f"attention block; colibri: `Pipeline.skip_unused_rows`, the rows cut after K "
                f"and V, so its last layer also computes queries, attention and the output "
                f"projection for the last token only; same logits as computing every row). "
                f"On the {fits_layers}-layer model the prefill above is therefore mostly "
                f"attention (colibri: K/V projections). Each engine's prefill of the same "
                f"model with {fits_layers + 1} layers (interleaved rounds) gives the time of one "
                f"more full layer (attention and MoE over every token), the same work in every "
                f"engine: n / (n / pp({fits_layers + 1}) - n / pp({fits_layers})).",
                "",
                table(lay_head, lay_rows),
                "",
            ]
        r = raw[best_tg][-1]
        short = peer["tg"] and med[best_tg]["tg"] < 1.2 * peer["tg"]
        md.append(("colibri's decode is below the 1.2× target. " if short else "")
                  + f"Where colibri's decode time goes ({best_tg}, last round): "
                  f"{r['compute_s_per_token'] * 1e3:.1f} ms/token in kernels, "
                  f"{r['wait_io_s_per_token'] * 1e3:.1f} ms/token waiting for records, of "
                  f"{1e3 / r['tg_tok_s']:.1f} ms/token; at the bound a token would take "
                  f"{1e3 / bound if bound else float('nan'):.1f} ms. Both engines share 2 cores "
                  f"with whatever else runs (load average at the start is in the machine "
                  f"record).\n")  # fmt: skip
        if r.get("decode_breakdown_s"):
            md.append(decode_breakdown(r["decode_breakdown_s"], sf, mem_gbps, best_tg) + "\n")
        if gguf is not None:
            md += deep_md
        md += prefill_breakdown(raw.get(vname[variants[0]], []), peer["pp_by_n"], sizes,
                                vname[variants[0]], sf["expert_macs_per_token"],
                                peer_names, sf["moe_layers"])  # fmt: skip
    data["fits"] = fits
    panels: list[dict[str, Any]] = []
    if fits.get("medians"):
        med = fits["medians"]
        panels += [
            {"title": "Decode, model fits in RAM", "bars": {n: m["tg"] for n, m in med.items()},
             "limit": fits["bound_tok_s"], "limit_name": "memory-bandwidth bound"},
            {"title": "Prefill, model fits in RAM", "bars": {n: m["pp"] for n, m in med.items()}},
        ]  # fmt: skip
    best_variant = next((v for v in variants if vname[v] == fits.get("best_decode")),
                        variants[-1])  # fmt: skip
    cname = vname[best_variant]

    # -- 2. bigger than the memory limit ----------------------------------------------------
    big: dict[str, Any] = {}
    store, gguf, note = ensure_model(ctx, big_layers, have_llama)
    if store is None:
        md.append(f"_Bigger-than-the-limit benchmark skipped: {note}._\n")
    else:
        sf = store_figures(store)
        limit = sf["store_nbytes"] // 2 // (1 << 20) << 20
        budget = colibri_budget(limit, sf["dense_nbytes"], sf["record_nbytes"])
        ctx_len = 128
        time_limit = PEER_TIME_LIMIT_S / 2.5 if quick else PEER_TIME_LIMIT_S
        big |= {"store": str(store), "gguf": str(gguf) if gguf else None, **sf,
                "limit_bytes": limit, "colibri_budget": budget, "n_gen": big_gen}  # fmt: skip
        files = [store / "experts.bin", store / "dense.safetensors"]
        raw = {}

        def llama_run(name: str, extra: list[str], ik: Path | None = None) -> float:
            r = llama_cpp.run_completion(gguf, PROMPT, big_gen, ctx.threads, memory_limit=limit,
                                         extra=["-c", str(ctx_len), *extra],
                                         time_limit=time_limit, ik_bindir=ik)  # fmt: skip
            ctx.record(f"(in a memory cgroup limited to {limit} bytes) " + shlex.join(r.pop("cmd")))
            raw.setdefault(name, []).append(r)
            return r["decode_tok_s"] or 0.0

        def colibri_run() -> float:
            for f in files:
                llama_cpp.drop_file_cache(f)
            args = [
                str(store),
                "--budget",
                str(budget),
                "--threads",
                str(ctx.threads),
                "--n-ctx",
                str(ctx_len),
                "--n-gen",
                str(big_gen),
                "--text",
                PROMPT,
            ]
            args += ["--activations", best_variant]
            r = run_colibri(ctx, args, limit, time_limit)
            raw.setdefault(cname, []).append(r)
            return r.get("tg_tok_s") or 0.0

        ctx.log(f"2x the memory limit: {store.name} under {limit / 2**30:.2f} GiB, "
                f"{big_gen} tokens")  # fmt: skip
        fio_runs: list[float] = []
        reader_runs: list[float] = []

        def fio() -> float:
            fio_runs.append(_fio_gbps(ctx, store / "experts.bin"))
            return fio_runs[-1]

        def reader() -> float:  # colibri's own reads of the same file (sec_limits.best_disk)
            experts = store / "experts.bin"
            gbps = sec_limits.reader_gbps(experts, 4 << 20, 32, 512 << 20, len(ctx.commands))
            reader_runs.append(gbps)
            return gbps

        runs = {"fio (disk limit)": fio, "colibri reader (disk limit)": reader}
        if gguf is not None:
            # the default repack is deterministic (killed or not): one run records the outcome
            llama_run("llama.cpp (default mmap + repack)", [])
            runs["llama.cpp (mmap, --no-repack)"] = lambda: llama_run(
                "llama.cpp (mmap, --no-repack)", ["--no-repack"]
            )
            if ik_dir is not None:  # its run-time repack (-rtr) is off by default: the mmap
                runs["ik_llama.cpp (mmap)"] = lambda: llama_run("ik_llama.cpp (mmap)", [], ik_dir)
        if budget:
            runs[cname] = colibri_run
        else:
            md.append(f"_colibri skipped: dense weights ({sf['dense_nbytes'] / 1e9:.2f} GB) "
                      f"and overhead leave no room for an expert under the limit._\n")  # fmt: skip
        interleave(runs, ctx.rounds, ctx.log)
        big["runs"] = raw
        summary = {}
        for name, rs in raw.items():
            ok = [r for r in rs if r["returncode"] == 0]
            summary[name] = {
                "tg": median([r["decode_tok_s" if "decode_tok_s" in r else "tg_tok_s"]
                              for r in ok]),
                "peak_rss": median([r["peak_rss_bytes"] for r in ok]) if ok else
                max((r.get("peak_rss_bytes") or 0 for r in rs), default=None),
                "cgroup_peak": max((r.get("cgroup_peak_bytes") or 0 for r in rs), default=None),
                "oom_kills": sum(r.get("oom_kills") or 0 for r in rs),
                "timeouts": sum(bool(r.get("timed_out")) for r in rs),
                "read_bytes": max((r.get("read_bytes") or 0 for r in rs), default=0),
                "runs": len(rs), "ok": len(ok),
            }  # fmt: skip
        big["summary"] = summary
        col = [r for r in raw.get(cname, []) if r["returncode"] == 0]
        bpt = median([r["bytes_read_per_token"] for r in col]) if col else None
        disk, disk_source = sec_limits.best_disk(fio_runs, reader_runs)
        bound = disk * 1e9 / bpt if disk and bpt else None
        big |= {"disk_gbps": disk, "disk_source": disk_source, "disk_runs": fio_runs,
                "reader_runs": reader_runs, "bytes_read_per_token": bpt,
                "bound_tok_s": bound}  # fmt: skip
        peers = {n: m["tg"] for n, m in summary.items()
                 if not n.startswith("colibri") and m["tg"]}  # fmt: skip
        peer_name = max(peers, key=peers.get) if peers else None
        # each peer's cell: its best variant's tok/s, or what bounds a thrashing one
        cells: dict[str, Any] = {"peer": None, "ik": None, "peer_note": "", "ik_note": ""}
        for key, prefix in (("peer", "llama.cpp"), ("ik", "ik_llama")):
            mine = {n: m for n, m in summary.items() if n.startswith(prefix)}
            have = [m["tg"] for m in mine.values() if m["tg"]]
            if have:
                cells[key] = max(have)
            elif mine:
                cells[f"{key}_note"] = "; ".join(
                    thrash_note(m, big_gen, time_limit) for m in mine.values())  # fmt: skip
        c = summary.get(cname, {}).get("tg")
        panels.append({"title": "Decode, model 2× the memory limit",
                       "bars": {n: m["tg"] for n, m in summary.items()},
                       "missing": {n: f"did not finish\nin {time_limit:.0f} s"
                                   if m["timeouts"] else "OOM-killed" if m["oom_kills"]
                                   else "failed" for n, m in summary.items() if not m["tg"]},
                       "limit": bound, "limit_name": "storage bound"})  # fmt: skip
        heads.append(Headline(
            "Decode, model 2× the memory limit", "tok/s", c, limit=bound,
            limit_name="storage bound" if bound else "", target="≥ 3× the best peer",
            note=f"{sf['store_nbytes'] / 1e9:.2f} GB model, {limit / 2**30:.2f} GiB cgroup "
            f"limit; best peer: {peer_name or 'did not run'}", **cells))  # fmt: skip
        rows = []
        for name, sm in summary.items():
            status = outcome(sm["runs"], sm["ok"], sm["oom_kills"], sm["timeouts"], time_limit)
            if not sm["tg"] and sm["timeouts"]:
                status = thrash_note(sm, big_gen, time_limit)
            rows.append([name, sm["tg"],
                         "—" if not (c and sm["tg"]) else f"{c / sm['tg']:.2f}×",
                         _gb(sm["peak_rss"]), _gb(sm["cgroup_peak"]), status])  # fmt: skip
        md += [
            "### Model bigger than the memory limit",
            "",
            f"Model: the same shapes with {sf['layers']} layers, {sf['store_nbytes'] / 1e9:.2f} "
            f"GB, run inside a cgroup (v1 `memory.limit_in_bytes` / v2 `memory.max`, made by "
            f"this script for its own child process) limited to {limit / 2**30:.2f} GiB; "
            f"the cgroup is charged for page cache too, and the model files' cached pages are "
            f"dropped before each run. llama.cpp: `llama-completion -no-cnv -c {ctx_len}` "
            f"with its default mmap, {big_gen} greedy tokens after a short prompt; its "
            f"default Q4_0 repack copies the weights into anonymous memory, so it is also run "
            f"with `--no-repack`, which keeps them on the mmap; ik_llama.cpp: its `llama-cli` "
            f"with the same options (its repack, -rtr, is off by default). colibri: expert budget "
            f"{budget / 1e9:.2f} GB ({budget // sf['record_nbytes']} of {sf['num_records']} "
            f"records of {sf['record_nbytes'] / 1e6:.0f} MB) beside "
            f"{sf['dense_nbytes'] / 1e9:.2f} GB of dense weights, O_DIRECT reads (no page "
            f"cache). Decode tok/s are each engine's decode phase only. A run is ended (its "
            f"whole process group) after {time_limit:.0f} s of wall clock: a peer thrashing "
            f'under the limit "did not finish".',
            "",
            table(
                [
                    "engine",
                    "decode tok/s",
                    "colibri vs it",
                    "peak RSS GB",
                    "cgroup peak GB (incl. page cache)",
                    "outcome",
                ],
                rows,
            ),
            "",
        ]
        if col:
            r = col[-1]
            md.append(
                f"colibri's decode, last run: hit rate {r['hit_rate']:.0%}, "
                f"{r['bytes_read_per_token'] / 1e6:.0f} MB read per token, "
                f"{r['wait_io_s_per_token'] * 1e3:.0f} ms/token waiting for the disk and "
                f"{r['compute_s_per_token'] * 1e3:.0f} ms/token in kernels, of "
                f"{1e3 / r['tg_tok_s']:.0f} ms/token"
                + (
                    f"; storage bound {bound:.2f} tok/s ({disk:.2f} GB/s disk, {disk_source} / "
                    f"{bpt / 1e6:.0f} MB per token)."
                    if bound
                    else "."
                )
            )
            if peers and c and c < 3 * peers[peer_name]:
                md[-1] += (f" colibri falls short of the 3× target ({c / peers[peer_name]:.2f}×): "
                           f"the time split above says where its decode time goes.")  # fmt: skip
            if bound and c and c > bound:
                md[-1] += (" colibri beats the storage bound here: this virtual disk's "
                           f"throughput varies between rounds (fio: "
                           f"{', '.join(f'{g:.2f}' for g in fio_runs)} GB/s, colibri's reader: "
                           f"{', '.join(f'{g:.2f}' for g in reader_runs)} GB/s; the host may "
                           f"cache what the guest dropped), so the bound is rough.")  # fmt: skip
            md.append("")
    data["big"] = big
    figs = _plots(ctx, panels, big)
    return Section(key="llama", title=TITLE, markdown="\n".join(md), data=data, figures=figs,
                   headlines=heads)  # fmt: skip


def _wrap(name: str) -> str:
    return name.replace(" (", "\n(").replace(", ", ",\n")


def _gb(x: float | None) -> str:
    return f"{x / 1e9:.2f}" if x else "—"


def _plots(ctx: Context, panels: list[dict[str, Any]], big: dict[str, Any]) -> list[str]:
    """llama_speed.png: tok/s bars per engine for each scenario, the bound dashed;
    llama_memory.png: peak RSS and cgroup peak per engine under the limit."""
    import matplotlib.pyplot as plt

    figs = []
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.6), squeeze=False)
        for ax, p in zip(axes[0], panels, strict=True):
            names = list(p["bars"])
            vals = [p["bars"][n] or 0.0 for n in names]
            colors = ["tab:orange" if n.startswith("llama") else "tab:blue" for n in names]
            bars = ax.bar(range(len(names)), vals, color=colors)
            for n, b, v in zip(names, bars, vals, strict=True):
                label = f"{v:.3g}" if v else p.get("missing", {}).get(n, "n/a")
                ax.annotate(label, (b.get_x() + b.get_width() / 2, v), ha="center",
                            va="bottom", fontsize=9)  # fmt: skip
            if p.get("limit"):
                ax.axhline(p["limit"], ls="--", color="k",
                           label=f"{p['limit_name']} {p['limit']:.3g}")  # fmt: skip
                ax.legend(loc="upper left", fontsize=8)
            ax.set_xticks(range(len(names)), [_wrap(n) for n in names], fontsize=8)
            ax.set_title(p["title"], fontsize=10)
            ax.set_ylabel("tokens / s")
            ax.set_ylim(0, max([*vals, p.get("limit") or 0]) * 1.25 or 1)
        fig.suptitle(f"colibri vs llama.cpp on the same GGUF weights, {ctx.threads} threads")
        fig.tight_layout()
        fig.savefig(ctx.figure("llama_speed.png"), dpi=110)
        plt.close(fig)
        figs.append("llama_speed.png")
    summ = big.get("summary")
    if summ:
        fig, ax = plt.subplots(figsize=(8, 4.2))
        names = list(summ)
        x = range(len(names))
        rss = [(summ[n]["peak_rss"] or 0) / 2**30 for n in names]
        cg = [(summ[n]["cgroup_peak"] or 0) / 2**30 for n in names]
        ax.bar([i - 0.2 for i in x], rss, 0.4, label="peak RSS")
        ax.bar([i + 0.2 for i in x], cg, 0.4, label="cgroup peak (incl. page cache)")
        ax.axhline(big["limit_bytes"] / 2**30, ls="--", color="r", label="memory limit")
        ax.axhline(big["store_nbytes"] / 2**30, ls=":", color="k", label="model size")
        ax.set_xticks(list(x), [_wrap(n) for n in names], fontsize=8)
        ax.set_ylabel("GiB")
        ax.set_ylim(0, big["store_nbytes"] / 2**30 * 1.35)
        ax.set_title("Peak memory under the cgroup limit (model 2× the limit)")
        ax.legend(fontsize=8, loc="upper right", ncols=2)
        fig.tight_layout()
        fig.savefig(ctx.figure("llama_memory.png"), dpi=110)
        plt.close(fig)
        figs.append("llama_memory.png")
    return figs


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        raise SystemExit(child_main(sys.argv[2:]))
    raise SystemExit(
        "usage: python -m colibri.bench.sec_llama --child STORE ... (or: colibri bench)"
    )
