"""DeepSeek-V4 (DeepseekV4ForCausalLM; transformers 5.24 models/deepseek_v4 is the reference).

Every layer: manifold-constrained hyper-connections around both blocks (spec.HyperConnectionSpec:
`hc_mult` residual streams, Sinkhorn-normalised mixing); shared-KV multi-query attention with
per-head sinks, a sliding window over the last `sliding_window` tokens and, by `layer_types`,
compressed entries (spec.SharedKVSpec / CompressorSpec): `heavily_compressed_attention` (HCA)
sees one pooled entry per `compress_rates[...]` tokens, `compressed_sparse_attention` (CSA) the
top `index_topk` of its overlapping-window entries by a lightning indexer with its own
compressor; the grouped low-rank output projection (o_groups x o_lora_rank). FFN: routed experts
with the clamped SwiGLU (`swiglu_limit`, also on the shared expert) and one shared expert of
`moe_intermediate_size`; the router scores with `scoring_func` (sqrtsoftplus or sigmoid),
`e_score_correction_bias` for choosing only; `hash_moe` layers (`mlp_layer_types`) take their
experts from the checkpoint's `tid2eid[token id]` table. As the reference: the top-k weights are
always renormalised (norm_topk_prob is not read) and scaled by routed_scaling_factor, one shared
expert whatever n_shared_experts says, no dense layers. Multi-token-prediction layers are dropped.

Stored names are the checkpoint's original spelling, which transformers' save_pretrained writes
(`model.layers.L.attn.wq_a`, `...ffn.experts.E.w1`, `head.weight`); `renames` maps
transformers' own module names onto it. The hub checkpoint (deepseek-ai/DeepSeek-V4-Flash,
-Pro) is in the inference repo's spelling, without the `model.` prefix (`layers.L.attn.wq_a`,
`embed.weight`, `norm.weight`, `hc_head_fn`, `mtp.K.*`) and with each quantized linear's scale
as `X.scale`: SOURCE_RENAMES reads it so (transformers 5.24 conversion_mapping "deepseek_v4"
and its FP8 quantizer's `.scale` -> `.weight_scale_inv`; the formats: convert.quantized).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from colibri.compute.moe import RouterSpec
from colibri.compute.rope import inv_freq
from colibri.models.family import ExpertNames, Family
from colibri.models.spec import (
    AttentionSpec,
    CompressorSpec,
    HyperConnectionSpec,
    IndexerSpec,
    LayerSpec,
    ModelSpec,
    MoESpec,
    SharedKVSpec,
    base_spec,
    get,
    require,
)

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_RATIO_TO_TYPE = {0: LAYER_TYPES[0], 4: LAYER_TYPES[1], 128: LAYER_TYPES[2]}  # compress_ratios
DEFAULT_PARTIAL_ROTARY_FACTOR = 64 / 512  # DeepseekV4Config.default_partial_rotary_factor
DEFAULT_NUM_HASH_LAYERS = 3  # DeepseekV4Config.default_num_hash_layers


def layer_types(config: dict[str, Any]) -> list[str]:
    """`layer_types` as DeepseekV4Config resolves it: the list, else the legacy per-layer
    `compress_ratios` (0 / 4 / 128), else two HCA layers then CSA / HCA alternating."""
    n = require(config, "num_hidden_layers")
    types = config.get("layer_types")
    if types is None and config.get("compress_ratios") is not None:
        ratios = config["compress_ratios"]
        bad = [r for r in ratios if r not in _RATIO_TO_TYPE] if isinstance(ratios, list) else 1
        if bad:
            raise ValueError(f"config field compress_ratios: entries must be 0, 4 or 128: {ratios}")
        types = [_RATIO_TO_TYPE[r] for r in ratios]
    if types is None:
        inter = [LAYER_TYPES[1] if i % 2 else LAYER_TYPES[2] for i in range(max(n - 2, 0))]
        types = [LAYER_TYPES[2]] * min(n, 2) + inter
    if not isinstance(types, list) or len(types) < n or set(types[:n]) - set(LAYER_TYPES):
        raise ValueError(
            f"config field layer_types: must give one of {', '.join(LAYER_TYPES)} for each of "
            f"the {n} layers, got {types!r}"
        )
    return list(types[:n])


def mlp_layer_types(config: dict[str, Any]) -> list[str]:
    """`mlp_layer_types` ("hash_moe" / "moe" per layer): the list, else the legacy
    `num_hash_layers` (default 3) hash layers first."""
    n = require(config, "num_hidden_layers")
    types = config.get("mlp_layer_types")
    if types is None:
        n_hash = get(config, "num_hash_layers", default=DEFAULT_NUM_HASH_LAYERS)
        types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    if not isinstance(types, list) or len(types) < n or set(types[:n]) - {"hash_moe", "moe"}:
        raise ValueError(
            f"config field mlp_layer_types: must give 'hash_moe' or 'moe' for each of the {n} "
            f"layers, got {types!r}"
        )
    return list(types[:n])


def compress_rates(config: dict[str, Any]) -> dict[str, int]:
    """`compress_rates` per compressed layer type (legacy compress_rate_csa / _hca fold in)."""
    rates = dict(get(config, "compress_rates", default={}) or {})
    for key, legacy in (
        (LAYER_TYPES[1], "compress_rate_csa"),
        (LAYER_TYPES[2], "compress_rate_hca"),
    ):
        if config.get(legacy) is not None:
            rates[key] = config[legacy]
        rate = rates.get(key)
        if not isinstance(rate, int) or rate < 1:
            raise ValueError(
                f"config field compress_rates[{key!r}]: must be an int >= 1, got {rate!r}"
            )
    return rates


def rope_dicts(config: dict[str, Any], prf: float) -> dict[str, dict[str, Any]]:
    """The "main" (sliding layers) and "compress" (compressed layers, their compressors and
    indexer) RoPE settings as DeepseekV4Config.__post_init__ builds them: given nested, else
    main = plain `rope_theta`, compress = `compress_rope_theta` with the given scaling (YaRN:
    attention_factor 1, the reference does not scale cos/sin)."""
    rp = get(config, "rope_parameters", "rope_scaling", default={}) or {}
    if not isinstance(rp, dict):
        raise ValueError(f"config field rope_parameters: must be an object, got {rp!r}")
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        out = {"main": dict(rp["main"]), "compress": dict(rp["compress"])}
    else:
        scaling = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        theta = get(config, "rope_theta", default=10000.0)
        out = {
            "main": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": prf},
            "compress": {
                **scaling,
                "rope_theta": get(config, "compress_rope_theta", default=160000.0),
                "partial_rotary_factor": prf,
            },
        }
    for params in out.values():
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        params.setdefault("rope_type", "default")
        if params["rope_type"] == "yarn":
            params.setdefault("attention_factor", 1.0)
    return out


def v4_router(config: dict[str, Any]) -> RouterSpec:
    """DeepseekV4TopKRouter as data (the hash layers' weights: the same scores)."""
    scoring = get(config, "scoring_func", default="sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        raise ValueError(
            f"config field scoring_func: {scoring!r} is not supported (sqrtsoftplus, sigmoid)"
        )
    return RouterSpec(
        num_experts=require(config, "n_routed_experts"),
        top_k=require(config, "num_experts_per_tok"),
        scoring=scoring,
        norm_topk_prob=True,  # DeepseekV4TopKRouter / HashRouter always renormalise
        routed_scaling_factor=float(get(config, "routed_scaling_factor", default=1.0)),
        norm_eps=1e-20,
    )


def _names(i: int, kind: str, hashed: bool) -> dict[str, str]:
    p = f"model.layers.{i}"
    a = f"{p}.attn"
    names = {
        "input_norm": f"{p}.attn_norm",
        "post_norm": f"{p}.ffn_norm",
        "q_a": f"{a}.wq_a",
        "q_a_norm": f"{a}.q_norm",
        "q_b": f"{a}.wq_b",
        "kv": f"{a}.wkv",
        "kv_norm": f"{a}.norm",
        "o_a": f"{a}.wo_a",
        "o_b": f"{a}.wo_b",
        "sinks": f"{a}.attn_sink",
        "router": f"{p}.ffn.gate",
        "shared_gate_proj": f"{p}.ffn.shared_experts.w1",
        "shared_up_proj": f"{p}.ffn.shared_experts.w3",
        "shared_down_proj": f"{p}.ffn.shared_experts.w2",
    }
    names |= {
        f"hc_{b}_{t}": f"{p}.hc_{b}_{t}" for b in ("attn", "ffn") for t in ("fn", "base", "scale")
    }
    names |= (
        {"tid2eid": f"{p}.ffn.gate.tid2eid"}
        if hashed
        else {"correction_bias": f"{p}.ffn.gate.bias"}
    )
    comps = {"cmp": f"{a}.compressor"} if kind != "sliding_attention" else {}
    if kind == "compressed_sparse_attention":
        comps["idx_cmp"] = f"{a}.indexer.compressor"
        names |= {"idx_wq_b": f"{a}.indexer.wq_b", "idx_weights_proj": f"{a}.indexer.weights_proj"}
    for pre, c in comps.items():
        names |= {f"{pre}_{t}": f"{c}.{t}" for t in ("wkv", "wgate", "ape", "norm")}
    return names


def model_spec(config: dict[str, Any]) -> ModelSpec:
    n_heads, head_dim = require(config, "num_attention_heads"), require(config, "head_dim")
    if (kv_heads := get(config, "num_key_value_heads", default=1)) != 1:
        raise ValueError(
            f"config field num_key_value_heads: DeepSeek-V4 attention has one shared key/value "
            f"head, got {kv_heads}"
        )
    if (act := get(config, "hidden_act", default="silu")) != "silu":
        raise ValueError(f"config field hidden_act: only silu is supported, got {act!r}")
    if get(config, "mlp_bias", default=False):
        raise ValueError("config field mlp_bias: true is not supported (DeepSeek-V4 has none)")
    prf = float(get(config, "partial_rotary_factor", default=DEFAULT_PARTIAL_ROTARY_FACTOR))
    rot = int(head_dim * prf)
    if rot < 2 or rot % 2:
        raise ValueError(
            f"config field partial_rotary_factor: {prf} gives {rot} rotated dims of head_dim "
            f"{head_dim} (must be even and >= 2)"
        )
    o_groups, o_rank = require(config, "o_groups"), require(config, "o_lora_rank")
    if (n_heads * head_dim) % o_groups:
        raise ValueError(
            f"config field o_groups: {o_groups} does not divide num_attention_heads * head_dim "
            f"= {n_heads * head_dim}"
        )
    hc = HyperConnectionSpec(
        hc_mult=require(config, "hc_mult"),
        hc_sinkhorn_iters=require(config, "hc_sinkhorn_iters"),
        hc_eps=float(require(config, "hc_eps")),
    )
    if hc.hc_mult < 1 or hc.hc_sinkhorn_iters < 1:
        raise ValueError(
            f"config fields hc_mult / hc_sinkhorn_iters: must be >= 1, got {hc.hc_mult} / "
            f"{hc.hc_sinkhorn_iters}"
        )
    eps = float(get(config, "rms_norm_eps", default=1e-6))
    rates = compress_rates(config)
    max_pos = get(config, "max_position_embeddings", default=4096)
    ropes = {k: inv_freq(v, rot, max_pos) for k, v in rope_dicts(config, prf).items()}
    window = require(config, "sliding_window")
    q_rank = require(config, "q_lora_rank")
    index = IndexerSpec(
        index_n_heads=require(config, "index_n_heads"),
        index_head_dim=require(config, "index_head_dim"),
        index_topk=require(config, "index_topk"),
        rope_mode="interleaved",
        norm_eps=eps,
    )
    types = layer_types(config)
    if LAYER_TYPES[1] in types and index.index_head_dim < rot:
        raise ValueError(
            f"config field index_head_dim: {index.index_head_dim} is smaller than the "
            f"{rot} rotated dims"
        )
    layers = []
    for i, (kind, mlp) in enumerate(zip(types, mlp_layer_types(config), strict=True)):
        comp = idx_comp = None
        if kind != LAYER_TYPES[0]:
            comp = CompressorSpec(rates[kind], head_dim, overlap=kind == LAYER_TYPES[1])
        if kind == LAYER_TYPES[1]:
            idx_comp = CompressorSpec(rates[kind], index.index_head_dim, overlap=True)
        freq, mscale = ropes["main" if kind == LAYER_TYPES[0] else "compress"]
        attn = AttentionSpec(
            n_heads=n_heads,
            n_kv_heads=1,
            head_dim=head_dim,
            v_head_dim=head_dim,
            rot_dim=rot,
            rope_mode="interleaved",
            inv_freq=freq,
            mscale=mscale,
            scale=head_dim**-0.5,
            window=window,
            sinks=True,
            indexer=index if kind == LAYER_TYPES[1] else None,
            shared_kv=SharedKVSpec(kind, q_rank, o_groups, o_rank, window, comp, idx_comp, eps),
        )
        hashed = mlp == "hash_moe"
        names = _names(i, kind, hashed)
        ff = require(config, "moe_intermediate_size")
        layers.append(LayerSpec(i, attn, True, names, shared_d_ff=ff, hash_routed=hashed))
    limit = float(require(config, "swiglu_limit"))
    moe = MoESpec(
        router=v4_router(config),
        d_ff=require(config, "moe_intermediate_size"),
        act="silu_clamp",
        limit=limit,
        shared_act="silu_clamp",
    )
    spec = base_spec(config, layers, moe, "deepseek_v4")
    head = spec.lm_head if spec.lm_head == spec.embed else "head"  # the original `head.weight`
    return dataclasses.replace(spec, hc=hc, lm_head=head)


# transformers 5 module names -> the original (stored) spelling, the inverse of its
# conversion_mapping "deepseek_v4" (the original names pass through unchanged)
RENAMES = (
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.kv_norm\.", ".attn.norm."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"^lm_head\.weight$", "head.weight"),
)

# the hub (inference repo) spelling -> the names read (Family.source_renames): transformers
# 5.24 conversion_mapping "deepseek_v4" leaf renames (^embed.weight, ^head.weight, ^hc_head_*)
# under the `model.` prefix its base model adds, and quantizer_finegrained_fp8's
# `(.+).scale` -> `.weight_scale_inv`; the multi-token-prediction module `mtp.K.*` is dropped
# (first, and only on hub names: transformers 5's own layout has `model.layers.L.attn_hc.scale`)
SOURCE_RENAMES = (
    (r"^(?!model\.)(.+)\.scale$", r"\1.weight_scale_inv"),
    (r"^layers\.", "model.layers."),
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^mtp\..*", ""),
)

_TINY = dict(
    num_key_value_heads=1,
    head_dim=32,
    partial_rotary_factor=0.25,  # 8 rotated dims
    q_lora_rank=32,
    moe_intermediate_size=32,
    o_groups=2,
    o_lora_rank=16,
    # 16 index heads: an index score of exactly 0 (every head relu-ed out) stays rare
    index_n_heads=16,
    index_head_dim=16,
    sliding_window=8,
)

FAMILY = Family(
    model_type="deepseek_v4",
    model_spec=model_spec,
    defaults={  # DeepseekV4Config
        "vocab_size": 129280,
        "hidden_size": 4096,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 43,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "q_lora_rank": 1024,
        "num_experts_per_tok": 6,
        "n_routed_experts": 256,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "max_position_embeddings": 1048576,
        "rope_theta": 10000.0,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "compress_rope_theta": 160000.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "swiglu_limit": 10.0,
        "sliding_window": 128,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY_FACTOR,
        "mlp_bias": False,
    },
    aliases={"num_local_experts": "n_routed_experts", "intermediate_size": "moe_intermediate_size"},
    num_experts_key="n_routed_experts",
    d_ff_key="moe_intermediate_size",
    experts=ExpertNames(
        per_expert="model.layers.{layer}.ffn.experts.{expert}.{proj}.weight",
        projs={"gate": "w1", "up": "w3", "down": "w2"},
        fused="model.layers.{layer}.mlp.experts",
    ),
    renames=RENAMES,
    source_renames=SOURCE_RENAMES,
    test_configs={
        # 64-token runs: 8-token window, CSA every 4 tokens (16 entries, the indexer keeps 4),
        # HCA every 8; the clamp at 0.5 cuts a good part of the gate / up pre-activations
        "deepseek_v4": _TINY
        | dict(
            layer_types=list(LAYER_TYPES),
            mlp_layer_types=["hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            index_topk=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            swiglu_limit=0.5,
            hc_mult=4,
        ),
        # sigmoid scoring, YaRN on the compressed layers, two hash layers, 2 streams
        "deepseek_v4_yarn_sigmoid": _TINY
        | dict(
            num_hidden_layers=4,
            layer_types=[LAYER_TYPES[2], LAYER_TYPES[1], LAYER_TYPES[0], LAYER_TYPES[1]],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            index_topk=6,
            n_routed_experts=16,
            num_experts_per_tok=4,
            scoring_func="sigmoid",
            routed_scaling_factor=2.5,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            hc_mult=2,
            hc_sinkhorn_iters=5,
            swiglu_limit=1.0,
        ),
    },
)
