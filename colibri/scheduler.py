"""Continuous batching: the scheduler that owns an engine's running sequences.

Engine.stream() submits a Generation and reads its Token items from a queue; one task per
engine runs the steps. Each step is one Pipeline.forward_batch over every running sequence:
one decode token for each sequence that is generating, plus prompt chunks of sequences still
in prefill, at most `prefill_chunk` prompt tokens a step (one chunk at least), so a long
prompt is prefilled in pieces between the decode steps of the others instead of stalling
them. Prompt chunks are cut at multiples of `prefill_chunk` from the sequence's first
position, the same cuts as when the sequence runs alone: with the pipeline's per-sequence
kernel calls, a request's tokens do not depend on what else runs (batch invariance).
New requests join between steps, up to `max_running` sequences; the rest wait in FIFO order.

Expert-aware admission: when the expert cache cannot hold every expert, the batch is also
kept small enough that its working set fits: the expert records a decode step requests per
sequence are measured (an average over recent steps, so routing overlap between sequences
counts), and a new sequence joins only while (running + 1) x that <= the cache's slots.
Past that, the cache evicts each sequence's experts before its next token needs them
(measured under LRU: 4 concurrent streams on a 1/4 budget fell from a 90% to an 8% hit rate
and ran at half the aggregate speed of one stream). No margin beyond the fit: on the
OLMoE-shaped synthetic store (64 experts of 8 per token, 4 layers, nextuse policy), a 1/4
budget holds exactly 2 sequences' records, and 2 together ran 1.4-1.8x the tok/s of one
(hit rate 92% -> 81%, 40% more bytes read per token, but half the steps); at 3/4, 6 together
kept a 98% hit rate and cost no more CPU per token than 4.

Cancellation (a consumer that stops reading, a client that disconnects): the sequence leaves
the batch at the end of the current step and its KV cache is freed; when it is alone in the
step, the step itself is cancelled at once (the pipeline releases every record it holds).
Closing the engine ends every sequence with finish_reason "cancelled".
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri.sampling import Sampler, SamplingParams
from colibri.tokenizer import StopChecker


@dataclass(frozen=True)
class GenerationStatistics:
    """One stream's figures. Times in seconds; ttft: from the call to the first token;
    decode_tok_s: generated tokens after the first / their time. hit_rate, bytes_read,
    expert_hits (gets served from RAM), expert_misses (gets that needed or waited on a
    read): expert cache figures while this stream ran (shared with concurrent streams).
    prefix_tokens: prompt tokens whose KV came from the prefix cache."""

    prompt_tokens: int
    generated_tokens: int
    ttft: float
    decode_tok_s: float
    total_seconds: float
    hit_rate: float
    bytes_read: int
    wait_io_seconds: float
    compute_seconds: float
    expert_hits: int = 0
    expert_misses: int = 0
    prefix_tokens: int = 0

    @property
    def bytes_read_per_token(self) -> float:
        return self.bytes_read / max(1, self.generated_tokens)


@dataclass(frozen=True)
class Token:
    """One item of engine.stream().

    text: the new text (may be "" while a multi-byte character or a possible stop string is
    held back). token_id: the sampled id (None on a final item that only flushes text).
    logprob: its log-probability under the processed distribution; top_logprobs: (id,
    logprob) alternatives when asked for. finish_reason: None, or on the last item "stop"
    (EOS or a stop string), "length" (max_tokens or the context is full) or "cancelled"
    (the engine was closed). statistics: on the last item only. stop: on the last item, the
    stop string that ended generation (None for EOS or another reason).
    """

    text: str
    token_id: int | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = None
    statistics: GenerationStatistics | None = None
    stop: str | None = None


class Generation:
    """One request inside the scheduler: prompt ids, its Sequence (KV cache), sampler,
    detokenizer, stop strings, and the queue its Token items go to.

    seq: a sequence of the caller's (a Session's) whose first `seq.length` tokens are the
    prompt's already (fed from there on); its KV cache is kept when the generation ends, the
    prefix cache is left out, and a step it is in runs to its end even when it is cancelled
    (its KV cache stays whole). None: a fresh sequence, freed at the end."""

    def __init__(
        self,
        engine: Any,
        ids: list[int],
        params: SamplingParams,
        eos: frozenset[int],
        t0: float,
        seq: Any = None,
    ) -> None:
        self.engine, self.ids, self.params, self.eos, self.t0 = engine, ids, params, eos, t0
        self.max_tokens = params.max_tokens or 1
        self.keep_kv = seq is not None
        self.seq = seq if seq is not None else engine.new_sequence()
        self.pos = self.seq.length  # prompt tokens already in the KV cache
        self.start = self.pos  # of them, those the caller's sequence held before
        self.prefix_tokens = 0
        self.sampler = Sampler(params)
        tok = engine.tokenizer
        self.decoder = tok.stream_decoder(ids) if tok is not None else None
        self.stops = StopChecker(params.stop)
        self.out: list[int] = []
        self.queue: asyncio.Queue[Token | BaseException] = asyncio.Queue()
        self.t_first: float | None = None
        self.s0 = engine.statistics(components=False)
        self.done = False
        self.cancelled = False
        self.settled: asyncio.Future | None = None  # cancel() of a keep_kv gen mid-step

    def reuse_prefix(self) -> None:
        """Take the longest stored prefix of the prompt from the engine's prefix cache."""
        pc = self.engine.prefix_cache
        if pc is not None and self.pos == 0 and not self.keep_kv:
            self.pos = self.prefix_tokens = pc.lookup(self.ids, self.seq.kv)
            self.seq.tokens.extend(self.ids[: self.pos])
            self.engine._counts["prefix_hits"] += self.pos

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.ids)

    def next_tokens(self, chunk: int) -> list[int]:
        """What this sequence feeds in the next step: a prompt chunk (cut at multiples of
        `chunk`) or its last sampled token."""
        if self.prefilling:
            end = min(len(self.ids), (self.pos // chunk + 1) * chunk)
            return self.ids[self.pos : end]
        return [self.out[-1]]

    def advance(self, fed: list[int], logits: np.ndarray) -> None:
        """Account for a finished step; sample and emit a token when the prompt is done."""
        self.seq.tokens.extend(fed)
        if self.prefilling:
            self.pos += len(fed)
            if self.prefilling:
                return
            self.engine._counts["prompt_tokens"] += len(self.ids) - self.start
            if self.engine.prefix_cache is not None and not self.keep_kv:
                self.engine.prefix_cache.store(self.ids, self.seq.kv)
        s = self.sampler.sample(logits, self.ids, self.out)
        self.out.append(s.token_id)
        self.engine._counts["generated_tokens"] += 1
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if s.token_id in self.eos:
            self.queue.put_nowait(Token("", s.token_id, s.logprob, s.top_logprobs))
            return self.finish("stop")
        text = self.decoder.push(s.token_id) if self.decoder is not None else ""
        text, stopped = self.stops.push(text)
        self.queue.put_nowait(Token(text, s.token_id, s.logprob, s.top_logprobs))
        if stopped:
            return self.finish("stop")
        if len(self.out) >= self.max_tokens or self.seq.length + 1 > self.seq.kv.n_ctx:
            return self.finish("length")

    def finish(self, reason: str) -> None:
        """Emit the last item (held-back text, finish_reason, statistics); free the KV."""
        if self.done:
            return
        self.done = True
        self.release()
        tail = ""
        if not self.stops.stopped and self.decoder is not None:  # EOS and length flush too
            tail, _ = self.stops.push(self.decoder.flush())
            tail += self.stops.flush()
        t_end = time.perf_counter()
        d = self.engine.statistics(components=False).delta(self.s0)
        t_first = self.t_first or t_end
        n = len(self.out)
        stats = GenerationStatistics(
            prompt_tokens=len(self.ids) - self.start,
            generated_tokens=n,
            ttft=t_first - self.t0,
            decode_tok_s=(n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else 0.0,
            total_seconds=t_end - self.t0,
            hit_rate=d.hit_rate,
            bytes_read=d.bytes_read,
            wait_io_seconds=d.wait_io_seconds,
            compute_seconds=d.compute_seconds,
            expert_hits=d.expert_hits,
            expert_misses=d.expert_misses,
            prefix_tokens=self.prefix_tokens,
        )
        self.queue.put_nowait(
            Token(tail, None, finish_reason=reason, statistics=stats, stop=self.stops.matched)
        )

    def fail(self, exc: BaseException) -> None:
        if not self.done:
            self.done = True
            self.release()
            self.queue.put_nowait(exc)

    def release(self) -> None:
        """Free the KV cache now, unless it is the caller's (keep_kv)."""
        if not self.keep_kv:
            self.seq.kv = None


class Scheduler:
    """Runs the steps of an engine's generations (module docstring).

    max_running: sequences in one batch; prefill_chunk: prompt tokens a step, and the cut
    points of prompts.
    """

    def __init__(self, engine: Any, max_running: int, prefill_chunk: int) -> None:
        self.engine, self.max_running, self.prefill_chunk = engine, max_running, prefill_chunk
        self.waiting: deque[Generation] = deque()
        self.running: list[Generation] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._step: asyncio.Task | None = None
        self._step_members: list[Generation] = []
        self._closing = False
        # records a decode step requests per sequence: top-k per MoE layer until measured
        spec = engine.spec
        self.records_per_sequence = float(
            spec.moe.router.top_k * sum(1 for layer in spec.layers if layer.moe)
        )
        c = engine.cache.counts()
        self._slots = c["num_slots"]
        self._all_fit = self._slots >= len(engine.store.records)

    def capacity(self) -> int:
        """Sequences the next step may hold (max_running, or fewer: expert-aware admission)."""
        if self._all_fit:
            return self.max_running
        fit = int(self._slots / self.records_per_sequence)
        return max(1, min(self.max_running, fit))

    def submit(self, gen: Generation) -> None:
        """Queue a generation; the scheduler task starts on first use."""
        if self._closing:
            gen.finish("cancelled")
            return
        self.waiting.append(gen)
        self._update_counts()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._loop())

    def cancel(self, gen: Generation) -> asyncio.Future | None:
        """Stop a generation (its consumer went away); no-op once it has finished. Returns
        the step it was alone in, now cancelled (await it to know that every record the step
        held is released), or for a keep_kv generation in a step a future done once that step
        has ended and its tokens are in the sequence; else None."""
        if gen.done:
            return None
        gen.cancelled = True
        step = None
        if gen in self.waiting:
            self.waiting.remove(gen)
            gen.done = True
            gen.release()
        elif self._step is not None and gen in self._step_members and gen.keep_kv:
            # the caller's KV cache must stay whole: the step runs on; the future is done
            # once its tokens are in the sequence (the caller may feed it again then)
            if gen.settled is None or gen.settled.done():
                gen.settled = asyncio.get_running_loop().create_future()
            step = gen.settled
        elif self._step is not None and self._step_members == [gen]:
            step = self._step
            step.cancel()  # alone in the step: stop it now
        elif gen.keep_kv:  # running but not in this step: nothing writes its KV cache
            gen.done = True
        self._update_counts()
        self._wake.set()
        return step

    async def aclose(self) -> None:
        """End every generation with "cancelled" after the current step; wait for the task."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        for gen in [*self.waiting, *self.running]:
            gen.finish("cancelled")
        self.waiting.clear()
        self.running.clear()
        self._update_counts()

    def _update_counts(self) -> None:
        c = self.engine._counts
        c["running"], c["waiting"] = len(self.running), len(self.waiting)

    def _drop_finished(self) -> None:
        for gen in self.running:
            if gen.cancelled and not gen.done:
                gen.done = True
                gen.release()
        self.running = [g for g in self.running if not g.done]

    async def _loop(self) -> None:
        while not self._closing:
            self._drop_finished()
            while self.waiting and len(self.running) < self.capacity():
                gen = self.waiting.popleft()
                gen.reuse_prefix()
                self.running.append(gen)
            self._update_counts()
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            members, fed = [], []
            budget = self.prefill_chunk
            for gen in self.running:
                if gen.prefilling:
                    if budget <= 0:
                        continue
                    tokens = gen.next_tokens(self.prefill_chunk)
                    budget -= len(tokens)
                else:
                    tokens = gen.next_tokens(self.prefill_chunk)
                members.append(gen)
                fed.append(tokens)
            batch = [
                (np.asarray(t, dtype=np.int64), g.seq.kv) for g, t in zip(members, fed, strict=True)
            ]
            # a prompt chunk before the last one needs no logits (an empty array): the last
            # layer then computes every row's keys and values but its output for one row only
            # (Pipeline._kept_rows)
            mid = [
                g.prefilling and g.pos + len(t) < len(g.ids)
                for g, t in zip(members, fed, strict=True)
            ]
            firsts = [len(t) if m else 0 for t, m in zip(fed, mid, strict=True)]
            self._step_members = members
            self._step = asyncio.ensure_future(
                self.engine.pipeline.forward_batch(batch, mid, firsts)
            )
            try:
                await asyncio.wait({self._step})
            finally:
                step, self._step, self._step_members = self._step, None, []
            try:
                self._after_step(step, members, fed)
            finally:
                for gen in members:
                    if gen.settled is not None and not gen.settled.done():
                        gen.settled.set_result(None)
        self._update_counts()

    def _after_step(self, step: asyncio.Future, members: list[Generation], fed: list) -> None:
        """Hand a finished step's logits to its generations (sampling, emitting, finishing)."""
        if step.cancelled():
            return  # its one member was cancelled; dropped at the top
        n, records = self.engine.pipeline.last_step
        if n and not any(len(t) > 1 for t in fed):  # decode steps only
            per = records / n
            self.records_per_sequence = 0.7 * self.records_per_sequence + 0.3 * per
        if step.exception() is not None:
            for gen in members:
                gen.fail(step.exception())
            return
        for gen, tokens, logits in zip(members, fed, step.result(), strict=True):
            if gen.cancelled or gen.done:
                if gen.keep_kv and not gen.done:  # its KV cache holds them now
                    gen.seq.tokens.extend(tokens)
                    gen.done = True
                continue
            try:
                gen.advance(tokens, logits)
            except Exception as exc:  # a sampling error: this request only
                gen.fail(exc)
