"""DeepSeek-V3 / R1 (DeepseekV3ForCausalLM): DeepSeek-V2's multi-head latent attention
(RoPE interleaved when `rope_interleave`, the default) and layout, with the sigmoid router:
`e_score_correction_bias` for choosing only, groups scored by their top-2 sum, `topk_group`
groups kept, weights renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`
(DeepseekV3TopkRouter). Multi-token-prediction layers are not used (the converter drops them)."""

from __future__ import annotations

from typing import Any

from colibri.compute.moe import RouterSpec
from colibri.models.deepseek_v2 import (
    DEEPSEEK2_HPARAMS,
    TINY_MLA,
    TINY_YARN,
    layers_of,
    mla_biases,
)
from colibri.models.family import Family, GGUFArch
from colibri.models.spec import (
    ModelSpec,
    MoESpec,
    base_spec,
    get,
    mla_attention,
    mla_names,
    require,
)


def sigmoid_router(config: dict[str, Any]) -> RouterSpec:
    """DeepseekV3TopkRouter / Glm4MoeTopkRouter as data."""
    return RouterSpec(
        num_experts=require(config, "n_routed_experts"),
        top_k=require(config, "num_experts_per_tok"),
        scoring="sigmoid",
        norm_topk_prob=bool(get(config, "norm_topk_prob", default=True)),
        n_group=get(config, "n_group", default=1),
        topk_group=get(config, "topk_group", default=1),
        group_score="top2_sum",
        routed_scaling_factor=float(get(config, "routed_scaling_factor", default=1.0)),
        norm_eps=1e-20,
    )


def model_spec(config: dict[str, Any]) -> ModelSpec:
    mode = "interleaved" if get(config, "rope_interleave", default=True) else "neox"
    q_lora = get(config, "q_lora_rank") is not None
    attn = mla_attention(config, mode)
    layers = layers_of(config, attn, lambda p: mla_names(p, q_lora), True, mla_biases(config))
    moe = MoESpec(router=sigmoid_router(config), d_ff=require(config, "moe_intermediate_size"))
    return base_spec(config, layers, moe, "deepseek_v3")


# the tests' tiny routers: grouped (4 groups of 4, 2 kept, scaled) and plain (2 groups, 1 kept)
TINY_GROUPED_ROUTER = dict(
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_parameters=TINY_YARN | dict(mscale=1.0, mscale_all_dim=1.0),
)
TINY_PLAIN_ROUTER = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
)

FAMILY = Family(
    model_type="deepseek_v3",
    model_spec=model_spec,
    defaults={  # DeepseekV3Config
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    aliases={"num_local_experts": "n_routed_experts"},
    num_experts_key="n_routed_experts",
    d_ff_key="moe_intermediate_size",
    gguf=GGUFArch(  # llama.cpp's deepseek2: MLA, normal (interleaved) RoPE, sigmoid router
        arch="DEEPSEEK2",
        name="deepseek2",
        architectures="DeepseekV3ForCausalLM",
        mla=True,
        leading_dense=True,
        hparams=DEEPSEEK2_HPARAMS,
        fixed={"expert_gating_func": 2},  # sigmoid
        implied={"rope_interleave": True, "attention_bias": False},
    ),
    test_configs={
        "deepseek_v3": TINY_MLA | TINY_GROUPED_ROUTER | dict(q_lora_rank=48, rope_interleave=True),
        "deepseek_v3_one_group_no_q_lora": TINY_MLA
        | TINY_PLAIN_ROUTER
        | dict(q_lora_rank=None, first_k_dense_replace=0, rope_interleave=False),
    },
)
