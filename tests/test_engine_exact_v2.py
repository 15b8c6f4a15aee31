"""DeepSeek-V2, DeepSeek-V3, GLM-4.5 MoE and gpt-oss against transformers (issue 6).

The engine standard (f32 logits and greedy tokens, quantized storage) runs for these families'
cases in test_engine_exact.py. Here: the one routing implementation against the transformers
routers over many group settings, the compressed MLA KV cache, MLA rope and softmax scale,
and the same tokens whatever the placement (prefetch included, which predicts with the next
layer's router, correction bias and groups included).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from colibri.compute import moe
from colibri.model import KVCache
from colibri.registry import model_spec
from tests import hf_models

torch, transformers = hf_models.torch, hf_models.transformers
_run = hf_models.engine_greedy

_ROUTERS = {  # config class -> (modeling module, router class)
    "DeepseekV2Config": ("deepseek_v2", "DeepseekV2TopkRouter"),
    "DeepseekV3Config": ("deepseek_v3", "DeepseekV3TopkRouter"),
    "Glm4MoeConfig": ("glm4_moe", "Glm4MoeTopkRouter"),
    "GptOssConfig": ("gpt_oss", "GptOssTopKRouter"),
    "DeepseekV4Config": ("deepseek_v4", "DeepseekV4TopKRouter"),
}


def _hf_router(cls_name: str, **cfg):
    """(config, transformers router module) with random weights and correction bias."""
    config = getattr(transformers, cls_name)(hidden_size=32, num_attention_heads=4, **cfg)
    mod_name, router_cls = _ROUTERS[cls_name]
    modeling = importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}")
    router = getattr(modeling, router_cls)(config)
    gen = torch.Generator().manual_seed(len(str(cfg)))
    with torch.no_grad():
        for _, p in router.named_parameters():  # logits of order 1
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        for _, b in router.named_buffers():  # e_score_correction_bias, both signs
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return config, router


ROUTER_CASES = [
    ("DeepseekV2Config", dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="greedy")),
    *[
        (
            "DeepseekV2Config",
            dict(
                n_routed_experts=16,
                num_experts_per_tok=k,
                topk_method="group_limited_greedy",
                n_group=g,
                topk_group=t,
                routed_scaling_factor=1.7,
            ),
        )
        for g, t, k in [(4, 1, 3), (4, 2, 4), (8, 3, 5), (4, 4, 2)]
    ],
    *[
        (
            cls,
            dict(
                n_routed_experts=32,
                num_experts_per_tok=k,
                n_group=g,
                topk_group=t,
                norm_topk_prob=norm,
                routed_scaling_factor=2.5,
            ),
        )
        for cls in ("DeepseekV3Config", "Glm4MoeConfig")
        for g, t, k, norm in [(1, 1, 4, True), (8, 4, 8, True), (4, 1, 3, False), (8, 2, 6, True)]
    ],
    ("GptOssConfig", dict(num_local_experts=16, num_experts_per_tok=4)),
    *[
        ("DeepseekV4Config", dict(n_routed_experts=32, num_experts_per_tok=k, scoring_func=f))
        for f, k in [("sqrtsoftplus", 6), ("sqrtsoftplus", 2), ("sigmoid", 4)]
    ],
]


@pytest.mark.parametrize(("cls_name", "cfg"), ROUTER_CASES, ids=lambda x: str(x))
def test_route_matches_transformers_router(cls_name, cfg):
    """moe.route on the router's logits picks the experts transformers picks, with the same
    weights, for every group setting (topk_group < n_group included) and a random correction
    bias; tokens whose cuts are within 1e-5 are not compared (order of f32 rounding)."""
    config, router = _hf_router(cls_name, **cfg)
    spec = model_spec(config.to_dict()).moe.router
    x = torch.randn(512, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, weights, ids = router(x)
    bias = getattr(router, "e_score_correction_bias", None)
    ours_ids, ours_w = moe.route(
        spec, logits.numpy(), None if bias is None else bias.numpy().astype(np.float32)
    )
    hf_models.assert_routes_match(
        ids, weights, ours_ids, ours_w, hf_models.router_margins(router, logits)
    )


def test_mla_kv_cache_holds_the_latent():
    """MLA layers cache kv_lora_rank + qk_rope_head_dim per position, one array for k and v."""
    config = hf_models.config("deepseek_v3").to_dict()
    spec = model_spec(config)
    kv = KVCache.allocate(spec, 100)
    width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert all(k is v and k.shape == (100, 1, width) for k, v in zip(kv.k, kv.v, strict=True))
    assert kv.nbytes == config["num_hidden_layers"] * 100 * width * 4


@pytest.mark.parametrize("case", ["deepseek_v3", "gpt_oss", "deepseek_v4"])
async def test_same_tokens_whatever_the_placement(case, tmp_path):
    """Reader backends x budgets (one layer's top-k, everything) x prefetch on/off give the
    same greedy tokens; the small budget really evicts and re-reads."""
    await hf_models.assert_same_tokens_whatever_the_placement(case, tmp_path)


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="default", rope_theta=1e4),
        dict(rope_type="yarn", rope_theta=1e4, factor=40.0, original_max_position_embeddings=64),
        dict(rope_type="yarn", rope_theta=1e4, factor=40.0, original_max_position_embeddings=64)
        | dict(mscale=1.0, mscale_all_dim=0.8, beta_fast=16, beta_slow=2),
    ],
    ids=["default", "yarn", "yarn_mscale_all_dim"],
)
def test_mla_rope_and_softmax_scale_match_transformers(rope):
    """inv_freq, the cos/sin scale (YaRN attention factor) and the softmax scale with the
    mscale_all_dim correction are transformers' DeepseekV3RotaryEmbedding / Attention's."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    config = hf_models.config("deepseek_v3", rope_parameters=rope)
    a = model_spec(config.to_dict()).layers[0].attention
    emb = ds.DeepseekV3RotaryEmbedding(config)
    np.testing.assert_array_equal(a.inv_freq, emb.inv_freq.numpy())
    assert a.mscale == pytest.approx(emb.attention_scaling, rel=1e-12)
    assert a.scale == pytest.approx(ds.DeepseekV3Attention(config, 0).scaling, rel=1e-12)
