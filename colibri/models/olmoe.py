"""OLMoE: q/k RMSNorm over the whole projection (not per head), optional `clip_qkv`."""

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
    attn = standard_attention(config, qk_norm="full")
    layers = []
    for i in range(require(config, "num_hidden_layers")):
        p = f"model.layers.{i}"
        names = attention_names(p, qk_norm=True) | {"router": f"{p}.mlp.gate"}
        layers.append(LayerSpec(i, attn, moe=True, names=names))
    router = RouterSpec(
        num_experts=require(config, "num_experts", "num_local_experts"),
        top_k=require(config, "num_experts_per_tok"),
        norm_topk_prob=bool(get(config, "norm_topk_prob", default=False)),
    )
    moe = MoESpec(router=router, d_ff=require(config, "intermediate_size"))
    return base_spec(config, layers, moe, "olmoe")
