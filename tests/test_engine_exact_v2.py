"""DeepSeek-V2, DeepSeek-V3, GLM-4.5 MoE and gpt-oss against transformers (issue 6).

The engine standard (test_engine_exact.py) per case of hf_models.EXTRA_CONFIGS: f32 storage
gives logits within 1e-4 of their scale and the same 32 greedy tokens; q8_0 / q4_0 stay close.
Plus: the one routing implementation against the transformers routers over many group
settings, the compressed MLA KV cache, routers/biases/norms kept f32 under any storage
quantization, and the same tokens whatever the placement (prefetch included, which predicts
with the next layer's router, correction bias and groups included).
"""

from __future__ import annotations

import asyncio
import importlib
import itertools

import numpy as np
import pytest

from colibri.compute import moe
from colibri.convert import convert
from colibri.engine import open_engine
from colibri.io.format import open_store
from colibri.model import KVCache
from colibri.registry import model_spec
from tests import hf_models

torch, transformers = hf_models.torch, hf_models.transformers

LOGIT_RTOL = 1e-4  # |ours - hf| <= LOGIT_RTOL * max|hf| (f32 storage)
MIN_GAP = 1e-4  # skip prompts whose routing cuts or argmax gap are below this
PROMPT_LEN, NEW_TOKENS = 32, 32
# Quantized storage: mean KL(float || quant) per token as test_engine_exact.py, and top-1
# agreement with the float run counted where the float top-1 leads by at least DECISIVE logits.
# The tiny random models have flat outputs (top-2 gaps of ~0.01 logits are common), and with
# sigmoid routing, routed_scaling_factor 2.5 and q4_0 experts, flips there are expected while KL
# stays ~1e-3; at a decisive position a flip means a real error. By (storage, activations):
# Q8_0 activations (the default) add an error of q8_0 weights' size to every matmul input, so
# q8_0 storage with them gets twice the KL bound and q4_0's decisive margin.
QUANT_BOUNDS = {
    ("q8_0", "f32"): (5e-3, 0.90),
    ("q8_0", "q8_0"): (1e-2, 0.90),
    ("q4_0", "f32"): (5e-2, 0.80),
    ("q4_0", "q8_0"): (5e-2, 0.80),
}
DECISIVE = {("q8_0", "f32"): 0.05, ("q8_0", "q8_0"): 0.1, ("q4_0", "f32"): 0.1,
            ("q4_0", "q8_0"): 0.1}  # fmt: skip


def _prompt(model, seed: int) -> list[int] | None:
    return hf_models.find_prompt(model, seed, PROMPT_LEN, NEW_TOKENS, MIN_GAP)


_run = hf_models.engine_greedy


@pytest.fixture(scope="module", params=sorted(hf_models.EXTRA_CONFIGS))
def hf_pair(request, tmp_path_factory):
    """(case, model, checkpoint dir, prompt, f32 store, our greedy tokens and logits there)."""
    case = request.param
    model = hf_models.build(case, seed=3)
    root = tmp_path_factory.mktemp(case)
    src = hf_models.save(model, root / "hf")
    ids = _prompt(model, seed=5)
    if ids is None:
        pytest.skip(f"{case}: no prompt without a near-tie in 8 tries")
    store = root / "f32"
    convert(src, store, quant="f32", dense_quant="f32")
    tokens, logits = asyncio.run(_run(store, ids, NEW_TOKENS))  # prefetch on (the default)
    return case, model, src, ids, store, tokens, logits


def test_f32_matches_transformers(hf_pair):
    case, model, _src, ids, _store, tokens, logits = hf_pair
    expected = hf_models.greedy(model, ids, NEW_TOKENS)
    assert tokens == expected, case
    ref = hf_models.reference_logits(model, ids + expected)[PROMPT_LEN - 1 : -1]
    scale = np.abs(ref).max()
    err = np.abs(logits - ref).max()
    assert err <= LOGIT_RTOL * scale, f"{case}: max err {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize(("quant", "activations"), sorted(QUANT_BOUNDS))
async def test_quantized_close_to_float(hf_pair, tmp_path, quant, activations):
    case, _model, src, ids, _store, tokens, ref_logits = hf_pair
    q_store = tmp_path / quant
    convert(src, q_store, quant=quant, dense_quant="q8_0")
    # teacher-forced on the float run's tokens
    async with open_engine(q_store, activations=activations) as engine:
        seq = engine.new_sequence()
        q_logits = [await engine.forward(seq, ids)]
        for tok in tokens[:-1]:
            q_logits.append(await engine.forward(seq, [tok]))
    q, p = np.stack(q_logits).astype(np.float64), ref_logits.astype(np.float64)
    logp = p - np.logaddexp.reduce(p, axis=1, keepdims=True)
    logq = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
    kl = float((np.exp(logp) * (logp - logq)).sum(axis=1).mean())
    agree = p.argmax(1) == q.argmax(1)
    top2 = np.sort(p, axis=1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] >= DECISIVE[quant, activations]
    top1 = float(agree[decisive].mean())
    max_kl, min_top1 = QUANT_BOUNDS[quant, activations]
    print(
        f"{case} {quant}/{activations}: mean KL {kl:.2e}, top-1 agreement "
        f"{agree.mean():.3f} (all), {top1:.3f} ({decisive.sum()} decisive positions)"
    )
    assert decisive.sum() >= len(p) // 4, "too few decisive positions to judge top-1"
    assert kl <= max_kl and top1 >= min_top1, (case, quant, activations, kl, top1)

    # routers, correction biases, norms, sinks and biases stay f32 whatever the quantization
    s = open_store(q_store)
    kept = [
        name
        for name in s.dense_names()
        if name.endswith(("norm.weight", "e_score_correction_bias", ".bias", ".sinks"))
        or name.endswith((".mlp.gate.weight", ".mlp.router.weight"))
    ]
    assert any("gate" in n or "router" in n for n in kept)
    for name in kept:
        assert s.dense(name)[1] == "f32", name


_ROUTERS = {  # config class -> (modeling module, router class)
    "DeepseekV2Config": ("deepseek_v2", "DeepseekV2TopkRouter"),
    "DeepseekV3Config": ("deepseek_v3", "DeepseekV3TopkRouter"),
    "Glm4MoeConfig": ("glm4_moe", "Glm4MoeTopkRouter"),
    "GptOssConfig": ("gpt_oss", "GptOssTopKRouter"),
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
    margins = hf_models.router_margins(router, logits)
    compared = 0
    for t in np.flatnonzero(margins.numpy() >= 1e-5):
        ref = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        got = dict(zip(ours_ids[t].tolist(), ours_w[t].tolist(), strict=True))
        assert set(got) == set(ref), (t, got, ref)
        for e, wt in ref.items():
            assert abs(got[e] - wt) <= 1e-6 * max(1.0, abs(wt)), (t, e, got[e], wt)
        compared += 1
    assert compared >= 400


def test_mla_kv_cache_holds_the_latent():
    """MLA layers cache kv_lora_rank + qk_rope_head_dim per position, one array for k and v."""
    config = transformers.DeepseekV3Config(
        **{**hf_models.COMMON, **hf_models.EXTRA_CONFIGS["deepseek_v3"][1]}
    ).to_dict()
    spec = model_spec(config)
    kv = KVCache.allocate(spec, 100)
    width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert all(k is v and k.shape == (100, 1, width) for k, v in zip(kv.k, kv.v, strict=True))
    assert kv.nbytes == config["num_hidden_layers"] * 100 * width * 4


@pytest.mark.parametrize("case", ["deepseek_v3", "gpt_oss"])
async def test_same_tokens_whatever_the_placement(case, tmp_path):
    """Reader backends x budgets (one layer's top-k, everything) x prefetch on/off give the
    same greedy tokens; the small budget really evicts and re-reads."""
    model = hf_models.build(case, seed=7)
    src = hf_models.save(model, tmp_path / "hf")
    store = tmp_path / "store"
    convert(src, store, quant="q4_0", dense_quant="q8_0")
    s = open_store(store)
    record, k = s.layout.record_nbytes, s.config["num_experts_per_tok"]
    total = len(s.records) * record
    ids = list(range(3, 19))
    reference, _ = await _run(store, ids, 12, io="threads", budget=total, prefetch=False)
    for io, budget, prefetch in itertools.product(
        ("uring", "threads", "mmap"), (k * record, total), (False, True)
    ):
        tokens, _ = await _run(store, ids, 12, io=io, budget=budget, prefetch=prefetch, threads=1)
        assert tokens == reference, (case, io, budget, prefetch)


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

    cfg = {**hf_models.COMMON, **hf_models.EXTRA_CONFIGS["deepseek_v3"][1], "rope_parameters": rope}
    config = transformers.DeepseekV3Config(**cfg)
    a = model_spec(config.to_dict()).layers[0].attention
    emb = ds.DeepseekV3RotaryEmbedding(config)
    np.testing.assert_array_equal(a.inv_freq, emb.inv_freq.numpy())
    assert a.mscale == pytest.approx(emb.attention_scaling, rel=1e-12)
    assert a.scale == pytest.approx(ds.DeepseekV3Attention(config, 0).scaling, rel=1e-12)
