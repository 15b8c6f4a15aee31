"""Next-token sampling: penalties, temperature, top-k, top-p, min-p, seeded draws, logprobs.

Processors run in Hugging Face / vLLM order on float64 logits:
    repetition penalty (HF RepetitionPenaltyLogitsProcessor: over prompt + generated tokens,
        positive logits divided by the penalty, negative ones multiplied)
    presence and frequency penalties (OpenAI: over generated tokens only,
        logit -= presence * [count > 0] + frequency * count)
    temperature (divide; 0 means greedy: argmax of the penalized logits, lowest id on ties)
    top-k (HF TopKLogitsWarper: keep logits >= the k-th largest, ties included)
    top-p (HF TopPLogitsWarper: drop the lowest tokens whose cumulative probability <= 1 - top_p)
    min-p (HF MinPLogitsWarper: drop tokens with probability < min_p * max probability)
Removed tokens get -inf. Each warper keeps at least one token.

Reported logprobs are vLLM's "processed_logprobs": the log-softmax of the logits after every
processor (so filtered tokens have -inf and temperature is included); for greedy requests the
temperature is taken as 1, i.e. the log-softmax of the penalized logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from colibri.errors import SamplingError

__all__ = [
    "Sample",
    "Sampler",
    "SamplingParams",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k",
    "apply_top_p",
    "log_softmax",
]

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


def _is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Validated at construction; bad values raise `SamplingError` naming
    the field.

    temperature: >= 0; 0 is greedy. top_k: 0 (off) or a count >= 1. top_p: in (0, 1].
    min_p: in [0, 1]. repetition_penalty: > 0 (1 is off). presence_penalty, frequency_penalty:
    in [-2, 2] (OpenAI's range). seed: None (fresh entropy) or an int >= 0; the same seed and
    logits give the same tokens. logprobs: number of top alternatives to report, 0..20.
    max_tokens: None or >= 1 generated tokens. stop: strings that end generation (a single
    string is accepted); they are not part of the output.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int = 0
    max_tokens: int | None = None
    stop: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> SamplingError:
            return SamplingError(f"{name}={getattr(self, name)!r}: {why}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v):
                raise bad(name, "must be a finite number")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise bad(name, "must be a number in [-2, 2]")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 is greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0 (1 disables it)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 disables it)")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise bad("seed", "must be None or an integer >= 0")
        if not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be None or an integer >= 1")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            stop = tuple(stop)
        except TypeError:
            raise bad("stop", "must be a string or a sequence of strings") from None
        if not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "stop strings must be non-empty strings")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        """True when temperature is 0 (deterministic argmax)."""
        return self.temperature == 0


class Sample(NamedTuple):
    """One sampled token.

    token_id: the chosen id. logprob: its log-probability under the processed distribution (see
    the module docstring). top_logprobs: up to `params.logprobs` (id, logprob) pairs of the most
    likely tokens under the same distribution, most likely first (ties: lowest id first); tokens
    filtered out (-inf) are never listed.
    """

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


def log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax of a 1-D array; -inf entries stay -inf."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x)
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted)))


def apply_penalties(
    logits: np.ndarray,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> np.ndarray:
    """Return float64[vocab] logits with the repetition (HF, over prompt + output) and presence /
    frequency (OpenAI, over output) penalties applied. `logits` is not modified."""
    out = np.array(logits, dtype=np.float64)
    vocab = out.shape[0]
    if repetition_penalty != 1.0:
        seen = np.unique(np.asarray(list(prompt_ids) + list(output_ids), dtype=np.int64))
        s = out[seen]
        out[seen] = np.where(s < 0, s * repetition_penalty, s / repetition_penalty)
    if (presence_penalty or frequency_penalty) and len(output_ids):
        counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=vocab)[:vocab]
        out -= frequency_penalty * counts + presence_penalty * (counts > 0)
    return out


def apply_top_k(logits: np.ndarray, top_k: int) -> np.ndarray:
    """Keep logits >= the k-th largest (ties kept, as HF); others -inf. top_k 0 is a no-op."""
    if top_k <= 0 or top_k >= logits.shape[0]:
        return logits
    kth = np.partition(logits, -top_k)[-top_k]
    return np.where(logits < kth, -np.inf, logits)


def apply_top_p(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Nucleus filtering as HF: sort ascending, drop tokens while the cumulative probability is
    <= 1 - top_p, always keep the most likely token. top_p 1 is a no-op.

    Only the most likely tokens are sorted: the top 1024 (more if they hold less than top_p of
    the mass), since every token below them is dropped anyway. The cumulative sum starts from
    the mass of the unsorted tail, so the result is HF's up to float64 rounding.
    """
    if top_p >= 1.0:
        return logits
    probs = np.exp(log_softmax(logits))
    n, m = logits.shape[0], 1024
    while True:
        if m >= n:
            top = np.arange(n)
            break
        top = np.argpartition(probs, n - m)[n - m :]
        if probs[top].sum() > top_p + 1e-9:
            break
        m *= 8
    order = top[np.argsort(probs[top], kind="stable")]
    cum = max(1.0 - probs[order].sum(), 0.0) + np.cumsum(probs[order])
    remove = cum <= 1.0 - top_p
    remove[-1] = False
    out = np.full_like(logits, -np.inf)
    keep = order[~remove]
    out[keep] = logits[keep]
    return out


def apply_min_p(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens whose probability is < min_p * the largest probability (HF). 0 is a no-op."""
    if min_p <= 0.0:
        return logits
    logp = log_softmax(logits)
    return np.where(logp < np.log(min_p) + np.max(logp), -np.inf, logits)


class Sampler:
    """Draws tokens for one request. Holds a numpy Generator seeded from `params.seed`, so a
    request's tokens depend only on its seed and logits. Not thread-safe; one per request."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def process(
        self, logits: np.ndarray, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = ()
    ) -> np.ndarray:
        """float64[vocab] processed logits (every processor, in order; greedy skips temperature
        and the warpers); filtered tokens are -inf."""
        ids, x = self._process(logits, prompt_ids, output_ids)
        if ids is None:
            return x
        out = np.full(np.shape(logits)[0], -np.inf)
        out[ids] = x
        return out

    def _process(
        self, logits: np.ndarray, prompt_ids: Sequence[int], output_ids: Sequence[int]
    ) -> tuple[np.ndarray | None, np.ndarray]:
        # -> (ids, their processed logits), ids None meaning the whole vocabulary. After top-k
        # only the k survivors are carried: the other tokens have probability 0 in every later
        # step, so top-p, min-p and the softmax over the survivors are unchanged.
        p = self.params
        x = np.asarray(logits)
        if x.ndim != 1 or x.shape[0] == 0:
            raise SamplingError(f"logits must be a non-empty 1-D array, got shape {x.shape}")
        x = apply_penalties(
            x,
            prompt_ids,
            output_ids,
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
        )
        if not np.isfinite(np.max(x)):
            raise SamplingError("logits have no finite maximum (all -inf, +inf or NaN)")
        if p.greedy:
            return None, x
        x = x / p.temperature
        ids = None
        if 0 < p.top_k < x.shape[0]:
            ids = np.flatnonzero(apply_top_k(x, p.top_k) > -np.inf)  # ascending ids
            x = x[ids]
        return ids, apply_min_p(apply_top_p(x, p.top_p), p.min_p)

    def sample(
        self, logits: np.ndarray, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = ()
    ) -> Sample:
        """Pick the next token.

        Args:
            logits: float32 or float64[vocab], the model's raw next-token logits.
            prompt_ids: the prompt's token ids (repetition penalty only).
            output_ids: the tokens generated so far (all penalties).

        Returns a `Sample`. Greedy takes the argmax (lowest id on ties); otherwise one draw from
        the processed distribution by inverse CDF with this sampler's Generator.

        Raises SamplingError if logits are not 1-D or have no finite maximum.
        """
        ids, x = self._process(logits, prompt_ids, output_ids)
        logp = log_softmax(x)
        if self.params.greedy:
            pick = int(np.argmax(x))
        else:
            cdf = np.cumsum(np.exp(logp))
            pick = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
            if pick >= x.shape[0] or not np.isfinite(logp[pick]):  # u rounded up to cdf[-1]
                pick = int(np.flatnonzero(np.isfinite(logp))[-1])
        top: tuple[tuple[int, float], ...] = ()
        if n := min(self.params.logprobs, logp.shape[0]):
            kth = np.partition(logp, -n)[-n]
            cand = np.flatnonzero(logp >= kth)  # ties at the n-th value all included
            best = cand[np.lexsort((cand, -logp[cand]))][:n]  # by logprob, then lowest id
            top = tuple(
                (int(i if ids is None else ids[i]), float(logp[i]))
                for i in best
                if np.isfinite(logp[i])
            )
        token = pick if ids is None else int(ids[pick])
        return Sample(token, float(logp[pick]), top)
