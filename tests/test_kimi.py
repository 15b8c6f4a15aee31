"""Kimi K2.5 end to end against transformers' own multimodal class: a tiny random
Kimi_K25ForConditionalGeneration (vision tower, projector, DeepSeek-V3 language model) saved by
transformers 5.24 converts to its language model only, says what it dropped, and runs text
exactly: f32 logits within 1e-4 and 32 greedy tokens identical to the model's generate()."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.convert import convert
from colibri.io.format import open_store
from colibri.models.kimi_k25 import FAMILY
from tests import hf_models

torch, transformers = hf_models.torch, hf_models.transformers

VISION = dict(
    patch_size=14, num_attention_heads=2, num_hidden_layers=1, hidden_size=32,
    intermediate_size=64, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2,
)  # fmt: skip


def _kimi_k25(seed: int):
    text = {**hf_models.COMMON, **FAMILY.test_configs["kimi_k25"], "model_type": "deepseek_v3"}
    cfg = transformers.AutoConfig.for_model(
        "kimi_k25",
        text_config=text,
        vision_config=VISION,
        projection_hidden_size=32,
        tie_word_embeddings=False,  # the class ties on this top-level flag (default True)
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # perturbed as hf_models.build does
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    return model


def _greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(ids) :].tolist()


async def test_kimi_k25_text_part_matches_transformers(tmp_path, capsys):
    model = _kimi_k25(seed=7)
    src = tmp_path / "hf"
    # transformers 5.24's reverse renaming to the hub layout also rewrites the language
    # model's names (layers -> blocks, ...), so the test saves transformers 5's own layout;
    # the hub layout is the generic tests' (tests/hf_models.family_layout)
    model.save_pretrained(src, save_original_format=False)
    store = open_store(convert(src, tmp_path / "f32", quant="f32", dense_quant="f32"))
    err = capsys.readouterr().err
    assert "kept the language model only" in err and "vision_tower." in err, err
    assert "mm_projector." in err, err
    assert store.model_type == "kimi_k25"
    assert not [n for n in store.dense_names() if "vision" in n or "projector" in n]
    rng = np.random.default_rng(3)
    for _ in range(8):
        ids = rng.integers(0, 160, 24).tolist()
        expected = _greedy(model, ids, 32)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + expected])).logits[0].numpy()
        top2 = np.sort(logits, axis=1)[:, -2:]
        if (top2[:, 1] - top2[:, 0]).min() > 1e-4:
            break
    else:
        pytest.skip("no prompt without a near-tie in 8 tries")
    tokens, ours = await hf_models.engine_greedy(store.path, ids, 32)
    assert tokens == expected
    ref = logits[len(ids) - 1 : -1]
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


KIMI_TEMPLATE = hf_models.SHARED / "chat_templates" / "Kimi-K2-Instruct.jinja"
DEEPSEEK_TOKENIZER = hf_models.SHARED / "tokenizers" / "deepseek_v3"


def test_kimi_k2_chat_with_its_real_template(tmp_path):
    """`colibri run --chat` on a kimi_k2 store (hub config model_type "kimi_k2") carrying Kimi
    K2's real chat template and the DeepSeek-V3 tokenizer (Kimi's own is tiktoken, not in
    shared/data): the prompt is transformers' rendering and the text is the decoding of
    transformers' greedy tokens for it."""
    import json
    import lzma
    import subprocess
    import sys

    if not (KIMI_TEMPLATE.exists() and (DEEPSEEK_TOKENIZER / "tokenizer.json.xz").exists()):
        pytest.skip("shared data missing: Kimi-K2 template or DeepSeek-V3 tokenizer")
    src = tmp_path / "hf"
    cfg = hf_models.config("kimi_k2", vocab_size=129280)
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.colibri_family = "kimi_k2"
    hf_models.save(model, src)
    assert json.loads((src / "config.json").read_text())["model_type"] == "kimi_k2"
    (src / "tokenizer.json").write_bytes(
        lzma.decompress((DEEPSEEK_TOKENIZER / "tokenizer.json.xz").read_bytes())
    )
    template = KIMI_TEMPLATE.read_text(encoding="utf-8")
    tok_cfg = {"eos_token": "<｜end▁of▁sentence｜>", "chat_template": template}
    (src / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    convert(src, tmp_path / "store", quant="f32", dense_quant="f32")
    prompt = "What does multi-head latent attention cache?"
    res = subprocess.run(
        [sys.executable, "-m", "colibri", "run", str(tmp_path / "store"), "--chat", "-p",
         prompt, "-n", "6", "--temperature", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"))
    messages = [{"role": "user", "content": prompt}]
    text = tok.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert "<|im_user|>user<|im_middle|>" in text and text.endswith("<|im_middle|>")
    ids = tok(text, add_special_tokens=False).input_ids
    assert f"[{len(ids)} prompt + 6 generated tokens" in res.stderr, res.stderr
    gen = hf_models.greedy(model, ids, 6)
    if hf_models.choice_gap(model, ids + gen) > 1e-4:  # else a near-tie may flip
        assert res.stdout.endswith(tok.decode(gen)), (res.stdout, tok.decode(gen))
