"""GGUF files -> store, read with the `gguf` package's GGUFReader.

Expert tensors `blk.N.ffn_{gate,up,down}_exps.weight` (GGML dims [H, I, E] / [I, H, E], i.e.
row-major [E, I, H] / [E, H, I]) in Q4_0, Q4_1, Q8_0, F16, BF16 or F32 are copied into records
byte for byte, no requantization. Dense tensors are renamed to their HF names; a dense tensor
already in its target storage type is copied bit-exact (rows un-permuted where llama.cpp
permuted Q/K for its rope), any other is dequantized by gguf and requantized.

Architectures: every family with a GGUFArch (models/<model_type>.py; today GGUF "llama" with
experts (Mixtral) -> mixtral, "qwen3moe" -> qwen3_moe). The config is rebuilt from GGUF
metadata in HF spelling; each GGUF tensor's HF name is the one of the family's spec whose
GGUF name (gguf's own TensorNameMap) it has. A tokenizer.json is rebuilt from the
GGUF vocabulary for byte-level BPE vocabularies with the Qwen2 pre-tokenizer (`tokenizer.ggml.
model` "gpt2", `pre` "qwen2": Qwen2/Qwen3 GGUFs); others (SentencePiece "llama", other `pre`
regexes) get none, with a note. `tokenizer.chat_template` becomes chat_template.jinja.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from colibri.convert import dense_qtype, progress, quantize
from colibri.errors import ConversionError, StoreError
from colibri.io.config import ConfigError, check_config
from colibri.io.format import ExpertLayout, StoreWriter
from colibri.models.family import Family
from colibri.models.spec import ModelSpec, dense_tensors, f32_tensors
from colibri.registry import FAMILIES, model_spec

# GGUF general.architecture -> colibri family
GGUF_ARCHS: dict[str, Family] = {f.gguf.name: f for f in FAMILIES.values() if f.gguf is not None}

_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q4_0": "q4_0", "Q4_1": "q4_1"}
_TYPES["Q8_0"] = "q8_0"
_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by tokenizer.ggml.pre
_PRE_REGEX = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader: Any, path: Path) -> tuple[str, dict[str, Any]]:
    """(model_type, HF-spelled config) from the GGUF metadata. Raises ConversionError for an
    architecture without experts or one not handled."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS or not _field(reader, f"{arch}.expert_count"):
        supported = ", ".join(f"{a} ({f.model_type})" for a, f in GGUF_ARCHS.items())
        raise ConversionError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported, with experts: " + supported
        )
    fam = GGUF_ARCHS[arch]
    g = fam.gguf
    assert g is not None

    def get(key: str, default: Any = None) -> Any:
        v = _field(reader, f"{arch}.{key}", default)
        if v is None:
            raise ConversionError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return v

    H, nh = int(get("embedding_length")), int(get("attention.head_count"))
    names = {t.name: t for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens else int(names["token_embd.weight"].shape[1])
    cfg: dict[str, Any] = {
        "architectures": [g.architectures],
        "model_type": fam.model_type,
        "vocab_size": vocab,
        "hidden_size": H,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": nh,
        "num_key_value_heads": int(get("attention.head_count_kv", nh)),
        "head_dim": int(get("attention.key_length", H // nh)),
        "num_experts_per_tok": int(get("expert_used_count")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        fam.num_experts_key: int(get("expert_count")),
        fam.d_ff_key: int(get(g.expert_ff_key)),
    }
    if fam.d_ff_key != "intermediate_size":  # the dense MLP's size, when the arch has one
        cfg["intermediate_size"] = int(get("feed_forward_length", 0))
    cfg.update(g.implied)
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        v = _field(reader, f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[hf] = int(v)
    return fam.model_type, cfg


def hf_names(fam: Family, spec: ModelSpec) -> dict[str, str]:
    """{GGUF tensor name: HF name} of every dense tensor of `spec`, named by gguf's
    TensorNameMap of the family's llama.cpp arch (as llama.cpp's converter names them)."""
    import gguf

    assert fam.gguf is not None
    arch = getattr(gguf.MODEL_ARCH, fam.gguf.arch)
    names = gguf.get_tensor_name_map(arch, len(spec.layers))
    out = {}
    for hf in dense_tensors(spec):
        base, suffix = hf.rsplit(".", 1)
        gname = names.get_name(base)
        if gname is not None:
            out[f"{gname}.{suffix}"] = hf
    return out


def gguf_tokenizer_files(meta: dict[str, Any], path: Path) -> list[tuple[str, bytes]]:
    """[(file name, contents)] from GGUF metadata `meta` (key -> value): tokenizer.json
    rebuilt from the vocabulary when it is a byte-level BPE with a known pre-tokenizer (see
    _PRE_REGEX), and chat_template.jinja from tokenizer.chat_template."""
    files = []
    template = meta.get("tokenizer.chat_template")
    if template:
        files.append(("chat_template.jinja", template.encode()))
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if model != "gpt2" or pre not in _PRE_REGEX:
        print(
            f"note: {path}: no tokenizer.json made (tokenizer.ggml.model {model!r}, pre {pre!r};"
            " only byte-level BPE with pre 'qwen2' is rebuilt)",
            file=sys.stderr,
        )
        return files
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pt

    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pt.Sequence(
        [pt.Split(Regex(_PRE_REGEX[pre]), "isolated"), pt.ByteLevel(False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # token_type 3 = CONTROL, 4 = USER_DEFINED (llama.cpp's llama_token_type)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True)
         if ty in (3, 4)]
    )  # fmt: skip
    files.append(("tokenizer.json", tok.to_str().encode()))
    return files


def _unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (rope pairs interleaved ->
    HF's rotate-half halves). Works on any row representation (floats or block bytes)."""
    r = rows.shape[0]
    return rows.reshape(n_head, r // n_head // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def convert_gguf(
    src: Path, out: Path, quant: str, dense_quant: str, force: bool, show_progress: bool
) -> Path:
    """Convert GGUF file `src` into a store at `out` (see the module docstring). `quant` is
    ignored for experts (their GGUF type is kept); `dense_quant` applies to dense weights."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(src)
    except Exception as exc:  # the reader raises ValueError/KeyError/... on bad files
        raise ConversionError(f"{src}: cannot read GGUF (truncated or malformed): {exc}") from None
    try:
        model_type, cfg = gguf_config(reader, src)
    except (ValueError, TypeError, KeyError, IndexError, ArithmeticError) as exc:
        msg = f"{src}: malformed GGUF metadata: {type(exc).__name__}: {exc}"
        raise ConversionError(msg) from None
    try:
        check_config(cfg, f"{src}: metadata (as config.json)")
    except ConfigError as exc:
        raise ConversionError(str(exc)) from None
    fam = GGUF_ARCHS[_field(reader, "general.architecture")]
    try:
        spec = model_spec(cfg)
    except StoreError as exc:
        raise ConversionError(f"{src}: {exc}") from None
    hf_of, f32 = hf_names(fam, spec), f32_tensors(spec)
    H, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    E, I = cfg[fam.num_experts_key], cfg[fam.d_ff_key]  # noqa: E741
    experts: dict[int, dict[str, Any]] = {}
    dense: list[tuple[str, Any]] = []
    for t in reader.tensors:
        tname = t.tensor_type.name
        if m := _EXPERT.match(t.name):
            if tname not in _TYPES:
                raise ConversionError(f"{src}: not supported yet: tensor {t.name} has type {tname}")
            want = [H, I, E] if m[2] != "down" else [I, H, E]  # GGML order: ne0 = columns
            if [int(x) for x in t.shape] != want:
                raise ConversionError(
                    f"{src}: tensor {t.name} has GGML shape {list(t.shape)}, "
                    f"metadata implies {want}"
                )
            experts.setdefault(int(m[1]), {})[m[2]] = t
        elif t.name in hf_of:
            dense.append((hf_of[t.name], t))
        else:
            raise ConversionError(f"{src}: unexpected tensor {t.name}")
    if len(experts) != n or sorted(experts) != list(range(n)):
        raise ConversionError(
            f"{src}: experts found in layers {sorted(experts)}, expected 0-{n - 1} (block_count)"
        )
    types = set()
    for layer, parts in experts.items():
        for role in ("gate", "up", "down"):
            if role not in parts:
                raise ConversionError(f"{src}: missing tensor blk.{layer}.ffn_{role}_exps.weight")
            types.add(_TYPES[parts[role].tensor_type.name])
    if len(types) != 1:
        raise ConversionError(f"{src}: expert tensors mix types {sorted(types)}; not supported yet")
    qtype = types.pop()
    if quant != qtype:
        print(f"note: experts keep the GGUF's {qtype} (--quant {quant} ignored)", file=sys.stderr)
    layout = ExpertLayout.build(qtype, H, I)
    dense.sort(key=lambda x: (int(x[0].split(".")[2]) if ".layers." in x[0] else -1, x[0]))
    plan = []
    for hf, t in dense:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if len(shape) == 2 and shape[0] == 1 and hf.endswith("norm.weight"):
            shape = shape[1:]
        plan.append((hf, dense_qtype(hf, shape, dense_quant, f32), shape, t))
    total = sum(int(t.n_bytes) for t in reader.tensors)
    with StoreWriter(out, layout, force=force) as w:
        w.begin_dense([(hf, qt, shape) for hf, qt, shape, _ in plan])
        bar = progress(total, f"convert {src.name}") if show_progress else None
        for hf, qt, shape, t in plan:
            w.write_dense(hf, _dense_data(t, hf, qt, shape, cfg, fam))
            if bar is not None:
                bar.update(int(t.n_bytes))
        for layer in range(n):
            p = experts[layer]
            for e in range(E):
                w.write_expert(
                    layer, e, {r: np.asarray(p[r].data[e]) for r in ("gate", "up", "down")}
                )
            if bar is not None:
                bar.update(sum(int(p[r].n_bytes) for r in p))
        if bar is not None:
            bar.close()
        meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
        for name, data in gguf_tokenizer_files(meta, src):
            w.add_file(name, data)
        return w.finish(model_type, cfg, {"kind": "gguf", "name": src.name})


def _dense_data(
    t: Any, hf: str, qtype: str, shape: tuple[int, ...], cfg: dict, fam: Family
) -> np.ndarray:
    """The stored form of GGUF tensor `t` as dense `qtype`: its own bytes when the types agree,
    else dequantized (gguf.quants) and requantized; Q/K rows un-permuted where the arch
    permutes them (GGUFArch.rope_permute: llama)."""
    from gguf.quants import dequantize

    src_type = _TYPES.get(t.tensor_type.name)
    perm = None
    assert fam.gguf is not None
    if fam.gguf.rope_permute and hf.endswith(("q_proj.weight", "k_proj.weight")):
        perm = cfg["num_attention_heads"] if "q_proj" in hf else cfg["num_key_value_heads"]
    data = np.asarray(t.data)
    if src_type == qtype:
        x = data.reshape(shape[0], -1) if len(shape) == 2 else data.reshape(shape)
    else:
        f = dequantize(data, t.tensor_type).astype(np.float32).reshape(shape)
        x = quantize(f, qtype)
    return _unpermute(x, perm) if perm else x
