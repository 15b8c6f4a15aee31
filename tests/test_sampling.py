"""Sampling: processors against transformers' LogitsProcessor classes, draw statistics, seeds,
logprobs and parameter validation."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.errors import SamplingError
from colibri.sampling import (
    Sampler,
    SamplingParams,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    log_softmax,
)

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")
torch.set_num_threads(1)

VOCAB = 1000
SEEDS = [0, 1, 2]


def _logits(seed: int, vocab: int = VOCAB, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def _hf(processor, logits: np.ndarray, ids=()) -> np.ndarray:
    input_ids = torch.tensor([list(ids) or [0]], dtype=torch.long)
    scores = torch.from_numpy(logits.astype(np.float64))[None]
    return processor(input_ids, scores)[0].numpy()


def _assert_same(ours: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(ref))
    keep = np.isfinite(ref)
    np.testing.assert_allclose(ours[keep], ref[keep], rtol=1e-12, atol=1e-12)


# --- processors vs transformers ---------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [1, 5, 50, 999])
def test_top_k_matches_hf(seed, k):
    x = _logits(seed).astype(np.float64)
    _assert_same(apply_top_k(x, k), _hf(lp.TopKLogitsWarper(k), x))


def test_top_k_keeps_ties_like_hf():
    x = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 0.0])
    _assert_same(apply_top_k(x, 2), _hf(lp.TopKLogitsWarper(2), x))
    _assert_same(apply_top_k(x, 3), _hf(lp.TopKLogitsWarper(3), x))  # keeps both 2.0s


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_matches_hf(seed, p):
    x = _logits(seed).astype(np.float64)
    _assert_same(apply_top_p(x, p), _hf(lp.TopPLogitsWarper(p), x))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("m", [0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_hf(seed, m):
    x = _logits(seed).astype(np.float64)
    _assert_same(apply_min_p(x, m), _hf(lp.MinPLogitsWarper(m), x))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_hf(seed, penalty):
    x = _logits(seed)
    rng = np.random.default_rng(seed + 100)
    prompt, output = rng.integers(0, VOCAB, 40).tolist(), rng.integers(0, VOCAB, 25).tolist()
    ours = apply_penalties(x, prompt, output, repetition_penalty=penalty)
    ref = _hf(lp.RepetitionPenaltyLogitsProcessor(penalty), x, prompt + output)
    np.testing.assert_allclose(ours, ref, rtol=1e-12)
    assert not np.allclose(ours, x)


@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.3), (-1.0, 1.5)])
def test_presence_frequency_penalties_openai(presence, frequency):
    x = _logits(3)
    rng = np.random.default_rng(7)
    prompt, output = rng.integers(0, 50, 30).tolist(), rng.integers(0, 50, 60).tolist()
    ours = apply_penalties(
        x, prompt, output, presence_penalty=presence, frequency_penalty=frequency
    )
    ref = x.astype(np.float64).copy()  # OpenAI's formula, token by token; prompt not counted
    for j in set(output):
        c = output.count(j)
        ref[j] -= c * frequency + presence
    np.testing.assert_allclose(ours, ref, rtol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_full_chain_order_matches_hf(seed):
    params = SamplingParams(
        temperature=0.8, top_k=100, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=seed
    )
    x = _logits(seed)
    rng = np.random.default_rng(seed)
    prompt, output = rng.integers(0, VOCAB, 30).tolist(), rng.integers(0, VOCAB, 10).tolist()
    chain = lp.LogitsProcessorList(
        [
            lp.RepetitionPenaltyLogitsProcessor(1.2),
            lp.TemperatureLogitsWarper(0.8),
            lp.TopKLogitsWarper(100),
            lp.TopPLogitsWarper(0.9),
            lp.MinPLogitsWarper(0.05),
        ]
    )
    ref = _hf(chain, x, prompt + output)
    sampler = Sampler(params)
    _assert_same(sampler.process(x, prompt, output), ref)
    # logprob and alternatives: log-softmax of the processed logits ("processed_logprobs")
    ref_logp = torch.log_softmax(torch.from_numpy(ref), -1).numpy()
    s = Sampler(SamplingParams(**{**params.__dict__, "logprobs": 5})).sample(x, prompt, output)
    assert np.isfinite(ref_logp[s.token_id])
    assert s.logprob == pytest.approx(ref_logp[s.token_id], abs=1e-12)
    order = [i for i in np.argsort(-ref_logp, kind="stable")[:5] if np.isfinite(ref_logp[i])]
    assert [t for t, _ in s.top_logprobs] == order
    np.testing.assert_allclose([v for _, v in s.top_logprobs], ref_logp[order], atol=1e-12)


# --- draws ------------------------------------------------------------------------------------


def test_greedy_argmax_and_lowest_index_on_ties():
    x = np.array([0.5, 2.0, -1.0, 2.0, 2.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0, logprobs=3)).sample(x)
    assert s.token_id == 1
    assert s.logprob == pytest.approx(log_softmax(x)[1])
    assert [t for t, _ in s.top_logprobs] == [1, 3, 4]
    x = _logits(5)
    assert Sampler(SamplingParams(temperature=0)).sample(x).token_id == int(np.argmax(x))


def _draws(params: SamplingParams, x: np.ndarray, n: int) -> np.ndarray:
    sampler = Sampler(params)
    return np.array([sampler.sample(x).token_id for _ in range(n)])


def test_top_k_never_outside_k():
    x = _logits(11, vocab=64, scale=1.0)
    draws = _draws(SamplingParams(top_k=5, temperature=1.5, seed=1), x, 3000)
    top5 = set(np.argsort(-x)[:5].tolist())
    assert set(draws.tolist()) == top5  # never outside, and every one of the k is reachable


def test_top_p_mass():
    x = _logits(12, vocab=64, scale=1.5)
    probs = np.exp(log_softmax(x))
    order = np.argsort(-probs)
    # nucleus computed independently: the fewest most-likely tokens whose mass reaches top_p
    n = int(np.searchsorted(np.cumsum(probs[order]), 0.8) + 1)
    nucleus = set(order[:n].tolist())
    draws = _draws(SamplingParams(top_p=0.8, seed=2), x, 4000)
    assert set(draws.tolist()) <= nucleus
    assert len(set(draws.tolist())) >= n - 2  # the tail of the nucleus is rarely empty


def test_min_p_never_below_threshold():
    x = _logits(13, vocab=64, scale=2.0)
    probs = np.exp(log_softmax(x))
    draws = _draws(SamplingParams(min_p=0.2, seed=3), x, 2000)
    assert np.all(probs[draws] >= 0.2 * probs.max())


def test_same_seed_same_tokens():
    x = _logits(14, vocab=200, scale=1.0)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    a, b = _draws(params, x, 200), _draws(params, x, 200)
    np.testing.assert_array_equal(a, b)
    c = _draws(SamplingParams(temperature=0.9, top_p=0.95, seed=1235), x, 200)
    assert not np.array_equal(a, c)


# chi-square critical value for 7 degrees of freedom at alpha = 0.001
CHI2_DF7_ALPHA001 = 24.322


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_distribution_matches_softmax_chi_square(temperature):
    x = np.array([1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.7], dtype=np.float32)
    n = 10000
    draws = _draws(SamplingParams(temperature=temperature, seed=42), x, n)
    expected = n * np.exp(log_softmax(x.astype(np.float64) / temperature))
    observed = np.bincount(draws, minlength=8)
    chi2 = float(np.sum((observed - expected) ** 2 / expected))
    assert chi2 < CHI2_DF7_ALPHA001, (chi2, observed, expected.round())


def test_all_masked_logits_raise():
    with pytest.raises(SamplingError, match="finite"):
        Sampler(SamplingParams()).sample(np.full(4, -np.inf, dtype=np.float32))
    with pytest.raises(SamplingError, match="1-D"):
        Sampler(SamplingParams()).sample(np.zeros((2, 3), dtype=np.float32))


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("seed", -1),
        ("seed", "7"),
        ("logprobs", 21),
        ("logprobs", -1),
        ("max_tokens", 0),
        ("stop", [""]),
        ("stop", [1]),
        ("stop", 5),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(SamplingError, match=f"^{field}="):
        SamplingParams(**{field: value})
    assert issubclass(SamplingError, ValueError)


def test_valid_params_normalize_stop():
    p = SamplingParams(temperature=0, top_k=1, top_p=1.0, min_p=1.0, stop="###", max_tokens=1)
    assert p.stop == ("###",) and p.greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # frozen
