"""Gemma 4 text model with the MoE block (Gemma4ForCausalLM, `enable_moe_block`; the language
model of gemma-4-26B-A4B, see gemma4.py for the multimodal checkpoints).

Each layer: attention with per-head q/k RMSNorms, a weightless v norm and softmax scale 1,
sliding-window or full per `layer_types`, each type with its own RoPE (`rope_parameters`
keyed by layer type; full layers "proportional": only a partial_rotary_factor share of the
head's angles rotate) and, on full layers, their own head_dim / kv heads (`per_layer_config`,
else `global_head_dim` / `num_global_key_value_heads`) and with `attention_k_eq_v` values
taken from the key projection; the last `num_kv_shared_layers` layers reuse the cache of the
last earlier layer of their type. Norms are plain RMSNorm (x * w, Gemma4RMSNorm), sandwiched:
the attention output is normed before the residual; the FFN is a dense GELU-tanh MLP on
pre_feedforward_layernorm(x) beside the routed experts on pre_feedforward_layernorm_2(x),
each output normed, their sum normed again (Gemma4TextDecoderLayer). The router scores
RMSNorm(x) * scale / sqrt(hidden_size), softmax, top-k, renormalised, times
per_expert_scale (Gemma4TextRouter). Per-layer input embeddings (hidden_size_per_layer_input)
and the layer's `layer_scalar` close the layer. Embeddings are scaled by sqrt(hidden_size);
logits soft-capped by final_logit_softcapping. Experts are stored fused at
`model.layers.L.experts`, gate_up_proj [E, 2*I, H] (gate rows first) and down_proj [E, H, I].
"""

from __future__ import annotations

import dataclasses
from typing import Any

from colibri.compute.moe import RouterSpec
from colibri.compute.rope import inv_freq
from colibri.models.family import ExpertNames, Family
from colibri.models.spec import (
    AttentionSpec,
    LayerSpec,
    ModelSpec,
    MoESpec,
    PerLayerInputSpec,
    attention_names,
    base_spec,
    get,
    mlp_names,
    require,
)

# Gemma4TextConfig.__post_init__'s rope_parameters when the config has none
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}
GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig.__post_init__'s default global_head_dim
TYPES = ("sliding_attention", "full_attention")


def layer_types(config: dict[str, Any]) -> list[str]:
    """layer_types as Gemma4TextConfig.__post_init__ makes them: 5 sliding to 1 full when
    absent, the last layer always full."""
    n = require(config, "num_hidden_layers")
    types = list(get(config, "layer_types") or [])
    if not types:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"config.json: layer_types needs num_hidden_layers={n} entries")
    for i, t in enumerate(types):
        if t not in TYPES:
            raise ValueError(f"config.json: layer_types[{i}] = {t!r} is not supported")
    types[-1] = "full_attention"
    return types


def _per_layer(config: dict[str, Any], types: list[str]) -> list[dict[str, Any]]:
    """Per layer {"head_dim", "num_key_value_heads"}: `per_layer_config` (as transformers
    saves it, keyed by layer index) over the top-level values; without it full layers take
    global_head_dim and, with attention_k_eq_v, num_global_key_value_heads (__post_init__)."""
    head_dim, kv = require(config, "head_dim"), require(config, "num_key_value_heads")
    given = get(config, "per_layer_config")
    out = []
    for i, t in enumerate(types):
        if isinstance(given, dict):
            over = given.get(str(i), given.get(i)) or {}
        elif t == "full_attention":
            over = {"head_dim": get(config, "global_head_dim", default=GLOBAL_HEAD_DIM)}
            glob = get(config, "num_global_key_value_heads")
            if glob is not None and get(config, "attention_k_eq_v", default=False):
                over["num_key_value_heads"] = glob
        else:
            over = {}
        bad = set(over) - {"head_dim", "num_key_value_heads"}
        if bad:
            raise ValueError(f"config.json: per_layer_config[{i}] sets {sorted(bad)}: unsupported")
        out.append({"head_dim": head_dim, "num_key_value_heads": kv, **over})
    return out


def _rope(config: dict[str, Any], layer_type: str, head_dim: int) -> Any:
    params = (get(config, "rope_parameters") or DEFAULT_ROPE).get(layer_type)
    if not isinstance(params, dict):
        raise ValueError(f"config.json: rope_parameters[{layer_type!r}] is missing")
    params = {"rope_type": "default", **params}
    kind = params["rope_type"]
    if kind not in ("default", "proportional") and params.get("partial_rotary_factor", 1) != 1:
        raise ValueError(
            f"config.json: rope_parameters[{layer_type!r}]: partial_rotary_factor with "
            f"rope_type {kind!r} is not supported"
        )
    return inv_freq(params, head_dim, get(config, "max_position_embeddings", default=131072))


def kv_sources(config: dict[str, Any], types: list[str]) -> list[int | None]:
    """Per layer, the earlier layer whose keys and values it reuses (None: its own), as
    Gemma4TextConfig.kv_sharing_modes: the last num_kv_shared_layers layers reuse the last
    non-shared layer of their layer type."""
    n, shared = len(types), int(get(config, "num_kv_shared_layers", default=0) or 0)
    first = n - shared
    if shared < 0 or first < 1:
        raise ValueError(f"config.json: num_kv_shared_layers={shared} of {n} layers")
    out: list[int | None] = [None] * n
    for i in range(first, n):
        src = [j for j in range(first) if types[j] == types[i]]
        if not src:
            raise ValueError(
                f"config.json: num_kv_shared_layers={shared}: layer {i} ({types[i]}) has no "
                "earlier layer of its type to share"
            )
        out[i] = src[-1]
    return out


def model_spec(config: dict[str, Any]) -> ModelSpec:
    if not get(config, "enable_moe_block", default=False):
        raise ValueError(
            "config.json: enable_moe_block is false: a dense Gemma 4 has no experts to stream "
            "(only the MoE model is supported)"
        )
    if get(config, "use_bidirectional_attention") == "all":
        raise ValueError("config.json: use_bidirectional_attention='all' is not supported")
    act = get(config, "hidden_activation")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"config.json: hidden_activation={act!r} is not supported")
    d = require(config, "hidden_size")
    n_heads = require(config, "num_attention_heads")
    types = layer_types(config)
    per = _per_layer(config, types)
    sources = kv_sources(config, types)
    k_eq_v = bool(get(config, "attention_k_eq_v", default=False))
    window = require(config, "sliding_window")
    biases = frozenset("qkvo") if get(config, "attention_bias", default=False) else frozenset()
    ff = require(config, "intermediate_size")
    double = bool(get(config, "use_double_wide_mlp", default=False))
    ple = get(config, "hidden_size_per_layer_input") or 0
    if ple and require(config, "vocab_size_per_layer_input") < require(config, "vocab_size"):
        raise ValueError(  # transformers would index past the per-layer table
            "config.json: vocab_size_per_layer_input is below vocab_size: token ids past it "
            "have no per-layer input embedding"
        )
    layers = []
    for i, t in enumerate(types):
        p = f"model.layers.{i}"
        hd, kv = per[i]["head_dim"], per[i]["num_key_value_heads"]
        freq, mscale = _rope(config, t, hd)
        src = sources[i]
        if src is not None and (per[src]["head_dim"], per[src]["num_key_value_heads"]) != (hd, kv):
            raise ValueError(f"config.json: layer {i} shares layer {src}'s cache of other shape")
        attn = AttentionSpec(
            n_heads=n_heads,
            n_kv_heads=kv,
            head_dim=hd,
            v_head_dim=hd,
            rot_dim=hd,  # "proportional": the unrotated pairs have frequency 0
            rope_mode="neox",
            inv_freq=freq,
            mscale=mscale,
            scale=1.0,  # Gemma4TextAttention.scaling (q_norm / k_norm set the scale)
            window=window if t == "sliding_attention" else 0,
            qk_norm="head",
            v_norm=True,
            k_eq_v=k_eq_v and t == "full_attention",
            kv_shared_from=src,
            kv_ring=t == "sliding_attention",
        )
        names = attention_names(p, qk_norm=True) | mlp_names(f"{p}.mlp")
        names |= {
            "attn_post_norm": f"{p}.post_attention_layernorm",
            "post_norm": f"{p}.pre_feedforward_layernorm",
            "router": f"{p}.router.proj",
            "router_scale": f"{p}.router.scale",
            "per_expert_scale": f"{p}.router.per_expert_scale",
            "expert_norm": f"{p}.pre_feedforward_layernorm_2",
            "mlp_post_norm": f"{p}.post_feedforward_layernorm_1",
            "expert_post_norm": f"{p}.post_feedforward_layernorm_2",
            "ffn_post_norm": f"{p}.post_feedforward_layernorm",
            "layer_scalar": f"{p}.layer_scalar",
        }
        if ple:
            names |= {
                "ple_gate": f"{p}.per_layer_input_gate",
                "ple_proj": f"{p}.per_layer_projection",
                "ple_post_norm": f"{p}.post_per_layer_input_norm",
            }
        if src is not None:
            for role in ("k", "v", "k_norm"):
                names.pop(role)
        elif attn.k_eq_v:
            names.pop("v")
        mlp_ff = ff * (2 if double and src is not None else 1)
        layers.append(LayerSpec(i, attn, True, names, mlp_d_ff=mlp_ff, biases=biases))
    router = RouterSpec(
        num_experts=require(config, "num_experts"),
        top_k=require(config, "top_k_experts"),
        scoring="softmax",
        norm_topk_prob=True,
    )
    moe = MoESpec(router=router, d_ff=require(config, "moe_intermediate_size"), act="gelu")
    spec = base_spec(config, layers, moe, config.get("model_type") or "gemma4_text")
    cap = get(config, "final_logit_softcapping")
    return dataclasses.replace(
        spec,
        embed_scale=float(d**0.5),
        final_logit_softcapping=None if cap is None else float(cap),
        dense_act="gelu",
        per_layer_input=PerLayerInputSpec(
            hidden_size_per_layer_input=ple,
            vocab_size_per_layer_input=require(config, "vocab_size_per_layer_input"),
        )
        if ple
        else None,
    )


DEFAULTS = {  # Gemma4TextConfig
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "sliding_window": 512,
    "final_logit_softcapping": None,
    "use_bidirectional_attention": None,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "num_experts": None,
    "top_k_experts": None,
    "moe_intermediate_size": None,
}

EXPERTS = ExpertNames(per_expert=None, fused="model.layers.{layer}.experts")

# tiny cases: sliding window 8 below the 32-token prompt; full layers with their own head_dim
# and kv heads (k_eq_v) and proportional RoPE; the last two layers share the earlier caches
TINY = dict(
    # weights of 0.08 (COMMON) make the 4-layer sandwich-normed model chaotic: q8_0-sized
    # weight noise flips its routing and moves its own output by KL ~1e-2
    initializer_range=0.05,
    num_hidden_layers=4,
    head_dim=16,
    intermediate_size=48,
    enable_moe_block=True,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=32,
    hidden_size_per_layer_input=32,
    vocab_size_per_layer_input=160,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    num_kv_shared_layers=2,
    final_logit_softcapping=30.0,
    use_double_wide_mlp=True,  # the shared layers' MLP is twice as wide
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

FAMILY = Family(
    model_type="gemma4_text",
    model_spec=model_spec,
    defaults=DEFAULTS,
    num_experts_key="num_experts",
    d_ff_key="moe_intermediate_size",
    experts=EXPERTS,
    test_configs={
        "gemma4_text": TINY,
        # no PLE, no sharing, separate v_proj, attention biases, tied embeddings, the default
        # layer_types (sliding; the last layer forced full). 3 layers: deeper tiny models are
        # chaotic (q8_0-sized noise on the weights moves transformers' own output by KL ~0.1
        # at 6 layers with top-1 routing)
        "gemma4_text_plain": TINY
        | dict(
            num_hidden_layers=3,
            layer_types=None,
            hidden_size_per_layer_input=0,
            attention_k_eq_v=False,
            num_global_key_value_heads=None,
            num_kv_shared_layers=0,
            attention_bias=True,
            final_logit_softcapping=None,
            tie_word_embeddings=True,
        ),
    },
)
