"""MiniMax-M2, Llama 4 (text) and Gemma 4 (text, MoE block) against transformers (issue 14).

The engine standard (f32 logits and 32 greedy tokens, quantized storage) runs for these
families' cases in test_engine_exact.py. Here: the routers against transformers' own router
modules, what the specs read from hub-style config.json files, and the same tokens whatever the
placement (reader backend, cache budget, prefetch).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from colibri.compute import moe
from colibri.convert import convert
from colibri.io.format import open_store
from colibri.registry import family, model_spec
from tests import hf_models

torch, transformers = hf_models.torch, hf_models.transformers
_run = hf_models.engine_greedy


@pytest.mark.parametrize(("experts", "k"), [(16, 1), (32, 4), (64, 8)])
def test_minimax_m2_route_matches_transformers_router(experts, k):
    """moe.route on MiniMaxM2TopKRouter's logits, with a random correction bias of both signs,
    picks the experts transformers picks with the same renormalised sigmoid weights."""
    from transformers.models.minimax_m2 import modeling_minimax_m2 as mm

    config = transformers.MiniMaxM2Config(
        hidden_size=32, num_attention_heads=4, num_local_experts=experts, num_experts_per_tok=k
    )
    router = mm.MiniMaxM2TopKRouter(config)
    gen = torch.Generator().manual_seed(experts + k)
    with torch.no_grad():
        router.weight.copy_(0.3 * torch.randn(router.weight.shape, generator=gen))
    bias = 0.2 * torch.randn(experts, generator=gen)
    x = torch.randn(512, 32, generator=gen)
    with torch.no_grad():
        logits, weights, ids = router(x, bias)
    spec = model_spec(config.to_dict()).moe.router
    ours_ids, ours_w = moe.route(spec, logits.numpy(), bias.numpy())
    margins = hf_models.router_margins(router, logits, bias).numpy()
    compared = 0
    for t in np.flatnonzero(margins >= 1e-5):
        ref = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        got = dict(zip(ours_ids[t].tolist(), ours_w[t].tolist(), strict=True))
        assert set(got) == set(ref), (t, got, ref)
        for e, wt in ref.items():
            assert abs(got[e] - wt) <= 1e-6, (t, e, got[e], wt)
        compared += 1
    assert compared >= 400


def test_minimax_m2_hub_config():
    """The hub config.json of MiniMax-M2 spells the rotary part `rotary_dim` (64 of head_dim
    128, rope_theta 5e6): rot_dim 64, the rope frequencies transformers builds, q/k norms over
    the whole projection, hub tensor names."""
    from transformers.models.minimax_m2 import modeling_minimax_m2 as mm

    hub = {
        "model_type": "minimax_m2",
        "architectures": ["MiniMaxM2ForCausalLM"],
        "hidden_size": 3072,
        "head_dim": 128,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "rotary_dim": 64,
        "rope_theta": 5000000,
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 2,
        "intermediate_size": 1536,
        "vocab_size": 200064,
    }
    spec = model_spec(hub)
    a = spec.layers[0].attention
    assert (a.rot_dim, a.qk_norm, a.head_dim) == (64, "full", 128)
    emb = mm.MiniMaxM2RotaryEmbedding(transformers.MiniMaxM2Config(**hub))
    # f32 pow of numpy and torch may differ in the last place at theta 5e6
    np.testing.assert_allclose(a.inv_freq, emb.inv_freq.numpy(), rtol=3e-7)
    shapes = family("minimax_m2").model_spec(family("minimax_m2").resolve_config(hub))
    names = shapes.layers[1].names
    assert names["correction_bias"] == "model.layers.1.block_sparse_moe.e_score_correction_bias"
    assert names["router"] == "model.layers.1.block_sparse_moe.gate"
    r = spec.moe.router
    assert (r.scoring, r.norm_topk_prob, r.n_group, r.routed_scaling_factor) == (
        "sigmoid", True, 1, 1.0,
    )  # fmt: skip


PLACEMENT_CASES = ["minimax_m2"]


@pytest.mark.parametrize("case", PLACEMENT_CASES)
async def test_same_tokens_whatever_the_placement(case, tmp_path):
    """Reader backends x budgets (one layer's top-k, everything) x prefetch on/off give the
    same greedy tokens (prefetch predicts with the next layer's router and correction bias)."""
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
