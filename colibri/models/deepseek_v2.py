"""DeepSeek-V2 (DeepseekV2ForCausalLM): multi-head latent attention with interleaved RoPE,
softmax router with greedy or group-limited greedy choice (group score = its best expert) and
`routed_scaling_factor`; `norm_topk_prob` is ignored, as in transformers' DeepseekV2TopkRouter.
Shared experts (n_shared_experts x moe_intermediate_size, no gate) and the first
`first_k_dense_replace` layers dense."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from colibri.compute.moe import RouterSpec
from colibri.models.spec import (
    AttentionSpec,
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


def num_experts(config: dict[str, Any]) -> int:
    return require(config, "n_routed_experts", "num_local_experts", "num_experts")


def ffn_names(config: dict[str, Any], i: int) -> tuple[bool, dict[str, str]]:
    """(routed?, FFN tensor names) of layer i in the DeepSeek layout (also GLM-4.5's): layers
    below first_k_dense_replace are dense MLPs; the others have a router (`mlp.gate`) and,
    when n_shared_experts > 0, ungated shared experts (`mlp.shared_experts`)."""
    p = f"model.layers.{i}.mlp"
    if i < get(config, "first_k_dense_replace", default=0):
        return False, mlp_names(p)
    names = {"router": f"{p}.gate"}
    if get(config, "n_shared_experts", default=0):
        names |= mlp_names(f"{p}.shared_experts", "shared")
    return True, names


def layers_of(
    config: dict[str, Any],
    attn: AttentionSpec,
    attn_names: Callable[[str], dict[str, str]],
    correction_bias: bool,
) -> list[LayerSpec]:
    """The layers of a DeepSeek-layout model: attn_names(prefix) names a layer's attention;
    with correction_bias, routed layers also name `mlp.gate.e_score_correction_bias`."""
    layers = []
    for i in range(require(config, "num_hidden_layers")):
        sparse, names = ffn_names(config, i)
        if sparse and correction_bias:
            names["correction_bias"] = f"{names['router']}.e_score_correction_bias"
        layers.append(LayerSpec(i, attn, sparse, attn_names(f"model.layers.{i}") | names))
    return layers


def model_spec(config: dict[str, Any]) -> ModelSpec:
    method = get(config, "topk_method", default="greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"config field topk_method: unsupported value {method!r}")
    grouped = method == "group_limited_greedy"
    router = RouterSpec(
        num_experts=num_experts(config),
        top_k=require(config, "num_experts_per_tok"),
        scoring="softmax",
        norm_topk_prob=False,  # DeepseekV2TopkRouter never renormalises
        n_group=require(config, "n_group") if grouped else 1,
        topk_group=require(config, "topk_group") if grouped else 1,
        group_score="max",
        routed_scaling_factor=float(get(config, "routed_scaling_factor", default=1.0)),
    )
    q_lora = get(config, "q_lora_rank") is not None
    layers = layers_of(
        config, mla_attention(config, "interleaved"), lambda p: mla_names(p, q_lora), False
    )
    moe = MoESpec(router=router, d_ff=require(config, "moe_intermediate_size"))
    return base_spec(config, layers, moe, "deepseek_v2")
