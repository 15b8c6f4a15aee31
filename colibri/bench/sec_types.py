"""Section "types": in-RAM decode and prefill per expert store type, colibri next to llama.cpp
on the very same GGUF weights where GGML has the type (issue 15).

One synthetic Mixtral-8x7B-shaped store per expert type (tools/synth_store.py: real layer
shapes, fewer layers, valid random blocks of the type; dense tensors Q8_0 for every store),
exported to GGUF with its own blocks (colibri export-gguf), so both engines multiply identical
bytes: Q4_0, Q4_K (the bulk of a Q4_K_M), Q6_K, MXFP4, and FP8, which GGUF has no type for
(export-gguf would write it as f32), so FP8 runs colibri alone. colibri runs its default
activations (Q8_K for Q4_K / Q6_K experts, llama.cpp's K-quant path; Q8_0 for the rest); Q4_K
and Q6_K also run with --activations q8_0. Per type: colibri in a child process (sec_llama's:
budget >= the store, every expert loaded first, then a timed prefill and greedy decode) and
llama-bench (pp / tg), rounds interleaved over all runs. The decode bound is each store's
weight bytes read per token at the memory bandwidth the limits section measured.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from colibri.bench import llama_cpp, sec_limits
from colibri.bench.report import ROOT, Context, Headline, Section, fmt, interleave, median, table
from colibri.bench.sec_llama import run_colibri, store_figures

TITLE = "Decode and prefill per expert type, colibri vs llama.cpp"
MODEL = "mixtral-8x7b"
TYPES = ("q4_0", "q4_k", "q6_k", "mxfp4", "fp8")
NO_GGUF = {"fp8": "GGUF has no FP8 type"}
Q8K_TYPES = ("q4_k", "q6_k")  # Q8_K by default; also run with --activations q8_0
# bytes per weight of each expert type (block bytes / weights), for the disk estimate
BYTES_PER_WEIGHT = {
    "q4_0": 18 / 32,
    "q4_k": 144 / 256,
    "q6_k": 210 / 256,
    "mxfp4": 17 / 32,
    "fp8": 1 + 4 / 128,
}
LAYER_WEIGHTS = 8 * 3 * 4096 * 14336  # one Mixtral-8x7B layer's expert weights
DENSE_NBYTES = 300_000_000  # embeddings, LM head, attention in Q8_0 (1-2 layers)


def _ensure(
    ctx: Context, quant: str, layers: int, want_gguf: bool
) -> tuple[Path | None, Path | None, str]:
    """The store of `quant` experts under ctx.work/types (made if missing) and its GGUF."""
    d = ctx.work / "types"
    d.mkdir(parents=True, exist_ok=True)
    store = d / f"{MODEL}-L{layers}-{quant}"
    gguf = d / f"{store.name}.gguf"
    est = int(DENSE_NBYTES + layers * LAYER_WEIGHTS * BYTES_PER_WEIGHT[quant])
    need = (0 if (store / "manifest.json").exists() else est) + (
        0 if gguf.exists() or not want_gguf else est
    )
    if need and ctx.free_bytes() < need + (2 << 30):
        return None, None, f"not enough free space under {ctx.work} ({need / 1e9:.1f} GB needed)"
    if not (store / "manifest.json").exists():
        ctx.log(f"types: making {store.name} (~{est / 1e9:.1f} GB)")
        ctx.run(
            [
                "nice",
                sys.executable,
                str(ROOT / "tools/synth_store.py"),
                MODEL,
                str(store),
                "--layers",
                str(layers),
                "--quant",
                quant,
                "--force",
            ]
        )
    if want_gguf and not gguf.exists():
        ctx.log(f"types: exporting {gguf.name}")
        ctx.run(
            ["nice", sys.executable, "-m", "colibri", "export-gguf", str(store), str(gguf)],
            cwd=ROOT,
        )
    return store, gguf if want_gguf else None, ""


def run(ctx: Context) -> Section:
    layers = 1 if ctx.quick else 2
    n_prompt, n_gen, reps = (64, 16, 1) if ctx.quick else (128, 32, 2)
    try:
        bindir: Path | None = llama_cpp.llama_bin_dir()
        llama_cpp._exe("llama-bench")
    except FileNotFoundError:
        bindir = None
    mem_gbps = sec_limits.memory_gbps(ctx)
    data: dict[str, Any] = {
        "llama_cpp_bin": str(bindir) if bindir else None,
        "threads": ctx.threads,
        "mem_gbps": mem_gbps,
        "types": {},
    }
    md: list[str] = []
    if bindir is None:
        md.append("**llama.cpp is not built** (`tools/build_llama_cpp.sh`): colibri only.\n")
    runs: dict[str, Any] = {}
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    figures: dict[str, dict[str, Any]] = {}
    for quant in TYPES:
        want_gguf = bindir is not None and quant not in NO_GGUF
        store, gguf, note = _ensure(ctx, quant, layers, want_gguf)
        if store is None:
            md.append(f"_{quant}: skipped: {note}._\n")
            continue
        sf = store_figures(store)
        figures[quant] = sf | {"store": str(store), "gguf": str(gguf) if gguf else None}
        raw[quant] = {}

        for act in ("q8_k", "q8_0") if quant in Q8K_TYPES else ("q8_k",):
            eng = "colibri" if act == "q8_k" else f"colibri {act}"

            def col(
                quant: str = quant,
                store: Path = store,
                sf: dict[str, Any] = sf,
                act: str = act,
                eng: str = eng,
            ) -> float:
                args = [
                    str(store),
                    "--budget",
                    str(sf["store_nbytes"]),
                    "--threads",
                    str(ctx.threads),
                    "--n-ctx",
                    str(n_prompt + n_gen + 8),
                    "--n-prompt",
                    str(n_prompt),
                    "--n-gen",
                    str(n_gen),
                    "--warm",
                    "--activations",
                    act,
                ]
                r = run_colibri(ctx, args)
                raw[quant].setdefault(eng, []).append(r)
                if r["returncode"]:
                    raise RuntimeError(f"colibri child failed on {quant} ({act}): {r['error']}")
                return r["tg_tok_s"]

            runs[f"{eng} {quant}"] = col
        if gguf is not None:

            def llama(quant: str = quant, gguf: Path = gguf) -> float:
                r = llama_cpp.run_llama_bench(gguf, ctx.threads, n_prompt, n_gen, reps)
                ctx.record(r.pop("cmd"))
                raw[quant].setdefault("llama.cpp", []).append(r)
                return r["tg_tok_s"]

            runs[f"llama.cpp {quant}"] = llama
    ctx.log(f"types: {', '.join(runs)}; pp{n_prompt} tg{n_gen}, {ctx.rounds} rounds")
    interleave(runs, ctx.rounds, ctx.log)
    rows, heads = [], []
    for quant, by in raw.items():
        sf = figures[quant]
        med = {
            eng: {
                "tg": median([r["tg_tok_s"] for r in rs]),
                "pp": median([r["pp_tok_s"] for r in rs]),
            }
            for eng, rs in by.items()
        }
        bound = mem_gbps * 1e9 / sf["active_bytes_per_token"] if mem_gbps else None
        c, p = med.get("colibri", {}), med.get("llama.cpp", {})
        data["types"][quant] = figures[quant] | {"runs": by, "medians": med, "bound_tok_s": bound}
        ratio = lambda a, b: f"{a / b:.2f}×" if a and b else "—"  # noqa: E731
        peer_note = NO_GGUF.get(quant, "" if bindir else "llama.cpp not built")
        for eng in [e for e in ("colibri", "colibri q8_0") if e in med]:
            ce = med[eng]
            rows.append([
                quant if eng == "colibri" else f"{quant}, --activations q8_0",
                f"{sf['active_bytes_per_token'] / 1e6:.0f}", ce.get("tg"),
                p.get("tg") if p else peer_note, ratio(ce.get("tg"), p.get("tg")),
                ce.get("pp"), p.get("pp") if p else peer_note, ratio(ce.get("pp"), p.get("pp")),
                f"{ce['tg'] / bound:.0%}" if bound and ce.get("tg") else "—",
            ])  # fmt: skip
        heads.append(
            Headline(
                f"Decode in RAM, {quant} experts",
                "tok/s",
                c.get("tg"),
                p.get("tg") if p else None,
                bound,
                "memory bandwidth bound",
                note=peer_note or f"{sf['store_nbytes'] / 1e9:.2f} GB store",
            )
        )
    md += [
        f"Stores: synthetic {MODEL}-shaped, {layers} layer(s), experts in the type, dense "
        f"tensors Q8_0; the GGUF of each holds the same blocks (llama.cpp's K-quant / MXFP4 "
        f"repacking for its CPU kernels is its default and stays on). {ctx.threads} threads for "
        f"both engines. llama.cpp: `llama-bench -p {n_prompt} -n {n_gen} -r {reps}`; colibri: "
        f"budget >= the store, every expert loaded first, default activations (Q8_K for "
        f"Q4_K / Q6_K experts, Q8_0 where the row says q8_0 and for the rest), a {n_prompt}-token "
        f"prefill and {n_gen} greedy decode steps timed separately. Medians of {ctx.rounds} "
        f"rounds interleaved over every run. Bound: MB of weights read per token at "
        f"{fmt(mem_gbps)} GB/s.",
        "",
        table(
            [
                "experts",
                "MB/token",
                "colibri decode tok/s",
                "llama.cpp decode tok/s",
                "decode ratio",
                "colibri prefill tok/s",
                "llama.cpp prefill tok/s",
                "prefill ratio",
                "colibri decode of bound",
            ],
            rows,
        ),
        "",
    ]
    return Section(key="types", title=TITLE, markdown="\n".join(md), data=data, headlines=heads)
