"""Kimi K2 (moonshotai/Kimi-K2-*): config.json `model_type` "kimi_k2", architectures
DeepseekV3ForCausalLM; the body is DeepSeek-V3's (multi-head latent attention with interleaved
RoPE, sigmoid router with `e_score_correction_bias` and groups, shared experts,
`first_k_dense_replace` dense layers), the config class of its remote code is DeepseekV3Config
(transformers has no kimi_k2 model type; Kimi_K25Config maps a "kimi_k2" text_config to
deepseek_v3). Hub checkpoints name tensors as DeepSeek-V3's."""

from __future__ import annotations

import dataclasses
from typing import Any

from colibri.models import deepseek_v3
from colibri.models.deepseek_v2 import TINY_MLA
from colibri.models.family import Family
from colibri.models.spec import ModelSpec


def model_spec(config: dict[str, Any]) -> ModelSpec:
    return dataclasses.replace(deepseek_v3.model_spec(config), model_type="kimi_k2")


# Kimi-K2's shape in small: one expert group, 1 dense layer, routed_scaling_factor 2.827
TINY_KIMI = TINY_MLA | dict(
    q_lora_rank=48,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.827,
    rope_interleave=True,
)

FAMILY = Family(
    model_type="kimi_k2",
    model_spec=model_spec,
    defaults=deepseek_v3.FAMILY.defaults,  # DeepseekV3Config (the remote code's class)
    aliases=deepseek_v3.FAMILY.aliases,
    num_experts_key="n_routed_experts",
    d_ff_key="moe_intermediate_size",
    text_model_type="deepseek_v3",  # the transformers config class whose defaults apply
    # exported as DeepSeek-V3 (llama.cpp deepseek2); a GGUF imports as deepseek_v3
    gguf=dataclasses.replace(deepseek_v3.FAMILY.gguf, importable=False),
    test_configs={"kimi_k2": TINY_KIMI},
)
