"""GGUF files -> store, read with the `gguf` package's GGUFReader.

Expert tensors `blk.N.ffn_{gate,up,down}_exps.weight` (GGML dims [H, I, E] / [I, H, E], i.e.
row-major [E, I, H] / [E, H, I]) in any GGML type the store has (F32, F16, BF16, Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, MXFP4, IQ4_NL, IQ4_XS) are copied into records byte for byte, no
requantization; each layer's record layout has its tensors' own types (Q4_K_M keeps some
layers' ffn_down_exps in Q6_K; io.format.plan_layouts). Dense tensors are renamed to their HF
names; a dense tensor already in its target storage type (`--dense-quant keep`: its own) is
copied bit-exact (rows un-permuted where llama.cpp permuted Q/K for its rope), any other is
dequantized by gguf and requantized.

Architectures: every family with an importable GGUFArch (models/<model_type>.py; GGUF
"llama" with experts (Mixtral) -> mixtral, "qwen3moe" -> qwen3_moe, "qwen2moe" -> qwen2_moe,
"olmoe" -> olmoe, "minimax-m2" -> minimax_m2, "glm4moe" -> glm4_moe, "gpt-oss" -> gpt_oss
(expert biases kept f32 in the records), "deepseek2" with attn_kv_b whole -> deepseek_v2
(softmax expert_gating_func) or deepseek_v3 (sigmoid)). The config is rebuilt from GGUF
metadata in HF spelling (YaRN included); each GGUF tensor's HF name is
the one of the family's spec whose GGUF name (gguf's own TensorNameMap) it has. A tokenizer.json
is rebuilt from the GGUF vocabulary for SentencePiece vocabularies (`tokenizer.ggml.model`
"llama": Llama 2, Mistral, Mixtral) and byte-level BPE ones ("gpt2") with the `pre` "qwen2",
"deepseek-llm" or "gpt-2" pre-tokenizer (llama.cpp's regexes, checked against its tokenization
vectors); other vocabularies get none, with a note. `tokenizer.chat_template` becomes
chat_template.jinja.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from colibri.convert import KEEP, dense_qtype, progress, quantize
from colibri.errors import ConversionError, StoreError
from colibri.io.config import ConfigError, check_config
from colibri.io.format import QTYPES, ExpertLayout, StoreWriter, plan_layouts
from colibri.models.family import Family
from colibri.models.spec import ModelSpec, dense_tensors, f32_tensors
from colibri.registry import FAMILIES, model_spec

# GGUF general.architecture -> the colibri families it may import as (GGUFArch.fixed decides)
GGUF_ARCHS: dict[str, list[Family]] = {}
for _f in FAMILIES.values():
    if _f.gguf is not None and _f.gguf.importable:
        GGUF_ARCHS.setdefault(_f.gguf.name, []).append(_f)

# GGML type name -> store qtype: every GGML type the store holds byte for byte
_TYPES = {q.upper(): q for q in QTYPES if q != "fp8"}
_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")
# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by tokenizer.ggml.pre: each splits
# every piece the previous ones left, matches kept as pieces of their own ("isolated")
_DEEPSEEK_LETTERS = (  # llama-vocab.cpp's letter class, escaped (NFC would change it)
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-"
    "\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-"
    "\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00"
    "-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-"
    "\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-"
    "\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-"
    "\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
    "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13"
    "-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)
_PRE_SPLITS: dict[str, list[str]] = {
    "qwen2": [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "gpt-2": [r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"],
    "deepseek-llm": [
        "[\r\n]",
        f"\\s?[{_DEEPSEEK_LETTERS}]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        "\\p{N}+",
    ],
}
_PRE_REGEX = {k: v[0] for k, v in _PRE_SPLITS.items() if len(v) == 1}  # single-regex ones


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32_decimal(v: Any) -> float:
    """A GGUF float32 as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06),
    the way a config.json spells it."""
    return float(str(np.float32(v)))


def gguf_family(reader: Any, path: Path) -> Family:
    """The family a GGUF imports as: by `general.architecture`, among several (deepseek2:
    deepseek_v2, deepseek_v3) the first whose GGUFArch.fixed values the file has (a key the
    file lacks counts as llama.cpp's default, the first family's). Raises ConversionError for
    an architecture without experts or one not handled."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS or not _field(reader, f"{arch}.expert_count"):
        supported = ", ".join(
            f"{a} ({'/'.join(f.model_type for f in fams)})" for a, fams in GGUF_ARCHS.items()
        )
        raise ConversionError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported, with experts: " + supported
        )
    fams = GGUF_ARCHS[arch]
    for i, fam in enumerate(fams):
        fixed = fam.gguf.fixed  # type: ignore[union-attr]
        if all(_field(reader, f"{arch}.{k}", v if i == 0 else None) == v for k, v in fixed.items()):
            return fam
    got = {k: _field(reader, f"{arch}.{k}") for k in fams[0].gguf.fixed}  # type: ignore[union-attr]
    raise ConversionError(f"{path}: {arch} with {got} matches no colibri family")


def gguf_config(reader: Any, path: Path) -> tuple[str, dict[str, Any]]:
    """(model_type, HF-spelled config) from the GGUF metadata. Raises ConversionError for an
    architecture without experts or one not handled."""
    fam = gguf_family(reader, path)
    arch, g = fam.gguf.name, fam.gguf
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
        "rms_norm_eps": _f32_decimal(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_decimal(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        fam.num_experts_key: int(get("expert_count")),
        fam.d_ff_key: int(get(g.expert_ff_key)),
    }
    if fam.d_ff_key != "intermediate_size":  # the dense MLP's size, when the arch has one
        cfg["intermediate_size"] = int(get("feed_forward_length", 0))
    if g.shared_ff_key is not None:
        cfg["shared_expert_intermediate_size"] = int(get(g.shared_ff_key))
    for key, hf in g.hparams.items():
        v = _field(reader, f"{arch}.{key}")
        if v is not None:
            cfg[hf] = _f32_decimal(v) if isinstance(v, float) else v
    if g.leading_dense:
        cfg["first_k_dense_replace"] = int(get("leading_dense_block_count", 0))
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling == "yarn":
        rope: dict[str, Any] = {
            "rope_type": "yarn",
            "rope_theta": cfg["rope_theta"],
            "factor": _f32_decimal(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        }
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_attn_factor", "attention_factor")):  # fmt: skip
            if (v := _field(reader, f"{arch}.rope.scaling.{key}")) is not None:
                rope[hf] = _f32_decimal(v)
        if g.mla and (v := _field(reader, f"{arch}.rope.scaling.yarn_log_multiplier")) is not None:
            # deepseek2: 0.1 * mscale_all_dim, and mscale taken equal (export_gguf's note)
            rope["mscale"] = rope["mscale_all_dim"] = _f32_decimal(float(v) / 0.1)
        cfg["rope_parameters"] = rope
    elif scaling not in (None, "none"):
        raise ConversionError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not imported")
    if g.mla:
        if _field(reader, f"{arch}.attention.key_length_mla") is not None:
            raise ConversionError(
                f"{path}: MLA with kv_b split into attn_k_b / attn_v_b (key_length_mla) is not "
                "imported yet; GGUFs with attn_kv_b whole (colibri export-gguf) are"
            )
        rope, k_len = int(get("rope.dimension_count")), int(get("attention.key_length"))
        del cfg["head_dim"]
        cfg |= {
            "kv_lora_rank": int(get("attention.kv_lora_rank")),
            "q_lora_rank": int(get("attention.q_lora_rank", 0)) or None,
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": k_len - rope,
            "v_head_dim": int(get("attention.value_length")),
        }
    if g.partial_rotary:
        rot = int(get("rope.dimension_count", cfg["head_dim"]))
        if rot != cfg["head_dim"]:
            cfg["partial_rotary_factor"] = rot / cfg["head_dim"]
    for key, tensor in g.present.items():
        cfg[key] = tensor in names
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
        base, suffix = fam.gguf.split_name(hf)
        gname = names.get_name(base)
        if gname is not None:
            out[f"{gname}.{suffix}"] = hf
    return out


def gguf_tokenizer_files(meta: dict[str, Any], path: Path) -> list[tuple[str, bytes]]:
    """[(file name, contents)] from GGUF metadata `meta` (key -> value): tokenizer.json
    rebuilt from the vocabulary (SentencePiece "llama" vocabularies, and byte-level BPE
    "gpt2" ones with a known pre-tokenizer, see _PRE_SPLITS), and chat_template.jinja from
    tokenizer.chat_template. Other vocabularies get no tokenizer.json, with a note."""
    files = []
    template = meta.get("tokenizer.chat_template")
    if template:
        files.append(("chat_template.jinja", template.encode()))
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if model == "llama":
        tok = _spm_tokenizer(meta)
    elif model == "gpt2" and pre in _PRE_SPLITS:
        tok = _bpe_tokenizer(meta, _PRE_SPLITS[pre], nfc=pre == "qwen2")
    else:
        print(
            f"note: {path}: no tokenizer.json made (tokenizer.ggml.model {model!r}, pre {pre!r};"
            f" rebuilt are 'llama' (SentencePiece) and 'gpt2' with pre "
            f"{', '.join(map(repr, _PRE_SPLITS))})",
            file=sys.stderr,
        )
        return files
    files.append(("tokenizer.json", tok.to_str().encode()))
    return files


def _add_special(tok: Any, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    # token_type 3 = CONTROL (special), 4 = USER_DEFINED (llama.cpp's llama_token_type)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True)
         if ty == 3]
    )  # fmt: skip
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types, strict=True)
         if ty == 4]
    )  # fmt: skip


def _bpe_tokenizer(meta: dict[str, Any], splits: list[str], nfc: bool) -> Any:
    """Byte-level BPE (GPT-2 style): the vocabulary and merges as they are, llama.cpp's
    pre-tokenizer regexes as isolated Splits, then the byte-to-unicode map."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pt

    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pt.Sequence(
        [pt.Split(Regex(r), "isolated") for r in splits] + [pt.ByteLevel(False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    _add_special(tok, tokens, types)
    return tok


def _spm_tokenizer(meta: dict[str, Any]) -> Any:
    """SentencePiece vocabulary (tokenizer.ggml.model "llama") as a byte-fallback BPE, the way
    transformers' LlamaConverter builds one: a merge (a, b) for every split of a normal token
    into two vocabulary pieces, ranked by the merged token's score (highest first), which is
    the pair llama.cpp's SPM tokenizer merges first; spaces become "▁", with one "▁" in front
    of every text run when `add_space_prefix` (default true); unknown characters fall back to
    their <0xXX> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, i in vocab.items():
        if types[i] != 1:  # NORMAL pieces only
            continue
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]  # fmt: skip
        local.sort(key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
        merges += [(a, b, scores[i]) for a, b in local]
    merges.sort(key=lambda m: m[2], reverse=True)  # stable: ties keep vocabulary order
    unk = next((t for t, ty in zip(tokens, types, strict=True) if ty == 2), None)
    bpe = models.BPE(vocab, [(a, b) for a, b, _ in merges], unk_token=unk, fuse_unk=True,
                     byte_fallback=True)  # fmt: skip
    tok = Tokenizer(bpe)
    norm = [normalizers.Replace(" ", "\u2581")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        norm.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(norm)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    _add_special(tok, tokens, types)
    return tok


def _unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (rope pairs interleaved ->
    HF's rotate-half halves). Works on any row representation (floats or block bytes)."""
    r = rows.shape[0]
    return rows.reshape(n_head, r // n_head // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def convert_gguf(
    src: Path, out: Path, quant: str, dense_quant: str, force: bool, show_progress: bool
) -> Path:
    """Convert GGUF file `src` into a store at `out` (see the module docstring). `quant` is
    ignored for experts (their GGUF types are kept, per layer and tensor: mixed quants get
    per-layer layouts); `dense_quant` applies to dense weights, "keep" keeps each one's GGUF
    type (as f32 where colibri needs f32: norms, routers)."""
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
    fam = gguf_family(reader, src)
    try:
        spec = model_spec(cfg)
    except StoreError as exc:
        raise ConversionError(f"{src}: {exc}") from None
    hf_of, f32 = hf_names(fam, spec), f32_tensors(spec)
    H = cfg["hidden_size"]
    E, I = cfg[fam.num_experts_key], cfg[fam.d_ff_key]  # noqa: E741
    experts: dict[int, dict[str, Any]] = {}
    dense: list[tuple[str, Any]] = []
    for t in reader.tensors:
        tname = t.tensor_type.name
        if m := _EXPERT.match(t.name):
            bias = m[3] == "bias"
            if bias and not fam.gguf.expert_biases:
                raise ConversionError(f"{src}: unexpected tensor {t.name}")
            if tname not in (("F32",) if bias else _TYPES):
                raise ConversionError(f"{src}: not supported yet: tensor {t.name} has type {tname}")
            want = [H, I, E] if m[2] != "down" else [I, H, E]  # GGML order: ne0 = columns
            if bias:
                want = want[1:]
            if [int(x) for x in t.shape] != want:
                raise ConversionError(
                    f"{src}: tensor {t.name} has GGML shape {[int(x) for x in t.shape]}, "
                    f"metadata implies {want}"
                )
            experts.setdefault(int(m[1]), {})[f"{m[2]}_bias" if bias else m[2]] = t
        elif t.name in hf_of:
            dense.append((hf_of[t.name], t))
        else:
            raise ConversionError(f"{src}: unexpected tensor {t.name}")
    moe = [layer.index for layer in spec.layers if layer.moe]
    if sorted(experts) != moe:
        raise ConversionError(
            f"{src}: experts found in layers {sorted(experts)}, the metadata implies {moe}"
        )
    per_layer = {}
    biases = fam.gguf.expert_biases
    roles = ("gate", "up", "down") + (("gate_bias", "up_bias", "down_bias") if biases else ())
    for layer, parts in experts.items():
        for role in roles:
            if role not in parts:
                name = f"{role.removesuffix('_bias')}_exps.{'bias' if '_' in role else 'weight'}"
                raise ConversionError(f"{src}: missing tensor blk.{layer}.ffn_{name}")
        qtypes = {role: _TYPES[parts[role].tensor_type.name] for role in ("gate", "up", "down")}
        per_layer[layer] = ExpertLayout.build(qtypes["gate"], H, I, biases, qtypes=qtypes)
    layout, overrides = plan_layouts(per_layer)
    kinds = sorted({q for lay in per_layer.values() for q in lay.weight_qtypes})
    if quant not in kinds or len(kinds) > 1:
        print(
            f"note: experts keep the GGUF's types ({', '.join(kinds)}; --quant {quant} ignored)",
            file=sys.stderr,
        )
    dense.sort(key=lambda x: (int(x[0].split(".")[2]) if ".layers." in x[0] else -1, x[0]))
    plan = []
    for hf, t in dense:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if len(shape) == 2 and shape[0] == 1 and hf.endswith("norm.weight"):
            shape = shape[1:]
        want = dense_quant
        if dense_quant == KEEP:  # the GGUF's own type where the store has it
            want = _TYPES.get(t.tensor_type.name, "f32")
        plan.append((hf, dense_qtype(hf, shape, want, f32), shape, t))
    total = sum(int(t.n_bytes) for t in reader.tensors)
    with StoreWriter(out, layout, force=force, layouts=overrides) as w:
        w.begin_dense([(hf, qt, shape) for hf, qt, shape, _ in plan])
        bar = progress(total, f"convert {src.name}") if show_progress else None
        for hf, qt, shape, t in plan:
            w.write_dense(hf, _dense_data(t, hf, qt, shape, cfg, fam))
            if bar is not None:
                bar.update(int(t.n_bytes))
        for layer in moe:
            p = experts[layer]
            for e in range(E):
                w.write_expert(layer, e, {r: np.asarray(p[r].data[e]) for r in roles})
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
