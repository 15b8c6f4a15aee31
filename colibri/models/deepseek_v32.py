"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3 (MLA with interleaved RoPE, the sigmoid
router with `e_score_correction_bias` and group-limited choice, shared experts) plus DeepSeek
Sparse Attention: every layer's "lightning indexer" scores the past tokens and attention runs
over the `index_topk` best only (spec.IndexerSpec; the indexer's RoPE is half-split "neox").
Dense vs routed layers follow `mlp_layer_types` (default: `first_k_dense_replace` dense).
q_lora_rank is required (transformers dropped the formulation without it). The reference
indexer's Hadamard rotation and FP8 scoring are skipped, as transformers does: scores are f32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from colibri.models import deepseek_v3
from colibri.models.deepseek_v2 import TINY_MLA, mla_biases
from colibri.models.deepseek_v3 import TINY_GROUPED_ROUTER, TINY_PLAIN_ROUTER, sigmoid_router
from colibri.models.family import Family
from colibri.models.spec import (
    AttentionSpec,
    IndexerSpec,
    LayerSpec,
    ModelSpec,
    MoESpec,
    base_spec,
    get,
    mla_attention,
    mla_names,
    mlp_names,
    require,
)


def mlp_layer_types(config: dict[str, Any]) -> list[str]:
    """`mlp_layer_types` ("dense" / "sparse" per layer) as DeepseekV32Config resolves it: the
    given list, else `first_k_dense_replace` dense layers then sparse ones."""
    n = require(config, "num_hidden_layers")
    types = config.get("mlp_layer_types")
    if types is None:
        n_dense = min(get(config, "first_k_dense_replace", default=0), n)
        return ["dense"] * n_dense + ["sparse"] * (n - n_dense)
    if not isinstance(types, list) or len(types) < n or set(types) - {"dense", "sparse"}:
        raise ValueError(
            f"config field mlp_layer_types: must list 'dense' or 'sparse' for each of the {n} "
            f"layers, got {types!r}"
        )
    return list(types[:n])  # transformers reads entry i of layer i: a longer list is fine


def dsa_layers(
    config: dict[str, Any],
    indexer_rope: Literal["neox", "interleaved"],
    shared: list[bool] | None = None,
) -> list[LayerSpec]:
    """The layers of a DSA model: MLA attention with an indexer (`shared[i]`: layer i reuses
    the previous full layer's selection and has no indexer tensors), FFNs per
    `mlp_layer_types` in the DeepSeek layout (mlp.gate router with e_score_correction_bias,
    mlp.shared_experts when n_shared_experts; dense layers mlp.{gate,up,down}_proj)."""
    if get(config, "q_lora_rank") is None:
        raise ValueError("config field q_lora_rank: required (the DSA indexer reads q_a)")
    n = require(config, "num_hidden_layers")
    base = mla_attention(config, "interleaved")
    attn: dict[bool, AttentionSpec] = {}
    for s in (False, True):
        index = IndexerSpec(
            index_n_heads=require(config, "index_n_heads"),
            index_head_dim=require(config, "index_head_dim"),
            index_topk=require(config, "index_topk"),
            rope_mode=indexer_rope,
            shared=s,
        )
        if index.index_head_dim < base.rot_dim:
            raise ValueError(
                f"config field index_head_dim: {index.index_head_dim} is smaller than "
                f"qk_rope_head_dim {base.rot_dim}"
            )
        attn[s] = dataclasses.replace(base, indexer=index)
    shared = shared or [False] * n
    shared_ff = require(config, "moe_intermediate_size") * (
        get(config, "n_shared_experts", default=0) or 0
    )
    layers = []
    for i, kind in enumerate(mlp_layer_types(config)):
        prefix = f"model.layers.{i}"
        names = mla_names(prefix, True)
        biases = mla_biases(config)
        if not shared[i]:
            x = f"{prefix}.self_attn.indexer"
            names |= {f"idx_{t}": f"{x}.{t}" for t in ("wq_b", "wk", "k_norm", "weights_proj")}
            biases |= {"idx_k_norm"}
        p = f"{prefix}.mlp"
        if kind == "sparse":
            names |= {"router": f"{p}.gate", "correction_bias": f"{p}.gate.e_score_correction_bias"}
            if shared_ff:
                names |= mlp_names(f"{p}.shared_experts", "shared")
            layers.append(LayerSpec(i, attn[shared[i]], True, names, shared_d_ff=shared_ff,
                                    biases=biases))  # fmt: skip
        else:
            names |= mlp_names(p)
            ff = require(config, "intermediate_size")
            layers.append(LayerSpec(i, attn[shared[i]], False, names, mlp_d_ff=ff, biases=biases))
    return layers


def model_spec(config: dict[str, Any]) -> ModelSpec:
    layers = dsa_layers(config, "neox")
    moe = MoESpec(router=sigmoid_router(config), d_ff=require(config, "moe_intermediate_size"))
    return base_spec(config, layers, moe, "deepseek_v32")


# the indexer: 32 heads (an exact 0 score, every head relu-ed out, ties at the cut; torch.topk
# breaks ties its own way) of 16 dims (>= qk_rope_head_dim 8), top-12 of a 64-token test run
TINY_DSA = TINY_MLA | dict(q_lora_rank=48, index_n_heads=32, index_head_dim=16, index_topk=12)

FAMILY = Family(
    model_type="deepseek_v32",
    model_spec=model_spec,
    defaults={  # DeepseekV32Config: DeepseekV3Config's (no rope_interleave) and the indexer's
        **{k: v for k, v in deepseek_v3.FAMILY.defaults.items() if k != "rope_interleave"},
        "max_position_embeddings": 163840,
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": 64,
    },
    aliases={"num_local_experts": "n_routed_experts"},
    num_experts_key="n_routed_experts",
    d_ff_key="moe_intermediate_size",
    test_configs={
        "deepseek_v32": TINY_DSA | TINY_GROUPED_ROUTER | dict(index_topk=24),
        "deepseek_v32_mlp_types_bias": TINY_DSA
        | TINY_PLAIN_ROUTER
        | dict(mlp_layer_types=["sparse", "dense", "sparse"], attention_bias=True, index_topk=12),
    },
)
