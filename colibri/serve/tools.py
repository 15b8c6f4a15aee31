"""Tool calls: parse a model's generated text back into OpenAI `tool_calls`.

The format is the one the model's own chat template writes for an assistant tool call, so
the parser is chosen by what the template contains (any family that uses the same template
works):
    hermes   (Qwen3): <tool_call>{"name": N, "arguments": {...}}</tool_call>
    glm      (GLM-4.5/4.6/4.7): <tool_call>N<arg_key>k</arg_key><arg_value>v</arg_value>
             ...</tool_call>
    deepseek (DeepSeek-V3, V3.1, V3.2): <｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
             (V3's original form: function<｜tool▁sep｜>N\\n```json\\n{...}\\n```)
    harmony  (gpt-oss): ... to=functions.N ... <|message|>{...}<|call|>
Parsing runs on the text decoded with special tokens kept (the markers are special tokens
in some vocabularies). Arguments are returned as JSON strings, as OpenAI does.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_DS_BEGIN, _DS_SEP, _DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def _call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _hermes(raw: str) -> list[dict[str, Any]]:
    calls = []
    for body in re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", raw, re.DOTALL):
        obj = _json(body)
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
    return calls


def _glm(raw: str) -> list[dict[str, Any]]:
    calls = []
    for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", raw, re.DOTALL):
        name = body.split("<arg_key>", 1)[0].strip()
        if not name:
            continue
        args = {}
        pairs = re.findall(
            r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", body, re.DOTALL
        )
        for k, v in pairs:
            parsed = _json(v)
            args[k.strip()] = v if parsed is None else parsed
        calls.append(_call(name, args))
    return calls


def _deepseek(raw: str) -> list[dict[str, Any]]:
    calls = []
    pattern = re.escape(_DS_BEGIN) + r"(.*?)" + re.escape(_DS_SEP) + r"(.*?)" + re.escape(_DS_END)
    for name, args in re.findall(pattern, raw, re.DOTALL):
        name = name.strip()
        if name == "function":  # V3: function<sep>NAME\n```json\n{...}\n```
            m = re.match(r"\s*(\S+)\s*```(?:json)?\s*(.*?)\s*```", args, re.DOTALL)
            if not m:
                continue
            name, args = m.group(1), m.group(2)
        obj = _json(args.strip())
        calls.append(_call(name, obj if obj is not None else args.strip()))
    return calls


def _harmony(raw: str) -> list[dict[str, Any]]:
    calls = []
    pattern = r"to=functions\.([^\s<]+).*?<\|message\|>(.*?)(?:<\|call\|>|<\|end\|>|$)"
    for name, args in re.findall(pattern, raw, re.DOTALL):
        obj = _json(args.strip())
        calls.append(_call(name, obj if obj is not None else args.strip()))
    return calls


@dataclass(frozen=True)
class ToolParser:
    """name: the format; start: the marker that opens a tool call in generated text."""

    name: str
    start: str
    _parse: Callable[[str], list[dict[str, Any]]]

    def parse(self, raw: str) -> tuple[str, list[dict[str, Any]]]:
        """(content before the first call, the calls) of generated text `raw` (special tokens
        kept); no calls: (raw, [])."""
        calls = self._parse(raw)
        if not calls:
            return raw, []
        cut = raw.find(self.start)
        return (raw[:cut] if cut >= 0 else "").strip(), calls


PARSERS = {
    "glm": ToolParser("glm", "<tool_call>", _glm),
    "hermes": ToolParser("hermes", "<tool_call>", _hermes),
    "deepseek": ToolParser("deepseek", "<｜tool▁calls▁begin｜>", _deepseek),
    "harmony": ToolParser("harmony", "to=functions.", _harmony),
}


def parser_for_template(template: str) -> ToolParser | None:
    """The parser for the tool-call format a chat template writes, or None."""
    if "<arg_key>" in template:
        return PARSERS["glm"]
    if "<tool_call>" in template:
        return PARSERS["hermes"]
    if _DS_BEGIN in template:
        return PARSERS["deepseek"]
    if "to=functions." in template or '"functions." + ' in template or "functions." in template:
        return PARSERS["harmony"] if "<|call|>" in template else None
    return None


def parser_for(engine: Any, tools: Sequence[Any] | None) -> ToolParser | None:
    """The parser for `engine`'s chat template when the request has tools, else None."""
    tok = engine.tokenizer
    if not tools or tok is None:
        return None
    try:
        template = tok.get_chat_template(None, tools)
    except Exception:
        return None
    return parser_for_template(template)


class ToolStream:
    """Streams content until a tool call may have begun, then holds text back.

    push(token_id, text) -> text to send now; finish() -> (held text to send, tool calls).
    `decode(ids)` must keep special tokens.
    """

    def __init__(self, parser: ToolParser, decode: Callable[[list[int]], str]) -> None:
        self.parser, self.decode = parser, decode
        self.ids: list[int] = []
        self.held: list[str] = []
        self.active = False

    def _partial(self, raw: str) -> bool:
        s = self.parser.start
        return any(raw.endswith(s[:n]) for n in range(1, len(s)))

    def push(self, token_id: int | None, text: str) -> str:
        if token_id is not None:
            self.ids.append(token_id)
        raw = self.decode(self.ids)
        if self.active or self.parser.start in raw:
            self.active = True
            self.held.append(text)
            return ""
        if self._partial(raw):
            self.held.append(text)
            return ""
        out, self.held = "".join(self.held) + text, []
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        _, calls = self.parser.parse(self.decode(self.ids))
        held, self.held = "".join(self.held), []
        return ("", calls) if calls else (held, [])
