"""Qwen3.5 / Qwen3.6 MoE (multimodal checkpoint; colibri runs its language model, the
`text_config`): Qwen3-Next's hybrid of Gated DeltaNet and gated full attention, with the
DeltaNet projections split (in_proj_qkv / in_proj_z / in_proj_b / in_proj_a), every layer
MoE with a sigmoid-gated shared expert, top-k weights always renormalised
(Qwen3_5MoeTopKRouter). Its multimodal RoPE (mrope_section) rotates text positions exactly
as plain RoPE: the three position streams are equal for text, so every frequency gets the
token's position."""

from __future__ import annotations

import dataclasses
from typing import Any

from colibri.compute.moe import RouterSpec
from colibri.models import qwen3_next
from colibri.models.family import Family
from colibri.models.qwen3_next import TINY_HYBRID, hybrid_layers
from colibri.models.spec import ModelSpec, MoESpec, base_spec, require


def model_spec(config: dict[str, Any]) -> ModelSpec:
    layers = hybrid_layers(config, False, lambda i: True)
    router = RouterSpec(
        num_experts=require(config, "num_experts"),
        top_k=require(config, "num_experts_per_tok"),
        norm_topk_prob=True,
    )
    moe = MoESpec(router=router, d_ff=require(config, "moe_intermediate_size"))
    return dataclasses.replace(base_spec(config, layers, moe, "qwen3_5_moe"), norm_offset=1.0)


# Qwen3NextConfig keys Qwen3_5MoeTextConfig lacks (every layer is MoE, always renormalised)
_NEXT_ONLY = frozenset(
    {"intermediate_size", "decoder_sparse_step", "norm_topk_prob", "mlp_only_layers"}
)

FAMILY = Family(
    model_type="qwen3_5_moe",
    model_spec=model_spec,
    defaults={  # Qwen3_5MoeTextConfig: Qwen3NextConfig's but the dense-MLP keys
        **{k: v for k, v in qwen3_next.FAMILY.defaults.items() if k not in _NEXT_ONLY},
        "vocab_size": 248320,
        "num_hidden_layers": 40,
        "num_experts_per_tok": 8,
        "num_experts": 256,
    },
    num_experts_key="num_experts",
    d_ff_key="moe_intermediate_size",
    text_model_type="qwen3_5_moe_text",
    text_prefixes=(("model.language_model.", "model."), ("lm_head.", "lm_head.")),
    test_configs={
        "qwen3_5_moe": TINY_HYBRID
        | dict(
            num_experts_per_tok=4,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 2],
                "mrope_interleaved": True,
            },
            # the vision tower transformers builds beside the language model (dropped)
            vision_config=dict(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                patch_size=4,
                num_position_embeddings=16,
            ),
        ),
    },
)
