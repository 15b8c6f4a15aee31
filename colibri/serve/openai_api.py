"""The OpenAI endpoints: POST /v1/completions and /v1/chat/completions (streaming or not).

Translation only: a request becomes prompt ids, max_tokens and sampling options for
Service.generate(); its Token items become one response or SSE chunks ("data: {...}" lines,
then "data: [DONE]"). usage carries colibri's expert figures as an extension object:
usage.colibri = {expert_hits, expert_reads, bytes_read, hit_rate, ttft_seconds,
decode_tokens_per_second}.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from colibri.engine import GenerationStatistics, Token
from colibri.serve import tools as tool_parsing
from colibri.serve.errors import APIError, error_body
from colibri.serve.protocol import ChatCompletionRequest, CompletionRequest, parse
from colibri.serve.service import Service

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def usage(stats: GenerationStatistics | None) -> dict[str, Any]:
    """OpenAI usage with the colibri extension object."""
    if stats is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "colibri": {
            "expert_hits": stats.expert_hits,
            "expert_reads": stats.expert_misses,
            "bytes_read": stats.bytes_read,
            "hit_rate": stats.hit_rate,
            "ttft_seconds": stats.ttft,
            "decode_tokens_per_second": stats.decode_tok_s,
        },
    }


def finish_reason(tok: Token) -> str:
    return tok.finish_reason or "stop"


async def collect(
    service: Service, request: Request, ids: list[int], max_tokens: int, sampling: dict
) -> list[Token]:
    """Every Token of a generation; cancelled (sequence freed) if the client disconnects."""

    async def run() -> list[Token]:
        return [t async for t in service.generate(ids, max_tokens, sampling)]

    task = asyncio.ensure_future(run())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise asyncio.CancelledError
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def sse(events: AsyncIterator[str], anthropic: bool = False) -> StreamingResponse:
    """An SSE response; starlette cancels `events` when the client disconnects. A failure
    after the response has started (a read error, say) ends the stream with an error event
    in the endpoint's style instead of a cut connection."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in events:
                yield chunk
        except Exception as exc:
            err = (
                exc if isinstance(exc, APIError) else APIError(500, f"{type(exc).__name__}: {exc}")
            )
            body = error_body(err, anthropic)
            if anthropic:
                yield f"event: error\ndata: {json.dumps(body)}\n\n"
            else:
                yield _data(body)
                yield "data: [DONE]\n\n"

    return StreamingResponse(guarded(), media_type="text/event-stream", headers=SSE_HEADERS)


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class _Logprobs:
    """Token strings and logprob entries in the two OpenAI shapes."""

    def __init__(self, service: Service) -> None:
        tok = service.engine.tokenizer

        @lru_cache(maxsize=65536)
        def text(i: int) -> str:
            return tok.decode([i]) if tok is not None else str(i)

        self.text: Callable[[int], str] = text

    def chat(self, t: Token) -> dict[str, Any]:
        s = self.text(t.token_id)
        return {
            "token": s,
            "logprob": t.logprob,
            "bytes": list(s.encode()),
            "top_logprobs": [
                {"token": self.text(i), "logprob": lp, "bytes": list(self.text(i).encode())}
                for i, lp in t.top_logprobs
            ],
        }

    def completion(self, toks: list[Token], offset: int) -> dict[str, Any]:
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for t in toks:
            s = self.text(t.token_id)
            out["tokens"].append(s)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append({self.text(i): lp for i, lp in t.top_logprobs})
            out["text_offset"].append(offset)
            offset += len(s)
        return out


# ---- /v1/completions ---------------------------------------------------------------------


async def completions(service: Service, request: Request, body: Any) -> Any:
    req = parse(CompletionRequest, body)
    service.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(
                400, "one prompt per request (send several requests, or use /v1/batch)",
                param="prompt",
            )  # fmt: skip
        prompt = prompt[0]
    ids = await service.encode(prompt)
    sampling = req.sampling()
    if req.logprobs:
        sampling["logprobs"] = req.logprobs
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if "max_tokens" not in req.model_fields_set:  # the default 16: what the context leaves
        max_tokens = min(max_tokens, service.engine.n_ctx - len(ids))
    if req.echo:
        return await _echo(service, request, req, ids, max_tokens, sampling)
    if max_tokens == 0:
        raise APIError(400, "max_tokens must be >= 1 (0 only with echo)", param="max_tokens")
    service.check(max_tokens, sampling, len(ids))
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    lp = _Logprobs(service) if req.logprobs is not None else None
    head = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
    if not req.stream:
        toks = await collect(service, request, ids, max_tokens, sampling)
        last = toks[-1]
        choice = {
            "index": 0,
            "text": "".join(t.text for t in toks),
            "logprobs": lp.completion([t for t in toks if t.token_id is not None], 0)
            if lp
            else None,
            "finish_reason": finish_reason(last),
        }
        return JSONResponse({**head, "choices": [choice], "usage": usage(last.statistics)})
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        offset = 0
        async for t in service.generate(ids, max_tokens, sampling):
            if t.token_id is None and not t.text and t.finish_reason is None:
                continue
            logprobs = None
            if lp and t.token_id is not None:
                logprobs = lp.completion([t], offset)
                offset += len(lp.text(t.token_id))
            choice = {
                "index": 0,
                "text": t.text,
                "logprobs": logprobs,
                "finish_reason": t.finish_reason and finish_reason(t),
            }
            chunk = {**head, "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            yield _data(chunk)
            if t.finish_reason is not None and include_usage:
                yield _data({**head, "choices": [], "usage": usage(t.statistics)})
        yield "data: [DONE]\n\n"

    return sse(events())


async def _echo(
    service: Service, request: Request, req: CompletionRequest, ids: list[int],
    max_tokens: int, sampling: dict,
) -> Any:  # fmt: skip
    """echo: the prompt's text and (with logprobs) its tokens' logprobs, then max_tokens
    (0 allowed) generated ones: what lm-evaluation-harness's local-completions model scores
    with, as vLLM answers it. Not streamed."""
    if req.stream:
        raise APIError(400, "echo is not supported with stream", param="echo")
    if max_tokens:
        service.check(max_tokens, sampling, len(ids))
    scored = await service.score(ids, req.logprobs or 0)
    toks = await collect(service, request, ids, max_tokens, sampling) if max_tokens else []
    tok = service.engine.tokenizer
    prompt_text = tok.decode(ids) if tok is not None else ""
    text = prompt_text + "".join(t.text for t in toks)
    logprobs = None
    if req.logprobs is not None:
        lp = _Logprobs(service)
        first = Token("", ids[0])
        logprobs = lp.completion([first, *scored], 0)
        logprobs["token_logprobs"][0] = None
        logprobs["top_logprobs"][0] = None
        gen = lp.completion([t for t in toks if t.token_id is not None], len(prompt_text))
        for k in logprobs:
            logprobs[k] += gen[k]
    last = toks[-1] if toks else None
    choice = {
        "index": 0,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason(last) if last else "length",
    }
    u = usage(last.statistics if last else None)
    if last is None:
        u.update(prompt_tokens=len(ids), total_tokens=len(ids))
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": req.model}  # fmt: skip
    return JSONResponse({**head, "choices": [choice], "usage": u})


# ---- /v1/chat/completions ----------------------------------------------------------------


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template expects them (text parts joined, tool call
    arguments as dicts, as transformers passes them)."""
    out = []
    for i, m in enumerate(req.messages):
        # chat templates know system, not OpenAI's newer name for it
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400, f"messages[{i}].content: only text parts are supported",
                        param=f"messages.{i}.content",
                    )  # fmt: skip
                parts.append(part["text"])
            content = "".join(parts)
        msg["content"] = content if content is not None else ""
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise APIError(
                            400, f"messages[{i}].tool_calls: arguments are not JSON",
                            param=f"messages.{i}.tool_calls",
                        ) from None  # fmt: skip
                if not isinstance(args, dict):
                    raise APIError(
                        400, f"messages[{i}].tool_calls: arguments must be a JSON object, "
                        f"not {type(args).__name__}", param=f"messages.{i}.tool_calls",
                    )  # fmt: skip
                calls.append(
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": args},
                    }
                )
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def raw_text(service: Service, toks: list[Token]) -> str:
    """The generated text with special tokens kept (where tool-call markers may be)."""
    ids = [t.token_id for t in toks if t.token_id is not None]
    tok = service.engine.tokenizer
    return tok.decode(ids) if tok is not None else "".join(t.text for t in toks)


def template_kwargs(service: Service, tools: list[dict] | None, extra: dict | None) -> dict:
    kw = dict(extra or {})
    if tools:
        kw["tools"] = tools
    return kw


async def chat_completions(service: Service, request: Request, body: Any) -> Any:
    req = parse(ChatCompletionRequest, body)
    service.check_model(req.model)
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    ids = await service.encode(
        chat_messages(req), **template_kwargs(service, tools, req.chat_template_kwargs)
    )
    sampling = req.sampling()
    if req.logprobs:
        sampling["logprobs"] = req.top_logprobs or 0
    # not given: up to the end of the context (finish_reason "length" there)
    max_tokens = req.max_completion_tokens or req.max_tokens or service.engine.n_ctx - len(ids)
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    service.check(max_tokens, sampling, len(ids), param)
    parser = tool_parsing.parser_for(service.engine, tools)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    lp = _Logprobs(service) if req.logprobs else None
    head = {"id": rid, "object": "chat.completion", "created": created, "model": req.model}
    if not req.stream:
        toks = await collect(service, request, ids, max_tokens, sampling)
        last = toks[-1]
        text = "".join(t.text for t in toks)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reason = finish_reason(last)
        if parser is not None:
            content, calls = parser.parse(raw_text(service, toks))
            if calls:
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                reason = "tool_calls"
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": [lp.chat(t) for t in toks if t.token_id is not None]}
            if lp
            else None,
            "finish_reason": reason,
        }
        return JSONResponse({**head, "choices": [choice], "usage": usage(last.statistics)})
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(delta: dict, reason: str | None = None, logprobs: Any = None) -> str:
        c = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": reason}]}  # fmt: skip
        if include_usage:
            c["usage"] = None
        return _data(c)

    async def events() -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": ""})
        held = None
        if parser is not None:
            tok = service.engine.tokenizer
            held = tool_parsing.ToolStream(parser, lambda ids: tok.decode(ids))
        async for t in service.generate(ids, max_tokens, sampling):
            text = t.text if held is None else held.push(t.token_id, t.text)
            logprobs = {"content": [lp.chat(t)]} if lp and t.token_id is not None else None
            if text or logprobs:
                yield chunk({"content": text}, logprobs=logprobs)
            if t.finish_reason is None:
                continue
            reason = finish_reason(t)
            if held is not None:
                content, calls = held.finish()
                if content:
                    yield chunk({"content": content})
                if calls:
                    reason = "tool_calls"
                    yield chunk({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
            yield chunk({}, reason)
            if include_usage:
                yield _data({**head, "choices": [], "usage": usage(t.statistics)})
        yield "data: [DONE]\n\n"

    return sse(events())
