"""OLMoE: q/k RMSNorm over the whole projection (not per head), optional `clip_qkv`."""

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
    require,
    standard_attention,
)


def model_spec(config: dict[str, Any]) -> ModelSpec:
    attn = standard_attention(config, qk_norm="full")
    biases = frozenset("qkvo") if get(config, "attention_bias", default=False) else frozenset()
    layers = []
    for i in range(require(config, "num_hidden_layers")):
        p = f"model.layers.{i}"
        names = attention_names(p, qk_norm=True) | {"router": f"{p}.mlp.gate"}
        layers.append(LayerSpec(i, attn, moe=True, names=names, biases=biases))
    router = RouterSpec(
        num_experts=require(config, "num_experts"),
        top_k=require(config, "num_experts_per_tok"),
        norm_topk_prob=bool(get(config, "norm_topk_prob", default=False)),
    )
    moe = MoESpec(router=router, d_ff=require(config, "intermediate_size"))
    return base_spec(config, layers, moe, "olmoe")


FAMILY = Family(
    model_type="olmoe",
    model_spec=model_spec,
    defaults={  # OlmoeConfig
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "clip_qkv": None,
        "num_experts_per_tok": 8,
        "num_experts": 64,
        "norm_topk_prob": False,
        "tie_word_embeddings": False,
    },
    aliases={"num_local_experts": "num_experts"},
    num_experts_key="num_experts",
    d_ff_key="intermediate_size",
    gguf=GGUFArch(  # llama.cpp's olmoe: NeoX RoPE, q/k norm over the projection, no biases
        arch="OLMOE",
        name="olmoe",
        architectures="OlmoeForCausalLM",
        expert_ff_key="feed_forward_length",
        implied={"norm_topk_prob": False, "clip_qkv": None, "attention_bias": False},
        requires_mha=True,
    ),
    test_configs={
        "olmoe": dict(intermediate_size=64, num_experts=8, num_experts_per_tok=2, clip_qkv=8.0),
    },
)
