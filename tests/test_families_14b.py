"""MiniMax-M2, Llama 4 (text) and Gemma 4 (text, MoE block) against transformers (issue 14).

The engine standard (f32 logits and 32 greedy tokens, quantized storage) runs for these
families' cases in test_engine_exact.py. Here: the routers against transformers' own router
modules, what the specs read from hub-style config.json files, and the same tokens whatever the
placement (reader backend, cache budget, prefetch).
"""

from __future__ import annotations

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
    margins = hf_models.router_margins(router, logits, bias)
    hf_models.assert_routes_match(ids, weights, ours_ids, ours_w, margins)


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
    await hf_models.assert_same_tokens_whatever_the_placement(case, tmp_path)


PLACEMENT_CASES.append("llama4_text_interleaved_top2")

VISION = dict(  # a tiny Llama4VisionConfig
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=64,
    image_size=28,
    patch_size=14,
    vision_output_dim=32,
    projector_input_dim=32,
    projector_output_dim=32,
)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_hidden_layers": 8, "interleave_moe_layer_step": 2, "no_rope_layer_interval": 3},
        {"num_hidden_layers": 4, "attention_chunk_size": None},
        {"num_hidden_layers": 4, "no_rope_layers": [0, 1, 1, 0], "moe_layers": [0, 2]},
        {"num_hidden_layers": 4, "attn_temperature_tuning": False, "use_qk_norm": False},
    ],
    ids=str,
)
def test_llama4_layer_settings_are_transformers(overrides):
    """Which layers use RoPE, qk norm, chunked attention, temperature tuning and experts is
    what Llama4TextConfig and Llama4TextAttention / DecoderLayer decide."""
    from transformers.models.llama4 import modeling_llama4 as ml

    hf = transformers.Llama4TextConfig(**overrides)
    spec = model_spec({"model_type": "llama4_text", **overrides})
    for i, layer in enumerate(spec.layers):
        a = layer.attention
        attn = ml.Llama4TextAttention(hf, i)
        assert (a.rot_dim > 0) == bool(attn.use_rope), i
        assert (a.qk_norm == "l2") == hasattr(attn, "qk_norm"), i
        chunked = hf.layer_types[i] == "chunked_attention"
        assert a.attention_chunk_size == (hf.attention_chunk_size if chunked else 0), i
        tuned = attn.attn_temperature_tuning and not attn.use_rope
        assert (a.floor_scale, a.attn_scale) == ((8192.0, 0.1) if tuned else (0.0, 0.0)), i
        assert layer.moe == (i in hf.moe_layers), i
        assert a.rope_mode == "interleaved" and a.scale == attn.scaling


def test_llama4_route_matches_transformers_router():
    """moe.route on Llama4Router's logits: the top-k experts and sigmoid of their logits."""
    from transformers.models.llama4 import modeling_llama4 as ml

    for k in (1, 2, 4):
        config = transformers.Llama4TextConfig(
            hidden_size=32, num_local_experts=16, num_experts_per_tok=k
        )
        router = ml.Llama4Router(config)
        gen = torch.Generator().manual_seed(k)
        with torch.no_grad():
            router.weight.copy_(0.3 * torch.randn(router.weight.shape, generator=gen))
            scores, logits = router(torch.randn(512, 32, generator=gen))
        ids, w = moe.route(model_spec(config.to_dict()).moe.router, logits.numpy())
        margins = hf_models.router_margins(router, logits).numpy()
        full = np.zeros((512, 16), np.float32)
        np.put_along_axis(full, ids.astype(np.int64), w, axis=1)
        keep = margins >= 1e-5
        assert keep.sum() >= 400
        np.testing.assert_allclose(full[keep], scores.numpy()[keep], rtol=1e-6, atol=1e-7)


async def test_llama4_multimodal_checkpoint_runs_its_text_model(tmp_path, capsys):
    """A Llama4ForConditionalGeneration checkpoint (model_type llama4, text_config, tensors
    under language_model.*, a vision tower): converts with the vision part dropped and gives
    the tokens and logits of the text model alone."""
    cfg = hf_models.config("llama4_text_interleaved_top2").to_dict()
    torch.manual_seed(0)
    mm = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=cfg, vision_config=VISION)
    ).eval()
    text = hf_models.build("llama4_text_interleaved_top2", seed=4)
    mm.language_model.load_state_dict(text.state_dict())
    src = hf_models.save(mm, tmp_path / "mm")
    store = open_store(convert(src, tmp_path / "store", quant="f32", dense_quant="f32"))
    err = capsys.readouterr().err
    assert "kept the language model only" in err and "vision_model" in err
    assert store.model_type == "llama4"
    ids = list(range(5, 45))  # 40 tokens: five chunks of 8
    tokens, logits = await _run(store.path, ids, 8)
    assert tokens == hf_models.greedy(text, ids, 8)
    ref = hf_models.reference_logits(text, ids + tokens)[len(ids) - 1 : -1]
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("flag", ["apply_router_weight_on_input", "attention_chunk_size"])
async def test_llama4_quirks_matter(flag, tmp_path, monkeypatch):
    """The tiny llama4 case would catch each quirk being dropped: with the router weight
    applied to the output instead of the input, or with full instead of chunked attention,
    the logits leave transformers' by far more than the 1e-4 the exactness test allows."""
    import dataclasses

    from colibri.models import llama4_text

    model = hf_models.build("llama4_text", seed=3)
    src = hf_models.save(model, tmp_path / "hf")
    store = convert(src, tmp_path / "store", quant="f32", dense_quant="f32")
    ids = list(range(7, 39))
    ref = hf_models.reference_logits(model, ids)[-1]
    _, good = await _run(store, ids, 1)
    real = llama4_text.model_spec

    def broken(config):
        spec = real(config)
        if flag == "apply_router_weight_on_input":
            return dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, **{flag: False}))
        layers = [
            dataclasses.replace(
                layer, attention=dataclasses.replace(layer.attention, attention_chunk_size=0)
            )
            for layer in spec.layers
        ]
        return dataclasses.replace(spec, layers=tuple(layers))

    from colibri import registry

    fam = dataclasses.replace(family("llama4_text"), model_spec=broken)
    monkeypatch.setitem(registry.FAMILIES, "llama4_text", fam)
    _, bad = await _run(store, ids, 1)
    scale = np.abs(ref).max()
    assert np.abs(good[0] - ref).max() <= 1e-4 * scale
    assert np.abs(bad[0] - ref).max() > 1e-2 * scale


def test_llama4_scout_rope_is_transformers():
    """Llama-4-Scout's rope settings (llama3 scaling with low_freq_factor == high_freq_factor,
    where the smoothing formula divides by zero and is masked out): transformers' frequencies."""
    from transformers.models.llama4 import modeling_llama4 as ml

    rope = dict(rope_type="llama3", rope_theta=5e5, factor=16.0, low_freq_factor=1.0)
    rope |= dict(high_freq_factor=1.0, original_max_position_embeddings=8192)
    with np.errstate(all="raise"):
        a = model_spec({"model_type": "llama4_text", "rope_parameters": rope}).layers[0].attention
    emb = ml.Llama4TextRotaryEmbedding(transformers.Llama4TextConfig(rope_parameters=rope))
    np.testing.assert_allclose(a.inv_freq, emb.inv_freq.numpy(), rtol=1e-6)
