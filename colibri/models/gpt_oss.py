"""gpt-oss (GptOssForCausalLM): attention sinks, sliding-window and full attention layers
alternating as `layer_types` says, q/k/v/o biases, YaRN RoPE (neox pairing); router with a
bias, top-k on the logits then softmax over the k (GptOssTopKRouter); experts with biases and
the clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`; GptOssExperts)."""

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
    n = require(config, "num_hidden_layers")
    # GptOssConfig's default: even layers sliding, odd layers full
    types = get(config, "layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    if len(types) != n:
        raise ValueError(f"config field layer_types: {len(types)} entries for {n} layers")
    window = get(config, "sliding_window", default=0) or 0
    biases = frozenset({"q", "k", "v", "o", "router"})
    if not get(config, "attention_bias", default=True):
        biases -= set("qkvo")
    layers = []
    for i in range(n):
        w = window if types[i] == "sliding_attention" else 0
        p = f"model.layers.{i}"
        names = attention_names(p) | {"router": f"{p}.mlp.router", "sinks": f"{p}.self_attn.sinks"}
        attn = standard_attention(config, window=w, sinks=True)
        layers.append(LayerSpec(i, attn, True, names, biases=biases))
    router = RouterSpec(
        num_experts=require(config, "num_local_experts"),
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


FAMILY = Family(
    model_type="gpt_oss",
    model_spec=model_spec,
    defaults={  # GptOssConfig
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
            "rope_theta": 150000.0,
        },
        "sliding_window": 128,
        "attention_bias": True,
        "num_experts_per_tok": 4,
        "num_local_experts": 128,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
        "tie_word_embeddings": False,
    },
    aliases={"num_experts": "num_local_experts"},
    num_experts_key="num_local_experts",
    d_ff_key="intermediate_size",
    experts=ExpertNames(per_expert=None, fused_layout="interleaved_t"),
    gguf=GGUFArch(  # llama.cpp's gpt-oss: sinks, biases everywhere, SWA on even layers
        arch="GPT_OSS",
        name="gpt-oss",
        architectures="GptOssForCausalLM",
        hparams={"attention.sliding_window": "sliding_window"},
        implied={"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True},
        expert_biases=True,
        swa_pattern=2,
    ),
    test_configs={
        "gpt_oss": dict(
            head_dim=16,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=8,  # shorter than the test prompt
            swiglu_limit=1.0,  # low enough that the clamp bites in a tiny model
            attention_bias=True,
        ),
    },
)
