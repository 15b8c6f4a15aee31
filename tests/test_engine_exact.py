"""The engine against transformers: f32 storage gives the same logits (1e-4 of their scale)
and the same 32 greedy tokens; q8_0 / q4_0 storage stays close (KL, top-1 agreement)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.convert import convert
from colibri.engine import open_engine
from tests import hf_models

LOGIT_RTOL = 1e-4  # |ours - hf| <= LOGIT_RTOL * max|hf| (f32 storage)
MIN_GAP = 1e-4  # skip prompts whose router top-k or argmax gap is below this
PROMPT_LEN, NEW_TOKENS = 32, 32

# Quantized storage, measured over the same greedy continuation (see closing note):
# mean KL(float || quant) per token and top-1 agreement with the float run, by (storage,
# activations). Q8_0 activations (the default) add an error of q8_0 weights' size to every
# matmul input, roughly doubling q8_0 storage's error variance: twice its KL bound.
QUANT_BOUNDS = {
    ("q8_0", "f32"): (5e-3, 0.90),
    ("q8_0", "q8_0"): (1e-2, 0.90),
    ("q4_0", "f32"): (5e-2, 0.80),
    ("q4_0", "q8_0"): (5e-2, 0.80),
}


def _prompt(model, seed: int) -> list[int] | None:
    return hf_models.find_prompt(model, seed, PROMPT_LEN, NEW_TOKENS, MIN_GAP)


_run = hf_models.engine_greedy


@pytest.fixture(scope="module", params=sorted(hf_models.CONFIGS))
def hf_pair(request, tmp_path_factory):
    model_type = request.param
    model = hf_models.build(model_type, seed=3)
    src = hf_models.save(model, tmp_path_factory.mktemp(model_type) / "hf")
    ids = _prompt(model, seed=5)
    if ids is None:
        pytest.skip(f"{model_type}: no prompt without a near-tie in 8 tries")
    return model_type, model, src, ids


async def test_f32_matches_transformers(hf_pair, tmp_path):
    model_type, model, src, ids = hf_pair
    store = tmp_path / "store"
    convert(src, store, quant="f32", dense_quant="f32")
    expected_tokens = hf_models.greedy(model, ids, NEW_TOKENS)
    tokens, logits = await _run(store, ids, NEW_TOKENS)
    assert tokens == expected_tokens, model_type
    ref = hf_models.reference_logits(model, ids + expected_tokens)[PROMPT_LEN - 1 : -1]
    scale = np.abs(ref).max()
    err = np.abs(logits - ref).max()
    assert err <= LOGIT_RTOL * scale, f"{model_type}: max err {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize(("quant", "activations"), sorted(QUANT_BOUNDS))
async def test_quantized_close_to_float(hf_pair, tmp_path, quant, activations):
    model_type, _model, src, ids = hf_pair
    f32_store, q_store = tmp_path / "f32", tmp_path / quant
    convert(src, f32_store, quant="f32", dense_quant="f32")
    convert(src, q_store, quant=quant, dense_quant="q8_0")
    tokens, ref_logits = await _run(f32_store, ids, NEW_TOKENS)
    # teacher-forced on the float run's tokens, so every position compares like with like
    async with open_engine(q_store, activations=activations) as engine:
        seq = engine.new_sequence()
        q_logits = [await engine.forward(seq, ids)]
        for tok in tokens[:-1]:
            q_logits.append(await engine.forward(seq, [tok]))
    q = np.stack(q_logits).astype(np.float64)
    p = ref_logits.astype(np.float64)
    logp = p - np.logaddexp.reduce(p, axis=1, keepdims=True)
    logq = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
    kl = float((np.exp(logp) * (logp - logq)).sum(axis=1).mean())
    top1 = float((p.argmax(1) == q.argmax(1)).mean())
    max_kl, min_top1 = QUANT_BOUNDS[quant, activations]
    print(f"{model_type} {quant}/{activations}: mean KL {kl:.2e}, top-1 agreement {top1:.3f}")
    assert kl <= max_kl and top1 >= min_top1, (model_type, quant, activations, kl, top1)
