"""Qwen3-Next: Gated DeltaNet linear-attention layers beside gated full-attention layers
(`layer_types`, else every `full_attention_interval`-th layer is full), q/k RMSNorm and
partial rotary on the full layers, a shared expert scaled by sigmoid(shared_expert_gate(x)),
zero-centred (1 + w) RMSNorms (Qwen3NextRMSNorm; the gated norm keeps a plain weight)."""

from __future__ import annotations

import dataclasses
from typing import Any

from colibri.compute.moe import RouterSpec
from colibri.models.family import Family
from colibri.models.qwen2_moe import is_sparse
from colibri.models.spec import (
    GatedDeltaNetSpec,
    LayerSpec,
    ModelSpec,
    MoESpec,
    attention_names,
    base_spec,
    get,
    mlp_names,
    require,
    standard_attention,
)

LINEAR_ROLES = ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def layer_types(config: dict[str, Any]) -> list[str]:
    """Per layer "linear_attention" or "full_attention" (Qwen3NextConfig.__post_init__)."""
    n = require(config, "num_hidden_layers")
    types = get(config, "layer_types")
    if types is None:
        interval = get(config, "full_attention_interval", default=4)
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        ]
    if len(types) != n or not set(types) <= {"linear_attention", "full_attention"}:
        raise ValueError(
            f"config.json: layer_types must list {n} of linear_attention / full_attention"
        )
    return list(types)


def linear_attn(config: dict[str, Any], fused_qkvz: bool) -> GatedDeltaNetSpec:
    spec = GatedDeltaNetSpec(
        linear_num_key_heads=require(config, "linear_num_key_heads"),
        linear_num_value_heads=require(config, "linear_num_value_heads"),
        linear_key_head_dim=require(config, "linear_key_head_dim"),
        linear_value_head_dim=require(config, "linear_value_head_dim"),
        linear_conv_kernel_dim=require(config, "linear_conv_kernel_dim"),
        fused_qkvz=fused_qkvz,
        norm_eps=float(get(config, "rms_norm_eps", default=1e-6)),
    )
    if spec.linear_num_value_heads % spec.linear_num_key_heads:
        raise ValueError(
            "config.json: linear_num_value_heads must be a multiple of linear_num_key_heads"
        )
    return spec


def hybrid_layers(
    config: dict[str, Any], fused_qkvz: bool, sparse: Any, prefix: str = "model.layers"
) -> list[LayerSpec]:
    """The decoder layers of a Qwen3-Next-style hybrid; sparse(i) says whether layer i has
    routed experts (else a dense MLP of intermediate_size)."""
    if get(config, "hidden_act", default="silu") != "silu":
        raise ValueError(f"config.json: hidden_act {config['hidden_act']!r} is not supported")
    attn = dataclasses.replace(standard_attention(config, qk_norm="head"), output_gate=True)
    plain = dataclasses.replace(attn, qk_norm="none", output_gate=False)  # unused placeholder
    lin = linear_attn(config, fused_qkvz)
    biases = frozenset("qkvo") if get(config, "attention_bias", default=False) else frozenset()
    layers = []
    for i, kind in enumerate(layer_types(config)):
        p = f"{prefix}.{i}"
        if kind == "full_attention":
            names, a, la = attention_names(p, qk_norm=True), attn, None
        else:
            la, a = lin, plain
            names = {
                "input_norm": f"{p}.input_layernorm",
                "post_norm": f"{p}.post_attention_layernorm",
            }
            la_roles = LINEAR_ROLES[:2] if fused_qkvz else LINEAR_ROLES[2:]
            names |= {r: f"{p}.linear_attn.{r}" for r in la_roles}
            names |= {r: f"{p}.linear_attn.{r}" for r in ("conv1d", "dt_bias", "A_log")}
            names |= {"linear_norm": f"{p}.linear_attn.norm", "o": f"{p}.linear_attn.out_proj"}
        kw: dict[str, Any] = {"biases": biases if la is None else frozenset(), "linear_attn": la}
        if sparse(i):
            names |= {
                "router": f"{p}.mlp.gate",
                "shared_expert_gate": f"{p}.mlp.shared_expert_gate",
            }
            names |= mlp_names(f"{p}.mlp.shared_expert", "shared")
            kw["shared_d_ff"] = require(config, "shared_expert_intermediate_size")
            layers.append(LayerSpec(i, a, True, names, **kw))
        else:
            names |= mlp_names(f"{p}.mlp")
            kw["mlp_d_ff"] = require(config, "intermediate_size")
            layers.append(LayerSpec(i, a, False, names, **kw))
    return layers


def model_spec(config: dict[str, Any]) -> ModelSpec:
    layers = hybrid_layers(config, True, lambda i: is_sparse(config, i))
    router = RouterSpec(
        num_experts=require(config, "num_experts"),
        top_k=require(config, "num_experts_per_tok"),
        norm_topk_prob=bool(get(config, "norm_topk_prob", default=True)),
    )
    moe = MoESpec(router=router, d_ff=require(config, "moe_intermediate_size"))
    return dataclasses.replace(base_spec(config, layers, moe, "qwen3_next"), norm_offset=1.0)


# the tests' tiny hybrid: linear, full, linear, full attention layers, 8 experts
TINY_HYBRID = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    head_dim=32,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=96,
    num_experts=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,  # 16: keys so collinear that q8_0 noise is amplified
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
)

FAMILY = Family(
    model_type="qwen3_next",
    model_spec=model_spec,
    defaults={  # Qwen3NextConfig
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 48,
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
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts_per_tok": 10,
        "num_experts": 512,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    },
    num_experts_key="num_experts",
    d_ff_key="moe_intermediate_size",
    test_configs={
        "qwen3_next": TINY_HYBRID
        | dict(
            intermediate_size=128, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[2]
        ),
    },
)
