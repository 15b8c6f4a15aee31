"""The family records (colibri/models/<model_type>.py `FAMILY`) against transformers 5.24:
config defaults and aliases, what registry.model_spec resolves from a config.json that leaves
keys out, every dense tensor name and shape, and the multimodal `text_config` hook."""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from colibri import registry
from colibri.models.spec import dense_tensors
from tests import hf_models

torch, transformers = hf_models.torch, hf_models.transformers

# transformers zeroes a few defaults when the feature is off; their default shows with it on
PROBES = {"sliding_window": {"use_sliding_window": True}}
# keys transformers computes from others when left out (colibri computes them the same way)
# computed by the config class (not defaults): + Llama4TextConfig's no_rope_layers, moe_layers
# Gemma4TextConfig's per_layer_config
COMPUTED = {
    "layer_types", "mlp_layer_types", "indexer_types", "no_rope_layers", "moe_layers",
    "per_layer_config",
}  # fmt: skip
# families whose class default has no experts (Gemma 4: a dense model unless enable_moe_block)
MOE_ON = {
    "gemma4_text": dict(
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=64
    )
}
# spellings of the rope settings; Family.resolve_config folds them into rope_parameters
ROPE_KEYS = {"rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"}


def hf_config(model_type: str, **kw):
    fam = registry.family(model_type)
    return transformers.AutoConfig.for_model(fam.text_model_type or model_type, **kw)


def _value(config, key):
    d = config.to_dict()  # Gemma 4's config raises on per-layer attributes read globally
    return d[key] if key in d else getattr(config, key, None)


@pytest.mark.parametrize("model_type", registry.SUPPORTED)
def test_defaults_and_aliases_are_transformers(model_type):
    """Every default in the family's table is the transformers config class's default, and
    its aliases are the class's attribute_map."""
    fam = registry.family(model_type)
    for key, value in fam.defaults.items():
        got = _value(hf_config(model_type, **PROBES.get(key, {})), key)
        assert got == value, (model_type, key, got, value)
    amap = transformers.CONFIG_MAPPING[fam.text_model_type or model_type].attribute_map
    assert fam.aliases == {k: v for k, v in amap.items() if v in fam.defaults}
    assert fam.num_experts_key not in fam.aliases and fam.d_ff_key in fam.defaults


class _Recorder(dict):
    """A config dict that records the keys read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


@pytest.mark.parametrize("model_type", registry.SUPPORTED)
def test_every_key_read_has_the_transformers_default(model_type):
    """Each key model_spec reads is in the defaults table, or transformers has no such
    field (then absent means None for both), or is computed from others as transformers does."""
    fam = registry.family(model_type)
    given = {"model_type": model_type, "num_experts_per_tok": 2}
    given |= MOE_ON.get(fam.text_model_type or model_type, {})
    cfg = _Recorder(fam.resolve_config(given))
    fam.model_spec(cfg)
    hf = hf_config(model_type)
    for key in cfg.read - set(fam.defaults) - ROPE_KEYS - COMPUTED - {"model_type"}:
        assert _value(hf, key) is None, (model_type, key, _value(hf, key))


def _rotary(model_type: str, config):
    """(inv_freq, attention_scaling) of the family's transformers rotary embedding."""
    model_type = {"llama4_text": "llama4"}.get(model_type, model_type)  # one module for both
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    cls = next(
        getattr(modeling, n) for n in dir(modeling) if n.endswith("RotaryEmbedding") and n[0] != "_"
    )
    emb = cls(config)
    return emb.inv_freq.numpy(), emb.attention_scaling


def _check_v4(spec, hf) -> None:
    """DeepSeek-V4: each layer's RoPE is the rotary's "main" (sliding_attention) or
    "compress" table; every layer has the sliding window; compressors, indexer and hash
    routing follow layer_types, compress_rates and mlp_layer_types; hyper-connections."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    emb = DeepseekV4RotaryEmbedding(hf)
    for i, layer in enumerate(spec.layers):
        a, kind = layer.attention, hf.layer_types[i]
        rope = "main" if kind == "sliding_attention" else "compress"
        np.testing.assert_allclose(a.inv_freq, getattr(emb, f"{rope}_inv_freq").numpy(), rtol=1e-6)
        assert a.mscale == pytest.approx(getattr(emb, f"{rope}_attention_scaling"), rel=1e-9)
        assert a.window == hf.sliding_window and a.shared_kv.layer_type == kind
        c = a.shared_kv.compressor
        assert (c.compress_rate if c else None) == hf.compress_rates.get(kind)
        assert (a.indexer is not None) == (kind == "compressed_sparse_attention")
        assert layer.hash_routed == (hf.mlp_layer_types[i] == "hash_moe")
    assert (spec.hc.hc_mult, spec.hc.hc_sinkhorn_iters) == (hf.hc_mult, hf.hc_sinkhorn_iters)


MINIMAL = [
    {},
    {"rope_theta": 5e5},
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
    {"num_hidden_layers": 5, "first_k_dense_replace": 2, "mlp_only_layers": [1]},
    {"use_sliding_window": True, "max_window_layers": 3, "num_hidden_layers": 4},
]


@pytest.mark.parametrize("minimal", MINIMAL, ids=["empty", "theta", "scaling", "layers", "swa"])
@pytest.mark.parametrize("model_type", registry.SUPPORTED)
def test_spec_resolves_what_transformers_resolves(model_type, minimal):
    """registry.model_spec of a config.json that leaves keys out equals what transformers
    builds from the same dict (AutoConfig.for_model): sizes, top-k, expert count, norm eps,
    tied embeddings, heads, RoPE frequencies and scale, sliding windows, routing settings."""
    fam = registry.family(model_type)
    if (fam.text_model_type or model_type) == "gemma4_text":
        pytest.skip("per-layer-type RoPE and head dims: test_gemma4.py resolves its configs")
    given = {"num_experts_per_tok": 6, **minimal}  # DeepseekV2Config's default is None
    # copies: transformers fills rope dicts in place (glm4_moe's partial_rotary_factor would
    # leak into the next family's case through the shared MINIMAL dict)
    hf = hf_config(model_type, **copy.deepcopy(given))
    spec = registry.model_spec({"model_type": model_type, **copy.deepcopy(given)})
    r = spec.moe.router
    assert (spec.vocab_size, spec.d_model) == (hf.vocab_size, hf.hidden_size)
    assert len(spec.layers) == hf.num_hidden_layers
    assert spec.norm_eps == hf.rms_norm_eps
    assert (spec.lm_head == spec.embed) == bool(hf.tie_word_embeddings)
    assert r.top_k == hf.num_experts_per_tok == 6
    assert r.num_experts == getattr(hf, fam.num_experts_key)
    assert spec.moe.d_ff == getattr(hf, fam.d_ff_key)
    for name in ("norm_topk_prob", "routed_scaling_factor"):
        if model_type != "deepseek_v2" and getattr(hf, name, None) is not None:
            assert getattr(r, name) == getattr(hf, name), name
    if getattr(hf, "topk_method", "noaux_tc") != "greedy" and getattr(hf, "n_group", None):
        assert (r.n_group, r.topk_group) == (hf.n_group, hf.topk_group)
    a = spec.layers[0].attention
    if a.mla is None:
        assert a.n_kv_heads == hf.num_key_value_heads
        assert a.head_dim == (
            getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        )
    else:
        assert a.mla.q_lora_rank == hf.q_lora_rank and a.mla.kv_lora_rank == hf.kv_lora_rank
    # the module of the class that builds it (kimi_k2: deepseek_v3; qwen3_5_moe: its own)
    text = fam.text_model_type
    known = text is not None and importlib.util.find_spec(f"transformers.models.{text}")
    if spec.hc is not None:  # DeepSeek-V4: RoPE, windows, compressors by layer type
        _check_v4(spec, hf)
        types, window = None, 0
    else:
        inv_freq, scaling = _rotary(text if known else model_type, hf)
        np.testing.assert_allclose(a.inv_freq, inv_freq, rtol=1e-6)
        assert a.mscale == pytest.approx(scaling, rel=1e-9)
        # sliding windows: layer_types where the class has them, else Qwen3-MoE's rule
        types = getattr(hf, "layer_types", None)
        window = getattr(hf, "sliding_window", None) or 0
    for i, layer in enumerate(spec.layers if spec.hc is None else ()):
        if types is not None:
            want = window if types[i] == "sliding_attention" else 0
        else:
            want = window if getattr(hf, "use_sliding_window", False) else 0
        assert layer.attention.window == want, (i, layer.attention.window, want)
    # MoE layers: the decoder layers transformers builds with routed experts
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    moe = [
        any(".experts." in n for n, _ in layer.named_parameters(prefix="."))
        for layer in model.model.layers
    ]
    assert [layer.moe for layer in spec.layers] == moe


VARIANTS = [(case, {}) for case in sorted(hf_models.CASES)] + [
    ("mixtral", {"tie_word_embeddings": True}),
    ("qwen2_moe", {"qkv_bias": False}),
    ("qwen3_moe", {"attention_bias": True, "mlp_only_layers": [0]}),
    ("olmoe", {"attention_bias": True}),
    ("deepseek_v3", {"attention_bias": True}),
    ("deepseek_v2_grouped_no_q_lora", {"attention_bias": True}),
    ("glm4_moe", {"attention_bias": False, "use_qk_norm": False}),
    ("gpt_oss", {"attention_bias": False}),
]


@pytest.mark.parametrize(("case", "overrides"), VARIANTS, ids=lambda x: str(x))
def test_dense_tensors_are_the_checkpoints(case, overrides):
    """models.spec.dense_tensors (what the converter checks and synth_store writes) names
    every non-expert tensor transformers saves, with its shape, in the stored (hub) spelling."""
    model_type = hf_models.CASES[case][0]
    fam = registry.family(model_type)
    config = hf_models.config(case, **overrides)
    with torch.device("meta"):
        model = hf_models.auto_class(case).from_config(config)
    want = {
        fam.rename(name): tuple(t.shape)
        for name, t in model.state_dict().items()
        if ".experts." not in name
    }
    if fam.text_prefixes and "vision_config" in hf_models.CASES[case][1]:
        # built multimodal (else as its text model, e.g. kimi): the language model, renamed
        want = {
            dst + name[len(src) :]: shape
            for name, shape in want.items()
            for src, dst in fam.text_prefixes
            if name.startswith(src)
        }
    if config.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    assert dense_tensors(registry.model_spec(config.to_dict())) == want


def test_every_family_has_its_test_case_and_the_registry_finds_all():
    files = Path(registry.__file__).parent / "models"
    declared = sorted(p.stem for p in files.glob("*.py") if "\nFAMILY = Family(" in p.read_text())
    assert list(registry.SUPPORTED) == declared
    for model_type in registry.SUPPORTED:
        text = registry.family(model_type).text_model_type
        if model_type not in hf_models.CASES and text in hf_models.CASES:
            continue  # a multimodal wrapper (llama4), tested around its text case
        assert hf_models.CASES[model_type][0] == model_type


def test_family_files_are_data():
    """models/ imports no engine, pipeline, model, io or convert module."""
    banned = (
        "colibri.engine",
        "colibri.pipeline",
        "colibri.model",
        "colibri.io",
        "colibri.convert",
    )
    for path in (Path(registry.__file__).parent / "models").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            for mod in mods:
                assert not any(mod == b or mod.startswith(b + ".") for b in banned), (path, mod)


# ---- multimodal: text_config and the language model's tensor prefix ----------------------


@pytest.fixture
def multimodal(monkeypatch):
    """A multimodal family built on Mixtral (config under text_config, language model under
    model.language_model.), registered for the test."""
    fam = dataclasses.replace(
        registry.family("mixtral"),
        model_type="mixtral_vl",
        text_model_type="mixtral",
        text_prefixes=(("model.language_model.", "model."), ("lm_head.", "lm_head.")),
        test_configs={},
    )
    monkeypatch.setitem(registry.FAMILIES, "mixtral_vl", fam)
    return fam


def test_text_config_is_the_language_model(multimodal):
    inner = {"model_type": "mixtral", **hf_models.CASES["mixtral"][1], **hf_models.COMMON}
    outer = {"model_type": "mixtral_vl", "text_config": inner, "vision_config": {"depth": 2}}
    resolved = registry.resolve_config(outer)
    assert resolved["model_type"] == "mixtral_vl"
    assert resolved == {**registry.resolve_config(inner), "model_type": "mixtral_vl"}
    a, b = registry.model_spec(outer), registry.model_spec(inner)
    assert dense_tensors(a) == dense_tensors(b) and a.moe == b.moe


async def test_multimodal_checkpoint_converts_its_text_part(multimodal, tmp_path, capsys):
    """A checkpoint with the language model under model.language_model. and a vision tower
    converts to the same store bytes as the text-only checkpoint, says what it dropped, and
    runs to the same tokens."""
    from safetensors.numpy import load_file, save_file

    from colibri.convert import convert
    from colibri.io.format import open_store

    model = hf_models.build("mixtral", seed=2)
    src = hf_models.save(model, tmp_path / "text")
    mm = tmp_path / "mm"
    mm.mkdir()
    tensors = {
        (k if k.startswith("lm_head.") else k.replace("model.", "model.language_model.", 1)): v
        for k, v in load_file(src / "model.safetensors").items()
    }
    tensors["model.visual.patch_embed.weight"] = np.ones((4, 3), np.float32)
    tensors["model.visual.blocks.0.norm.weight"] = np.ones(3, np.float32)
    save_file(tensors, mm / "model.safetensors")
    text_cfg = json.loads((src / "config.json").read_text())
    cfg = {"model_type": "mixtral_vl", "text_config": text_cfg, "vision_config": {}}
    (mm / "config.json").write_text(json.dumps(cfg))
    a = open_store(convert(src, tmp_path / "a", quant="f32", dense_quant="f32"))
    b = open_store(convert(mm, tmp_path / "b", quant="f32", dense_quant="f32"))
    assert "dropped model.visual.* (2)" in capsys.readouterr().err
    assert b.model_type == "mixtral_vl"
    assert a.experts_path.read_bytes() == b.experts_path.read_bytes()
    assert a.dense_path.read_bytes() == b.dense_path.read_bytes()
    ids = list(range(5, 15))
    ta, la = await hf_models.engine_greedy(a.path, ids, 4)
    tb, lb = await hf_models.engine_greedy(b.path, ids, 4)
    assert ta == tb == hf_models.greedy(model, ids, 4)
    np.testing.assert_array_equal(la, lb)
