"""GLM-4.5 / 4.6 MoE (Glm4MoeForCausalLM): grouped-query attention with partial rotary
(`partial_rotary_factor`, default 0.5, neox pairing on the leading dims), q/k/v biases when
`attention_bias` (o_proj has none), optional per-head q/k RMSNorm (`use_qk_norm`); DeepSeek-V3's
sigmoid router with `e_score_correction_bias`, shared experts and `first_k_dense_replace`
dense layers."""

from __future__ import annotations

from typing import Any

from colibri.models.deepseek_v2 import layers_of
from colibri.models.deepseek_v3 import sigmoid_router
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
    rope = config.get("rope_parameters") or {}
    if get(config, "partial_rotary_factor") is None and rope.get("partial_rotary_factor") is None:
        config = {**config, "partial_rotary_factor": 0.5}  # Glm4MoeConfig's default
    qk_norm = bool(get(config, "use_qk_norm", default=False))
    attn = standard_attention(config, qk_norm="head" if qk_norm else "none")
    layers = layers_of(config, attn, lambda p: attention_names(p, qk_norm=qk_norm), True)
    moe = MoESpec(router=sigmoid_router(config), d_ff=require(config, "moe_intermediate_size"))
    return base_spec(config, layers, moe, "glm4_moe")
