"""MiniMax-M2 (MiniMaxM2ForCausalLM): grouped-query attention whose q/k RMSNorm spans the whole
projection (all heads at once, `q_norm` [n_heads * head_dim], `k_norm` [n_kv * head_dim]) before
partial rotary (`rotary_dim` / `partial_rotary_factor`, neox pairing on the leading dims); every
layer routed, sigmoid router with `e_score_correction_bias` added for choosing only, the k
sigmoid scores renormalised to sum 1 (MiniMaxM2TopKRouter), no shared expert. The hub
checkpoint keeps the experts as `block_sparse_moe.experts.{e}.w1/w3/w2` and the bias as
`block_sparse_moe.e_score_correction_bias` (transformers' conversion_mapping)."""

from __future__ import annotations

from typing import Any

from colibri.compute.moe import RouterSpec
from colibri.models.family import ExpertNames, Family, GGUFArch
from colibri.models.spec import (
    LayerSpec,
    ModelSpec,
    MoESpec,
    attention_names,
    base_spec,
    require,
    standard_attention,
)


def _partial_rotary(config: dict[str, Any]) -> dict[str, Any]:
    """MiniMaxM2Config.convert_rope_params_to_dict: the hub config's `rotary_dim` sets
    partial_rotary_factor = rotary_dim / head_dim unless the rope dict has one."""
    params = dict(config["rope_parameters"])
    if config.get("rotary_dim") is not None and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = config["rotary_dim"] / require(config, "head_dim")
    return {**config, "rope_parameters": params}


def model_spec(config: dict[str, Any]) -> ModelSpec:
    attn = standard_attention(_partial_rotary(config), qk_norm="full")
    layers = []
    for i in range(require(config, "num_hidden_layers")):
        p = f"model.layers.{i}"
        names = attention_names(p, qk_norm=True) | {
            "router": f"{p}.block_sparse_moe.gate",
            "correction_bias": f"{p}.block_sparse_moe.e_score_correction_bias",
        }
        layers.append(LayerSpec(i, attn, moe=True, names=names))
    router = RouterSpec(
        num_experts=require(config, "num_local_experts"),
        top_k=require(config, "num_experts_per_tok"),
        scoring="sigmoid",
        norm_topk_prob=True,  # MiniMaxM2TopKRouter always renormalises (no epsilon)
    )
    moe = MoESpec(router=router, d_ff=require(config, "intermediate_size"))
    return base_spec(config, layers, moe, "minimax_m2")


FAMILY = Family(
    model_type="minimax_m2",
    model_spec=model_spec,
    defaults={  # MiniMaxM2Config
        "vocab_size": 200064,
        "hidden_size": 3072,
        "intermediate_size": 1536,
        "num_hidden_layers": 62,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 196608,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0},
        "num_experts_per_tok": 8,
        "num_local_experts": 256,
        "tie_word_embeddings": False,
    },
    aliases={"num_experts": "num_local_experts"},
    num_experts_key="num_local_experts",
    d_ff_key="intermediate_size",
    experts=ExpertNames(
        per_expert="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
        projs={"gate": "w1", "up": "w3", "down": "w2"},
    ),
    renames=(
        (r"\.mlp\.gate\.weight$", ".block_sparse_moe.gate.weight"),
        (r"\.mlp\.e_score_correction_bias$", ".block_sparse_moe.e_score_correction_bias"),
    ),
    gguf=GGUFArch(  # llama.cpp's minimax-m2: NeoX partial RoPE, full-projection q/k norm
        arch="MINIMAXM2",
        name="minimax-m2",
        architectures="MiniMaxM2ForCausalLM",
        fixed={"expert_gating_func": 2},  # sigmoid; the weights always renormalised
        partial_rotary=True,
    ),
    test_configs={
        "minimax_m2": dict(
            head_dim=32,
            intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=3,
            rotary_dim=16,
            rope_theta=1e4,
        ),
    },
)
