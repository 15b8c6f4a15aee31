"""`colibri eval` scores the model `colibri run` samples from: on a store as `colibri convert`
writes it by default (q4_0 experts, q8_0 dense weights: the output head in q8_0 through the
Q8_0 GEMM), eval's log-probabilities equal the log-softmax of the logits `run` computes for
the same tokens (a prompt prefilled in chunks, then one token a decode step), bit for bit
through the same log-sum-exp (ops.logsumexp: f32 exps), and to 1e-6 against a float64 numpy
log-softmax of those logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri.compute import ops
from colibri.convert import convert
from colibri.engine import open_engine
from colibri.eval import scoring
from tests import hf_models


@pytest.fixture(scope="module")
def q4_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("runhead")
    src = hf_models.save(hf_models.build("mixtral", seed=5), root / "hf")
    return convert(src, root / "q4", quant="q4_0", dense_quant="q8_0", show_progress=False)


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


async def _run_logits(engine, prompt: list[int], fed: list[int]) -> np.ndarray:
    """The logits `run` samples from: `prompt` prefilled in engine.prefill_chunk chunks (its
    last row), then each token of `fed` as one decode step; f32 [1 + len(fed), vocab]."""
    seq = engine.new_sequence(n_ctx=len(prompt) + len(fed))
    for a in range(0, len(prompt), engine.prefill_chunk):
        last = await engine.forward(seq, prompt[a : a + engine.prefill_chunk])
    rows = [last]
    for t in fed:
        rows.append(await engine.forward(seq, [t]))
    seq.kv = None
    return np.stack(rows)


@pytest.mark.parametrize("batch", ["split", "fused"])
async def test_perplexity_equals_run_logits(q4_store, batch):
    rng = np.random.default_rng(0)
    n_ctx, first = 24, 12
    async with open_engine(q4_store, n_ctx=n_ctx, batch=batch) as engine:
        head = engine.model.lm_head
        assert head.qtype == ops.QType.Q8_0 and head.act_q8  # the store's own q8_0 head
        engine.prefill_chunk = 5  # prompts in several chunks, as run prefills longer ones
        vocab = engine.spec.vocab_size
        tokens = rng.integers(0, vocab, 3 * n_ctx + 7).tolist()
        res = await scoring.perplexity(engine, tokens, n_ctx)
        want = []
        for w in scoring.windows(tokens, n_ctx, None):
            logits = await _run_logits(engine, w[: first + 1], w[first + 1 : -1])
            targets = np.asarray(w[first + 1 :])
            got = scoring.target_logprobs(logits, targets)
            ref = _log_softmax64(logits)[np.arange(len(targets)), targets]
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)  # f32 exps in C
            want.append(-got)
    want = np.concatenate(want)
    assert res.nll.shape == want.shape == (3 * (n_ctx - 1 - first),)
    if batch == "split":  # the repo's batch invariance: the same bits as run's rows
        assert np.array_equal(res.nll, want)
    else:  # fused rows meet the attention kernels in other groupings
        np.testing.assert_allclose(res.nll, want, rtol=1e-5)


async def test_choices_equal_run_logits(q4_store):
    rng = np.random.default_rng(1)
    async with open_engine(q4_store, n_ctx=64) as engine:
        engine.prefill_chunk = 4
        vocab = engine.spec.vocab_size
        items = []
        for n_ctx, lens in [(9, (3, 1, 4)), (6, (2, 5))]:
            ctx = rng.integers(0, vocab, n_ctx).tolist()
            items.append([(ctx, rng.integers(0, vocab, n).tolist()) for n in lens])
        got = await scoring.score_items(engine, items)
        for reqs, lps in zip(items, got, strict=True):
            for (ctx, cont), lp in zip(reqs, lps, strict=True):
                logits = await _run_logits(engine, ctx, cont[:-1])
                want = scoring.target_logprobs(logits, np.asarray(cont))
                assert np.array_equal(lp, want)


@pytest.mark.parametrize("scale", [1e-3, 0.05, 3.0])
def test_compare_logits_equals_float64(scale):
    """compare_logits (blocked, KL without either log-sum-exp) against numpy's float64
    log-softmax on the whole arrays, from tiny KL (1e-3 noise: KL ~5e-7) to large; a row
    against itself gives KL exactly 0."""
    rng = np.random.default_rng(4)
    n, vocab = 37, 5003  # rows not a multiple of the block
    ref = (rng.standard_normal((n, vocab)) * 4).astype(np.float32)
    x = (ref + scale * rng.standard_normal((n, vocab))).astype(np.float32)
    x[3] = ref[3]  # one row equal to its reference
    t = rng.integers(0, vocab, n)
    nll, ref_nll, kl, top1 = scoring.compare_logits(x, ref, t)
    lp, rlp = _log_softmax64(x), _log_softmax64(ref)
    want_kl = (np.exp(rlp) * (rlp - lp)).sum(axis=1)
    np.testing.assert_allclose(nll, -lp[np.arange(n), t], rtol=1e-7, atol=1e-6)
    np.testing.assert_allclose(ref_nll, -rlp[np.arange(n), t], rtol=1e-7, atol=1e-6)
    np.testing.assert_allclose(kl, want_kl, rtol=1e-6, atol=1e-13)
    assert kl[3] == 0.0 and kl.dtype == nll.dtype == np.float64
    assert np.array_equal(top1, x.argmax(1) == ref.argmax(1)) and top1[3]


async def test_choice_groups_feed_four_prefill_chunks(q4_store, monkeypatch):
    """score_items' groups grow until they feed CHOICE_CHUNKS x prefill_chunk tokens (then
    every expert a group routes to is read about twice for that many tokens, where prefill
    reads it once a chunk), capped by max_batch sequences; results as one item at a time."""
    rng = np.random.default_rng(2)
    groups: list[int] = []
    inner = scoring._score_group

    async def spy(engine, items, needs, counters):
        groups.append(sum(scoring._fed(reqs) for reqs in items))
        return await inner(engine, items, needs, counters)

    async with open_engine(q4_store, n_ctx=64, batch="split") as engine:
        engine.prefill_chunk = 32
        vocab = engine.spec.vocab_size
        items = [
            [(ctx, rng.integers(0, vocab, n).tolist()) for n in (2, 4, 3)]
            for ctx in (rng.integers(0, vocab, 7).tolist() for _ in range(12))
        ]
        # an item feeds its 7-token context once and 1 + 3 + 2 continuation tokens: 13
        assert [scoring._fed(reqs) for reqs in items] == [13] * 12
        alone = [await scoring.score_requests(engine, reqs) for reqs in items]
        monkeypatch.setattr(scoring, "_score_group", spy)
        got = await scoring.score_items(engine, items)
        assert groups == [130, 26]  # 10 items reach 128 = 4 x 32 tokens; the rest
        groups.clear()
        await scoring.score_items(engine, items, max_batch=6)  # 2 items of 3 choices
        assert groups == [26] * 6
    for a, b in zip(alone, got, strict=True):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y)
