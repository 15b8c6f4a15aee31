"""Llama 4 text model (Llama4ForCausalLM; the language model of Llama-4-Scout / Maverick, see
llama4.py for the multimodal checkpoints). Grouped-query attention with RoPE on adjacent pairs
(complex multiplication, "interleaved"), except on the no-RoPE layers (`no_rope_layers[i]` == 0,
by default every `no_rope_layer_interval`-th); RoPE layers use chunked local attention
(`attention_chunk_size`, layer_types "chunked_attention") and, with `use_qk_norm`, a weightless
per-head RMSNorm of q and k after RoPE (Llama4TextL2Norm); no-RoPE layers attend to the whole
context, their queries scaled by 1 + attn_scale * log1p(floor((pos + 1) / floor_scale)) when
`attn_temperature_tuning`. MoE layers every `interleave_moe_layer_step` (`moe_layers`), the
others a dense MLP of `intermediate_size_mlp`; an MoE layer is a shared expert of
`intermediate_size` plus top-k experts chosen on the router logits, each weighted by the sigmoid
of its logit, and that weight scales the expert's INPUT (Llama4Router, Llama4TextMoe). Experts
are stored fused, gate_up_proj [E, H, 2*I] (gate columns first) and down_proj [E, I, H]."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from colibri.compute.moe import RouterSpec
from colibri.models.family import ExpertNames, Family
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


def layer_settings(config: dict[str, Any]) -> tuple[list[int], list[int], list[str]]:
    """(no_rope_layers, moe_layers, layer_types) as Llama4TextConfig.__post_init__ computes
    them when the config leaves them out. no_rope_layers[i] == 1 means layer i USES RoPE."""
    n = require(config, "num_hidden_layers")
    interval = require(config, "no_rope_layer_interval")
    no_rope = get(config, "no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    step = require(config, "interleave_moe_layer_step")
    moe_layers = get(config, "moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, n, step))
    chunk = get(config, "attention_chunk_size")
    types = get(config, "layer_types") or [
        "chunked_attention" if r and chunk is not None else "full_attention" for r in no_rope
    ]
    if len(no_rope) != n or len(types) != n:
        raise ValueError(
            f"config.json: no_rope_layers / layer_types need num_hidden_layers={n} entries"
        )
    return list(no_rope), list(moe_layers), list(types)


def model_spec(config: dict[str, Any]) -> ModelSpec:
    qk_norm = bool(get(config, "use_qk_norm", default=False))
    base = standard_attention(config, rope_mode="interleaved")
    tuning = bool(get(config, "attn_temperature_tuning", default=False))
    chunk = get(config, "attention_chunk_size") or 0
    no_rope, moe_layers, types = layer_settings(config)
    biases = frozenset("qkvo") if get(config, "attention_bias", default=False) else frozenset()
    ff, ff_mlp = require(config, "intermediate_size"), require(config, "intermediate_size_mlp")
    layers = []
    for i in range(require(config, "num_hidden_layers")):
        p = f"model.layers.{i}"
        if no_rope[i]:
            attn = dataclasses.replace(base, qk_norm="l2" if qk_norm else "none")
        else:
            attn = dataclasses.replace(base, rot_dim=0, inv_freq=np.zeros(0, np.float32))
            if tuning:
                attn = dataclasses.replace(
                    attn,
                    floor_scale=float(require(config, "floor_scale")),
                    attn_scale=float(require(config, "attn_scale")),
                )
        if types[i] == "chunked_attention":
            attn = dataclasses.replace(attn, attention_chunk_size=int(chunk))
        elif types[i] != "full_attention":
            raise ValueError(f"config.json: layer_types[{i}] = {types[i]!r} is not supported")
        names = attention_names(p)
        if i in moe_layers:
            names["router"] = f"{p}.feed_forward.router"
            names |= mlp_names(f"{p}.feed_forward.shared_expert", "shared")
            layers.append(LayerSpec(i, attn, True, names, shared_d_ff=ff, biases=biases))
        else:
            names |= mlp_names(f"{p}.feed_forward")
            layers.append(LayerSpec(i, attn, False, names, mlp_d_ff=ff_mlp, biases=biases))
    router = RouterSpec(
        num_experts=require(config, "num_local_experts"),
        top_k=require(config, "num_experts_per_tok"),
        scoring="topk_sigmoid",
    )
    moe = MoESpec(router=router, d_ff=ff, apply_router_weight_on_input=True)
    return base_spec(config, layers, moe, config.get("model_type") or "llama4_text")


DEFAULTS = {  # Llama4TextConfig
    "vocab_size": 202048,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "num_experts_per_tok": 1,
    "num_local_experts": 16,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "attention_bias": False,
    "tie_word_embeddings": False,
}

EXPERTS = ExpertNames(
    per_expert=None, fused="model.layers.{layer}.feed_forward.experts", fused_layout="concat_t"
)

# tiny cases: chunk 8 and floor_scale 4 so that a 32-token prompt crosses chunks and the
# temperature changes; every other layer MoE, every other layer without RoPE
TINY = dict(
    head_dim=32,
    intermediate_size=32,
    intermediate_size_mlp=96,
    num_local_experts=8,
    num_experts_per_tok=1,
    interleave_moe_layer_step=1,
    no_rope_layer_interval=2,
    attention_chunk_size=8,
    floor_scale=4,
    attn_scale=0.3,
    rope_theta=1e4,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

FAMILY = Family(
    model_type="llama4_text",
    model_spec=model_spec,
    defaults=DEFAULTS,
    num_experts_key="num_local_experts",
    d_ff_key="intermediate_size",
    experts=EXPERTS,
    test_configs={
        "llama4_text": TINY,
        "llama4_text_interleaved_top2": TINY
        | dict(
            num_hidden_layers=4,
            interleave_moe_layer_step=2,
            num_experts_per_tok=2,
            use_qk_norm=False,
            attention_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=1e4,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    },
)
