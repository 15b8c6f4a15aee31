"""Quality per store type: mean KL(float || quantized) per token and top-1 agreement of the
next-token distribution, colibri's logits on the same tokens (teacher-forced).

    nice .venv/bin/python -m colibri.bench.quality [--tokens 256] [--out table.md]

Two models, each converted once per expert type (`--quant T`, dense tensors f32 so a row
shows the expert type alone; a last row per model adds q8_0 dense to q4_k experts):

- demo: the embedded demo Mixtral (colibri/data/demo, trained on Python's documentation;
  hidden 192, so the 256-weight K-quant / iq4_xs blocks do not fit its rows), its q8_0 store
  dequantized to f32 and taken as the float model, on Python documentation text
  (`pydoc_data.topics`, part of its training text) tokenized with its own tokenizer.
- random: a tiny random Mixtral made with transformers (hidden 256, 2 layers, 8 experts of
  512, top-2, initializer_range 0.08, router weights x ROUTER_SCALE so routing is decisive),
  on random tokens teacher-forced with its own greedy continuation. A random model's
  outputs hang on small differences (flat distributions), so its KLs are far above a trained
  model's; it is there for the K-quants, and to rank the types on one model.

KL = sum_v p log(p / q) over the vocabulary (nats), p the f32 store's softmax, averaged over
positions; top-1 = fraction of positions where both argmaxes agree. Activations: f32 (the
weight type alone) and q8_0 (colibri's default for quantized weights).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import numpy as np

from colibri.convert import convert
from colibri.engine import open_engine
from colibri.errors import ConversionError
from colibri.io.format import row_nbytes

ROUTER_SCALE = 10.0
TYPES = ["bf16", "fp8", "q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "mxfp4", "q4_k", "q4_1", "q4_0"]


async def logits(store: Path, ids: list[int], activations: str) -> np.ndarray:
    """f32 [len(ids) - 1, vocab]: the logits after each prefix, one prefill per window."""
    async with open_engine(store, activations=activations) as engine:
        seq = engine.new_sequence()
        out = [await engine.forward(seq, ids[:1])]
        for t in ids[1:-1]:
            out.append(await engine.forward(seq, [t]))
    return np.stack(out).astype(np.float64)


def kl_top1(p_logits: np.ndarray, q_logits: np.ndarray) -> tuple[float, float]:
    logp = p_logits - np.logaddexp.reduce(p_logits, axis=1, keepdims=True)
    logq = q_logits - np.logaddexp.reduce(q_logits, axis=1, keepdims=True)
    kl = float((np.exp(logp) * (logp - logq)).sum(axis=1).mean())
    return kl, float((p_logits.argmax(1) == q_logits.argmax(1)).mean())


def demo_checkpoint(out: Path) -> Path:
    """The demo store dequantized into a Hugging Face Mixtral directory (hub layout)."""
    from colibri.convert.store import store_to_hf
    from colibri.run import DEMO_STORE

    return store_to_hf(DEMO_STORE, out)


def demo_ids(path: Path, n: int) -> list[int]:
    import pydoc_data.topics

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = pydoc_data.topics.topics["for"] + pydoc_data.topics.topics["with"]
    return tok.encode(text).ids[:n]


def random_checkpoint(out: Path, n: int) -> tuple[Path, list[int]]:
    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = transformers.MixtralConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=1024, initializer_range=0.08,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # decisive routers, as trained ones are (random ones near-tie)
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(ROUTER_SCALE)
    prompt = torch.randint(0, cfg.vocab_size, (1, 8))
    with torch.no_grad():
        ids = model.generate(prompt, max_new_tokens=n - 8, do_sample=False)[0].tolist()
    model.save_pretrained(out)
    return out, ids


def bits_per_weight(qtype: str) -> float:
    return 8 * row_nbytes(qtype, 1024) / 1024


def measure(name: str, src: Path, ids: list[int], tmp: Path, types: list[str]) -> list[str]:
    rows = []
    ref_store = convert(src, tmp / f"{name}-f32", quant="f32", dense_quant="f32",
                        show_progress=False)  # fmt: skip
    ref = asyncio.run(logits(ref_store, ids, "f32"))
    cases = [(t, "f32") for t in types] + [("q4_k", "q8_0")]
    for qtype, dense in cases:
        try:
            store = convert(src, tmp / f"{name}-{qtype}-{dense}", quant=qtype, dense_quant=dense,
                            show_progress=False)  # fmt: skip
        except ConversionError as exc:  # K-quant blocks on 192-wide rows
            del exc
            rows.append(f"| {name} | {qtype} | {dense} | {bits_per_weight(qtype):.2f} | "
                        "n/a (rows not a multiple of 256) | | | |")  # fmt: skip
            continue
        cells = []
        for act in ("f32", "q8_0"):
            kl, top1 = kl_top1(ref, asyncio.run(logits(store, ids, act)))
            cells += [f"{kl:.2e}", f"{top1:.3f}"]
        rows.append(f"| {name} | {qtype} | {dense} | {bits_per_weight(qtype):.2f} | "
                    + " | ".join(cells) + " |")  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--out", type=Path)
    p.add_argument("--models", default="demo,random", help="comma-separated: demo, random")
    args = p.parse_args()
    head = [
        "| model | experts | dense | bits/weight | KL (f32 act) | top-1 (f32 act) "
        "| KL (q8_0 act) | top-1 (q8_0 act) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = []
        if "demo" in args.models:
            demo = demo_checkpoint(tmp / "demo-hf")
            rows += measure("demo", demo, demo_ids(demo, args.tokens), tmp, TYPES)
        if "random" in args.models:
            rnd, ids = random_checkpoint(tmp / "random-hf", args.tokens)
            rows += measure("random", rnd, ids, tmp, TYPES)
    table = "\n".join(head + rows)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
