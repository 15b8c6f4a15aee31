"""DeepSeek-V2 (DeepseekV2ForCausalLM): multi-head latent attention with interleaved RoPE,
softmax router with greedy or group-limited greedy choice (group score = its best expert) and
`routed_scaling_factor`; `norm_topk_prob` is ignored, as in transformers' DeepseekV2TopkRouter.
Shared experts (n_shared_experts x moe_intermediate_size, no gate) and the first
`first_k_dense_replace` layers dense."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from colibri.compute.moe import RouterSpec
from colibri.models.family import Family, GGUFArch
from colibri.models.spec import (
    AttentionSpec,
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


def ffn_names(config: dict[str, Any], i: int) -> tuple[bool, dict[str, str]]:
    """(routed?, FFN tensor names) of layer i in the DeepSeek layout (also GLM-4.5's): layers
    below first_k_dense_replace are dense MLPs; the others have a router (`mlp.gate`) and,
    when n_shared_experts > 0, ungated shared experts (`mlp.shared_experts`)."""
    p = f"model.layers.{i}.mlp"
    if i < get(config, "first_k_dense_replace", default=0):
        return False, mlp_names(p)
    names = {"router": f"{p}.gate"}
    if get(config, "n_shared_experts", default=0):
        names |= mlp_names(f"{p}.shared_experts", "shared")
    return True, names


def layers_of(
    config: dict[str, Any],
    attn: AttentionSpec,
    attn_names: Callable[[str], dict[str, str]],
    correction_bias: bool,
    biases: frozenset[str] = frozenset(),
) -> list[LayerSpec]:
    """The layers of a DeepSeek-layout model: attn_names(prefix) names a layer's attention;
    with correction_bias, routed layers also name `mlp.gate.e_score_correction_bias`; `biases`
    are the attention roles with a bias (`attention_bias`)."""
    layers = []
    shared_ff = require(config, "moe_intermediate_size") * (
        get(config, "n_shared_experts", default=0) or 0
    )
    for i in range(require(config, "num_hidden_layers")):
        sparse, names = ffn_names(config, i)
        if sparse and correction_bias:
            names["correction_bias"] = f"{names['router']}.e_score_correction_bias"
        names |= attn_names(f"model.layers.{i}")
        if sparse:
            layers.append(LayerSpec(i, attn, True, names, shared_d_ff=shared_ff, biases=biases))
        else:
            ff = require(config, "intermediate_size")
            layers.append(LayerSpec(i, attn, False, names, mlp_d_ff=ff, biases=biases))
    return layers


def mla_biases(config: dict[str, Any]) -> frozenset[str]:
    """DeepseekV2/V3Attention: `attention_bias` adds biases to q_a, kv_a and o only."""
    return frozenset({"q_a", "kv_a", "o"}) if get(config, "attention_bias") else frozenset()


def model_spec(config: dict[str, Any]) -> ModelSpec:
    method = get(config, "topk_method", default="greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"config field topk_method: unsupported value {method!r}")
    grouped = method == "group_limited_greedy"
    router = RouterSpec(
        num_experts=require(config, "n_routed_experts"),
        top_k=require(config, "num_experts_per_tok"),
        scoring="softmax",
        norm_topk_prob=False,  # DeepseekV2TopkRouter never renormalises
        n_group=require(config, "n_group") if grouped else 1,
        topk_group=require(config, "topk_group") if grouped else 1,
        group_score="max",
        routed_scaling_factor=float(get(config, "routed_scaling_factor", default=1.0)),
    )
    q_lora = get(config, "q_lora_rank") is not None
    attn = mla_attention(config, "interleaved")
    layers = layers_of(config, attn, lambda p: mla_names(p, q_lora), False, mla_biases(config))
    moe = MoESpec(router=router, d_ff=require(config, "moe_intermediate_size"))
    return base_spec(config, layers, moe, "deepseek_v2")


# llama.cpp deepseek2's GGUF keys (after "deepseek2.") -> config fields, as convert_hf_to_gguf
# writes them; leading_dense_block_count is the store's dense-layer count (GGUFArch.leading_dense)
DEEPSEEK2_HPARAMS = {
    "expert_shared_count": "n_shared_experts",
    "expert_weights_scale": "routed_scaling_factor",
    "expert_weights_norm": "norm_topk_prob",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
}

# MLA expands keys per head: num_key_value_heads == heads
TINY_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8)
TINY_MLA |= dict(v_head_dim=12, intermediate_size=96, moe_intermediate_size=32, n_shared_experts=1)
TINY_YARN = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64)

FAMILY = Family(
    model_type="deepseek_v2",
    model_spec=model_spec,
    defaults={  # DeepseekV2Config
        "vocab_size": 102400,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "moe_intermediate_size": 1407,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "n_shared_experts": 2,
        "n_routed_experts": 64,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "greedy",
        "n_group": None,
        "topk_group": None,
        "num_experts_per_tok": None,
        "first_k_dense_replace": 0,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    aliases={"num_experts": "n_routed_experts"},
    num_experts_key="n_routed_experts",
    d_ff_key="moe_intermediate_size",
    gguf=GGUFArch(  # llama.cpp's deepseek2 with its softmax router (greedy: its groups differ)
        arch="DEEPSEEK2",
        name="deepseek2",
        architectures="DeepseekV2ForCausalLM",
        mla=True,
        leading_dense=True,
        hparams={k: v for k, v in DEEPSEEK2_HPARAMS.items() if k != "expert_weights_norm"},
        fixed={"expert_gating_func": 1},  # softmax, weights never renormalised
        implied={"topk_method": "greedy", "attention_bias": False},
    ),
    test_configs={
        # several routing group settings, MLA with and without q_lora_rank, YaRN with
        # mscale_all_dim
        "deepseek_v2": TINY_MLA
        | dict(
            q_lora_rank=48,
            n_routed_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            topk_method="greedy",
            routed_scaling_factor=1.5,
            rope_parameters=TINY_YARN | dict(mscale=0.707, mscale_all_dim=0.707),
        ),
        "deepseek_v2_grouped_no_q_lora": TINY_MLA
        | dict(
            q_lora_rank=None,
            n_routed_experts=12,
            num_experts_per_tok=3,
            first_k_dense_replace=0,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.0,
        ),
    },
)
