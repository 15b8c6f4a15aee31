"""Log-likelihoods of given tokens, through the engine's public API only.

- `score_items` / `score_requests` / `continuation_logprobs`: the log-probability of each
  continuation token given its context (multiple choice). The longest token prefix an item's
  requests share is computed once; every request continues from a fork of its KV cache
  (Sequence.fork); items are scored in groups through batched forwards
  (Engine.forward_batch): the group's prefixes together, then all their continuations.
- `encode_pair`: lm-evaluation-harness's request tokenization (lm_eval/api/model.py
  `_encode_pair` and HFLM.tok_encode).
- `perplexity`: llama.cpp's llama-perplexity method (tools/perplexity/perplexity.cpp,
  perplexity()): non-overlapping windows of n_ctx tokens, each scored on its second half,
  BOS replacing each window's first token where the tokenizer adds BOS; optionally against a
  reference engine (KL divergence, top-1 agreement, routing agreement per MoE layer);
  windows are fed side by side in batched forwards too.

Log-probabilities are float64: a target's f32 logit minus its row's log-sum-exp
(ops.logsumexp: exps in f32, their sums in f64).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colibri.compute import ops
from colibri.eval.data import EvalError


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis of f32 logits [..., vocab]: x - logsumexp(x)
    (ops.logsumexp: the row's max, the exps in f32, their sums in f64)."""
    x = np.ascontiguousarray(logits, dtype=np.float32)
    return x.astype(np.float64) - ops.logsumexp(x)[..., None]


def target_logprobs(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """float64 log-softmax(logits[i])[targets[i]] for f32 logits [n, vocab] and int targets
    [n]: the target's logit minus the row's log-sum-exp (ops.logsumexp, one pass in C over
    both threads), without a log-softmax array."""
    x = np.ascontiguousarray(logits, dtype=np.float32)
    return x[np.arange(len(targets)), targets].astype(np.float64) - ops.logsumexp(x)


# rows of logits one block of compare_logits works on (two f32 temporaries of this many rows)
COMPARE_BLOCK = 16


def compare_logits(
    logits: np.ndarray, ref_logits: np.ndarray, targets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row of f32 logits [n, vocab] and the reference's f32 [n, vocab] with token ids
    targets [n]: (nll, ref_nll, kl, top1) = (-log p(target), -log p_ref(target),
    KL(p_ref || p), argmax p == argmax p_ref), float64 [n] x 3 and bool [n]. nll and ref_nll:
    the target's logit minus the row's log-sum-exp (ops.logsumexp). KL in float64 on blocks
    of COMPARE_BLOCK rows (no [n, vocab] float64 array), from d = ref_logits - logits and
    e = exp(ref_logits - max) alone, so that neither log-sum-exp's rounding enters it:
    KL = sum_j p_ref,j d_j - (L_ref - L) with L_ref - L = -log1p(sum_j p_ref,j expm1(-d_j))
    and p_ref = e / sum e (precise for small d, where KL is small). A row equal to its
    reference gives KL exactly 0."""
    x = np.ascontiguousarray(logits, dtype=np.float32)
    xr = np.ascontiguousarray(ref_logits, dtype=np.float32)
    t = np.asarray(targets)
    idx = np.arange(len(t))
    nll = ops.logsumexp(x) - x[idx, t].astype(np.float64)
    ref_nll = ops.logsumexp(xr) - xr[idx, t].astype(np.float64)
    top1 = x.argmax(axis=1) == xr.argmax(axis=1)
    kl = np.empty(len(t), np.float64)
    for a in range(0, len(t), COMPARE_BLOCK):
        r = xr[a : a + COMPARE_BLOCK].astype(np.float64)
        d = r - x[a : a + COMPARE_BLOCK]  # exact: the difference of two f32 in f64
        r -= r.max(axis=1, keepdims=True)
        np.exp(r, out=r)  # e
        s0 = r.sum(axis=1)
        s1 = np.einsum("ij,ij->i", r, d)
        np.negative(d, out=d)
        np.expm1(d, out=d)
        s2 = np.einsum("ij,ij->i", r, d)  # sum e (exp(-d) - 1)
        kl[a : a + len(s0)] = s1 / s0 + np.log1p(s2 / s0)
    return nll, ref_nll, kl, top1


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


def encode_pair(
    tokenizer: Any,
    context: str,
    continuation: str,
    contexts: dict[str, list[int]] | None = None,
) -> tuple[list[int], list[int]]:
    """lm-eval's request tokenization: trailing spaces of the context move to the
    continuation; context + continuation is tokenized whole and the continuation is the
    tokens after the context's own count. An empty context becomes [BOS] (else [EOS]), as
    lm-eval's loglikelihood does with prefix_token_id. contexts: a dict the context's own
    tokens are kept in and taken from (one tokenization of a context that every choice of an
    item shares). Returns (context ids, continuation ids); raises EvalError when the
    continuation has no token."""
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
        if contexts is None:
            ctx_enc = tok_encode(tokenizer, context)
        else:
            if context not in contexts:
                contexts[context] = tok_encode(tokenizer, context)
            ctx_enc = list(contexts[context])
        cont_enc = whole[len(ctx_enc) :]
    if not cont_enc:
        raise EvalError(f"continuation {continuation!r} has no token after its context")
    return ctx_enc, cont_enc


@dataclass
class Counters:
    """Tokens fed to the engine and seconds spent in its forward passes."""

    tokens: int = 0
    seconds: float = 0.0


# at most this many sequences in one batched forward, and this much KV cache and logits
# held by one batch of windows
MAX_BATCH = 16
BATCH_NBYTES = 256 << 20
# a group of multiple-choice items: at most CHOICE_BATCH sequences (every choice one) and
# CHOICE_NBYTES of KV cache, and no more items once it feeds CHOICE_CHUNKS x the engine's
# prefill_chunk tokens. A group takes about two forward steps (prefixes, then continuations),
# each reading every routed expert once (out of core: from the store), where prefill reads
# them once per prefill_chunk tokens: CHOICE_CHUNKS 4 reads fewer expert bytes per token
# than prefill whenever the KV budget lets a group grow that far.
CHOICE_BATCH = 64
CHOICE_NBYTES = 1 << 30
CHOICE_CHUNKS = 4


async def _feed_batch(
    engine: Any,
    seqs: Sequence[Any],
    tokens: Sequence[Sequence[int]],
    logits_from: Sequence[int | None],
    counters: Counters | None,
    targets: Sequence[Sequence[int]] | None = None,
) -> tuple[list[np.ndarray], list[list[tuple[int, int]]]]:
    """Feed tokens[s] into seqs[s], every sequence in the same batched forwards
    (Engine.forward_batch): step j takes chunk j (engine.prefill_chunk tokens, the chunks of
    `colibri run`'s prefill) of each sequence that has one. logits_from[s] None: the last
    row's logits f32 [vocab] (zeros when tokens[s] is empty); else the rows of
    tokens[s][logits_from[s]:], f32 [len(tokens[s]) - logits_from[s], vocab], or with
    `targets` (targets[s]: one token id per such row) the log-probabilities of those ids,
    float64 [len(tokens[s]) - logits_from[s]] (the engine's scoring: no logits array). Also
    returns per step the (sequence, tokens fed) in the order the forward saw them (what a
    routing trace of the span records)."""
    chunk = getattr(engine, "prefill_chunk", 256)
    vocab = engine.spec.vocab_size
    rows: list[list[np.ndarray]] = [[] for _ in seqs]
    last = [np.zeros(vocab, np.float32) for _ in seqs]
    steps: list[list[tuple[int, int]]] = []
    t0 = time.perf_counter()
    n_steps = max((-(-len(t) // chunk) for t in tokens), default=0)
    for j in range(n_steps):
        start = j * chunk
        idx, parts, full, first, tgts = [], [], [], [], []
        for s, t in enumerate(tokens):
            part = list(t[start : start + chunk])
            if not part:
                continue
            lf = logits_from[s]
            skip = 0 if lf is None else max(0, lf - start)
            want = lf is not None and skip < len(part)
            idx.append(s)
            parts.append(part)
            full.append(want)
            first.append(skip if want else 0)
            if targets is not None and want:
                assert lf is not None
                tgts.append(targets[s][start + skip - lf : start + len(part) - lf])
            else:
                tgts.append(None)
        outs = await engine.forward_batch(
            [seqs[s] for s in idx], parts, full, first, tgts if targets is not None else ()
        )
        for s, want, out in zip(idx, full, outs, strict=True):
            if want:
                rows[s].append(out)
            else:
                last[s] = out
        steps.append([(s, len(p)) for s, p in zip(idx, parts, strict=True)])
    if counters is not None:
        counters.tokens += sum(len(t) for t in tokens)
        counters.seconds += time.perf_counter() - t0
    result = []
    empty = np.zeros(0, np.float64) if targets is not None else np.zeros((0, vocab), np.float32)
    for s, lf in enumerate(logits_from):
        if lf is None:
            result.append(last[s])
        else:
            result.append(np.concatenate(rows[s]) if rows[s] else empty)
    return result, steps


def _shared_prefix(requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> int:
    """The longest common token prefix of the requests' sequences, at most the shortest
    context."""
    seqs = [list(c) + list(t) for c, t in requests]
    shared = min(len(c) for c, _ in requests)
    first = seqs[0]
    for s in seqs[1:]:
        n = 0
        while n < shared and s[n] == first[n]:
            n += 1
        shared = n
    return shared


def _check_requests(engine: Any, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> int:
    """The KV length the item needs; raises EvalError (empty request, too long)."""
    for c, t in requests:
        if not c or not t:
            raise EvalError("a request needs a non-empty context and continuation")
    need = max(len(c) + len(t) for c, t in requests) - 1
    if need > engine.n_ctx:
        raise EvalError(
            f"request of {need + 1} tokens exceeds the context length {engine.n_ctx} (--ctx)"
        )
    return need


async def score_items(
    engine: Any,
    items: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]],
    counters: Counters | None = None,
    *,
    max_batch: int = CHOICE_BATCH,
    progress: Callable[[int], None] | None = None,
) -> list[list[np.ndarray]]:
    """score_requests of every item, items batched: a group of items (at most max_batch
    sequences, CHOICE_NBYTES of KV cache, items added until it feeds CHOICE_CHUNKS x
    engine.prefill_chunk tokens) prefills its shared prefixes in one batched forward
    per chunk; each request then continues from a fork of its item's prefix KV cache, all the
    group's continuations in one batched forward per chunk. In the default split batch mode
    every log-probability is bit-identical to scoring the item alone. progress(n) after each
    group of n items. Raises EvalError naming the item (an empty request, one longer than
    the context)."""
    from colibri.model import KVCache

    dtype = np.float16 if getattr(engine.options, "kv_dtype", "f32") == "f16" else np.float32
    needs = []
    for i, reqs in enumerate(items):
        if not reqs:
            raise EvalError(f"item {i}: no requests")
        try:
            needs.append(_check_requests(engine, reqs))
        except EvalError as exc:
            raise EvalError(f"item {i}: {exc}") from None
    out: list[list[np.ndarray]] = []
    enough = CHOICE_CHUNKS * getattr(engine, "prefill_chunk", 256)
    i = 0
    while i < len(items):
        group, n_seqs, nbytes, fed = [], 0, 0, 0
        while i < len(items) and fed < enough:
            n = len(items[i])
            kv = (n + 1) * KVCache.nbytes_for(engine.spec, max(1, needs[i]), dtype)
            if group and (n_seqs + n > max_batch or nbytes + kv > CHOICE_NBYTES):
                break
            group.append(i)
            n_seqs, nbytes, i = n_seqs + n, nbytes + kv, i + 1
            fed += _fed(items[group[-1]])
        out += await _score_group(engine, [items[g] for g in group],
                                  [needs[g] for g in group], counters)  # fmt: skip
        if progress is not None:
            progress(len(group))
    return out


def _fed(requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> int:
    """Tokens an item feeds: its shared prefix once, each request's rest but the last."""
    n = _shared_prefix(requests)
    return n + sum(len(c) + len(t) - 1 - n for c, t in requests)


async def _score_group(
    engine: Any,
    items: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]],
    needs: Sequence[int],
    counters: Counters | None,
) -> list[list[np.ndarray]]:
    bases = [engine.new_sequence(n_ctx=max(1, n)) for n in needs]
    forks: list[Any] = []
    try:
        shared = [_shared_prefix(reqs) for reqs in items]
        seqs = [[list(c) + list(t) for c, t in reqs] for reqs in items]
        lasts, _ = await _feed_batch(
            engine, bases, [s[0][:n] for s, n in zip(seqs, shared, strict=True)],
            [None] * len(items), counters,
        )  # fmt: skip
        owner, tails, froms, targets = [], [], [], []
        for k, (reqs, ss, n) in enumerate(zip(items, seqs, shared, strict=True)):
            for j, s in enumerate(ss):
                # the last request of an item continues in the item's own sequence
                forks.append(bases[k] if j == len(reqs) - 1 else bases[k].fork())
                owner.append((k, j))
                tails.append(s[n:-1])  # positions n .. len(s) - 2
                # only the scored positions len(ctx) - 1 .. len(s) - 2 go through the head;
                # the row at n - 1 (the prefix's last) is the first when len(ctx) == n
                lf = max(0, len(reqs[j][0]) - 1 - n)
                froms.append(lf)
                targets.append(s[n + 1 + lf :])  # logits at pos predict s[pos + 1]
        lps, _ = await _feed_batch(engine, forks, tails, froms, counters, targets)
        # the requests whose context ends where the shared prefix does take their first
        # log-probability from the prefix's last row: one log-sum-exp per such item (a row's
        # log-sum-exp does not depend on the rows beside it), not one per request
        firsts = sorted({k for k, j in owner if len(items[k][j][0]) == shared[k]})
        lse = dict(zip(firsts, ops.logsumexp(np.stack([lasts[k] for k in firsts])), strict=True)
                   if firsts else ())  # fmt: skip
        out: list[list[np.ndarray]] = [[] for _ in items]
        for (k, j), lp in zip(owner, lps, strict=True):
            s, n = seqs[k][j], shared[k]
            if k in lse and len(items[k][j][0]) == n:
                head = np.float64(lasts[k][s[n]]) - lse[k]
                lp = np.concatenate([[head], lp])
            out[k].append(lp)
        return out
    finally:
        for seq in bases + forks:
            seq.kv = None  # free the KV caches now


async def score_requests(
    engine: Any,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    counters: Counters | None = None,
) -> list[np.ndarray]:
    """Log-probabilities of each request's continuation tokens given its context.

    requests: (context ids, continuation ids) pairs, both non-empty. The sequences share their
    longest common token prefix (at most the shortest context), fed once; each request then
    continues from a fork of that prefix's KV cache, every request in the same batched
    forward. Returns one float64 [len(continuation)] array per request:
    log p(continuation[j] | context + continuation[:j]). Raises EvalError when a
    request is empty or does not fit in the engine's context (engine.n_ctx)."""
    if not requests:
        return []
    need = _check_requests(engine, requests)
    return (await _score_group(engine, [requests], [need], counters))[0]


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


async def _windows(
    engine: Any,
    ws: list[list[int]],
    first: int,
    counters: Counters | None,
    routing: bool,
    scored: bool = False,
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Per window: logits f32 [n_ctx - 1 - first, vocab] of positions first .. n_ctx-2 (with
    `scored` instead the log-probabilities float64 [n_ctx - 1 - first] of the tokens they
    predict, w[first + 1:]) and, with `routing`, the routing (int32 [n_ctx - 1, layers,
    top_k]) of the tokens fed; the windows fed side by side in batched forwards."""
    seqs = [engine.new_sequence(n_ctx=len(w)) for w in ws]
    feed = [w[:-1] for w in ws]
    try:
        if not routing:
            targets = [w[first + 1 :] for w in ws] if scored else None
            rows, _ = await _feed_batch(engine, seqs, feed, [first] * len(ws), counters, targets)
            return rows, None
        with engine.capture_routing() as tracer:  # one pass, logits of the scored half only
            rows, steps = await _feed_batch(engine, seqs, feed, [first] * len(ws), counters)
        experts = tracer.trace().experts
    finally:
        for seq in seqs:
            seq.kv = None
    # the trace holds each step's tokens sequence after sequence: cut it back per window
    parts: list[list[np.ndarray]] = [[] for _ in ws]
    t = 0
    for step in steps:
        for s, n in step:
            parts[s].append(experts[t : t + n])
            t += n
    return rows, [np.concatenate(p) for p in parts]


def _window_group(engine: Any, n_ctx: int, first: int, logits: bool = True) -> int:
    """How many windows one batch holds: MAX_BATCH, fewer when their KV caches and (with
    `logits`: against a reference) their logits would pass BATCH_NBYTES."""
    from colibri.model import KVCache

    per = (n_ctx - 1 - first) * (engine.spec.vocab_size * 4 if logits else 8)
    per += KVCache.nbytes_for(engine.spec, n_ctx, np.float32)
    return max(1, min(MAX_BATCH, BATCH_NBYTES // max(1, per)))


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
    agreement on the same windows, fed in batches of windows (Engine.forward_batch).
    progress(n) is called after each batch of n windows.
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
    group = _window_group(engine, n_ctx, first, logits=reference is not None)
    for g in range(0, len(ws), group):
        batch = ws[g : g + group]
        routing = reference is not None and bool(moe)
        got = await _windows(engine, batch, first, counters, routing, reference is None)
        ref = None
        if reference is not None:
            ref = await _windows(reference, batch, first, None, routing)
        for b, w in enumerate(batch):
            rows = got[0][b]
            targets = np.asarray(w[first + 1 :])
            if ref is None:  # rows: the log-probabilities of the targets
                nll.append(-rows)
                continue
            n, r_n, k, t1 = compare_logits(rows, ref[0][b], targets)
            nll.append(n)
            ref_nll.append(r_n)
            kl.append(k)
            top1.append(t1)
            if routing:
                assert got[1] is not None and ref[1] is not None
                a = np.sort(got[1][b][:, moe], axis=-1)
                r = np.sort(ref[1][b][:, moe], axis=-1)
                same += (a == r).all(axis=-1).sum(axis=0)
                k = a.shape[-1]
                overlap += (a[..., :, None] == r[..., None, :]).any(-1).sum(-1).sum(0) / k
                routed += a.shape[0]
        if progress is not None:
            progress(len(batch))
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
    vocab_size, d_model, layers, experts, top_k, and where both have one the tokenizer: the
    same ids for TOKENIZER_PROBE): only the storage format may differ."""
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
    ta, tb = getattr(engine, "tokenizer", None), getattr(reference, "tokenizer", None)
    if ta is not None and tb is not None:  # same sizes, another vocabulary: KL would be noise
        ids, ref_ids = ta.encode(TOKENIZER_PROBE), tb.encode(TOKENIZER_PROBE)
        if ids != ref_ids:
            raise EvalError(
                f"--reference {ref_path}: another tokenizer (its tokenizer.json encodes a probe "
                f"text as {ref_ids[:6]}..., this store's as {ids[:6]}...); the reference must "
                "be the same model in another format"
            )


# a text whose tokens tell tokenizers apart (words, digits, punctuation, accents, spaces)
TOKENIZER_PROBE = "The quick brown fox jumps over 13 lazy dogs; naïve café, 1984-2026!  \n\tx"


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
