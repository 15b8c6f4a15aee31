"""Log-likelihoods of given tokens, through the engine's public API only.

- `score_requests` / `continuation_logprobs`: the log-probability of each continuation token
  given its context (multiple choice; a server's `echo` prompt logprobs). The longest token
  prefix the requests share is computed once; every request continues from its KV cache
  (Sequence.truncate rewinds it).
- `encode_pair`: lm-evaluation-harness's request tokenization (lm_eval/api/model.py
  `_encode_pair` and HFLM.tok_encode).
- `perplexity`: llama.cpp's llama-perplexity method (tools/perplexity/perplexity.cpp,
  perplexity()): non-overlapping windows of n_ctx tokens, each scored on its second half,
  BOS replacing each window's first token where the tokenizer adds BOS; optionally against a
  reference engine (KL divergence, top-1 agreement, routing agreement per MoE layer).

Log-softmax runs in float64 on the engine's f32 logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colibri.eval.data import EvalError


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis of f32 logits [..., vocab]."""
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def added_bos(tokenizer: Any) -> int | None:
    """The id the tokenizer's post-processor puts in front of encoded text (its BOS), or None
    when it adds nothing in front. Taken from the encoding itself, not from configuration
    (a generation_config.json may name another bos_token_id)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    special = tokenizer.encode("a", add_special_tokens=True)
    if len(special) > len(plain) and special[1 : 1 + len(plain)] == plain:
        return special[0]
    return None


def tok_encode(tokenizer: Any, text: str) -> list[int]:
    """lm-eval HFLM.tok_encode: the tokenizer's special tokens added (BOS where it adds one),
    except when the text already starts with the BOS token's text."""
    bos = tokenizer.bos_token
    special = not (bos and text.startswith(bos))
    return tokenizer.encode(text, add_special_tokens=special)


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's request tokenization: trailing spaces of the context move to the
    continuation; context + continuation is tokenized whole and the continuation is the
    tokens after the context's own count. An empty context becomes [BOS] (else [EOS]), as
    lm-eval's loglikelihood does with prefix_token_id. Returns (context ids, continuation
    ids); raises EvalError when the continuation has no token."""
    if context == "":
        cont = tokenizer.encode(continuation, add_special_tokens=False)
        # HFLM.prefix_token_id: the tokenizer's BOS token, else its EOS token
        name = tokenizer.bos_token or tokenizer.eos_token
        if name is None:
            raise EvalError("empty context and the tokenizer has neither BOS nor EOS")
        prefix = tokenizer.token_to_id(name)
        if cont and cont[0] == prefix:
            ctx_enc, cont_enc = cont[:1], cont[1:]
        else:
            ctx_enc, cont_enc = [prefix], cont
    else:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces > 0:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = tok_encode(tokenizer, context + continuation)
        ctx_enc = tok_encode(tokenizer, context)
        cont_enc = whole[len(ctx_enc) :]
    if not cont_enc:
        raise EvalError(f"continuation {continuation!r} has no token after its context")
    return ctx_enc, cont_enc


@dataclass
class Counters:
    """Tokens fed to the engine and seconds spent in its forward passes."""

    tokens: int = 0
    seconds: float = 0.0


async def _feed(
    engine: Any,
    seq: Any,
    tokens: Sequence[int],
    all_logits: bool,
    counters: Counters | None,
    logits_from: int = 0,
) -> np.ndarray:
    """engine.forward in prefill chunks (engine.prefill_chunk tokens, as `colibri run`
    prefills); all_logits: the rows of tokens[logits_from:], f32 [len(tokens) - logits_from,
    vocab] (else the last row [vocab])."""
    chunk = getattr(engine, "prefill_chunk", 256)
    rows, last = [], None
    t0 = time.perf_counter()
    for start in range(0, len(tokens), chunk):
        part = list(tokens[start : start + chunk])
        skip = max(0, logits_from - start)
        if all_logits and skip < len(part):
            rows.append(await engine.forward(seq, part, all_logits=True, logits_from=skip))
        else:
            last = await engine.forward(seq, part)
    if counters is not None:
        counters.tokens += len(tokens)
        counters.seconds += time.perf_counter() - t0
    if all_logits:
        return np.concatenate(rows) if rows else np.zeros((0, engine.spec.vocab_size), np.float32)
    return last  # type: ignore[return-value]


async def score_requests(
    engine: Any,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    counters: Counters | None = None,
) -> list[np.ndarray]:
    """Log-probabilities of each request's continuation tokens given its context.

    requests: (context ids, continuation ids) pairs, both non-empty. The sequences share their
    longest common token prefix (at most the shortest context), fed once; each request then
    continues from that prefix's KV cache. Returns one float64 [len(continuation)] array per
    request: log p(continuation[j] | context + continuation[:j]). Raises EvalError when a
    request is empty or does not fit in the engine's context (engine.n_ctx)."""
    if not requests:
        return []
    seqs = [list(c) + list(t) for c, t in requests]
    for c, t in requests:
        if not c or not t:
            raise EvalError("a request needs a non-empty context and continuation")
    need = max(len(s) for s in seqs) - 1
    if need > engine.n_ctx:
        raise EvalError(
            f"request of {need + 1} tokens exceeds the context length {engine.n_ctx} (--ctx)"
        )
    shared = min(len(c) for c, _ in requests)
    first = seqs[0]
    for s in seqs[1:]:
        n = 0
        while n < shared and s[n] == first[n]:
            n += 1
        shared = n
    seq = engine.new_sequence(n_ctx=max(1, need))
    try:
        last = await _feed(engine, seq, first[:shared], False, counters) if shared else None
        snap = seq.snapshot()  # the shared context, restored before each choice
        out = []
        for (ctx, _), s in zip(requests, seqs, strict=True):
            seq.restore(snap)
            rows = await _feed(engine, seq, s[shared:-1], True, counters)
            offset = 0
            if last is not None:
                rows, offset = np.concatenate([last[None], rows]), shared - 1
            pos = np.arange(len(ctx) - 1, len(s) - 1)  # logits at pos predict s[pos + 1]
            lp = log_softmax(rows[pos - offset])
            out.append(lp[np.arange(len(pos)), np.asarray(s)[pos + 1]])
        return out
    finally:
        seq.kv = None  # free the KV cache now


async def continuation_logprobs(
    engine: Any, context: Sequence[int], continuations: Sequence[Sequence[int]]
) -> list[np.ndarray]:
    """Log-probabilities of the tokens of each continuation after one shared context
    (computed once); see score_requests. For a prompt's own token logprobs (an OpenAI
    `echo`), call it with context=prompt[:1], continuations=[prompt[1:]]."""
    return await score_requests(engine, [(context, c) for c in continuations])


# ---- perplexity ---------------------------------------------------------------------------


def ppl_and_stderr(nll: np.ndarray) -> tuple[float, float]:
    """PPL = exp(mean nll) and its standard error as llama-perplexity prints it:
    PPL * sqrt((E[nll^2] - E[nll]^2) / (count - 1))."""
    nll = np.asarray(nll, dtype=np.float64)
    mean = float(nll.mean())
    ppl = float(np.exp(mean))
    var = float((nll * nll).mean() - mean * mean)
    err = ppl * float(np.sqrt(var / (len(nll) - 1))) if var > 0 and len(nll) > 1 else 0.0
    return ppl, err


@dataclass
class PerplexityResult:
    """nll: float64 [tokens scored]; with a reference also kl (KL(reference || this) per
    scored token), top1 (bool, same argmax), ref_nll, and per MoE layer routing_agreement
    (fraction of tokens fed whose top-k set equals the reference's) and routing_overlap
    (mean |ours ∩ reference| / top_k); moe_layers: their layer indices."""

    nll: np.ndarray
    counters: Counters
    kl: np.ndarray | None = None
    top1: np.ndarray | None = None
    ref_nll: np.ndarray | None = None
    moe_layers: list[int] = field(default_factory=list)
    routing_agreement: list[float] = field(default_factory=list)
    routing_overlap: list[float] = field(default_factory=list)


def windows(tokens: Sequence[int], n_ctx: int, bos: int | None, limit: int | None = None):
    """llama-perplexity's windows: [tokens[i*n_ctx : (i+1)*n_ctx] for every whole window]
    (at most `limit`), each first token replaced by `bos` when not None."""
    n = len(tokens) // n_ctx
    if limit is not None:
        n = min(n, limit)
    out = []
    for i in range(n):
        w = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if bos is not None:
            w[0] = bos
        out.append(w)
    return out


def text_tokens(tokenizer: Any, text: str) -> tuple[list[int], int | None]:
    """llama-perplexity's tokenization: the text with BOS in front where the tokenizer adds
    BOS. Returns (ids, the BOS id or None)."""
    bos = added_bos(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ([bos] if bos is not None else []) + ids, bos


async def _window(engine: Any, w: list[int], first: int, counters: Counters | None):
    """Logits f32 [n_ctx - 1 - first, vocab] of positions first .. n_ctx-2, and the routing
    (int32 [n_ctx - 1, layers, top_k]) of the tokens fed."""
    seq = engine.new_sequence(n_ctx=len(w))
    try:
        with engine.capture_routing() as tracer:  # one pass, logits of the scored half only
            rows = await _feed(engine, seq, w[:-1], True, counters, logits_from=first)
        return rows, tracer.trace().experts
    finally:
        seq.kv = None


async def perplexity(
    engine: Any,
    tokens: Sequence[int],
    n_ctx: int,
    *,
    bos: int | None = None,
    reference: Any | None = None,
    limit: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> PerplexityResult:
    """Score `tokens` as llama-perplexity does (module docstring), with `reference` (another
    engine on the same model) per-token KL(reference || engine), top-1 agreement and routing
    agreement on the same windows. progress(1) is called after each window.
    Raises EvalError when not one window of n_ctx tokens fits in the text, or n_ctx < 4."""
    if n_ctx < 4:
        raise EvalError(f"--ctx {n_ctx}: a perplexity window needs at least 4 tokens")
    ws = windows(tokens, n_ctx, bos, limit)
    if not ws:
        raise EvalError(
            f"the text has {len(tokens)} tokens, fewer than one window of --ctx {n_ctx}"
        )
    first = n_ctx // 2
    counters = Counters()
    moe = [s.index for s in engine.spec.layers if s.moe]
    nll, kl, top1, ref_nll = [], [], [], []
    same = np.zeros(len(moe))
    overlap = np.zeros(len(moe))
    routed = 0
    for w in ws:
        rows, routes = await _window(engine, w, first, counters)
        targets = np.asarray(w[first + 1 :])
        lp = log_softmax(rows)
        idx = np.arange(len(targets))
        nll.append(-lp[idx, targets])
        if reference is not None:
            ref_rows, ref_routes = await _window(reference, w, first, None)
            ref_lp = log_softmax(ref_rows)
            kl.append((np.exp(ref_lp) * (ref_lp - lp)).sum(axis=1))
            top1.append(ref_rows.argmax(axis=1) == rows.argmax(axis=1))
            ref_nll.append(-ref_lp[idx, targets])
            if moe:
                a = np.sort(routes[:, moe], axis=-1)
                b = np.sort(ref_routes[:, moe], axis=-1)
                same += (a == b).all(axis=-1).sum(axis=0)
                k = a.shape[-1]
                overlap += (a[..., :, None] == b[..., None, :]).any(-1).sum(-1).sum(0) / k
                routed += a.shape[0]
        if progress is not None:
            progress(1)
    res = PerplexityResult(np.concatenate(nll), counters, moe_layers=moe)
    if reference is not None:
        res.kl, res.top1 = np.concatenate(kl), np.concatenate(top1)
        res.ref_nll = np.concatenate(ref_nll)
        if routed:
            res.routing_agreement = (same / routed).tolist()
            res.routing_overlap = (overlap / routed).tolist()
    return res


def check_same_model(engine: Any, reference: Any, ref_path: str) -> None:
    """Raise EvalError unless `reference` runs the same model as `engine` (model_type,
    vocab_size, d_model, layers, experts, top_k): only the storage format may differ."""
    a, b = engine.spec, reference.spec
    checks = [
        ("model_type", a.model_type, b.model_type),
        ("vocab_size", a.vocab_size, b.vocab_size),
        ("hidden size", a.d_model, b.d_model),
        ("layers", len(a.layers), len(b.layers)),
        ("experts", a.moe.router.num_experts, b.moe.router.num_experts),
        ("experts per token", a.moe.router.top_k, b.moe.router.top_k),
        ("MoE layers", [s.moe for s in a.layers], [s.moe for s in b.layers]),
    ]
    for what, x, y in checks:
        if x != y:
            raise EvalError(
                f"--reference {ref_path}: another model ({what} {y} there, {x} here); "
                "the reference must be the same model in another format"
            )


# ---- multiple-choice metrics ----------------------------------------------------------------


def mean_stderr(x: Sequence[float]) -> float:
    """lm-eval's mean_stderr: sample standard deviation (n - 1) / sqrt(n); 0 for n < 2."""
    a = np.asarray(x, dtype=np.float64)
    if len(a) < 2:
        return 0.0
    return float(np.sqrt(((a - a.mean()) ** 2).sum() / (len(a) - 1)) / np.sqrt(len(a)))


def choose(logprobs: Sequence[float], nchars: Sequence[int]) -> tuple[int, int]:
    """lm-eval's multiple-choice decision: (argmax of the summed log-likelihoods, argmax of
    those divided by each choice string's length in characters)."""
    lls = np.asarray(logprobs, dtype=np.float64)
    return int(np.argmax(lls)), int(np.argmax(lls / np.asarray(nchars, dtype=np.float64)))
