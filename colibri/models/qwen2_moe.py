"""Qwen2-MoE: qkv biases, a shared expert scaled by sigmoid(shared_expert_gate(x)),
`decoder_sparse_step` / `mlp_only_layers` dense layers, optional sliding-window layers."""

from __future__ import annotations

from typing import Any

from colibri.compute.moe import RouterSpec
from colibri.models.family import Family, GGUFArch
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


def is_sparse(config: dict[str, Any], i: int, num_experts_key: str = "num_experts") -> bool:
    """Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer's rule for a routed-expert layer."""
    step = get(config, "decoder_sparse_step", default=1)
    only_mlp = get(config, "mlp_only_layers", default=[])
    return i not in only_mlp and require(config, num_experts_key) > 0 and (i + 1) % step == 0


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
    biases = frozenset("qkv") if get(config, "qkv_bias", default=True) else frozenset()
    layers = []
    for i in range(require(config, "num_hidden_layers")):
        p = f"model.layers.{i}"
        names = attention_names(p)
        attn = standard_attention(config, window=windows[i])
        if is_sparse(config, i):
            names |= {
                "router": f"{p}.mlp.gate",
                "shared_expert_gate": f"{p}.mlp.shared_expert_gate",
            }
            names |= mlp_names(f"{p}.mlp.shared_expert", "shared")
            ff = require(config, "shared_expert_intermediate_size")
            layers.append(LayerSpec(i, attn, True, names, shared_d_ff=ff, biases=biases))
        else:
            names |= mlp_names(f"{p}.mlp")
            ff = require(config, "intermediate_size")
            layers.append(LayerSpec(i, attn, False, names, mlp_d_ff=ff, biases=biases))
    router = RouterSpec(
        num_experts=require(config, "num_experts"),
        top_k=require(config, "num_experts_per_tok"),
        norm_topk_prob=bool(get(config, "norm_topk_prob", default=False)),
    )
    moe = MoESpec(router=router, d_ff=require(config, "moe_intermediate_size"))
    return base_spec(config, layers, moe, "qwen2_moe")


FAMILY = Family(
    model_type="qwen2_moe",
    model_spec=model_spec,
    defaults={  # Qwen2MoeConfig
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4,
        "num_experts": 60,
        "norm_topk_prob": False,
        "mlp_only_layers": [],
        "qkv_bias": True,
        "tie_word_embeddings": False,
    },
    num_experts_key="num_experts",
    d_ff_key="moe_intermediate_size",
    gguf=GGUFArch(  # llama.cpp's qwen2moe: NeoX RoPE, qkv biases, sigmoid-gated shared expert
        arch="QWEN2MOE",
        name="qwen2moe",
        architectures="Qwen2MoeForCausalLM",
        shared_ff_key="expert_shared_feed_forward_length",
        implied={
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "qkv_bias": True,
            "use_sliding_window": False,
        },
    ),
    test_configs={
        "qwen2_moe": dict(
            intermediate_size=128,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            qkv_bias=True,
        ),
    },
)
