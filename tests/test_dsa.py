"""DeepSeek Sparse Attention (deepseek_v32, glm_moe_dsa; spec.IndexerSpec) beyond the engine
exactness test: the selection is really sparse in prefill and decode (and matters: the dense
model's logits differ), the indexer stays exact under quantized experts, placement changes
nothing, and a saved session carries the indexer's key cache."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from colibri.convert import convert
from colibri.engine import open_engine
from colibri.session import Session, load_session, save_session
from tests import hf_models

torch, transformers = hf_models.torch, hf_models.transformers
PROMPT = list(range(3, 43))  # 40 tokens, more than every DSA case's index_topk


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(transformers model, checkpoint dir, f32 store) of the glm_moe_dsa case."""
    model = hf_models.build("glm_moe_dsa", seed=7)
    root = tmp_path_factory.mktemp("dsa")
    src = hf_models.save(model, root / "hf")
    convert(src, root / "f32", quant="f32", dense_quant="f32")
    return model, src, root / "f32"


async def _greedy(store, n: int, **options):
    async with open_engine(store, **options) as engine:
        seq = engine.new_sequence()
        logits = [await engine.forward(seq, PROMPT)]
        sel = [seq.kv.index_sel.copy()]
        out = []
        for _ in range(n):
            out.append(int(np.argmax(logits[-1])))
            logits.append(await engine.forward(seq, [out[-1]]))
            sel.append(seq.kv.index_sel.copy())
    return out, np.stack(logits[:-1]), sel


async def test_selection_is_sparse_in_prefill_and_decode(glm):
    model, src, store = glm
    topk = model.config.index_topk
    _tokens, logits, sel = await _greedy(store, 4, activations="f32")
    prefill = sel[0]
    assert prefill.shape == (len(PROMPT), topk)
    for s, row in enumerate(prefill):
        valid = row[row >= 0]
        assert len(set(valid)) == min(s + 1, topk) and valid.max() <= s
    for step, row in enumerate(sel[1:]):
        valid = row[0][row[0] >= 0]
        assert row.shape == (1, topk) and len(set(valid)) == topk  # of 40 + step positions
        assert valid.max() <= len(PROMPT) + step
    # the transformers model with the same weights and a dense selection gives other logits
    dense = transformers.AutoModelForCausalLM.from_pretrained(src, index_topk=1024).float()
    ref = hf_models.reference_logits(model, PROMPT)[-1]
    other = hf_models.reference_logits(dense.eval(), PROMPT)[-1]
    assert np.abs(logits[0] - ref).max() <= 1e-4 * np.abs(ref).max()
    assert np.abs(other - ref).max() > 100 * np.abs(logits[0] - ref).max()


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
async def test_quantized_experts_keep_the_indexer_exact(glm, tmp_path, quant):
    """With f32 dense weights the indexer sees the float model's inputs up to expert
    quantization error, so the standard (non-DSA) KL bound holds."""
    _model, src, store = glm
    tokens, ref, _ = await _greedy(store, 16, activations="f32")
    convert(src, tmp_path / quant, quant=quant, dense_quant="f32")
    async with open_engine(tmp_path / quant, activations="f32") as engine:
        seq = engine.new_sequence()
        q = [await engine.forward(seq, PROMPT)]
        for tok in tokens[:-1]:
            q.append(await engine.forward(seq, [tok]))
    p, q = ref.astype(np.float64), np.stack(q).astype(np.float64)
    logp = p - np.logaddexp.reduce(p, axis=1, keepdims=True)
    logq = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
    kl = float((np.exp(logp) * (logp - logq)).sum(axis=1).mean())
    assert kl <= {"q8_0": 5e-3, "q4_0": 5e-2}[quant], kl


async def test_same_tokens_whatever_the_placement(glm, tmp_path):
    _model, src, _store = glm
    store = tmp_path / "q4"
    convert(src, store, quant="q4_0", dense_quant="q8_0")
    reference, _, _ = await _greedy(store, 8, io="threads", prefetch=False, threads=1)
    for io, budget, prefetch in itertools.product(("uring", "mmap"), (1 << 14, 1 << 30), (0, 1)):
        threads = 1 if prefetch else 0
        tokens, _, _ = await _greedy(
            store, 8, io=io, budget=budget, prefetch=bool(prefetch), threads=threads
        )
        assert tokens == reference, (io, budget, prefetch)


async def test_session_keeps_the_index_keys(glm, tmp_path):
    _model, _src, store = glm
    async with open_engine(store, activations="f32") as engine:
        seq = engine.new_sequence()
        logits = await engine.forward(seq, PROMPT)
        seq.tokens = list(PROMPT)
        path = save_session(engine, Session(engine, seq, []), tmp_path / "s.session")
        again = load_session(engine, path).seq
        for a, b in zip(seq.kv.index_k, again.kv.index_k, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert np.array_equal(a[: len(PROMPT)], b[: len(PROMPT)]) and a[:1].any()
        tok = int(np.argmax(logits))
        assert np.array_equal(await engine.forward(seq, [tok]), await engine.forward(again, [tok]))


@pytest.mark.parametrize("k_dtype", [np.float32, np.float16])
@pytest.mark.parametrize(("n_q", "n_kv", "q_pos0", "n_heads", "d"),
                         [(1, 1, 0, 1, 1), (1, 300, 299, 32, 128), (7, 90, 40, 4, 20),
                          (3, 5, 2, 64, 17)])  # fmt: skip
def test_index_scores_kernel(isa, k_dtype, n_q, n_kv, q_pos0, n_heads, d):
    """ops.index_scores (C, per ISA) against the numpy formula of DeepseekV32Indexer."""
    from colibri.compute import ops

    rng = np.random.default_rng(n_kv + d)
    q = rng.standard_normal((n_q, n_heads, d)).astype(np.float32)
    w = rng.standard_normal((n_q, n_heads)).astype(np.float32)
    k = rng.standard_normal((n_kv + 2, d)).astype(k_dtype)
    out = np.full((n_q, n_kv), np.nan, np.float32)
    ops.index_scores(out, q, w, k, n_kv, q_pos0, d**-0.5)
    kf = k[:n_kv].astype(np.float64)
    want = np.einsum("ih,iht->it", w, np.maximum(q.astype(np.float64) @ kf.T * d**-0.5, 0))
    for i in range(n_q):
        p = q_pos0 + i
        np.testing.assert_allclose(out[i, : p + 1], want[i, : p + 1], rtol=1e-5, atol=1e-5)
        assert np.all(out[i, p + 1 :] == -np.inf)
    with pytest.raises(ops.KernelError, match="index_scores: n_kv"):
        ops.index_scores(out, q, w, k, n_kv + 3, q_pos0, 1.0)


async def test_prefix_cache_carries_the_index_keys(glm):
    """A prompt whose prefix comes from the prefix cache gets that prefix's indexer keys too,
    so its logits are the cold run's."""
    from colibri.prefix_cache import PrefixCache

    _model, _src, store = glm
    cache = PrefixCache(1 << 26, block_size=8)
    async with open_engine(store, activations="f32") as engine:
        cold = engine.new_sequence()
        want = await engine.forward(cold, PROMPT)
        cache.store(PROMPT, cold.kv)
        warm = engine.new_sequence()
        n = cache.lookup(PROMPT, warm.kv)
        assert n == 32
        for a, b in zip(cold.kv.index_k, warm.kv.index_k, strict=True):
            if a is not None:
                assert np.array_equal(a[:n], b[:n]) and a[:1].any()
        got = await engine.forward(warm, PROMPT[n:])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
