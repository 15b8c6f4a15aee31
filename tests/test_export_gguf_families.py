"""export-gguf for the families beyond test_export_gguf.py's Mixtral and Qwen3-MoE: OLMoE
(llama.cpp arch "olmoe") and Qwen2-MoE ("qwen2moe", shared expert and qkv biases). The GGUF
imports back into the same store, and llama.cpp on it agrees with transformers on the same
weights (skipped where llama.cpp is not built)."""

from __future__ import annotations

import lzma
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGUFReader  # noqa: E402

from colibri.convert import convert  # noqa: E402
from colibri.export_gguf import export_gguf  # noqa: E402
from colibri.io.format import open_store  # noqa: E402
from colibri.registry import FAMILIES, model_spec  # noqa: E402
from tests.test_export_gguf import (  # noqa: E402
    PROMPT,
    SHARED,
    _colibri_last_logits,
    _llama_bin,
    _llama_cpp_last_logits,
)

# family test case -> config overrides llama.cpp's arch needs (OLMoE: no clip_qkv, no GQA;
# Qwen2-MoE: every layer sparse)
CASES = {
    "olmoe": dict(clip_qkv=None, num_key_value_heads=4),
    "qwen2_moe": dict(mlp_only_layers=[]),
    "minimax_m2": {},
    "glm4_moe": {},  # layer 0 dense, a shared expert, partial rotary, qkv biases, q/k norms
    # MLA (llama.cpp deepseek2, attn_kv_b whole), YaRN with mscale_all_dim 0.707 / 1.0
    "deepseek_v2": {},
    "deepseek_v3": {},
    "deepseek_v3_one_group_no_q_lora": dict(rope_interleave=True),  # q_proj, 2 groups
    "kimi_k2": {},
    "glm4_moe_lite": {},
    "kimi_k25": {},  # multimodal: the language model (text_config) exported
    # llama.cpp's SwiGLU limit is gpt-oss's 7; its YaRN rounds the ramp (truncate true)
    "gpt_oss": dict(
        swiglu_limit=7.0,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=1e4,
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32.0,
            beta_slow=1.0,
        ),
    ),
}
ARCH = {"olmoe": "olmoe", "qwen2_moe": "qwen2moe", "minimax_m2": "minimax-m2",
        "glm4_moe": "glm4moe", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
        "deepseek_v3_one_group_no_q_lora": "deepseek2", "kimi_k2": "deepseek2",
        "glm4_moe_lite": "deepseek2", "kimi_k25": "deepseek2", "gpt_oss": "gpt-oss"}  # fmt: skip
# a tensor each arch has that the others lack
MARK = {
    "olmoe": "blk.0.attn_q_norm.weight",
    "qwen2_moe": "blk.0.ffn_gate_inp_shexp.weight",
    "minimax_m2": "blk.0.exp_probs_b.bias",
    "glm4_moe": "blk.1.ffn_gate_shexp.weight",
    "deepseek_v2": "blk.1.attn_q_a.weight",
    "deepseek_v3": "blk.1.exp_probs_b.bias",
    "deepseek_v3_one_group_no_q_lora": "blk.0.attn_q.weight",
    "kimi_k2": "blk.1.attn_kv_b.weight",
    "glm4_moe_lite": "blk.2.attn_kv_a_mqa.weight",
    "kimi_k25": "blk.2.ffn_down_shexp.weight",
    "gpt_oss": "blk.1.ffn_down_exps.bias",
}


def _kimi_k25(vocab_size: int):
    """Kimi K2.5 in small (vision tower, projector, DeepSeek-V3 text model), as test_kimi
    builds it, with `vocab_size` tokens."""
    import torch
    import transformers

    from tests import hf_models
    from tests.test_kimi import VISION

    text = {**hf_models.COMMON, **FAMILIES["kimi_k25"].test_configs["kimi_k25"]}
    text |= {"model_type": "deepseek_v3", "vocab_size": vocab_size}
    cfg = transformers.AutoConfig.for_model(
        "kimi_k25", text_config=text, vision_config=VISION, projection_hidden_size=32,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(4)
    model = transformers.AutoModelForImageTextToText.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    return model


def _auto_model(case: str):
    import transformers

    if case == "kimi_k25":
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


@pytest.fixture(scope="module", params=sorted(CASES))
def model_dir(request, tmp_path_factory) -> Path:
    """A tiny random HF model of the family (norms and biases perturbed) with a byte-level
    BPE tokenizer trained here on real text (GPT-2 pre-tokenizer)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests import hf_models

    text = SHARED / "text/olmoe_routing_c4_texts.txt.xz"
    if not text.is_file():
        pytest.skip(f"{text} absent")
    lines = lzma.decompress(text.read_bytes()).decode("utf-8").splitlines()[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=380, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(lines, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    case = request.param
    path = tmp_path_factory.mktemp("hf") / f"tiny-{case}"
    if case == "kimi_k25":  # transformers 5's own layout (see test_kimi)
        _kimi_k25(vocab_size=384).save_pretrained(path, save_original_format=False)
    else:
        model = hf_models.build(case, seed=4, vocab_size=384, rope_theta=1e4, **CASES[case])
        model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("quant", "dense_quant"), [("f32", "f32"), ("q4_0", "q8_0"), ("q5_1", "q5_0")]
)
def test_gguf_round_trip(model_dir, tmp_path, quant, dense_quant):
    store = convert(model_dir, tmp_path / "s", quant=quant, dense_quant=dense_quant)
    out = export_gguf(store, tmp_path / "o.gguf")
    r = GGUFReader(out)
    case = model_dir.name.removeprefix("tiny-")
    assert r.fields["general.architecture"].contents() == ARCH[case]
    names = {t.name for t in r.tensors}
    first = open_store(store)
    router = f"blk.{first.moe_layers[0]}.ffn_gate_inp.weight"
    assert {MARK[case], router} <= names
    back = open_store(convert(out, tmp_path / "b", dense_quant="keep", show_progress=False))
    assert back.moe_layers == first.moe_layers
    assert [x.xxh3 for x in back.records] == [x.xxh3 for x in first.records]
    assert sorted(back.dense_names()) == sorted(first.dense_names())
    for name in first.dense_names():
        a, b = first.dense(name)[0], back.dense(name)[0]
        assert np.array_equal(a, b), name
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "num_experts_per_tok", "intermediate_size", "moe_intermediate_size",
            "shared_expert_intermediate_size", "rms_norm_eps", "vocab_size", "norm_topk_prob",
            "first_k_dense_replace", "n_shared_experts", "routed_scaling_factor",
            "attention_bias", "use_qk_norm"]  # fmt: skip
    keys += ["kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
             "n_group", "topk_group"]  # fmt: skip
    read = FAMILIES[first.model_type].defaults  # the fields the family reads
    for k in keys:
        if k in first.config and k in read:
            assert back.config.get(k) == first.config[k], k
    # the engine's view of the model is the same: rotary dims, routing, every layer's kind
    a, b = model_spec(first.config | {"model_type": first.model_type}), model_spec(back.config)
    assert [(x.moe, sorted(x.names), x.biases) for x in a.layers] == [
        (x.moe, sorted(x.names), x.biases) for x in b.layers
    ]
    for x, y in zip(a.layers, b.layers, strict=True):  # RoPE (YaRN included), windows, scale
        ax, ay = x.attention, y.attention
        assert (ax.rot_dim, ax.window, ax.head_dim, ax.v_head_dim, ax.sinks, ax.qk_norm) == (
            ay.rot_dim, ay.window, ay.head_dim, ay.v_head_dim, ay.sinks, ay.qk_norm)  # fmt: skip
        np.testing.assert_allclose(ay.inv_freq, ax.inv_freq, rtol=1e-6)
        assert ay.mscale == pytest.approx(ax.mscale, rel=1e-6)
        assert ay.scale == pytest.approx(ax.scale, rel=1e-6)
    assert a.moe == b.moe
    # the vocabulary comes back as a tokenizer.json that tokenizes like the original
    from tokenizers import Tokenizer

    orig = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    again = Tokenizer.from_file(str(back.path / "tokenizer.json"))
    text = PROMPT + " l'été, 1234 tokens!\n\n  done"
    assert again.encode(text).ids == orig.encode(text).ids


def test_llama_cpp_logits_match_transformers(model_dir, tmp_path):
    _llama_bin()
    import torch
    import transformers

    store = convert(model_dir, tmp_path / "s", quant="f32", dense_quant="f32")
    path = export_gguf(store, tmp_path / f"{model_dir.name}.gguf")
    ids, got = _llama_cpp_last_logits(path, PROMPT, tmp_path / "out")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert ids == tok(PROMPT).input_ids
    auto = _auto_model(model_dir.name.removeprefix("tiny-"))
    model = auto.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0, -1].numpy()
    scale = float(np.abs(ref).max())
    assert float(np.abs(got - ref).max()) <= 1e-4 * scale
    ours = _colibri_last_logits(store, ids)
    assert float(np.abs(ours - ref).max()) <= 1e-4 * scale


def test_olmoe_with_gqa_refused(tmp_path):
    from colibri.errors import ConversionError
    from tests import hf_models

    src = hf_models.save(hf_models.build("olmoe", clip_qkv=None), tmp_path / "hf")  # 2 kv heads
    store = convert(src, tmp_path / "s", quant="q8_0", dense_quant="q8_0")
    with pytest.raises(ConversionError, match="no grouped-query attention"):
        export_gguf(store, tmp_path / "o.gguf")
    assert not (tmp_path / "o.gguf").exists()


def test_fp8_store_exports_exact_f32(model_dir, tmp_path):
    """fp8 has no GGML type: its tensors go out as their exact f32 values (the engine's)."""
    from colibri.compute import ref

    store = open_store(convert(model_dir, tmp_path / "s", quant="fp8", dense_quant="fp8"))
    out = export_gguf(store.path, tmp_path / "o.gguf")
    tensors = {t.name: t for t in GGUFReader(out).tensors}
    t = tensors["blk.1.ffn_down_exps.weight"]
    assert t.tensor_type.name == "F32"
    spec = store.layout_for(1).tensors["down"]
    rec = store.record(1, 3)
    with open(store.experts_path, "rb") as f:
        f.seek(rec.offset + spec.offset)
        raw = np.frombuffer(f.read(spec.nbytes), np.uint8)
    assert np.array_equal(np.asarray(t.data)[3], ref.fp8_dequantize(raw, spec.shape))
    fp8_dense = [n for n in store.dense_names() if store.dense_qtype(n) == "fp8"]
    assert fp8_dense
    assert all(tensors[n].tensor_type.name == "F32" for n in tensors if "attn_v" in n)
