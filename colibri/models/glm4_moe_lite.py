"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's multi-head latent attention
(DeepseekV3Attention: q_lora_rank, kv_lora_rank, RoPE on the qk_rope_head_dim part,
interleaved when `rope_interleave`, the default; `head_dim` is an alias of qk_rope_head_dim)
inside the GLM-4.5 MoE: sigmoid router with `e_score_correction_bias`, groups, shared experts
(n_shared_experts x moe_intermediate_size, no gate). Which layers are routed is
`mlp_layer_types` ("dense" / "sparse" per layer; transformers' default: layer 0 dense, the rest
sparse), not first_k_dense_replace. Multi-token-prediction layers (layer 47 on the hub) are
not used (the converter drops them)."""

from __future__ import annotations

import dataclasses
from typing import Any

from colibri.models import deepseek_v3
from colibri.models.deepseek_v2 import TINY_MLA, TINY_YARN, mla_biases
from colibri.models.deepseek_v3 import sigmoid_router
from colibri.models.family import Family
from colibri.models.spec import (
    LayerSpec,
    ModelSpec,
    MoESpec,
    base_spec,
    get,
    mla_attention,
    mla_names,
    mlp_names,
    require,
)


def mlp_layer_types(config: dict[str, Any]) -> list[str]:
    """The per-layer "dense" / "sparse" list: `mlp_layer_types` as given, else
    Glm4MoeLiteConfig's default (layer 0 dense, every other sparse). Like transformers, entries
    past num_hidden_layers are ignored. Raises ValueError for a list shorter than
    num_hidden_layers or an unknown entry."""
    n = require(config, "num_hidden_layers")
    types = get(config, "mlp_layer_types")
    if types is None:
        return ["dense"] + ["sparse"] * (n - 1)
    if not isinstance(types, list) or len(types) < n:
        raise ValueError(f"config field mlp_layer_types: need a list of {n} (num_hidden_layers)")
    types = types[:n]
    for t in types:
        if t not in ("dense", "sparse"):
            raise ValueError(f"config field mlp_layer_types: unknown entry {t!r}")
    return types


def model_spec(config: dict[str, Any]) -> ModelSpec:
    mode = "interleaved" if get(config, "rope_interleave", default=True) else "neox"
    q_lora = get(config, "q_lora_rank") is not None
    attn = mla_attention(config, mode)
    biases = mla_biases(config)
    shared_ff = require(config, "moe_intermediate_size") * (
        get(config, "n_shared_experts", default=0) or 0
    )
    layers = []
    for i, kind in enumerate(mlp_layer_types(config)):
        prefix = f"model.layers.{i}"
        names = mla_names(prefix, q_lora)
        if kind == "dense":
            names |= mlp_names(f"{prefix}.mlp")
            ff = require(config, "intermediate_size")
            layers.append(LayerSpec(i, attn, False, names, mlp_d_ff=ff, biases=biases))
            continue
        names |= {"router": f"{prefix}.mlp.gate"}
        names["correction_bias"] = f"{prefix}.mlp.gate.e_score_correction_bias"
        if shared_ff:
            names |= mlp_names(f"{prefix}.mlp.shared_experts", "shared")
        layers.append(LayerSpec(i, attn, True, names, shared_d_ff=shared_ff, biases=biases))
    moe = MoESpec(router=sigmoid_router(config), d_ff=require(config, "moe_intermediate_size"))
    return base_spec(config, layers, moe, "glm4_moe_lite")


FAMILY = Family(
    model_type="glm4_moe_lite",
    model_spec=model_spec,
    defaults={  # Glm4MoeLiteConfig
        "vocab_size": 154880,
        "hidden_size": 2048,
        "intermediate_size": 10240,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 47,
        "num_attention_heads": 20,
        "n_shared_experts": 1,
        "n_routed_experts": 64,
        "routed_scaling_factor": 1.8,
        "kv_lora_rank": 512,
        "q_lora_rank": 768,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "qk_nope_head_dim": 192,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    aliases={"num_local_experts": "n_routed_experts", "head_dim": "qk_rope_head_dim"},
    num_experts_key="n_routed_experts",
    d_ff_key="moe_intermediate_size",
    # exported as llama.cpp's deepseek2 (as convert_hf_to_gguf does); a GGUF imports as deepseek_v3
    gguf=dataclasses.replace(deepseek_v3.FAMILY.gguf, importable=False),
    test_configs={
        "glm4_moe_lite": TINY_MLA
        | dict(
            q_lora_rank=48,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.8,
            mlp_layer_types=["dense", "sparse", "sparse"],
            rope_interleave=True,
        ),
        "glm4_moe_lite_no_q_lora_yarn": TINY_MLA
        | dict(
            q_lora_rank=None,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            mlp_layer_types=["sparse", "dense", "sparse"],
            rope_interleave=False,
            attention_bias=True,
            rope_parameters=TINY_YARN | dict(mscale=1.0, mscale_all_dim=1.0),
        ),
    },
)
