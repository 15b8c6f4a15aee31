"""A store as the source of `colibri convert`: its weights dequantized to f32 into a Hugging
Face checkpoint directory (hub layout), which hf.py then converts like any other.

This is how the demo's float reference is made (`colibri convert colibri/data/demo OUT
--quant f32 --dense-quant f32`, for `colibri eval --reference`): the demo ships only as a q8_0
store, and its q8_0 weights dequantized are the float model the quantized stores approximate.
Only Mixtral stores (model_type "mixtral", the demo's family) are supported: the expert names
written here are Mixtral's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from colibri.convert import TOKENIZER_FILES
from colibri.errors import ConversionError
from colibri.io.format import open_store

# Mixtral's expert tensor names for colibri's roles (modeling_mixtral's w1 / w3 / w2)
MIXTRAL_EXPERT = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
MIXTRAL_ROLES = (("gate", "w1"), ("up", "w3"), ("down", "w2"))


def is_store(path: Path) -> bool:
    """True when `path` is a directory holding a store's manifest.json."""
    return (path / "manifest.json").is_file()


def store_to_hf(src: Path, out: Path) -> Path:
    """Write the store at `src` as an f32 Hugging Face checkpoint directory `out` (created):
    model.safetensors (every dense tensor and expert weight dequantized to float32, shapes as
    in the store's manifest), config.json (the store's config) and the store's tokenizer files.
    Returns `out`. Raises ConversionError for a store that is not a Mixtral, StoreError for a
    damaged store."""
    from safetensors.numpy import save_file

    from colibri.compute import ops

    try:
        model_type = json.loads((src / "manifest.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConversionError(f"{src / 'manifest.json'}: not a store manifest ({exc})") from None
    if model_type != "mixtral":
        raise ConversionError(
            f"{src}: a store as SRC is supported for Mixtral stores (the demo's family), not "
            f"model_type {model_type!r}: convert its original checkpoint"
        )
    store = open_store(src)
    tensors: dict[str, np.ndarray] = {}
    for name in store.dense_names():
        arr, qtype, shape = store.dense(name)
        w = arr if qtype in ("f32", "f16", "bf16") else ops.dequantize(arr, qtype, shape)
        tensors[name] = np.ascontiguousarray(w, np.float32)
    blob = store.experts_path.read_bytes()
    for rec in store.records:
        lay = store.layout_for(rec.layer)
        for role, w in MIXTRAL_ROLES:
            spec = lay.tensors[role]
            raw = blob[rec.offset + spec.offset : rec.offset + spec.offset + spec.nbytes]
            name = MIXTRAL_EXPERT.format(layer=rec.layer, expert=rec.expert, w=w)
            tensors[name] = np.ascontiguousarray(
                ops.dequantize(raw, spec.qtype, spec.shape), np.float32
            )
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(store.config))
    # the manifest's list, and the sidecar files a store may hold beside it (the demo's
    # generation_config.json: its sampling defaults)
    for f in dict.fromkeys([*store.manifest.get("tokenizer_files", []), *TOKENIZER_FILES]):
        if (src / f).is_file():
            (out / f).write_bytes((src / f).read_bytes())
    return out
