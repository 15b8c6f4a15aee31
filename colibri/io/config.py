"""Type and range checks of a checkpoint's config dict (config.json, or a store's manifest).

The model families read these fields (colibri/models/*.py, the converter, the GGUF exporter);
a wrong type or an impossible value there is caught here, before any of them computes sizes or
allocates from it, and reported as one line naming the file and the field. Fields a family
does not know are not looked at. A null value counts as absent (as the families read it),
except for the few fields every family needs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# fields every family reads (null or absent is an error)
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads")
POSITIVE_INT = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts_per_tok",
    "top_k_experts",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "n_group",
    "topk_group",
    "max_position_embeddings",
    "decoder_sparse_step",
)
NON_NEGATIVE_INT = (
    "first_k_dense_replace",
    "n_shared_experts",
    "max_window_layers",
    "num_nextn_predict_layers",
    "sliding_window",
)
POSITIVE_NUMBER = ("rms_norm_eps", "rope_theta", "clip_qkv", "swiglu_alpha", "swiglu_limit")
NUMBER = ("routed_scaling_factor",)
BOOL = (
    "norm_topk_prob",
    "tie_word_embeddings",
    "use_sliding_window",
    "use_qk_norm",
    "rope_interleave",
)
OBJECT = ("rope_parameters", "rope_scaling")
INT_LIST = ("mlp_only_layers",)
STRING = ("model_type", "topk_method")
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


# RoPE parameters (rope_parameters / rope_scaling, transformers' names): positive numbers
_ROPE_POSITIVE = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor")
_ROPE_NUMBER = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


def _check_rope(params: dict[str, Any], where: str) -> None:
    for key, value in params.items():
        if isinstance(value, dict):  # per-layer-type parameters
            _check_rope(value, f"{where}.{key}")
        elif value is None:
            continue
        elif key in _ROPE_POSITIVE and not (_is_number(value) and value > 0):
            raise ConfigError(f"{where}.{key} is {value!r}: needs a positive number")
        elif key in _ROPE_NUMBER and not _is_number(value):
            raise ConfigError(f"{where}.{key} is {value!r}: needs a finite number")
        elif key == "original_max_position_embeddings" and not (_is_int(value) and value > 0):
            raise ConfigError(f"{where}.{key} is {value!r}: needs a positive integer")
        elif key == "partial_rotary_factor" and not (_is_number(value) and 0 < value <= 1):
            raise ConfigError(f"{where}.{key} is {value!r}: needs a number in (0, 1]")
        elif key == "rope_type" and not isinstance(value, str):
            raise ConfigError(f"{where}.{key} is {value!r}: needs a string")


class ConfigError(ValueError):
    """A config field has the wrong type or an impossible value (message names it)."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def num_experts(config: dict[str, Any]) -> int | None:
    """The routed-expert count under whichever key the checkpoint uses, or None."""
    return next((config[k] for k in _EXPERT_KEYS if config.get(k) is not None), None)


def text_view(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of the language model: a multimodal config's `text_config` over its top
    level (Kimi K2.5, Qwen3.5, Llama 4, Gemma 4 keep the text model there), else config."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def check_config(config: Any, where: str | Path) -> dict[str, Any]:
    """Check the types and ranges of the fields above in `config`; returns it.

    Raises ConfigError "WHERE: field 'F' ...": config not a JSON object; a REQUIRED field
    absent or null; an integer field that is not an integer (2.5, "8", true, 1e9 as a float),
    not positive (or negative where 0 is allowed); a number that is not finite or (where it
    must be) not positive; num_experts_per_tok above the routed-expert count;
    partial_rotary_factor outside (0, 1]; a bool, object, string or int-list field of
    another type; inside rope_parameters / rope_scaling, a rope_theta, factor, ... that is not
    a positive number."""
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: config is a {type(config).__name__}, not a JSON object")

    if "text_config" in config and not isinstance(config["text_config"], dict):
        raise ConfigError(f"{where}: field 'text_config' needs a JSON object")
    outer, config = config, text_view(config)

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"{where}: field {key!r} is {config.get(key)!r}: {why}")

    for key in REQUIRED:
        if config.get(key) is None:
            raise ConfigError(f"{where}: missing field {key!r}")
    for key, value in config.items():
        if value is None:
            continue
        if key in POSITIVE_INT and not (_is_int(value) and value > 0):
            raise bad(key, "needs a positive integer")
        if key in NON_NEGATIVE_INT and not (_is_int(value) and value >= 0):
            raise bad(key, "needs a non-negative integer")
        if key in POSITIVE_NUMBER and not (_is_number(value) and value > 0):
            raise bad(key, "needs a positive number")
        if key in NUMBER and not _is_number(value):
            raise bad(key, "needs a finite number")
        if key in BOOL and not isinstance(value, bool):
            raise bad(key, "needs true or false")
        if key in OBJECT and not isinstance(value, dict):
            raise bad(key, "needs a JSON object")
        if key in STRING and not isinstance(value, str):
            raise bad(key, "needs a string")
        if key in INT_LIST and not (
            isinstance(value, list) and all(_is_int(x) and x >= 0 for x in value)
        ):
            raise bad(key, "needs a list of non-negative integers")
        if key == "partial_rotary_factor" and not (_is_number(value) and 0 < value <= 1):
            raise bad(key, "needs a number in (0, 1]")
        if key == "layer_types" and not (
            isinstance(value, list) and all(isinstance(x, str) for x in value)
        ):
            raise bad(key, "needs a list of strings")
    for key in OBJECT:
        if isinstance(config.get(key), dict):
            _check_rope(config[key], f"{where}: field {key!r}")
    for key in ("num_experts_per_tok", "top_k_experts"):  # Gemma 4 spells it top_k_experts
        n_exp, top_k = num_experts(config), config.get(key)
        if n_exp is not None and top_k is not None and top_k > n_exp:
            raise bad(key, f"more than the {n_exp} routed experts")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        raise bad("num_key_value_heads", f"does not divide num_attention_heads {heads}")
    layer_types = config.get("layer_types")
    if layer_types is not None and len(layer_types) < config["num_hidden_layers"]:
        raise bad("layer_types", "fewer entries than num_hidden_layers")
    return outer
