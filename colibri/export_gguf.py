"""Export a colibri store to a GGUF file that llama.cpp loads, with the very same weight bytes.

`python -m colibri.export_gguf STORE OUT.gguf` (or `colibri export-gguf`). The expert records'
blocks become `blk.N.ffn_{gate,up,down}_exps.weight` stacked over experts, each tensor in its
layer's stored type (every store type but fp8 is a GGML type, byte for byte: F32, F16, BF16,
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, MXFP4, IQ4_NL, IQ4_XS; fp8, which GGML lacks, is
written as its exact f32 values), the dense tensors keep their stored type (norms and routers
f32), so both engines run identical weights. Layout and metadata follow llama.cpp's own
converter (convert_hf_to_gguf.py):

- Mixtral -> arch "llama" with `expert_count` / `expert_used_count`. llama.cpp's llama-arch
  RoPE rotates adjacent pairs (GGML's "normal" mode) where HF rotates halves, so, as the
  converter does, the rows of q_proj / k_proj are permuted head by head: within a head of
  `head_dim` rows, new row 2i is old row i and new row 2i+1 is old row i + head_dim/2. A
  block-quantized row is a whole number of blocks, so the permutation moves quantized rows
  unchanged.
- Qwen3-MoE -> arch "qwen3moe" (NeoX RoPE: no permutation; `expert_feed_forward_length`);
  Qwen2-MoE -> "qwen2moe", OLMoE -> "olmoe", MiniMax-M2 -> "minimax-m2", GLM-4.5 MoE ->
  "glm4moe" (leading dense layers, shared expert, partial rotary dims), gpt-oss -> "gpt-oss"
  (sinks, expert biases `ffn_*_exps.bias`, sliding window on even layers). Each family's
  GGUFArch (models/<model_type>.py) says which keys its arch reads.
- MLA (DeepSeek-V2/V3, Kimi K2 / K2.5, GLM-4.7-Flash) -> "deepseek2" as llama.cpp runs it
  without absorption: `attn_kv_b` whole, keys/values expanded per head (key_length =
  qk_nope + qk_rope, value_length = v_head_dim, head_count_kv = head_count); llama.cpp's own
  converter splits kv_b into attn_k_b (transposed) / attn_v_b for its absorbed path, which
  would change the stored bytes. DeepSeek's interleaved RoPE is GGML's normal mode as is.
- YaRN: rope.scaling.{type, factor, original_context_length, yarn_beta_fast/slow}, for
  deepseek2 yarn_log_multiplier = 0.1 * mscale_all_dim (convert_hf_to_gguf's convention).

GGML lists dimensions fastest first: the logical [E, d_ff, d_model] of a stacked gate tensor
is ne = {d_model, d_ff, E}; gguf.GGUFWriter takes numpy order and reverses it.

Vocabulary, from the store's tokenizer.json:
- SentencePiece-derived BPE (byte_fallback, "▁" metaspace; Mixtral, Mistral, Llama 2) ->
  tokenizer model "llama". tokenizer.json has no piece scores; llama.cpp's SPM tokenizer
  merges the adjacent pair of highest score, so a token's score is minus the rank of the
  first merge producing it (the same merge order as the BPE model in tokenizer.json).
- Byte-level BPE (GPT-2 style; Qwen, Llama 3, OLMo) -> "gpt2", merges copied, with
  llama.cpp's pre-tokenizer name recognised from the Split regex (qwen2, llama-bpe, gpt-2).
Special token ids, add_bos/add_eos and the chat template come from gguf.SpecialVocab.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibri.errors import ConversionError, TokenizerError
from colibri.io.format import Store, open_store, tensor_nbytes
from colibri.models.family import GGUFArch
from colibri.registry import FAMILIES, model_spec, resolve_config

# colibri model_type -> llama.cpp architecture (gguf.MODEL_ARCH member name), from the families
ARCHS: dict[str, str] = {t: f.gguf.arch for t, f in FAMILIES.items() if f.gguf is not None}
EXPERT_TENSORS = {"gate": "FFN_GATE_EXP", "up": "FFN_UP_EXP", "down": "FFN_DOWN_EXP"}

# the Split regex of a byte-level BPE tokenizer.json -> llama.cpp's tokenizer.ggml.pre
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_RE = _QWEN2_RE.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
BPE_PRE: dict[str, str] = {_QWEN2_RE: "qwen2", _LLAMA3_RE: "llama-bpe", _GPT2_RE: "gpt-2"}


@dataclass
class _Tensor:
    name: str  # GGUF name
    shape: tuple[int, ...]  # logical, numpy order (slowest first)
    qtype: str  # colibri qtype name
    load: Callable[[], np.ndarray]  # the bytes, C order, exactly tensor_nbytes(qtype, shape)


def _gguf():
    import gguf

    return gguf


def _ggml_type(qtype: str):
    return _gguf().GGMLQuantizationType[qtype.upper()]


def gguf_qtype(qtype: str) -> str:
    """The type a store tensor of `qtype` has in the GGUF: its own (every store type but fp8 is
    a GGML type, byte for byte), fp8 (no GGML type) as its exact f32 values."""
    return "f32" if qtype == "fp8" else qtype


def _fp8_to_f32(rows: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    from colibri.compute.ref import fp8_dequantize

    return fp8_dequantize(np.ascontiguousarray(rows), shape)


# ---- hyperparameters ---------------------------------------------------------------------


def _cfg(config: dict[str, Any], *keys: str, default: Any = ...) -> Any:
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    if default is ...:
        raise ConversionError(f"manifest.json config: missing field {keys[0]!r}")
    return default


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn", None):
        raise ConversionError(
            f"manifest.json config: rope type {kind!r} is not exported (plain RoPE and YaRN are)"
        )
    return rope


def _rope_theta(config: dict[str, Any]) -> float:
    rope = _rope(config)
    return float(rope.get("rope_theta", _cfg(config, "rope_theta", default=10000.0)))


def _add_rope_scaling(w: Any, config: dict[str, Any], mla: bool) -> None:
    """YaRN as convert_hf_to_gguf writes it: type, factor, original context, beta_fast /
    beta_slow, and for MLA (deepseek2) yarn_log_mul = 0.1 * mscale_all_dim; llama.cpp then
    takes mscale to be mscale_all_dim (1 when that is 1), so other mscales are refused, as is
    an explicit attention_factor, which llama.cpp's deepseek2 ignores."""
    rope = _rope(config)
    if rope.get("rope_type", rope.get("type")) != "yarn":
        return
    gguf = _gguf()
    for key in ("factor", "original_max_position_embeddings"):
        if rope.get(key) is None:
            raise ConversionError(f"manifest.json config: YaRN rope_parameters lacks {key!r}")
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                     ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):  # fmt: skip
        if rope.get(key) is not None:
            add(float(rope[key]))
    if rope.get("truncate", True) is False:  # gpt-oss; llama.cpp's converter says nothing
        warnings.warn(
            "YaRN with truncate false: llama.cpp rounds the ramp's ends to whole dims (as "
            "truncate true does); a few rotary frequencies differ slightly from the model's",
            stacklevel=3,
        )
    if not mla:
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(float(rope["attention_factor"]))
        return
    m_all = float(rope.get("mscale_all_dim") or 0.0)
    if m_all:
        w.add_rope_scaling_yarn_log_mul(0.1 * m_all)
    if float(rope.get("mscale") or 1.0) != (m_all if m_all else 1.0):
        raise ConversionError(
            f"manifest.json config: YaRN mscale {rope.get('mscale')} != mscale_all_dim "
            f"{m_all}; llama.cpp's deepseek2 assumes them equal"
        )
    if rope.get("attention_factor") is not None:
        raise ConversionError(
            "manifest.json config: YaRN attention_factor is ignored by llama.cpp's deepseek2"
        )


# families without a GGUFArch: why (what llama.cpp has for them)
NOT_EXPORTED: dict[str, str] = {
    "qwen3_next": "llama.cpp's qwen3next reorders and reshapes the Gated DeltaNet tensors "
    "(ssm_*), which this exporter does not do yet",
    "qwen3_5_moe": "llama.cpp's qwen35moe reorders and reshapes the Gated DeltaNet tensors "
    "(ssm_*), which this exporter does not do yet",
    "llama4": "llama.cpp's llama4 (no-RoPE layers, chunked attention, interleaved MoE) is not "
    "mapped by this exporter yet",
    "llama4_text": "llama.cpp's llama4 (no-RoPE layers, chunked attention, interleaved MoE) is "
    "not mapped by this exporter yet",
    "deepseek_v32": "llama.cpp runs it as deepseek32, an architecture the installed gguf package "
    "cannot write",
    "glm_moe_dsa": "llama.cpp's glm-dsa (the DSA indexer tensors) is not mapped by this exporter "
    "yet",
}


def _arch(store: Store) -> GGUFArch:
    fam = FAMILIES.get(store.model_type)
    if fam is None or fam.gguf is None:
        why = NOT_EXPORTED.get(store.model_type, "llama.cpp has no architecture for it")
        raise ConversionError(
            f"{store.path}: model_type {store.model_type!r} has no GGUF export: {why} "
            f"(exported: {', '.join(ARCHS)})"
        )
    return fam.gguf


def _config(store: Store) -> dict[str, Any]:
    """The store's config as its family resolves it (transformers defaults filled in)."""
    return resolve_config({**store.config, "model_type": store.model_type})


def _check_supported(store: Store) -> None:
    g, cfg = _arch(store), _config(store)
    n_layer = int(_cfg(cfg, "num_hidden_layers"))
    lead = n_layer - len(store.moe_layers)
    if store.moe_layers != list(range(lead, n_layer)) or (lead and not g.leading_dense):
        what = "a run of dense layers then MoE ones" if g.leading_dense else "every layer MoE"
        raise ConversionError(
            f"{store.path}: llama.cpp's {g.name} runs {what}; this store's MoE layers are "
            f"{store.moe_layers} of {n_layer}"
        )
    fp8 = [n for n in store.dense_names() if store.dense_qtype(n) == "fp8"]
    fp8 += [
        f"layer {k} experts" for k in store.moe_layers if "fp8" in store.layout_for(k).weight_qtypes
    ]
    if fp8:
        print(
            f"note: {store.path}: fp8 has no GGML type; {', '.join(fp8[:3])}"
            f"{' …' if len(fp8) > 3 else ''} written as their exact f32 values",
            file=sys.stderr,
        )
    parts = {"gate", "up", "down"} | (
        {"gate_bias", "up_bias", "down_bias"} if g.expert_biases else set()
    )
    if set(store.layout.tensors) != parts:
        raise ConversionError(
            f"{store.path}: expert tensors {sorted(store.layout.tensors)}; llama.cpp's {g.name} "
            f"has {sorted(parts)}"
        )
    for key, value in g.implied.items():
        if cfg.get(key) != value:
            raise ConversionError(
                f"{store.path}: config.{key} is {cfg.get(key)!r}, but llama.cpp's {g.name} "
                f"assumes {value!r}"
            )
    n_head = int(_cfg(cfg, "num_attention_heads"))
    if g.requires_mha and int(_cfg(cfg, "num_key_value_heads", default=n_head)) != n_head:
        raise ConversionError(
            f"{store.path}: config.num_key_value_heads {cfg['num_key_value_heads']} != "
            f"num_attention_heads {n_head}; llama.cpp's {g.name} has no grouped-query attention"
        )
    spec = model_spec({**store.config, "model_type": store.model_type})
    window = max(layer.attention.window for layer in spec.layers)
    if g.swa_pattern:
        k = g.swa_pattern
        want = [window if i % k < k - 1 else 0 for i in range(len(spec.layers))]
        if [layer.attention.window for layer in spec.layers] != want:
            raise ConversionError(
                f"{store.path}: sliding-window layers {[x.attention.window for x in spec.layers]}"
                f"; llama.cpp's {g.name} slides on layers i % {k} < {k - 1} only"
            )
    elif window and window < spec.max_position_embeddings:
        warnings.warn(
            f"{store.path}: sliding_window={window} is ignored by llama.cpp's {g.name} arch; "
            "outputs differ past that many tokens",
            stacklevel=3,
        )


def _add_typed(w: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        raise ConversionError(f"GGUF key {key}: value {value!r} is not a number")


def _add_hparams(w: Any, store: Store) -> None:
    gguf, cfg, g = _gguf(), _config(store), _arch(store)
    n_head = int(_cfg(cfg, "num_attention_heads"))
    n_embd = int(_cfg(cfg, "hidden_size"))
    head_dim = int(_cfg(cfg, "head_dim", default=n_embd // n_head))
    w.add_name(str(store.manifest.get("source", {}).get("name") or store.path.name))
    w.add_vocab_size(int(_cfg(cfg, "vocab_size")))
    w.add_context_length(int(_cfg(cfg, "max_position_embeddings")))
    w.add_embedding_length(n_embd)
    w.add_block_count(int(_cfg(cfg, "num_hidden_layers")))
    w.add_head_count(n_head)
    attn = model_spec({**store.config, "model_type": store.model_type}).layers[0].attention
    if attn.mla is not None:  # deepseek2 without absorption: keys and values per head (MHA)
        w.add_head_count_kv(n_head)
        w.add_kv_lora_rank(attn.mla.kv_lora_rank)
        w.add_q_lora_rank(attn.mla.q_lora_rank or 0)  # 0: q_proj (llama.cpp's "lite" path)
        w.add_key_length(attn.head_dim)  # qk_nope + qk_rope
        w.add_value_length(attn.v_head_dim)
    else:
        w.add_head_count_kv(int(_cfg(cfg, "num_key_value_heads", default=n_head)))
    w.add_rope_freq_base(_rope_theta(cfg))
    _add_rope_scaling(w, cfg, attn.mla is not None)
    if attn.mla is not None:
        w.add_rope_dimension_count(attn.mla.qk_rope_head_dim)
    else:
        w.add_rope_dimension_count(attn.rot_dim if g.partial_rotary else head_dim)
    w.add_layer_norm_rms_eps(float(_cfg(cfg, "rms_norm_eps")))
    w.add_expert_count(store.num_experts)
    w.add_expert_used_count(int(_cfg(cfg, "num_experts_per_tok")))
    if g.expert_ff_key == "feed_forward_length":  # llama: the experts' n_ff
        w.add_feed_forward_length(store.layout.d_ff)
    else:  # qwen3moe: the experts' n_ff has its own key
        w.add_feed_forward_length(int(_cfg(cfg, "intermediate_size", default=store.layout.d_ff)))
        w.add_expert_feed_forward_length(store.layout.d_ff)
    if g.shared_ff_key is not None:  # qwen2moe: the shared expert's n_ff
        w.add_expert_shared_feed_forward_length(int(_cfg(cfg, "shared_expert_intermediate_size")))
    if g.leading_dense:
        w.add_leading_dense_block_count(int(_cfg(cfg, "num_hidden_layers")) - len(store.moe_layers))
    # head_dim may differ from n_embd / n_head
    if cfg.get("head_dim") is not None and attn.mla is None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    for key, field in g.hparams.items():
        if cfg.get(field) is not None:
            _add_typed(w, f"{w.arch}.{key}", cfg[field])
    for key, value in g.fixed.items():
        _add_typed(w, f"{w.arch}.{key}", value)
    w.add_file_type(file_type(store))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


# llama.cpp's general.file_type by the experts' most common type (informational: each
# tensor carries its own type; mixed K-quants are named like llama-quantize's _M mixes)
_FILE_TYPES = {
    "f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q4_0": "MOSTLY_Q4_0",
    "q4_1": "MOSTLY_Q4_1", "q8_0": "MOSTLY_Q8_0", "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1",
    "q2_k": "MOSTLY_Q2_K", "q3_k": "MOSTLY_Q3_K_M", "q4_k": "MOSTLY_Q4_K_M",
    "q5_k": "MOSTLY_Q5_K_M", "q6_k": "MOSTLY_Q6_K", "iq4_nl": "MOSTLY_IQ4_NL",
    "iq4_xs": "MOSTLY_IQ4_XS", "mxfp4": "MOSTLY_MXFP4_MOE", "fp8": "ALL_F32",
}  # fmt: skip


def file_type(store: Store) -> Any:
    """gguf.LlamaFileType for `store`: that of the most common expert weight type (ties: the
    first in layer order), e.g. MOSTLY_Q4_K_M for a Q4_K_M import (Q4_K with some Q6_K)."""
    counts: dict[str, int] = {}
    for layer in store.moe_layers:
        for q in store.layout_for(layer).weight_qtypes:
            counts[q] = counts.get(q, 0) + 1
    common = max(counts, key=lambda q: counts[q]) if counts else "f32"
    return _gguf().LlamaFileType[_FILE_TYPES[common]]


# ---- tensors -----------------------------------------------------------------------------


def rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of a q_proj / k_proj weight (or bias) from HF's rotate-half RoPE
    layout to GGML's adjacent-pair layout, as llama.cpp's `LlamaModel.permute` does.

    `w`: [n_head * head_dim, ...] (any dtype; a block-quantized row of uint8 is moved whole).
    Within each head, new row 2i = old row i, new row 2i+1 = old row i + head_dim // 2.
    Returns a new C-contiguous array of the same shape."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ConversionError(f"cannot RoPE-permute {rows} rows over {n_head} heads")
    out = w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(out.reshape(w.shape))


def _dense_bytes(store: Store, name: str, permute_heads: int) -> np.ndarray:
    """A dense tensor as it goes into the GGUF: block qtypes as stored uint8 rows, floats in
    their stored width (f16 / bf16 narrowed back exactly), RoPE-permuted if asked."""
    arr, qtype, shape = store.dense(name)
    if qtype == "fp8":
        arr = _fp8_to_f32(arr, shape)
    elif qtype == "f16":
        arr = arr.astype(np.float16)
    elif qtype == "bf16":
        arr = (arr.view(np.uint32) >> 16).astype(np.uint16)
    if permute_heads:
        arr = rope_permute(arr, permute_heads)
    return np.ascontiguousarray(arr)


def _plan(store: Store) -> list[_Tensor]:
    gguf, cfg, g = _gguf(), _config(store), _arch(store)
    arch = getattr(gguf.MODEL_ARCH, g.arch)
    n_layer = int(_cfg(cfg, "num_hidden_layers"))
    names = gguf.get_tensor_name_map(arch, n_layer)
    n_head = int(_cfg(cfg, "num_attention_heads"))
    n_head_kv = int(_cfg(cfg, "num_key_value_heads", default=n_head))
    plan: list[_Tensor] = []
    for hf in store.dense_names():
        base, suffix = g.split_name(hf)
        gname = names.get_name(base)
        if gname is None or suffix not in ("weight", "bias"):
            raise ConversionError(
                f"{store.dense_path}: tensor {hf!r} has no GGUF name in arch {arch.name.lower()}"
            )
        heads = 0
        if g.rope_permute and base.endswith("self_attn.q_proj"):
            heads = n_head
        elif g.rope_permute and base.endswith("self_attn.k_proj"):
            heads = n_head_kv
        qtype = store.dense_qtype(hf)
        shape = tuple(store.manifest["dense"][hf]["shape"])
        load = lambda n=hf, h=heads: _dense_bytes(store, n, h)  # noqa: E731
        plan.append(_Tensor(f"{gname}.{suffix}", shape, gguf_qtype(qtype), load))
    for layer in store.moe_layers:
        tensors = store.layout_for(layer).tensors
        stack = _ExpertStack(store, layer)
        for part, tensor in EXPERT_TENSORS.items():
            gname = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, tensor)].format(bid=layer)
            for key, suffix in ((part, "weight"), (f"{part}_bias", "bias")):
                if key in tensors:
                    spec = tensors[key]
                    shape = (store.num_experts, *spec.shape)
                    qt = gguf_qtype(spec.qtype)
                    plan.append(_Tensor(f"{gname}.{suffix}", shape, qt, stack.loader(key)))
    return plan


class _ExpertStack:
    """Reads one layer's records once (checksums verified), hands out gate / up / down
    stacked over experts as uint8 [E, rows, row_nbytes] (or floats), then drops the buffer."""

    def __init__(self, store: Store, layer: int) -> None:
        self.store, self.layer = store, layer
        self.raw: np.ndarray | None = None
        self.left = set(store.layout_for(layer).tensors)

    def _read(self) -> np.ndarray:
        st = self.store
        recs = [st.record(self.layer, e) for e in range(st.num_experts)]
        raw = np.empty((len(recs), st.layout_for(self.layer).record_nbytes), np.uint8)
        with open(st.experts_path, "rb", buffering=0) as f:
            for i, r in enumerate(recs):
                if f.seek(r.offset) != r.offset or f.readinto(raw[i]) != r.nbytes:
                    raise ConversionError(
                        f"{st.experts_path}: short read of layer {r.layer} expert {r.expert}"
                    )
                st.verify_record(r, raw[i])
        return raw

    def loader(self, part: str) -> Callable[[], np.ndarray]:
        def load() -> np.ndarray:
            if self.raw is None:
                self.raw = self._read()
            spec = self.store.layout_for(self.layer).tensors[part]
            out = np.ascontiguousarray(self.raw[:, spec.offset : spec.offset + spec.nbytes])
            self.left.discard(part)
            if not self.left:
                self.raw = None
            if spec.qtype == "fp8":
                return _fp8_to_f32(out, (len(out), *spec.shape))
            dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}.get(spec.qtype)
            return out.view(dtype) if dtype else out

        return load


# ---- vocabulary --------------------------------------------------------------------------


def _merge_pairs(merges: list[Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in merges]


def tokenizer_kind(tok: dict[str, Any]) -> str:
    """Which GGUF tokenizer model a parsed tokenizer.json maps to: "llama" (SentencePiece-
    derived BPE with byte fallback) or "gpt2" (byte-level BPE). Raises TokenizerError."""
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise TokenizerError(f"tokenizer.json: model type {model.get('type')!r} not exported")
    text = json.dumps(
        [tok.get("pre_tokenizer"), tok.get("normalizer"), tok.get("decoder")], ensure_ascii=False
    )
    if '"ByteLevel"' in text:
        return "gpt2"
    if model.get("byte_fallback") and "\u2581" in text:
        return "llama"
    raise TokenizerError("tokenizer.json: neither SentencePiece-style nor byte-level BPE")


def bpe_pre_name(tok: dict[str, Any]) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a byte-level tokenizer.json, from its Split regex
    (ByteLevel's own regex is GPT-2's). Unknown regexes give "default" with a warning."""
    found: list[str] = []

    def walk(node: Any) -> Iterator[dict[str, Any]]:
        if isinstance(node, dict):
            yield node
            for v in node.values():
                yield from walk(v)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v)

    for node in walk(tok.get("pre_tokenizer")):
        if node.get("type") == "Split" and "Regex" in node.get("pattern", {}):
            found.append(node["pattern"]["Regex"])
        elif node.get("type") == "ByteLevel" and node.get("use_regex", True):
            found.append(_GPT2_RE)
    for regex in found:
        if regex in BPE_PRE:
            return BPE_PRE[regex]
    warnings.warn(
        f"tokenizer.json: pre-tokenizer {found[:1]} unknown to this exporter; llama.cpp will "
        "use its default BPE pre-tokenizer",
        stacklevel=2,
    )
    return "default"


def vocab_tokens(
    tok: dict[str, Any], vocab_size: int, unk_token: str | None = None
) -> tuple[str, list[str], list[float], list[int]]:
    """(tokenizer model, tokens, scores, token types) for GGUF from a parsed tokenizer.json,
    padded to the model's `vocab_size` with unused "[PAD{i}]" entries.

    Types follow gguf.TokenType: added special tokens CONTROL, other added tokens USER_DEFINED,
    "<0xXX>" BYTE (llama), `unk_token` UNKNOWN (llama), the rest NORMAL. Scores (llama only):
    minus the rank of the first merge producing the token, -(n_merges + id) for a multi-
    character token no merge produces, 0 for the rest. Raises TokenizerError."""
    gguf = _gguf()
    kind = tokenizer_kind(tok)
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    added = {a["content"]: a for a in tok.get("added_tokens", [])}
    for content, a in added.items():
        vocab[content] = a["id"]
    if not vocab or max(vocab.values()) >= vocab_size:
        raise TokenizerError(
            f"tokenizer.json: token id {max(vocab.values(), default=-1)} outside the model's "
            f"vocab_size {vocab_size}"
        )
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for text, i in vocab.items():
        tokens[i], types[i] = text, int(gguf.TokenType.NORMAL)
    scores = [0.0] * vocab_size
    if kind == "llama":
        merges = _merge_pairs(tok["model"].get("merges", []))
        rank: dict[str, int] = {}
        for r, (a, b) in enumerate(merges):
            rank.setdefault(a + b, r)
        for text, i in vocab.items():
            if text in rank:
                scores[i] = -float(rank[text])
            elif len(text) > 1 and text not in added and not _is_byte(text):
                scores[i] = -float(len(merges) + i)
            if _is_byte(text):
                types[i] = int(gguf.TokenType.BYTE)
    for a in added.values():
        special = a.get("special", False)
        types[a["id"]] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    if kind == "llama" and unk_token in vocab:
        types[vocab[unk_token]] = int(gguf.TokenType.UNKNOWN)
    return kind, tokens, scores, types


def _is_byte(text: str) -> bool:
    return re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text) is not None


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _add_vocab(w: Any, store: Store) -> str:
    gguf = _gguf()
    path = store.path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{path}: missing; a GGUF for llama.cpp needs the vocabulary")
    try:
        tok = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise TokenizerError(f"{path}: not valid JSON: {exc}") from None
    tcfg_path = store.path / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text(encoding="utf-8")) if tcfg_path.is_file() else {}
    cfg = _config(store)
    vocab_size = int(_cfg(cfg, "vocab_size"))
    kind, tokens, scores, types = vocab_tokens(
        tok, vocab_size, _token_text(tcfg.get("unk_token")) or "<unk>"
    )
    w.add_tokenizer_model(kind)
    w.add_tokenizer_pre(bpe_pre_name(tok) if kind == "gpt2" else "default")
    w.add_token_list(tokens)
    if kind == "llama":
        w.add_token_scores(scores)
        prepend = [
            n.get("prepend_scheme", "always" if n.get("add_prefix_space", True) else "never")
            for n in _walk_types(tok.get("pre_tokenizer"), "Metaspace")
        ]
        if prepend:
            w.add_add_space_prefix(prepend[0] != "never")
    w.add_token_types(types)
    special = gguf.SpecialVocab(store.path, load_merges=kind == "gpt2", n_vocab=vocab_size)
    for typ in ("bos", "eos", "pad", "unk"):  # the model config's ids as the last resort
        tid = cfg.get(f"{typ}_token_id", store.config.get(f"{typ}_token_id"))
        if typ not in special.special_token_ids and isinstance(tid, int) and tid < vocab_size:
            special.special_token_ids[typ] = tid
    special.add_to_gguf(w, quiet=True)
    return kind


def _walk_types(node: Any, typ: str) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if node.get("type") == typ:
            yield node
        for v in node.values():
            yield from _walk_types(v, typ)
    elif isinstance(node, list):
        for v in node:
            yield from _walk_types(v, typ)


# ---- the export --------------------------------------------------------------------------


def export_gguf(
    store_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    force: bool = False,
    show_progress: bool = False,
) -> Path:
    """Write the store at `store_path` as a GGUF file `out_path` for llama.cpp.

    Expert and dense weights are copied byte for byte (q/k rows of arch "llama" reordered, see
    the module docstring); each layer's expert records are read once and their XXH3 checksums
    verified. The file is written to a temporary name beside `out_path` and renamed at the end;
    on any error nothing is left behind. Returns `out_path`.

    Raises StoreError (invalid store, checksum mismatch), ConversionError (model type or
    config llama.cpp cannot run as stored, or `out_path` exists without `force`),
    TokenizerError (tokenizer.json missing or of an unsupported kind)."""
    gguf = _gguf()
    store = open_store(store_path)
    out = Path(out_path)
    if out.exists() and not force:
        raise ConversionError(f"{out}: already exists (use --force to replace it)")
    if out.is_dir():
        raise ConversionError(f"{out}: is a directory; OUT.gguf must be a file name")
    if not out.parent.is_dir():
        raise ConversionError(f"{out}: directory {out.parent} does not exist")
    _check_supported(store)
    arch_name = gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, _arch(store).arch)]
    plan = _plan(store)
    # GGUFWriter creates the file itself (mode 0666 & ~umask); the name only has to be unique
    tmp = out.parent / f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    bar = None
    try:
        w = gguf.GGUFWriter(tmp, arch_name)
        _add_hparams(w, store)
        _add_vocab(w, store)
        for t in plan:
            nbytes = tensor_nbytes(t.qtype, t.shape)
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes, _ggml_type(t.qtype))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        if show_progress:
            from tqdm import tqdm

            total = sum(tensor_nbytes(t.qtype, t.shape) for t in plan)
            bar = tqdm(
                total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="gguf", disable=None
            )
        for t in plan:
            data = t.load()
            if data.nbytes != tensor_nbytes(t.qtype, t.shape):
                raise ConversionError(f"{t.name}: {data.nbytes} bytes, expected {t.shape}")
            w.write_tensor_data(data)
            if bar is not None:
                bar.update(data.nbytes)
        w.flush()
        assert w.fout is not None
        for f in w.fout:
            os.fsync(f.fileno())
        w.close()
        os.replace(tmp, out)
    except OSError as exc:  # no space, file too large...: name OUT, leave nothing
        tmp.unlink(missing_ok=True)
        raise ConversionError(f"{out}: cannot write the GGUF file: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return out


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", metavar="STORE", help="colibri store directory")
    p.add_argument("out", metavar="OUT.gguf", help="GGUF file to write")
    p.add_argument("--force", action="store_true", help="replace an existing OUT.gguf")


def run_cli(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out = export_gguf(args.store, args.out, force=args.force, show_progress=True)
    size = out.stat().st_size / 2**30
    print(f"wrote {out} ({size:.2f} GiB) in {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    from colibri.errors import ColibriError

    p = argparse.ArgumentParser(
        prog="python -m colibri.export_gguf", description=__doc__.splitlines()[0]
    )
    configure_parser(p)
    args = p.parse_args(argv)
    try:
        return run_cli(args)
    except ColibriError as exc:
        print(f"export_gguf: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
