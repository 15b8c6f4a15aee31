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
from colibri.models.family import Family
from colibri.models.qwen3_next import hybrid_layers
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


FAMILY = Family(
    model_type="qwen3_5_moe",
    model_spec=model_spec,
    defaults={  # Qwen3_5MoeTextConfig
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "attention_bias": False,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts_per_tok": 8,
        "num_experts": 256,
        "tie_word_embeddings": False,
    },
    num_experts_key="num_experts",
    d_ff_key="moe_intermediate_size",
    text_model_type="qwen3_5_moe_text",
    text_prefixes=(("model.language_model.", "model."), ("lm_head.", "lm_head.")),
    test_configs={
        "qwen3_5_moe": dict(
            num_hidden_layers=4,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            head_dim=32,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            num_experts=8,
            num_experts_per_tok=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=24,
            linear_conv_kernel_dim=4,
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
