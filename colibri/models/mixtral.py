"""Mixtral (MixtralForCausalLM): softmax router over all experts, top-k renormalised."""

from __future__ import annotations

from typing import Any

from colibri.compute.moe import RouterSpec
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
        num_experts=require(config, "num_local_experts", "num_experts"),
        top_k=require(config, "num_experts_per_tok"),
        norm_topk_prob=True,  # Mixtral always renormalises (MixtralTopKRouter)
    )
    moe = MoESpec(router=router, d_ff=require(config, "intermediate_size"))
    return base_spec(config, layers, moe, "mixtral")
