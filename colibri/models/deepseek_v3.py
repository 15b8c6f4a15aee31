"""DeepSeek-V3 / R1 (DeepseekV3ForCausalLM): DeepSeek-V2's multi-head latent attention
(RoPE interleaved when `rope_interleave`, the default) and layout, with the sigmoid router:
`e_score_correction_bias` for choosing only, groups scored by their top-2 sum, `topk_group`
groups kept, weights renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`
(DeepseekV3TopkRouter). Multi-token-prediction layers are not used (the converter drops them)."""

from __future__ import annotations

from typing import Any

from colibri.compute.moe import RouterSpec
from colibri.models.deepseek_v2 import layers_of, num_experts
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
        num_experts=num_experts(config),
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
    layers = layers_of(config, attn, lambda p: mla_names(p, q_lora), True)
    moe = MoESpec(router=sigmoid_router(config), d_ff=require(config, "moe_intermediate_size"))
    return base_spec(config, layers, moe, "deepseek_v3")
