"""colibri eval's perplexity against llama.cpp's own `llama-perplexity` on the same Q4_0 GGUF
bytes (colibri export-gguf of the store colibri scores), the same real text (../shared/data
c4), the same --ctx and number of windows: the final PPL within the issue's 0.5%, and the
running PPL llama-perplexity prints after each window ([1], [2], ...) close too (so the
windows are the same; RUNNING), and from the logits file it writes (--kl-divergence-base):
the very tokens colibri scores, and per scored token a log-probability close to colibri's.
Skipped when llama.cpp is not built (tools/build_llama_cpp.sh; CI).

Two models: the demo (a trained Mixtral, SentencePiece-style vocabulary, BOS added: every
window starts with BOS) and a tiny random Mixtral with the OLMoE tokenizer (byte-level BPE,
no BOS). colibri runs with --activations q8_0 and --kv f16, as llama.cpp's CPU backend
computes Q4_0 weights and keeps its KV cache by default.
"""

from __future__ import annotations

import asyncio
import json
import lzma
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from colibri.engine import open_engine
from colibri.eval import scoring

ROOT = Path(__file__).resolve().parents[1]
SHARED = next(
    (p / "shared" / "data" for p in ROOT.parents[0:3] if (p / "shared" / "data").is_dir()),
    ROOT.parent / "shared" / "data",
)
TEXT = SHARED / "text" / "olmoe_routing_c4_texts.txt.xz"
OLMOE_TOKENIZER = SHARED / "tokenizers" / "olmoe" / "allenai_gpt-neox-olmo-dolma-v1_5.json"
CTX, WINDOWS = 128, 6
TOLERANCE = 0.005  # issue 21: colibri's Q4_0 PPL within 0.5% of llama-perplexity's
# the running PPL after each window: the random model's near-tied routers flip an expert on
# rounding differences now and then, and the first windows hold few tokens (measured: demo
# within 0.01% everywhere; the random model 0.06-0.56% per window, 0.33% final)
RUNNING = {"demo": 0.005, "mixtral-olmoe-tokenizer": 0.01}
# mean |nll colibri - nll llama| per scored token (nats; measured on the bench's 8 windows of
# 128: demo 0.0024, a random Mixtral with the OLMoE tokenizer 0.008)
PER_TOKEN = {"demo": 0.01, "mixtral-olmoe-tokenizer": 0.03}


def _llama_perplexity() -> Path:
    from colibri.bench import llama_cpp

    try:
        exe = llama_cpp.llama_bin_dir() / "llama-perplexity"
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    if not exe.is_file():
        pytest.skip(f"{exe} is not built (tools/build_llama_cpp.sh)")
    return exe


def _q4_store(kind: str, tmp: Path) -> Path:
    from colibri.convert import convert

    if kind == "demo":
        from colibri.bench.sec_quality import requantize

        f32 = requantize(ROOT / "colibri" / "data" / "demo", tmp / "demo-f32", "f32")
        return requantize(f32, tmp / "demo-q4_0", "q4_0")
    from tests import hf_models

    if not OLMOE_TOKENIZER.exists():
        pytest.skip(f"shared data missing: {OLMOE_TOKENIZER}")
    model = hf_models.build("mixtral", seed=3, vocab_size=50304, hidden_size=128,
                            intermediate_size=256)  # fmt: skip
    hf = hf_models.save(model, tmp / "hf")
    (hf / "tokenizer.json").write_bytes(OLMOE_TOKENIZER.read_bytes())
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return convert(hf, tmp / "q4_0", quant="q4_0", dense_quant="f32", show_progress=False)


async def _colibri_nll(store: Path, text: str) -> tuple[list[int], np.ndarray]:
    async with open_engine(store, n_ctx=CTX, activations="q8_0", kv_dtype="f16") as engine:
        tokens, bos = scoring.text_tokens(engine.tokenizer, text)
        res = await scoring.perplexity(engine, tokens, CTX, bos=bos, limit=WINDOWS)
    return tokens, res.nll


@pytest.mark.parametrize("kind", ["demo", "mixtral-olmoe-tokenizer"])
def test_perplexity_equals_llama_perplexity(kind, tmp_path):
    exe = _llama_perplexity()
    if not TEXT.exists():
        pytest.skip(f"shared data missing: {TEXT}")
    from colibri.export_gguf import export_gguf

    with lzma.open(TEXT, "rt") as f:
        text = f.read(40_000)
    text_file = tmp_path / "text.txt"
    text_file.write_text(text)
    store = _q4_store(kind, tmp_path)
    gguf = export_gguf(store, tmp_path / "q4_0.gguf", force=True)
    logits = tmp_path / "llama.logits"
    cmd = [str(exe), "-m", str(gguf), "-f", str(text_file), "-c", str(CTX), "--chunks",
           str(WINDOWS), "-t", "2", "--kl-divergence-base", str(logits)]  # fmt: skip
    for _ in range(3):  # llama.cpp's log thread sometimes loses its last lines at exit
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-3000:]
        final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
        if final and f"[{WINDOWS}]" in out:
            break
    assert final, out[-3000:]
    running = [float(x) for x in re.findall(r"\[(?:\d+)\]([0-9.]+)", out)]
    assert len(running) == WINDOWS, out[-3000:]

    tokens, nll = asyncio.run(_colibri_nll(store, text))
    per_window = CTX - 1 - CTX // 2  # llama-perplexity scores the second half of each window
    assert len(nll) == WINDOWS * per_window
    ppl, err = scoring.ppl_and_stderr(nll)
    assert ppl == pytest.approx(float(final.group(1)), rel=TOLERANCE)
    assert err == pytest.approx(float(final.group(2)), rel=0.05)
    for k, theirs in enumerate(running, 1):
        ours = float(np.exp(nll[: k * per_window].mean()))
        assert ours == pytest.approx(theirs, rel=RUNNING[kind]), f"after window {k}"

    # the logits file llama-perplexity wrote: its tokens are colibri's, its per-token
    # log-probabilities (stored at ~2.4e-4 resolution) give its own final PPL, and colibri's
    # per-token nll is close to them token by token
    from colibri.bench.sec_quality import read_llama_logits

    n_ctx, theirs, lp, clipped = read_llama_logits(logits)
    assert n_ctx == CTX and len(theirs) == WINDOWS * CTX
    assert tokens[: len(theirs)] == theirs.tolist()
    assert len(lp) == len(nll) and (lp <= 0).all() and clipped.mean() < 0.1
    # the tokens llama.cpp stored exactly: their PPL is its PPL over them, to the file's rounding
    exact = float(np.exp(-lp[~clipped].mean()))
    assert exact == pytest.approx(float(np.exp(nll[~clipped].mean())), rel=TOLERANCE)
    d = np.abs(nll + lp)[~clipped]
    assert d.mean() < PER_TOKEN[kind], d.mean()
    # a clipped token's log-probability is at most the stored bound: colibri's below it too
    assert (-nll[clipped] <= lp[clipped] + 0.5).all()
