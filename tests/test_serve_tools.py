"""Tool-call parsing: what a real chat template writes for an assistant tool call is parsed
back into the same OpenAI tool_calls (templates from ../shared/data/chat_templates)."""

from __future__ import annotations

import json

import pytest

from colibri.serve.tools import PARSERS, ToolStream, parser_for_template
from colibri.tokenizer import _compile_template
from tests.serve_util import SHARED

TEMPLATES = SHARED / "chat_templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ARGS = {"city": "Paris", "days": 3}
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.mark.parametrize(
    ("file", "fmt"),
    [
        ("Qwen-Qwen3-0.6B.jinja", "hermes"),
        ("GLM-4.6.jinja", "glm"),
        ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek"),
        ("openai-gpt-oss-120b.jinja", "harmony"),
    ],
)
def test_template_tool_calls_parse_back(file, fmt):
    path = TEMPLATES / file
    if not path.exists():
        pytest.skip(f"shared data missing: {path}")
    source = path.read_text()
    parser = parser_for_template(source)
    assert parser is PARSERS[fmt]
    template = _compile_template(source)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    turn = [*user, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    before = template.render(messages=user, tools=TOOLS, add_generation_prompt=True, **SPECIALS)
    after = template.render(messages=turn, tools=TOOLS, add_generation_prompt=False, **SPECIALS)
    common = next(
        (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), len(before)
    )
    _, calls = parser.parse(after[common:])
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == ARGS
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")


def test_plain_text_is_not_a_call_and_streams_through():
    p = PARSERS["hermes"]
    assert p.parse("just words") == ("just words", [])
    pieces = ["Sure", ", <tool", "_call>", '{"name": "f", "arguments": {"x": 1}}', "</tool_call>"]
    ids = list(range(len(pieces)))
    stream = ToolStream(p, lambda i: "".join(pieces[k] for k in i))
    shown = [stream.push(k, pieces[k]) for k in ids]
    assert "".join(shown) == "Sure"  # ", <tool" is held back as a possible start
    rest, calls = stream.finish()
    assert rest == "" and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    s2 = ToolStream(p, lambda i: "".join(["a <to", "day"][k] for k in i))
    assert s2.push(0, "a <to") == ""  # could open "<tool_call>": held
    assert s2.push(1, "day") == "a <today"  # it did not: released
    assert s2.finish() == ("", [])
