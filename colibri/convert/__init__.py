"""`python -m colibri convert SRC OUT`: a Hugging Face checkpoint directory or a GGUF file in,
a store (docs/FORMAT.md) out. Streams tensor by tensor; writes OUT.tmp-XXXX, renamed at the end.

hf.py reads safetensors checkpoints (per-expert hub layout and transformers 5's fused layout),
gguf.py reads GGUF files (expert blocks copied bit-exact). This module holds what both share:
the quantizer, the rule deciding each dense tensor's storage type, and the CLI.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Collection
from pathlib import Path

import numpy as np

from colibri.errors import ConversionError
from colibri.io.format import BLOCK_QTYPES, QTYPES

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)
# store types without a quantizer: only a GGUF's own bytes make them (ops.QUANTIZE_TYPES)
IMPORT_ONLY = frozenset(("q2_k", "q3_k", "iq4_nl", "iq4_xs"))
# --dense-quant KEEP (GGUF sources): each dense tensor keeps the GGUF's own type
KEEP = "keep"
# dense tensors that always stay f32 whatever --dense-quant says (besides every 1-D tensor)
_F32_NAMES = re.compile(
    r"(\.mlp\.gate\.weight|\.block_sparse_moe\.gate\.weight|\.mlp\.router\.weight"
    r"|\.feed_forward\.router\.weight|\.router\.proj\.weight"
    r"|\.shared_expert_gate\.weight|norm\.weight|e_score_correction_bias|\.bias|\.sinks"
    r"|\.indexer\.weights_proj\.weight"
    # DeepSeek-V4: router, hash table, compressor position biases, hyper-connection maps
    r"|\.ffn\.gate\.weight|\.ffn\.gate\.tid2eid|\.compressor\.ape|\.hc_(?:attn|ffn)_fn"
    r"|\.hc_head\.hc_fn)$"
)


def dense_qtype(
    name: str, shape: tuple[int, ...], dense_quant: str, f32: Collection[str] = ()
) -> str:
    """Storage type of dense tensor `name` (HF spelling) of logical `shape`.

    Norms, routers, shared_expert_gate, e_score_correction_bias, biases, sinks, the DSA
    indexer's weights_proj, every
    tensor that is not 2-D and every name in `f32` (models.spec.f32_tensors: the spec's
    routers, whatever their names) stay f32; a 2-D weight whose columns are not a multiple of
    the block size (32; 256 for the K-quants and iq4_xs) falls back to f32 under a block
    `dense_quant`; everything else (attention, shared
    experts, embeddings, lm_head) uses `dense_quant`."""
    if len(shape) != 2 or name in f32 or _F32_NAMES.search(name):
        return "f32"
    if dense_quant in BLOCK_QTYPES and shape[-1] % max(32, QTYPES[dense_quant][0]):
        return "f32"
    return dense_quant


def _gguf_type(qtype: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[qtype.upper()]


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """Quantize float32 `x` [..., cols] row by row into `qtype`.

    Returns uint8 [..., row_nbytes] for q4_0/q4_1/q8_0 (GGML blocks, byte-identical to
    `gguf.quants.quantize`), uint16 bf16 bits (round to nearest even), float16 or float32.
    Uses colibri's C kernels when built (colibri.compute.ops.quantize), else gguf.quants."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == "f32":
        return x
    if qtype == "f16":
        return x.astype(np.float16)
    if qtype == "bf16":
        from gguf.quants import quantize as gq

        return gq(x, _gguf_type("bf16")).view(np.uint16)
    ops = _ops()
    if ops is not None:
        flat = x.reshape(-1, x.shape[-1])
        return ops.quantize(flat, qtype).reshape(*x.shape[:-1], -1)
    from gguf.quants import quantize as gq

    return gq(x, _gguf_type(qtype))


_OPS: list = []


def _ops():
    """colibri.compute.ops if its C quantizer is built, else None (then gguf.quants is used)."""
    if not _OPS:
        try:
            from colibri.compute import ops

            _OPS.append(ops if hasattr(ops, "quantize") else None)
        except ImportError:
            _OPS.append(None)
    return _OPS[0]


def progress(total_bytes: int, desc: str):
    """A tqdm bar counting bytes of source tensors processed (tensors shown as postfix)."""
    from tqdm import tqdm

    return tqdm(
        total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=None
    )


def convert(
    src: str | Path,
    out: str | Path,
    *,
    quant: str = "q4_0",
    dense_quant: str = "q8_0",
    force: bool = False,
    show_progress: bool = True,
) -> Path:
    """Convert the checkpoint at `src` (HF directory or .gguf file) into a store at `out`.
    `src` may also be a Mixtral store (the demo): its weights dequantized to f32 are the
    source (colibri/convert/store.py), e.g. for an f32 reference of the demo.

    `quant`: expert weight type (a GGUF's experts keep their types); `dense_quant`: type of
    dense 2-D weights (see dense_qtype), or "keep" for a GGUF's own types.
    Raises ConversionError (unsupported or inconsistent source) or StoreError (OUT exists
    without `force`); on any error nothing is left at OUT or OUT.tmp-*."""
    for what, q in (("--quant", quant), ("--dense-quant", dense_quant)):
        if q not in QTYPES and not (what == "--dense-quant" and q == KEEP):
            raise ConversionError(f"{what} {q!r} unknown (valid: {', '.join(QTYPES)})")
    if dense_quant in IMPORT_ONLY:
        raise ConversionError(
            f"--dense-quant {dense_quant!r} has no quantizer (an import-only type: a GGUF's "
            f"expert tensors keep it); choose one of {', '.join(sorted(set(QTYPES) - IMPORT_ONLY))}"
        )
    src, out = Path(src), Path(out)
    if dense_quant == KEEP and not src.is_file():
        raise ConversionError("--dense-quant keep is for GGUF sources (it keeps their types)")
    if quant in IMPORT_ONLY and not src.is_file():
        raise ConversionError(
            f"--quant {quant!r} has no quantizer (an import-only type, kept from GGUF files); "
            f"choose one of {', '.join(sorted(set(QTYPES) - IMPORT_ONLY))}"
        )
    if not src.exists():
        raise ConversionError(f"{src}: no such file or directory")
    s, o = src.resolve(), out.resolve()
    if s == o or o in s.parents:
        raise ConversionError(f"{out}: OUT must not be SRC or a directory containing it")
    if src.is_file():
        from colibri.convert.gguf import convert_gguf

        with open(src, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ConversionError(
                    f"{src}: not a GGUF file; SRC is a Hugging Face checkpoint directory "
                    "(config.json + safetensors) or a .gguf file"
                )

        return convert_gguf(src, Path(out), quant, dense_quant, force, show_progress)
    from colibri.convert.hf import convert_hf
    from colibri.convert.store import is_store, store_to_hf

    if is_store(src):  # a store's weights, dequantized to f32, re-converted (store.py)
        import tempfile

        with tempfile.TemporaryDirectory(prefix="colibri-store-src-") as tmp:
            hf = store_to_hf(src, Path(tmp) / "hf")
            try:
                return convert_hf(hf, Path(out), quant, dense_quant, force, show_progress)
            except ConversionError as exc:  # name the store, not the temporary copy
                raise ConversionError(str(exc).replace(str(hf), str(src))) from None
    return convert_hf(src, Path(out), quant, dense_quant, force, show_progress)


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "src",
        metavar="SRC",
        help="Hugging Face checkpoint directory or .gguf file (or a Mixtral store such as "
        "colibri/data/demo: its weights dequantized)",
    )
    p.add_argument("out", metavar="OUT", help="store directory to create")
    p.add_argument("--quant", default="q4_0", choices=list(QTYPES), help="expert weights")
    p.add_argument(
        "--dense-quant",
        default="q8_0",
        choices=[*QTYPES, KEEP],
        help="dense 2-D weights (keep: a GGUF's own types)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing OUT")


def run_cli(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out = convert(
        args.src, args.out, quant=args.quant, dense_quant=args.dense_quant, force=args.force
    )
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    return 0
