"""Qwen2-MoE: qkv biases, a shared expert scaled by sigmoid(shared_expert_gate(x)),
`decoder_sparse_step` / `mlp_only_layers` dense layers, optional sliding-window layers."""

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
    mlp_names,
    require,
    standard_attention,
)


def is_sparse(config: dict[str, Any], i: int) -> bool:
    """Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer's rule for a routed-expert layer."""
    step = get(config, "decoder_sparse_step", default=1)
    only_mlp = get(config, "mlp_only_layers", default=[])
    return (
        i not in only_mlp
        and require(config, "num_experts", "num_local_experts") > 0
        and (i + 1) % step == 0
    )


def layer_windows(config: dict[str, Any]) -> list[int]:
    """Per-layer sliding window (0 = full), from `layer_types` or Qwen2's max_window_layers."""
    n = require(config, "num_hidden_layers")
    window = get(config, "sliding_window", default=0) or 0
    types = get(config, "layer_types")
    if types is None:
        use = get(config, "use_sliding_window", default=False)
        first = get(config, "max_window_layers", default=n)
        types = [
            "sliding_attention" if use and (i + 1) % 2 and i < first else "full_attention"
            for i in range(n)
        ]
    return [window if t == "sliding_attention" else 0 for t in types]


def model_spec(config: dict[str, Any]) -> ModelSpec:
    windows = layer_windows(config)
    layers = []
    for i in range(require(config, "num_hidden_layers")):
        p = f"model.layers.{i}"
        names = attention_names(p)
        if sparse := is_sparse(config, i):
            names |= {
                "router": f"{p}.mlp.gate",
                "shared_expert_gate": f"{p}.mlp.shared_expert_gate",
            }
            names |= mlp_names(f"{p}.mlp.shared_expert", "shared")
        else:
            names |= mlp_names(f"{p}.mlp")
        layers.append(LayerSpec(i, standard_attention(config, window=windows[i]), sparse, names))
    router = RouterSpec(
        num_experts=require(config, "num_experts", "num_local_experts"),
        top_k=require(config, "num_experts_per_tok"),
        norm_topk_prob=bool(get(config, "norm_topk_prob", default=False)),
    )
    moe = MoESpec(router=router, d_ff=require(config, "moe_intermediate_size"), shared_gate=True)
    return base_spec(config, layers, moe, "qwen2_moe")
