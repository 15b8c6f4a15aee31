"""Issue 12, right output: dense f16/bf16 stores, OLMoE's clip_qkv (both against transformers
on the same tiny model) and streamed text that used to be lost (against the tokenizer's own
decode of the whole sequence)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from colibri.convert import convert, dense_qtype
from colibri.engine import open_engine
from tests import hf_models

torch = hf_models.torch
LOGIT_RTOL = 1e-4  # |ours - hf| <= LOGIT_RTOL * max|hf|, f32 activations


async def _logits(store, ids: list[int], prefill: int) -> np.ndarray:
    """colibri's logits after each position of ids: a prefill of `prefill` tokens (only its
    last logits are returned, so the rows start at prefill - 1), then one token at a time."""
    async with open_engine(store, activations="f32", io="threads") as engine:
        seq = engine.new_sequence()
        out = [await engine.forward(seq, ids[:prefill])]
        for t in ids[prefill:]:
            out.append(await engine.forward(seq, [t]))
    return np.stack(out)


@pytest.mark.parametrize("dense_quant", ["f16", "bf16"])
async def test_dense_f16_bf16_store_generates_like_transformers(tmp_path, dense_quant):
    model = hf_models.build("mixtral", seed=3)
    src = hf_models.save(model, tmp_path / "hf")
    store = tmp_path / "store"
    convert(src, store, quant="f32", dense_quant=dense_quant, show_progress=False)
    # the reference: the same model with exactly the weights the store rounded to 16 bits
    narrow = {"f16": torch.float16, "bf16": torch.bfloat16}[dense_quant]
    rounded = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if dense_qtype(name, tuple(p.shape), dense_quant) == dense_quant:
                p.copy_(p.to(narrow).float())
                rounded += 1
    assert rounded >= 4 * 3 + 2  # q, k, v, o per layer, embeddings, lm_head
    ids = np.random.default_rng(7).integers(0, model.config.vocab_size, 24).tolist()
    ref = hf_models.reference_logits(model, ids)[15:]
    got = await _logits(store, ids, prefill=16)
    err, scale = np.abs(got - ref).max(), np.abs(ref).max()
    assert err <= LOGIT_RTOL * scale, f"{dense_quant}: max err {err:.3g}, scale {scale:.3g}"
    # and the CLI path the issue reported: a store of this kind generates tokens
    async with open_engine(store, io="threads") as engine:
        items = [t async for t in engine.stream(ids, max_tokens=5, temperature=0)]
    assert sum(t.token_id is not None for t in items) == 5


@pytest.mark.parametrize("clip_qkv", [1.0, 0.5])
async def test_olmoe_clip_qkv_matches_transformers(tmp_path, clip_qkv, monkeypatch):
    model_type, extra = hf_models.CASES["olmoe"]
    monkeypatch.setitem(hf_models.CASES, "olmoe", (model_type, extra | {"clip_qkv": clip_qkv}))
    model = hf_models.build("olmoe", seed=3)
    src = hf_models.save(model, tmp_path / "hf")
    store = tmp_path / "store"
    convert(src, store, quant="f32", dense_quant="f32", show_progress=False)
    ids = np.random.default_rng(5).integers(0, model.config.vocab_size, 24).tolist()
    ref = hf_models.reference_logits(model, ids)[7:]
    # the clamp must bite in this model, or the test proves nothing
    model.config.clip_qkv = None
    for layer in model.model.layers:
        layer.self_attn.config.clip_qkv = None
    unclipped = hf_models.reference_logits(model, ids)[7:]
    scale = np.abs(ref).max()
    assert np.abs(unclipped - ref).max() > 100 * LOGIT_RTOL * scale
    got = await _logits(store, ids, prefill=8)
    err = np.abs(got - ref).max()
    assert err <= LOGIT_RTOL * scale, f"clip_qkv={clip_qkv}: max err {err:.3g}, scale {scale:.3g}"
    assert (got.argmax(1) == ref.argmax(1)).all()


# ---- streaming text -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    hf_models.save_with_tokenizer("mixtral", root / "hf", seed=4)
    convert(root / "hf", root / "store", quant="q8_0", dense_quant="q8_0", show_progress=False)
    return root / "store"


async def test_text_held_for_a_stop_string_is_flushed_at_eos(chat_store):
    prompt = "The capital of France is"
    async with open_engine(chat_store, io="threads") as engine:
        tok = engine.tokenizer
        free = [t async for t in engine.stream(prompt, max_tokens=16, temperature=0)]
    ids = [t.token_id for t in free if t.token_id is not None]
    # make a later greedy token the EOS: the text before it is what the stream must show
    k = next(
        (i for i in range(3, len(ids)) if ids[i] not in ids[:i] and tok.decode(ids[:i], True)),
        None,
    )
    assert k is not None, ids
    before = tok.decode(ids[:k], skip_special_tokens=True)
    gen = json.loads((chat_store / "generation_config.json").read_text() or "{}")
    (chat_store / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": ids[k]}))
    try:
        # a stop string that begins with the last character shown: it is held back, then EOS
        stop = before[-1] + "\ue000"
        async with open_engine(chat_store, io="threads") as engine:
            items = [
                t async for t in engine.stream(prompt, max_tokens=16, temperature=0, stop=[stop])
            ]
    finally:
        (chat_store / "generation_config.json").write_text(json.dumps(gen))
    assert items[-1].finish_reason == "stop"
    assert [t.token_id for t in items if t.token_id is not None] == ids[: k + 1]
    assert "".join(t.text for t in items) == before


TEXT = "ok 😀🎉 naïve — 日本語 end 🦜"


@pytest.mark.parametrize("name", ["olmoe", "qwen3", "mixtral_v1"])
def test_context_ending_inside_a_character_streams_it_whole(name):
    from tests import tokenizer_data

    tok = tokenizer_data.our_tokenizers()[name]
    ids = tok.encode(TEXT, add_special_tokens=False)
    full = tok.decode(ids)
    assert full.endswith(TEXT)
    cuts = 0
    for c in range(1, len(ids)):
        context = ids[:c]
        shown = tok.decode(context)
        dec = tok.stream_decoder(context)
        deltas = [dec.push(i) for i in ids[c:]] + [dec.flush()]
        joined = "".join(deltas)
        # what the context already showed, whole characters only, then the stream
        assert shown.rstrip("\ufffd") + joined == full, (name, c, deltas)
        assert "\ufffd" not in joined, (name, c, deltas)
        cuts += shown.endswith("\ufffd")
    assert cuts >= 2, f"{name}: no cut fell inside a character"
