"""gpt-oss (GptOssForCausalLM): attention sinks, sliding-window and full attention layers
alternating as `layer_types` says, q/k/v/o biases, YaRN RoPE (neox pairing); router with a
bias, top-k on the logits then softmax over the k (GptOssTopKRouter); experts with biases and
the clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`; GptOssExperts)."""

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
    n = require(config, "num_hidden_layers")
    # GptOssConfig's default: even layers sliding, odd layers full
    types = get(config, "layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    if len(types) != n:
        raise ValueError(f"config field layer_types: {len(types)} entries for {n} layers")
    window = get(config, "sliding_window", default=0) or 0
    layers = []
    for i in range(n):
        w = window if types[i] == "sliding_attention" else 0
        p = f"model.layers.{i}"
        names = attention_names(p) | {"router": f"{p}.mlp.router", "sinks": f"{p}.self_attn.sinks"}
        layers.append(LayerSpec(i, standard_attention(config, window=w, sinks=True), True, names))
    router = RouterSpec(
        num_experts=require(config, "num_local_experts", "num_experts"),
        top_k=require(config, "num_experts_per_tok"),
        scoring="topk_softmax",
    )
    moe = MoESpec(
        router=router,
        d_ff=require(config, "intermediate_size"),
        act="swiglu_oai",
        alpha=float(get(config, "swiglu_alpha", default=1.702)),
        limit=float(get(config, "swiglu_limit", default=7.0)),
    )
    return base_spec(config, layers, moe, "gpt_oss")
