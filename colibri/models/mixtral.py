"""Mixtral (MixtralForCausalLM): softmax router over all experts, top-k renormalised."""

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
    get,
    require,
    standard_attention,
)


def model_spec(config: dict[str, Any]) -> ModelSpec:
    attn = standard_attention(config, window=get(config, "sliding_window", default=0))
    layers = []
    for i in range(require(config, "num_hidden_layers")):
        p = f"model.layers.{i}"
        names = attention_names(p) | {"router": f"{p}.block_sparse_moe.gate"}
        layers.append(LayerSpec(i, attn, moe=True, names=names))
    router = RouterSpec(
        num_experts=require(config, "num_local_experts"),
        top_k=require(config, "num_experts_per_tok"),
        norm_topk_prob=True,  # Mixtral always renormalises (MixtralTopKRouter)
    )
    moe = MoESpec(router=router, d_ff=require(config, "intermediate_size"))
    return base_spec(config, layers, moe, "mixtral")


FAMILY = Family(
    model_type="mixtral",
    model_spec=model_spec,
    defaults={  # MixtralConfig
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": None,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_window": None,
        "num_experts_per_tok": 2,
        "num_local_experts": 8,
        "tie_word_embeddings": False,
    },
    aliases={"num_experts": "num_local_experts"},
    num_experts_key="num_local_experts",
    d_ff_key="intermediate_size",
    experts=ExpertNames(
        per_expert="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
        projs={"gate": "w1", "up": "w3", "down": "w2"},
    ),
    renames=((r"\.mlp\.gate\.weight$", ".block_sparse_moe.gate.weight"),),
    gguf=GGUFArch(
        arch="LLAMA",
        name="llama",
        architectures="MixtralForCausalLM",
        rope_permute=True,
        expert_ff_key="feed_forward_length",
    ),
    test_configs={
        "mixtral": dict(
            intermediate_size=96, num_local_experts=6, num_experts_per_tok=2, rope_theta=1e4
        ),
    },
)
