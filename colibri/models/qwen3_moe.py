"""Qwen3-MoE: per-head q/k RMSNorm before RoPE, `norm_topk_prob`, no shared expert."""

from __future__ import annotations

from typing import Any

from colibri.compute.moe import RouterSpec
from colibri.models.family import Family, GGUFArch
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
    biases = frozenset("qkvo") if get(config, "attention_bias", default=False) else frozenset()
    layers = []
    for i in range(require(config, "num_hidden_layers")):
        p = f"model.layers.{i}"
        names = attention_names(p, qk_norm=True)
        if is_sparse(config, i, "num_local_experts"):
            names["router"] = f"{p}.mlp.gate"
            layers.append(LayerSpec(i, attn, True, names, biases=biases))
        else:
            names |= mlp_names(f"{p}.mlp")
            ff = require(config, "intermediate_size")
            layers.append(LayerSpec(i, attn, False, names, mlp_d_ff=ff, biases=biases))
    router = RouterSpec(
        num_experts=require(config, "num_local_experts"),
        top_k=require(config, "num_experts_per_tok"),
        norm_topk_prob=bool(get(config, "norm_topk_prob", default=False)),
    )
    moe = MoESpec(router=router, d_ff=require(config, "moe_intermediate_size"))
    return base_spec(config, layers, moe, "qwen3_moe")


FAMILY = Family(
    model_type="qwen3_moe",
    model_spec=model_spec,
    defaults={  # Qwen3MoeConfig
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_local_experts": 128,
        "norm_topk_prob": False,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    },
    aliases={"num_experts": "num_local_experts"},
    num_experts_key="num_local_experts",
    d_ff_key="moe_intermediate_size",
    gguf=GGUFArch(
        arch="QWEN3MOE",
        name="qwen3moe",
        architectures="Qwen3MoeForCausalLM",
        implied={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
    test_configs={
        "qwen3_moe": dict(
            head_dim=32,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
        ),
    },
)
