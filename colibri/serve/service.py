"""What the endpoints share: the engine, the served model's name, admission and metrics.

`Service.generate()` is the one way an endpoint runs a generation: it checks the prompt
against the context, waits for one of the `parallel` sequence slots (429 with Retry-After
when `max_queue` requests already wait), streams the engine's Token items, and records
TTFT, inter-token latency and token counts. Closing its iterator (a client that went away)
cancels the sequence at once: Engine.stream's cleanup frees its KV cache and leases.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

from colibri.engine import Engine, Token
from colibri.errors import (
    ColibriError,
    PromptTooLongError,
    ReadError,
    SamplingError,
    StoreError,
    TokenizerError,
)
from colibri.sampling import SamplingParams
from colibri.serve.errors import APIError
from colibri.serve.metrics import Metrics
from colibri.tokenizer import TEMPLATE_MAX_CHARS


class Admission:
    """At most `parallel` generations run; at most `max_queue` more wait for a slot."""

    def __init__(self, parallel: int, max_queue: int) -> None:
        self.parallel, self.max_queue = parallel, max_queue
        self._sem = asyncio.Semaphore(parallel)
        self.running = self.waiting = 0

    def check(self) -> None:
        """APIError 429 (with Retry-After) when a new request would find the queue full."""
        if self._sem.locked() and self.waiting >= self.max_queue:
            raise APIError(
                429,
                f"server busy: {self.running} requests running and {self.waiting} waiting "
                f"(--parallel {self.parallel}, --max-queue {self.max_queue}); retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    async def acquire(self) -> None:
        """Wait for a slot (the queue bound is checked by check(), before the response)."""
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._sem.release()


class Service:
    """The state of one server: engine, model id, admission, metrics, API key."""

    def __init__(
        self,
        engine: Engine,
        model_id: str,
        *,
        parallel: int = 4,
        max_queue: int = 64,
        api_key: str | None = None,
    ) -> None:
        self.engine, self.model_id, self.api_key = engine, model_id, api_key
        self.admission = Admission(parallel, max_queue)
        self.metrics = Metrics(self.statistics)
        self.created = int(time.time())

    def statistics(self) -> Any:
        """The engine's EngineStatistics with the server's queue figures."""
        from dataclasses import replace

        st = self.engine.statistics(components=False)
        return replace(st, waiting=st.waiting + self.admission.waiting)

    def check_model(self, name: str) -> None:
        if name != self.model_id:
            raise APIError(
                404,
                f"model {name!r} is not served here (this server serves {self.model_id!r}; "
                "see GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    async def encode(
        self, prompt: str | list[int] | list[Mapping[str, Any]], **template_kwargs: Any
    ) -> list[int]:
        """Prompt token ids (text, ids, or chat messages through the model's template),
        rendered and tokenized in a worker thread: the event loop keeps serving the running
        streams meanwhile (a prompt of megabytes takes seconds). APIError 400 for a template
        or tokenizer failure or a prompt that leaves no room."""
        eng = self.engine
        ids_given = isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int))
        param = "prompt" if isinstance(prompt, str) or ids_given else "messages"

        def too_long(n: int, at_least: bool = False) -> APIError:
            return APIError(
                400,
                f"the prompt has {'more than ' if at_least else ''}{n} "
                f"{'characters' if at_least else 'tokens'}; this model's context length is "
                f"{eng.n_ctx} tokens (at least one must remain for the completion)",
                param=param,
                code="context_length_exceeded",
            )

        if ids_given:
            ids = list(prompt)
        else:
            if param == "messages" and _chars(prompt) > TEMPLATE_MAX_CHARS:  # see tokenizer.py
                raise too_long(TEMPLATE_MAX_CHARS, at_least=True)
            try:
                ids = await asyncio.to_thread(
                    eng.encode_prompt, prompt, max_prompt_tokens=eng.n_ctx - 1, **template_kwargs
                )
            except TokenizerError as exc:
                raise APIError(400, str(exc), param="messages") from None
            except PromptTooLongError as exc:
                raise too_long(exc.n_tokens) from None
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        vocab = eng.spec.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if len(ids) >= eng.n_ctx:
            raise too_long(len(ids))
        return ids

    def check(
        self,
        max_tokens: int,
        sampling: dict[str, Any],
        prompt_tokens: int | None = None,
        param: str = "max_tokens",
    ) -> None:
        """Before a response starts: APIError 400 for bad sampling values (naming the field)
        and, given the prompt's length `prompt_tokens`, for a `max_tokens` (the request field
        `param`) beyond the context left after the prompt (vLLM's check and message, OpenAI's
        400); 429 when the queue is full."""
        n_ctx = self.engine.n_ctx
        if prompt_tokens is not None and prompt_tokens + max_tokens > n_ctx:
            raise APIError(
                400,
                f"'{param}' is too large: {max_tokens}. This model's maximum context length is "
                f"{n_ctx} tokens and your request has {prompt_tokens} input tokens "
                f"({max_tokens} > {n_ctx} - {prompt_tokens})",
                param=param,
            )
        given = {k: v for k, v in sampling.items() if k != "ignore_eos"}
        try:
            SamplingParams(max_tokens=max_tokens, **{**self.engine.generation_defaults, **given})
        except SamplingError as exc:
            raise APIError(400, str(exc), param=str(exc).split("=", 1)[0]) from None
        except TypeError as exc:
            raise APIError(400, f"bad sampling option: {exc}") from None
        self.admission.check()

    async def score(self, ids: list[int], logprobs: int) -> list[Token]:
        """Prompt logprobs (Engine.score), holding one of the `parallel` slots meanwhile."""
        self.admission.check()
        await self.admission.acquire()
        try:
            return await self.engine.score(ids, logprobs)
        except ColibriError as exc:
            raise APIError(400, str(exc), param="prompt") from None
        finally:
            self.admission.release()

    async def generate(
        self, ids: list[int], max_tokens: int, sampling: dict[str, Any]
    ) -> AsyncIterator[Token]:
        """Token items of one generation (see the module docstring); call check() first."""
        await self.admission.acquire()
        m = self.metrics
        try:
            agen = self.engine.stream(ids, max_tokens=max_tokens, **sampling)
            async with aclosing(agen):
                t_prev = time.perf_counter()
                first = True
                try:
                    async for tok in agen:
                        now = time.perf_counter()
                        if tok.token_id is not None:
                            (m.ttft if first else m.inter_token).observe(now - t_prev)
                            first, t_prev = False, now
                            m.generation_tokens.inc()
                        yield tok
                except (StoreError, ReadError) as exc:  # the server's fault, not the request's
                    raise APIError(500, str(exc)) from None
                except ColibriError as exc:
                    raise APIError(400, str(exc)) from None
            m.prompt_tokens.inc(len(ids))
        finally:
            self.admission.release()


def _chars(value: Any) -> int:
    """Characters of every string in a prompt (text, or chat messages with their content
    parts, tool calls and arguments)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_chars(v) for v in value)
    return 0
