"""Qwen3-MoE: per-head q/k RMSNorm before RoPE, `norm_topk_prob`, no shared expert."""

from __future__ import annotations

from typing import Any

from colibri.compute.moe import RouterSpec
from colibri.models.qwen2_moe import is_sparse
from colibri.models.spec import (
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


def model_spec(config: dict[str, Any]) -> ModelSpec:
    # Qwen3MoeConfig: the window applies only with use_sliding_window
    window = get(config, "sliding_window", default=0) if config.get("use_sliding_window") else 0
    attn = standard_attention(config, window=window or 0, qk_norm="head")
    layers = []
    for i in range(require(config, "num_hidden_layers")):
        p = f"model.layers.{i}"
        names = attention_names(p, qk_norm=True)
        if sparse := is_sparse(config, i):
            names["router"] = f"{p}.mlp.gate"
        else:
            names |= mlp_names(f"{p}.mlp")
        layers.append(LayerSpec(i, attn, sparse, names))
    router = RouterSpec(
        num_experts=require(config, "num_experts", "num_local_experts"),
        top_k=require(config, "num_experts_per_tok"),
        norm_topk_prob=bool(get(config, "norm_topk_prob", default=False)),
    )
    moe = MoESpec(router=router, d_ff=require(config, "moe_intermediate_size"))
    return base_spec(config, layers, moe, "qwen3_moe")
