"""`colibri bench` section "quality": what each expert format and activation path costs.

Two models: the embedded demo (a trained 4-layer Mixtral, vocab 2048; its store holds q8_0
weights, so its "f32 store" is those weights dequantized) and a Mixtral-shaped random model
built with transformers (the OLMoE tokenizer, vocab 50304; random weights, so its PPL only
tells the formats apart, KL and routing agreement are the figures). For each: the f32 store
and one store per expert format (q8_0, q6_k, q5_k, q5_1, q5_0, q4_k, q4_1, q4_0, mxfp4, fp8,
f16, bf16; dense weights f32 in every store, so only the experts' format changes; K-quants
only where rows are a multiple of 256), each run with --activations f32 and, where it differs
(q4_0, q8_0 weights), q8_0. Every variant runs `colibri eval --task perplexity` (llama-perplexity's
method, ctx 128) on the same real text (../shared/data/text, c4) against the f32 store: PPL,
mean / p99 KL(f32 || variant), top-1 agreement, routing agreement (identical top-k set,
averaged over MoE layers). Eval tokens/s stands next to the same engine's prefill tokens/s
(`Engine.forward` on one 128-token prompt, as `colibri run` prefills). llama.cpp's
llama-perplexity on the q4_0 GGUF (colibri.export_gguf, same bytes) beside colibri's when
tools/build_llama_cpp.sh has built it. The q4_0 store as `colibri convert` writes it by default
(dense weights, the output head among them, in q8_0) gets a quality row of its own, and the
eval-speed table measures it beside the f32-head store: it is the store `colibri run` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import lzma
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from colibri.bench.report import ROOT, Context, Headline, Section, fmt, table

TITLE = "Quality per expert format (perplexity, KL, routing agreement)"
# every expert format a store can hold that colibri quantizes (K-quants need rows of 256: not
# the demo's hidden 192, those rows say n/a)
FORMATS = ("q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", "mxfp4", "fp8",
           "f16", "bf16")  # fmt: skip
Q8_ACT = ("q4_0", "q8_0")
CTX = 128
TEXT = ROOT.parent / "shared" / "data" / "text" / "olmoe_routing_c4_texts.txt.xz"
OLMOE_TOKENIZER = ROOT.parent / "shared/data/tokenizers/olmoe/allenai_gpt-neox-olmo-dolma-v1_5.json"


def _shared(path: Path) -> Path:
    """path, or the same file one level up (a worktree at /work/wt/<name>)."""
    if path.exists():
        return path
    alt = ROOT.parents[1] / path.relative_to(ROOT.parent)
    if alt.exists():
        return alt
    raise FileNotFoundError(f"{path}: shared data missing")


def _to_f32(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Stored bytes (uint8) of one tensor in `qtype` -> float32 [shape]."""
    from colibri.compute import ops

    if qtype == "f32":
        return raw.view(np.float32).reshape(shape)
    if qtype == "f16":
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if qtype == "bf16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return ops.dequantize(raw.reshape(shape[0], -1), ops.QType.parse(qtype), shape)


def requantize(src: Path, out: Path, qtype: str, dense: str = "f32") -> Path:
    """A copy of store `src` with expert weights in `qtype` (dequantized from src's format,
    then quantized) and every dense tensor f32 (dense "f32"), or in the type `colibri
    convert --dense-quant DENSE` gives it (colibri.convert.dense_qtype: norms and routers stay
    f32; its default q8_0 is the store `colibri run` runs: embeddings, attention and the
    output head in q8_0). Kept if `out` exists already."""
    from colibri.compute import ops
    from colibri.convert import dense_qtype, quantize
    from colibri.io.format import ExpertLayout, StoreWriter, open_store

    if (out / "manifest.json").exists():
        return out
    store = open_store(src)
    lay = store.layout
    layout = ExpertLayout.build(qtype, lay.d_model, lay.d_ff, biases="gate_bias" in lay.tensors)
    experts = np.memmap(store.experts_path, dtype=np.uint8, mode="r")
    with StoreWriter(out, layout, force=True) as w:
        names = store.dense_names()
        shapes = {n: store.dense(n)[2] for n in names}
        types = {n: "f32" if dense == "f32" else dense_qtype(n, shapes[n], dense) for n in names}
        w.begin_dense([(n, types[n], shapes[n]) for n in names])
        for n in names:
            data, qt, shape = store.dense(n)
            if data.dtype != np.float32:  # GGML blocks
                data = ops.dequantize(data, ops.QType.parse(qt), shape)
            data = np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
            w.write_dense(n, data if types[n] == "f32" else quantize(data, types[n]))
        for r in sorted(store.records, key=lambda r: (r.layer, r.expert)):
            rec = experts[r.offset : r.offset + r.nbytes]
            parts = {}
            for name, t in lay.tensors.items():
                raw = rec[t.offset : t.offset + t.nbytes]
                if name.endswith("_bias"):
                    parts[name] = raw.copy()
                    continue
                parts[name] = quantize(_to_f32(raw, t.qtype, t.shape), qtype)
            w.write_expert(r.layer, r.expert, parts)
        for name in store.manifest.get("tokenizer_files", []):
            w.add_file(name, (src / name).read_bytes())
        return w.finish(
            store.manifest["model_type"],
            store.config,
            {"kind": "requantized", "from": str(src), "quant": qtype},
        )


def mixtral_model(out: Path) -> Path:
    """A Mixtral-architecture random model (hidden 256, 4 layers, 8 experts top-2, d_ff 512)
    with the OLMoE tokenizer, converted to an f32 store at out/f32."""
    from colibri.convert import convert

    store = out / "f32"
    if (store / "manifest.json").exists():
        return store
    import json

    import torch
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=50304,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        initializer_range=0.05,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    hf = out / "hf"
    model.save_pretrained(hf, safe_serialization=True)
    (hf / "tokenizer.json").write_bytes(_shared(OLMOE_TOKENIZER).read_bytes())
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return convert(hf, store, quant="f32", dense_quant="f32", force=True, show_progress=False)


async def _measure(
    store: Path,
    ref: Path,
    text: str,
    acts: str,
    windows: int,
    threads: int,
    budget: int | None = None,
) -> dict[str, Any]:
    from colibri.engine import open_engine
    from colibri.eval.cli import eval_perplexity

    opts = dict(n_ctx=CTX, threads=threads)
    async with (
        open_engine(store, activations=acts, budget=budget, **opts) as engine,
        open_engine(ref, activations="f32", **opts) as reference,
    ):
        res = await eval_perplexity(
            engine, text, CTX, reference=reference, limit=windows, show_progress=False
        )
        ids = engine.tokenizer.encode(text, add_special_tokens=False)[:CTX]
        times = []
        for _ in range(3):  # prefill of one CTX-token prompt, median of 3 (warm cache)
            seq = engine.new_sequence(n_ctx=CTX)
            t0 = time.perf_counter()
            await engine.forward(seq, ids)
            times.append(time.perf_counter() - t0)
    m = res["metrics"]
    return {
        "ppl": m["ppl"],
        "ppl_stderr": m["ppl_stderr"],
        "kl_mean": m["kl_mean"],
        "kl_p99": m["kl_p99"],
        "kl_max": m["kl_max"],
        "top1": m["top1_agreement"],
        "routing": float(np.mean(m["routing_agreement"])) if m["routing_agreement"] else None,
        "routing_per_layer": m["routing_agreement"],
        "overlap_per_layer": m["routing_overlap"],
        "tokens_scored": m["tokens_scored"],
        "eval_tok_s": res["statistics"]["tokens_per_second"],
        "prefill_tok_s": CTX / float(np.median(times)),
        "hit_rate": res["statistics"]["hit_rate"],
    }


@contextlib.asynccontextmanager
async def _timed_lse(seconds: list[float], i: int) -> AsyncIterator[None]:
    """While inside, seconds[i] += the CPU seconds of every ops.logsumexp call (the scored
    rows' log-sum-exp; the pipeline and the scoring call it through the module): the
    bench's own probe, removed on exit."""
    from colibri.compute import ops

    lse = ops.logsumexp

    def probe(x: np.ndarray, nthreads: int = 0) -> np.ndarray:
        c = time.process_time()
        try:
            return lse(x, nthreads)
        finally:
            seconds[i] += time.process_time() - c

    ops.logsumexp = probe
    try:
        yield
    finally:
        ops.logsumexp = lse


SPEED_CTX = 512  # llama-perplexity's default window; prefill prompts of the same length
HELLASWAG = ROOT.parent / "shared" / "data" / "eval" / "hellaswag_validation.jsonl.xz"


async def eval_speed(
    store: Path,
    text: str,
    docs: list[dict[str, Any]],
    *,
    threads: int,
    budget: int | None = None,
    rounds: int = 3,
) -> dict[str, float]:
    """Tokens/s of `colibri run`'s prefill and of `colibri eval` on the same store and
    engine options, interleaved `rounds` times and the best of each kept (the machine is
    shared: the best is the least disturbed): prefill of 4 SPEED_CTX-token prompts in
    engine.prefill_chunk chunks (as `run` prefills), eval perplexity (ctx SPEED_CTX, 4
    windows) and eval hellaswag on `docs`, both in eval's default fused batch mode and in
    split mode. Every figure counts the tokens fed to the engine per second of wall time
    (eval's own scoring, tokenization and log-softmax included) and, as NAME_cpu, per CPU
    second of the process; NAME_head is the share of those CPU seconds spent in the output
    head (Model.logits, timed by a probe the bench installs), NAME_lse the share in the
    log-sum-exp of the scored rows (ops.logsumexp, probed for the run's duration), and
    NAME_rest_cpu the tokens per CPU second of everything else (the CPU seconds minus head
    and log-sum-exp: eval's work besides scoring, beside prefill's besides its one head row
    a chunk; prefill also runs its last layer's output for that row only, eval for every
    scored row). Also: bytes_per_token_prefill,
    bytes_per_token_ppl_MODE and bytes_per_token_hellaswag_MODE (expert bytes read from the
    store per token fed, last round), ppl_MODE_value (the PPL of those 4 windows) and
    hellaswag_acc (on `docs`)."""
    from colibri.engine import open_engine
    from colibri.eval.cli import eval_choice, eval_perplexity

    best: dict[str, float] = {}
    clock: list[float] = []
    # wall and CPU seconds in the output head (final norm, lm_head), then CPU seconds in the
    # scored rows' log-sum-exp
    head = [0.0, 0.0, 0.0]

    def timed_head(model: Any) -> None:
        """Count the seconds model.logits takes (the bench's own probe, not the engine's)."""
        logits = model.logits

        def probe(x: np.ndarray) -> np.ndarray:
            w, c = time.perf_counter(), time.process_time()
            try:
                return logits(x)
            finally:
                head[0] += time.perf_counter() - w
                head[1] += time.process_time() - c

        model.logits = probe

    def tick() -> None:  # the clock, and the head's seconds from now
        clock[:] = [time.perf_counter(), time.process_time()]
        head[:] = [0.0, 0.0, 0.0]

    def keep(name: str, tokens: int) -> None:
        """tokens per second of wall time, and (name_cpu) per CPU second of this process:
        the figure a loaded machine disturbs least; name_head: the output head's share of
        the CPU seconds (of the round kept)."""
        wall, cpu = time.perf_counter() - clock[0], time.process_time() - clock[1]
        best[name] = max(best.get(name, 0.0), tokens / wall)
        if tokens / max(cpu, 1e-9) > best.get(name + "_cpu", 0.0):
            best[name + "_cpu"] = tokens / max(cpu, 1e-9)
            best[name + "_head"] = head[1] / max(cpu, 1e-9)
            best[name + "_lse"] = head[2] / max(cpu, 1e-9)
            best[name + "_rest_cpu"] = tokens / max(cpu - head[1] - head[2], 1e-9)

    opts = dict(n_ctx=SPEED_CTX, threads=threads, budget=budget)
    async with (
        _timed_lse(head, 2),
        open_engine(store, batch="split", **opts) as split,
        open_engine(store, batch="fused", **opts) as fused,
    ):
        timed_head(split.model)
        timed_head(fused.model)
        ids = split.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < 4 * SPEED_CTX + 2:
            raise ValueError(f"eval_speed: the text has {len(ids)} tokens, fewer than 4 windows")
        # the text of 4 windows only: eval tokenizes what it is given, and scores all of it
        text = text[: int(len(text) * (4 * SPEED_CTX + 2) / len(ids) * 1.05)]
        for _ in range(rounds):
            # 4 prompts of SPEED_CTX tokens: as many tokens, and as long, as eval's 4 windows
            tick()
            s0 = split.statistics(components=False)
            for p in range(4):
                seq = split.new_sequence(n_ctx=SPEED_CTX)
                prompt = ids[p * SPEED_CTX : (p + 1) * SPEED_CTX]
                for start in range(0, len(prompt), split.prefill_chunk):
                    await split.forward(seq, prompt[start : start + split.prefill_chunk])
                seq.kv = None
            keep("prefill", 4 * SPEED_CTX)
            read = split.statistics(components=False).delta(s0).bytes_read
            best["bytes_per_token_prefill"] = read / (4 * SPEED_CTX)
            for mode, engine in (("fused", fused), ("split", split)):
                tick()
                r = await eval_perplexity(engine, text, SPEED_CTX, limit=4, show_progress=False)
                keep(f"ppl_{mode}", r["statistics"]["tokens"])
                st = r["statistics"]
                best[f"bytes_per_token_ppl_{mode}"] = st["bytes_read"] / st["tokens"]
                best[f"ppl_{mode}_value"] = r["metrics"]["ppl"]
                tick()
                r = await eval_choice(engine, "hellaswag", docs, "hellaswag",
                                      show_progress=False)  # fmt: skip
                keep(f"hellaswag_{mode}", r["statistics"]["tokens"])
                st = r["statistics"]
                best[f"bytes_per_token_hellaswag_{mode}"] = st["bytes_read"] / st["tokens"]
                best[f"hit_rate_{mode}"] = st["hit_rate"]
                best["hellaswag_acc"] = r["metrics"]["acc"]
    return best


REAL_LAYERS = 2  # the real-layer-shape Mixtral store's layers (sec_llama's full-run store)


def _speed_row(name: str, dense: str, label: str, r: dict[str, Any]) -> list[str]:
    """One row of the eval-speed table from an eval_speed result r."""
    return [
        name,
        dense,
        label,
        fmt(r["prefill"], 4),
        fmt(r["ppl_fused"], 4),
        f"{r['ppl_fused'] / r['prefill']:.2f}",
        fmt(r["hellaswag_fused"], 4),
        f"{r['hellaswag_fused'] / r['prefill']:.2f}",
        f"{r['hellaswag_split'] / r['prefill']:.2f}",
        fmt(r["prefill_cpu"], 4),
        fmt(r["ppl_fused_cpu"], 4),
        f"{r['ppl_fused_cpu'] / r['prefill_cpu']:.2f}",
        f"{r['ppl_fused_head']:.0%} + {r['ppl_fused_lse']:.0%}",
        f"{r['ppl_fused_rest_cpu'] / r['prefill_rest_cpu']:.2f}",
        fmt(r["hellaswag_fused_cpu"], 4),
        f"{r['hellaswag_fused_cpu'] / r['prefill_cpu']:.2f}",
        f"{r['hellaswag_fused_head']:.0%} + {r['hellaswag_fused_lse']:.0%}",
        f"{r['hellaswag_fused_rest_cpu'] / r['prefill_rest_cpu']:.2f}",
        f"{r['hellaswag_acc']:.3f}",
        f"{r['bytes_per_token_prefill']:.0f} / {r['bytes_per_token_ppl_fused']:.0f}"
        f" / {r['bytes_per_token_hellaswag_fused']:.0f}",
    ]


def _speed_rows(
    ctx: Context,
    models: dict[str, Path],
    work: Path,
    text: str,
    real: Path | None = None,
) -> tuple:
    """The eval-speed table: per model its q4_0 store (eval's default activations) as
    `colibri convert --quant q4_0` writes it (dense weights, the output head among them, in
    q8_0: the store `colibri run` runs), in core and with an expert cache of a third of its
    experts, and in core the same experts with f32 dense weights (the quality table's store:
    an f32 head). real: a q4_0 store with dense q8_0 (tools/synth_store.py's default) of real
    Mixtral-8x7B layer shapes and fewer layers (sec_llama.ensure_model), measured in core and
    with a third of its experts cached (keys "real/..." in the data). Returns (rows, data by
    row, the number of HellaSwag items)."""
    import json

    from colibri.io.format import open_store

    n = 16 if ctx.quick else 64
    with lzma.open(_shared(HELLASWAG), "rt") as f:
        docs = [json.loads(next(f)) for _ in range(n)]
    runs = []
    for name, ref in models.items():
        q4d = requantize(ref, work / f"{name}-q4_0-dense_q8_0", "q4_0", dense="q8_0")
        q4 = work / f"{name}-q4_0"
        third = sum(r.nbytes for r in open_store(q4d).records) // 3
        runs += [
            (name, name, "q8_0 (convert's default)", q4d, "in core", None),
            (name, name, "q8_0 (convert's default)", q4d, "1/3 of experts cached", third),
            (name, name, "f32", q4, "in core", None),
        ]
    if real is not None:
        st = open_store(real)
        third = sum(r.nbytes for r in st.records) // 3
        label = (
            f"Mixtral-8x7B layer shapes, {st.config['num_hidden_layers']} layers (random weights)"
        )
        runs += [
            ("real", label, "q8_0 (convert's default)", real, "in core", None),
            ("real", label, "q8_0 (convert's default)", real, "1/3 of experts cached", third),
        ]
    rows, data = [], {}
    for key, name, dense, store, label, budget in runs:
        ctx.log(f"quality: eval speed {name} q4_0, dense {dense}, {label}")
        r = asyncio.run(eval_speed(store, text, docs, threads=ctx.threads, budget=budget))
        data[f"{key}/dense {dense.split()[0]}/{label}"] = r
        rows.append(_speed_row(name, dense, label, r))
    return rows, data, n


def read_llama_logits(path: Path) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """The file `llama-perplexity --kl-divergence-base FILE` writes (tools/perplexity/
    perplexity.cpp, perplexity()): "_logits_", int32 n_ctx, n_vocab, n_chunk, the text's
    tokens int32 [n_chunk * n_ctx] (as tokenized, BOS in front where the vocabulary adds it,
    before each window's first token is replaced by BOS), then per window and scored position
    (n_ctx - 1 - n_ctx // 2 of them) a row of 2 * ((n_vocab + 1) // 2) + 4 uint16: f32 scale,
    f32 min_log_prob, then per vocabulary entry q, log p = min_log_prob + scale * q (q = 0:
    at most min_log_prob, logits more than 16 below the row's max are clipped there).
    Returns (n_ctx, tokens, the scored tokens' log-probabilities float64 [n_chunk * (n_ctx -
    1 - n_ctx // 2)], the target of window c's position i being tokens[c * n_ctx + i + 1],
    and bool [same] true where that value is only an upper bound: q = 0, clipped). Raises
    ValueError on another file."""
    raw = path.read_bytes()
    if raw[:8] != b"_logits_" or len(raw) < 20:
        raise ValueError(f"{path}: not a llama-perplexity logits file")
    n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(raw, np.int32, 3, 8))
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, 20)
    first = n_ctx // 2
    per = n_ctx - 1 - first
    nv = 2 * ((n_vocab + 1) // 2) + 4
    off = 20 + 4 * n_chunk * n_ctx
    if len(raw) != off + 2 * n_chunk * per * nv:
        raise ValueError(f"{path}: {len(raw)} bytes, not a llama-perplexity logits file")
    rows = np.frombuffer(raw, np.uint16, n_chunk * per * nv, off).reshape(-1, nv)
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)  # [scale, min_log_prob]
    targets = np.concatenate(
        [tokens[c * n_ctx + first + 1 : (c + 1) * n_ctx] for c in range(n_chunk)]
    )
    q = rows[np.arange(len(targets)), 4 + targets].astype(np.float64)
    lp = head[:, 1].astype(np.float64) + head[:, 0].astype(np.float64) * q
    return n_ctx, tokens, lp, q == 0


async def _colibri_nll(
    store: Path, text: str, windows: int, threads: int
) -> tuple[list[int], np.ndarray]:
    """colibri's tokens of text and per scored token nll (ctx CTX, `windows` windows) as
    llama.cpp's CPU backend computes a Q4_0 GGUF: q8_0 activations, an f16 KV cache."""
    from colibri.engine import open_engine
    from colibri.eval import scoring

    async with open_engine(
        store, n_ctx=CTX, threads=threads, activations="q8_0", kv_dtype="f16"
    ) as engine:
        ids, bos = scoring.text_tokens(engine.tokenizer, text)
        res = await scoring.perplexity(engine, ids, CTX, bos=bos, limit=windows)
    return ids, res.nll


def _llama_perplexity(
    ctx: Context, store: Path, text: str, text_file: Path, windows: int
) -> dict[str, Any] | None:
    """llama-perplexity on the store exported to GGUF (same bytes), beside colibri on the
    same text, --ctx and windows, or None if llama-perplexity is not built: llama_ppl (its
    final estimate), colibri_ppl (colibri with an f16 KV cache, as llama.cpp keeps it), and
    from the logits file llama-perplexity writes (read_llama_logits) the check that both
    scored the same tokens (tokens_same of tokens_total) and per scored token
    |nll colibri - nll llama| (dnll_mean, dnll_max; llama's log-probabilities are stored
    with a resolution of ~2.4e-4, and clipped at 16 below the row's max logit: the
    `clipped` tokens left out). llama.cpp's log thread sometimes loses its last lines at
    exit: the run is repeated (up to 3 times) until its final PPL is printed."""
    from colibri.bench import llama_cpp

    try:
        exe = llama_cpp.llama_bin_dir() / "llama-perplexity"
    except FileNotFoundError:
        return None
    if not exe.is_file():
        return None
    from colibri.export_gguf import export_gguf

    gguf = export_gguf(store, store.with_suffix(".gguf"), force=True)
    logits = store.with_suffix(".llama-logits")
    cmd = [str(exe), "-m", str(gguf), "-f", str(text_file), "-c", str(CTX), "--chunks",
           str(windows), "-t", str(ctx.threads), "--kl-divergence-base", str(logits)]  # fmt: skip
    for _ in range(3):
        res = ctx.run(cmd, check=False, timeout=1800)
        out = res.stdout + res.stderr
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
        # the running PPL after the last window ("[8]335.8626,") is the same figure
        running = re.findall(rf"\[{windows}\]([0-9.]+)", out)
        if m or running:
            break
    else:
        logits.unlink(missing_ok=True)
        return {"llama_ppl": None}
    r: dict[str, Any] = {"llama_ppl": float(m.group(1)) if m else float(running[-1])}
    try:
        n_ctx, theirs, lp, clipped = read_llama_logits(logits)
        if n_ctx != CTX:
            raise ValueError(f"n_ctx {n_ctx}, not {CTX}")
    except (OSError, ValueError) as exc:
        ctx.log(f"quality: llama-perplexity's logits unreadable ({exc})")
        return r
    finally:
        logits.unlink(missing_ok=True)
    ids, nll = asyncio.run(_colibri_nll(store, text, windows, ctx.threads))
    ours = np.asarray(ids[: len(theirs)])
    d = np.abs(nll + lp)[~clipped] if len(nll) == len(lp) else np.array([np.inf])
    r |= {
        "colibri_ppl": float(np.exp(nll.mean())),
        "tokens_same": int((ours == theirs).sum()) if len(ours) == len(theirs) else 0,
        "tokens_total": len(theirs),
        "dnll_mean": float(d.mean()),
        "dnll_max": float(d.max()) if len(d) else 0.0,
        "clipped": int(clipped.sum()),
    }
    return r


def _row(label: str, qtype: str, acts: str, r: dict[str, Any]) -> list[str]:
    """One row of the quality table from a _measure result (the llama-perplexity cell is
    empty where r has no llama_ppl)."""
    return [
        label,
        qtype,
        acts,
        fmt(r["ppl"], 4),
        fmt(r["kl_mean"], 3),
        fmt(r["kl_p99"], 3),
        f"{r['top1']:.3f}",
        "-" if r["routing"] is None else f"{r['routing']:.3f}",
        fmt(r["eval_tok_s"], 4),
        fmt(r["prefill_tok_s"], 4),
        _llama_cell(r),
    ]


def _llama_cell(r: dict[str, Any]) -> str:
    """llama-perplexity's PPL and colibri's relative difference to it."""
    if "llama_ppl" not in r:
        return ""
    if not r["llama_ppl"]:
        return "-"
    ll = r["llama_ppl"]
    cell = f"{fmt(ll, 4)} (colibri {r['ppl'] / ll - 1:+.3%}"
    if "colibri_ppl" not in r:
        return cell + ")"
    return (
        f"{cell}, with an f16 KV cache {r['colibri_ppl'] / ll - 1:+.3%}; same tokens "
        f"{r['tokens_same']}/{r['tokens_total']}; per token |Δnll| mean {r['dnll_mean']:.4f}, "
        f"max {r['dnll_max']:.3f}, {r['clipped']} clipped tokens left out)"
    )


def run(ctx: Context) -> Section:
    text_path = _shared(TEXT)
    with lzma.open(text_path, "rt") as f:
        text = f.read(400_000)
    text_file = ctx.work / "quality_text.txt"
    text_file.write_text(text)
    windows = 8 if ctx.quick else 32
    work = ctx.work / "quality"
    work.mkdir(parents=True, exist_ok=True)
    models = {"demo": requantize(ROOT / "colibri/data/demo", work / "demo-f32", "f32")}
    try:
        models["mixtral-shaped"] = mixtral_model(work / "mixtral")
    except ImportError as exc:  # transformers / torch: test extras
        ctx.log(f"quality: no Mixtral-shaped model ({exc}; it needs pip install -e '.[test]')")
    rows, data = [], {"ctx": CTX, "windows": windows, "models": {}}
    heads = []
    for name, ref in models.items():
        results: dict[str, Any] = {}
        for qtype in ("f32", *FORMATS):
            try:
                store = ref if qtype == "f32" else requantize(ref, work / f"{name}-{qtype}", qtype)
            except Exception as exc:  # rows that are not a multiple of the type's block
                ctx.log(f"quality: {name} {qtype}: not measured ({exc})")
                rows.append([name, qtype, "-", f"n/a ({str(exc)[:60]})", *[""] * 7])
                continue
            for acts in ("f32", "q8_0") if qtype in Q8_ACT else ("f32",):
                ctx.log(f"quality: {name} {qtype} activations {acts}")
                r = asyncio.run(_measure(store, ref, text, acts, windows, ctx.threads))
                if qtype == "q4_0" and acts == "q8_0":
                    r |= _llama_perplexity(ctx, store, text, text_file, windows) or {
                        "llama_ppl": None
                    }
                results[f"{qtype}/{acts}"] = r
                rows.append(_row(name, qtype, acts, r))
        # out of core: an expert cache of a third of the q4_0 store's experts
        from colibri.io.format import open_store

        q4_store = work / f"{name}-q4_0"
        budget = sum(r.nbytes for r in open_store(q4_store).records) // 3
        ctx.log(f"quality: {name} q4_0 activations q8_0, budget {budget >> 10} KiB")
        r = asyncio.run(_measure(q4_store, ref, text, "q8_0", windows, ctx.threads, budget))
        results["q4_0/q8_0/budget_third"] = r
        rows.append(
            _row(f"{name} (1/3 of experts cached: hit rate {r['hit_rate']:.0%})", "q4_0", "q8_0", r)
        )
        # the store `colibri convert --quant q4_0` writes: dense weights (the head) in q8_0
        q4d = requantize(ref, work / f"{name}-q4_0-dense_q8_0", "q4_0", dense="q8_0")
        ctx.log(f"quality: {name} q4_0, dense q8_0, activations q8_0")
        r = asyncio.run(_measure(q4d, ref, text, "q8_0", windows, ctx.threads))
        results["q4_0/q8_0/dense_q8_0"] = r
        rows.append(_row(f"{name} (dense q8_0: convert's default)", "q4_0", "q8_0", r))
        data["models"][name] = results
        q4 = results["q4_0/q8_0"]
        heads.append(
            Headline(
                f"{name}: q4_0 KL vs f32 (ctx {CTX})",
                "nats/token",
                q4["kl_mean"],
                note="mean KL(f32 || q4_0), q8_0 activations",
            )
        )
        heads.append(
            Headline(
                f"{name}: eval vs prefill tok/s (q4_0)",
                "tok/s",
                q4["eval_tok_s"],
                peer=None,
                limit=q4["prefill_tok_s"],
                limit_name="prefill",
                target=">= prefill",
            )
        )
    from colibri.bench.sec_llama import ensure_model

    real, _, note = ensure_model(ctx, REAL_LAYERS, False)
    if real is None:
        ctx.log(f"quality: no real-layer-shape Mixtral store ({note})")
    speed_rows, data["speed"], n_items = _speed_rows(ctx, models, work, text, real)
    for name in models:
        r = data["speed"][f"{name}/dense q8_0/in core"]
        heads.append(
            Headline(
                f"{name}: eval hellaswag vs prefill tok/s (q4_0)",
                "tok/s",
                r["hellaswag_fused"],
                limit=r["prefill"],
                limit_name="prefill",
                target=">= prefill",
            )
        )
    md = [
        f"`colibri eval --task perplexity` (llama-perplexity's method: windows of {CTX} tokens, "
        f"second half scored, {windows} windows of real c4 text) of each store against its "
        "f32 store. Dense weights are f32 in every store; only the experts' format changes. "
        "KL = KL(f32 || variant) per scored token (nats); routing = fraction of tokens whose "
        "top-k expert set equals the f32 run's, averaged over MoE layers (per layer in "
        "results.json). eval tok/s counts every token fed; prefill tok/s: one "
        f"{CTX}-token prompt through `Engine.forward`, median of 3 (after the eval run: warm "
        "cache). The row marked 1/3 runs the q4_0 store with an expert cache of a third of its "
        "experts (out of core; records come from the page cache here); the row marked dense "
        "q8_0 the q4_0 store as `colibri convert` writes it (embeddings, attention and output "
        "head in q8_0): what a quantized head adds. The Mixtral-shaped "
        "model has random weights (PPL near its vocabulary size): its KL and routing figures "
        "are what tell formats apart. llama-perplexity PPL: llama.cpp's own tool on the q4_0 "
        "store exported to GGUF (the same bytes), same text, --ctx and windows; colibri's "
        "difference to it as in the row (f32 KV cache) and with an f16 KV cache (llama.cpp's); "
        "from the logits file llama-perplexity writes (--kl-divergence-base): how many of the "
        "tokens both scored are the same, and per scored token |nll colibri - nll llama.cpp| "
        "(its log-probabilities are stored to ~2.4e-4 and clipped 16 below a row's max: "
        "clipped tokens left out).",
        "",
        table(
            [
                "model",
                "experts",
                "activations",
                "PPL",
                "KL mean",
                "KL p99",
                "top-1",
                "routing",
                "eval tok/s",
                "prefill tok/s",
                "llama-perplexity PPL",
            ],
            rows,
        ),
    ]
    md += [
        "",
        "Eval speed: tokens fed per second of wall time, the best of 3 interleaved "
        f"rounds, on each model's q4_0 store (q8_0 activations): `colibri run`'s prefill of 4 "
        f"{SPEED_CTX}-token prompts (256-token chunks), `colibri eval --task perplexity --ctx "
        f"{SPEED_CTX}` (4 windows, batched; the output head runs on the scored half of every "
        f"window, which prefill skips) and `--task hellaswag` on {n_items} items (items and "
        "choices batched: prefixes once, every choice from a fork of its prefix's KV cache), "
        "in eval's default fused batch mode, and hellaswag in split mode. The columns marked "
        "CPU s divide tokens by the CPU seconds of the process instead of wall seconds: on "
        "a loaded machine the steadier ratio. Head + log-sum-exp share: the fractions of "
        "eval's CPU seconds spent in the output head (final norm and lm_head, on every scored "
        "row; prefill runs it on one row a chunk) and in the scored rows' log-sum-exp: where "
        "they are large, eval is bound below prefill by them. Besides the head: the CPU-s "
        "ratio with both taken out of eval's seconds and the head out of prefill's (eval's "
        "other work per token against prefill's). "
        "Dense q8_0: the store `colibri convert --quant q4_0` writes by default (embeddings, "
        "attention and output head in q8_0, through the same Q8_0 kernels as `run`); dense "
        "f32: the quality table's store (an f32 head). Bytes read per token: expert bytes "
        "from the store per token fed (0 in core). The rows marked Mixtral-8x7B layer shapes run "
        f"a random-weight store of {REAL_LAYERS} real Mixtral-8x7B layers (hidden 4096, 8 "
        "experts of d_ff 14336, top-2; q4_0 experts, q8_0 dense; vocabulary 32,000; 1.95 GB, "
        "the llama section's store): a token's work is ~0.79 G multiply-adds in its layers "
        "against 0.13 G in the head, so the head is ~14% of a scored row here (the real "
        "32-layer model: ~1%), where the toy models' head is most of it.",
        "",
        table(
            [
                "model",
                "dense weights (head)",
                "experts cached",
                "prefill tok/s",
                "eval PPL tok/s",
                "PPL / prefill",
                "eval hellaswag tok/s",
                "hellaswag / prefill",
                "hellaswag split / prefill",
                "prefill tok/CPU s",
                "eval PPL tok/CPU s",
                "PPL / prefill (CPU s)",
                "head + log-sum-exp share PPL",
                "PPL / prefill besides the head (CPU s)",
                "eval hellaswag tok/CPU s",
                "hellaswag / prefill (CPU s)",
                "head + log-sum-exp share hellaswag",
                "hellaswag / prefill besides the head (CPU s)",
                "hellaswag acc",
                "bytes read / token: prefill / eval PPL / hellaswag",
            ],
            speed_rows,
        ),
    ]
    if not any(
        "llama_ppl" in r and r["llama_ppl"] for m in data["models"].values() for r in m.values()
    ):
        md += ["", "llama-perplexity: not built (tools/build_llama_cpp.sh), column empty."]
    return Section(key="quality", title=TITLE, markdown="\n".join(md), data=data, headlines=heads)
