"""The Anthropic endpoint: POST /v1/messages (streaming or not).

Messages (text blocks, tool_use and tool_result blocks) and `system` become chat messages for
the model's template; `tools` ({name, description, input_schema}) become OpenAI-style
function tools for it. Streaming sends Anthropic's events: message_start,
content_block_start, ping, content_block_delta (text_delta / input_json_delta),
content_block_stop, message_delta (stop_reason, usage), message_stop.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from colibri.engine import Token
from colibri.serve import tools as tool_parsing
from colibri.serve.errors import APIError
from colibri.serve.openai_api import collect, raw_text, sse
from colibri.serve.openai_api import usage as openai_usage
from colibri.serve.protocol import MessagesRequest, parse
from colibri.serve.service import Service


def _text(block: Any, where: str) -> str:
    if isinstance(block, str):
        return block
    if isinstance(block, list):
        return "".join(_text(b, where) for b in block)
    if (
        isinstance(block, dict)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
    ):
        return block["text"]
    raise APIError(400, f"{where}: only text content blocks are supported here", param=where)


def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """Anthropic messages as chat-template messages."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []
        for b in m.content:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "tool_use":
                if not isinstance(b.get("input", {}), dict):
                    raise APIError(
                        400, f"{where}: a tool_use block's input must be an object", param=where
                    )
                calls.append(
                    {
                        "id": b.get("id"),
                        "type": "function",
                        "function": {"name": b.get("name"), "arguments": b.get("input") or {}},
                    }
                )
            elif kind == "tool_result":
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": b.get("tool_use_id"),
                        "content": _text(b.get("content") or "", where),
                    }
                )
            else:
                text.append(_text(b, where))
        if text or calls:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def openai_tools(req: MessagesRequest) -> list[dict[str, Any]] | None:
    """The request's tools as OpenAI function tools (None without tools or with tool_choice
    none). APIError 400 for tool_choice any / tool: forcing a tool call needs constrained
    decoding, which colibri lacks (said, not treated as auto)."""
    choice = (req.tool_choice or {}).get("type", "auto")
    if choice not in ("auto", "none"):
        raise APIError(
            400, f"tool_choice.type: only 'auto' and 'none' are supported (got {choice!r:.40})",
            param="tool_choice",
        )  # fmt: skip
    if not req.tools or choice == "none":
        return None
    out = []
    for i, t in enumerate(req.tools):
        if not isinstance(t.get("name"), str):
            raise APIError(400, f"tools.{i}.name: required", param=f"tools.{i}.name")
        fn = {"name": t["name"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = t.get("input_schema") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def stop_reason(last: Token, eos: frozenset[int], prev_id: int | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation."""
    if last.finish_reason == "stop":
        if last.stop is not None:
            return "stop_sequence", last.stop
        return "end_turn", None
    return ("max_tokens" if last.finish_reason == "length" else "end_turn"), None


def _usage(last: Token) -> dict[str, Any]:
    st = last.statistics
    u = {
        "input_tokens": st.prompt_tokens if st else 0,
        "output_tokens": st.generated_tokens if st else 0,
    }
    if st is not None:  # the same extension object as the OpenAI endpoints'
        u["colibri"] = openai_usage(st)["colibri"]
    return u


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _tool_blocks(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "type": "tool_use",
            "id": "toolu_" + c["id"].removeprefix("call_"),
            "name": c["function"]["name"],
            "input": json.loads(c["function"]["arguments"] or "{}"),
        }
        for c in calls
    ]


async def messages(service: Service, request: Request, body: Any) -> Any:
    req = parse(MessagesRequest, body)
    service.check_model(req.model)
    tools = openai_tools(req)
    kw = {"tools": tools} if tools else {}
    ids = await service.encode(chat_messages(req), **kw)
    sampling = req.sampling()
    service.check(req.max_tokens, sampling)
    parser = tool_parsing.parser_for(service.engine, tools)
    mid = f"msg_{uuid.uuid4().hex}"
    tok = service.engine.tokenizer
    eos = tok.eos_token_ids if tok is not None else frozenset()
    head = {"id": mid, "type": "message", "role": "assistant", "model": req.model}
    if not req.stream:
        toks = await collect(service, request, ids, req.max_tokens, sampling)
        last = toks[-1]
        reason, seq = stop_reason(last, eos, None)
        content: list[dict[str, Any]] = []
        text = "".join(t.text for t in toks)
        calls = parser.parse(raw_text(service, toks))[1] if parser is not None else []
        if calls:
            before = parser.parse(raw_text(service, toks))[0]
            if before:
                content.append({"type": "text", "text": before})
            content += _tool_blocks(calls)
            reason = "tool_use"
        else:
            content.append({"type": "text", "text": text})
        return JSONResponse(
            {
                **head,
                "content": content,
                "stop_reason": reason,
                "stop_sequence": seq,
                "usage": _usage(last),
            }
        )

    async def events() -> AsyncIterator[str]:
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": len(ids), "output_tokens": 0}}  # fmt: skip
        yield _event("message_start", {"type": "message_start", "message": start})
        yield _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        )
        yield _event("ping", {"type": "ping"})
        held = tool_parsing.ToolStream(parser, lambda i: tok.decode(i)) if parser else None
        async for t in service.generate(ids, req.max_tokens, sampling):
            text = t.text if held is None else held.push(t.token_id, t.text)
            if text:
                delta = {"type": "text_delta", "text": text}
                yield _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": delta},
                )
            if t.finish_reason is None:
                continue
            reason, seq = stop_reason(t, eos, None)
            calls: list[dict[str, Any]] = []
            if held is not None:
                rest, calls = held.finish()
                if rest:
                    delta = {"type": "text_delta", "text": rest}
                    yield _event(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": 0, "delta": delta},
                    )
            yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            for k, block in enumerate(_tool_blocks(calls), start=1):
                reason = "tool_use"
                yield _event(
                    "content_block_start",
                    {"type": "content_block_start", "index": k,
                     "content_block": {**block, "input": {}}},
                )  # fmt: skip
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                yield _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": k, "delta": delta},
                )
                yield _event("content_block_stop", {"type": "content_block_stop", "index": k})
            yield _event(
                "message_delta",
                {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                 "usage": {"output_tokens": _usage(t)["output_tokens"]}},
            )  # fmt: skip
            yield _event("message_stop", {"type": "message_stop"})

    return sse(events(), anthropic=True)
