"""GLM-4.5 / 4.6 MoE (Glm4MoeForCausalLM): grouped-query attention with partial rotary
(`partial_rotary_factor`, default 0.5, neox pairing on the leading dims), q/k/v biases when
`attention_bias` (o_proj has none), optional per-head q/k RMSNorm (`use_qk_norm`); DeepSeek-V3's
sigmoid router with `e_score_correction_bias`, shared experts and `first_k_dense_replace`
dense layers."""

from __future__ import annotations

from typing import Any

from colibri.models.deepseek_v2 import layers_of
from colibri.models.deepseek_v3 import sigmoid_router
from colibri.models.family import Family, GGUFArch
from colibri.models.spec import (
    ModelSpec,
    MoESpec,
    attention_names,
    base_spec,
    get,
    require,
    standard_attention,
)


def model_spec(config: dict[str, Any]) -> ModelSpec:
    # partial_rotary_factor (Glm4MoeConfig's default 0.5) is in the resolved rope_parameters
    qk_norm = bool(get(config, "use_qk_norm", default=False))
    attn = standard_attention(config, qk_norm="head" if qk_norm else "none")
    biases = frozenset("qkv") if get(config, "attention_bias", default=False) else frozenset()
    names = lambda p: attention_names(p, qk_norm=qk_norm)  # noqa: E731
    layers = layers_of(config, attn, names, True, biases)
    moe = MoESpec(router=sigmoid_router(config), d_ff=require(config, "moe_intermediate_size"))
    return base_spec(config, layers, moe, "glm4_moe")


FAMILY = Family(
    model_type="glm4_moe",
    model_spec=model_spec,
    defaults={  # Glm4MoeConfig
        "vocab_size": 151552,
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        "attention_bias": False,
        "moe_intermediate_size": 1408,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_routed_experts": 128,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "use_qk_norm": False,
        "tie_word_embeddings": False,
    },
    aliases={"num_local_experts": "n_routed_experts"},
    num_experts_key="n_routed_experts",
    d_ff_key="moe_intermediate_size",
    gguf=GGUFArch(  # llama.cpp's glm4moe: NeoX partial RoPE, leading dense layers, shared expert
        arch="GLM4_MOE",
        name="glm4moe",
        architectures="Glm4MoeForCausalLM",
        leading_dense=True,
        hparams={
            "expert_shared_count": "n_shared_experts",
            "expert_weights_scale": "routed_scaling_factor",
            "expert_weights_norm": "norm_topk_prob",
            "expert_group_count": "n_group",
            "expert_group_used_count": "topk_group",
        },
        fixed={"expert_gating_func": 2},  # sigmoid
        partial_rotary=True,
        present={"attention_bias": "blk.0.attn_q.bias", "use_qk_norm": "blk.0.attn_q_norm.weight"},
    ),
    test_configs={
        "glm4_moe": dict(
            head_dim=32,
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=True,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.8,
        ),
    },
)
