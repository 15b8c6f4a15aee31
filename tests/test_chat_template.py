"""Chat templates: the real templates in ../shared/data rendered by colibri and by transformers'
apply_chat_template with the same messages, tools and options; the sandbox's globals and filters;
template lookup (tokenizer_config.json, chat_template.jinja, named templates)."""

from __future__ import annotations

import json
import shutil
from datetime import datetime

import pytest

from colibri.errors import TokenizerError
from colibri.tokenizer import Tokenizer
from tests import tokenizer_data as td

TEMPLATES = td.DATA / "chat_templates"
TEMPLATE_NAMES = sorted(p.name for p in TEMPLATES.glob("*.jinja")) if TEMPLATES.is_dir() else []

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"id": "a1b2c3d4e", "type": "function"}  # 9 alphanumerics: Mistral's rule
CONVERSATIONS = {
    "multi_turn_system": [
        {"role": "system", "content": "You are terse. Réponds en français si possible."},
        {"role": "user", "content": "Hi! 你好 🦙"},
        {"role": "assistant", "content": "Bonjour."},
        {"role": "user", "content": "What is MoE?"},
    ],
    "single_user": [{"role": "user", "content": "Hello"}],
    "tool_calls": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": CALL["id"], "name": "get_weather", "content": '{"c": 21}'},
        {"role": "assistant", "content": "21 °C."},
        {"role": "user", "content": "Thanks"},
    ],
    "tool_calls_json_args": None,  # filled below: same, with arguments as a JSON string
    "reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "3+3?"},
    ],
}

CONVERSATIONS["tool_calls_json_args"] = [
    {
        **m,
        "tool_calls": [
            {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    }
    if "tool_calls" in m
    else m
    for m in CONVERSATIONS["tool_calls"]
]


def _owner(template_name: str) -> str:
    """Which real tokenizer supplies the special-token variables (bos_token, ...)."""
    if template_name.startswith("Qwen"):
        return "qwen3"
    if template_name.startswith("mistral"):
        return "mixtral_v3"
    return "deepseek_v3"


@pytest.fixture(scope="module")
def hf():
    return td.hf_tokenizers()


@pytest.fixture(scope="module")
def ours():
    return td.our_tokenizers()


def _both(hf_tok, our_tok, messages, **kwargs):
    """(transformers' text or its exception, colibri's text or TokenizerError)."""
    try:
        expected = hf_tok.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # jinja2 errors, or transformers' own checks
        expected = e
    try:
        got = our_tok.apply_chat_template(messages, **kwargs)
    except TokenizerError as e:
        got = e
    return expected, got


@pytest.mark.parametrize("template_name", TEMPLATE_NAMES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_real_templates_match_transformers(template_name, add_generation_prompt, hf, ours):
    source = (TEMPLATES / template_name).read_text(encoding="utf-8")
    owner = _owner(template_name)
    rendered = 0
    for conv_name, messages in CONVERSATIONS.items():
        tools = TOOLS if conv_name.startswith("tool_calls") else None
        expected, got = _both(
            hf[owner],
            ours[owner],
            messages,
            tools=tools,
            chat_template=source,
            add_generation_prompt=add_generation_prompt,
        )
        if isinstance(expected, Exception):  # e.g. Kimi's template calls list.append (sandboxed)
            assert isinstance(got, TokenizerError), (conv_name, expected)
            continue
        assert got == expected, conv_name
        rendered += 1
    assert rendered >= 3  # the plain conversations render with every template


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
@pytest.mark.parametrize("template_kwargs", [{}, {"enable_thinking": False}, {"thinking": True}])
def test_model_template_text_and_ids(name, template_kwargs, hf, ours):
    """The model's own template (from tokenizer_config.json) and the token ids of the prompt."""
    for conv_name, messages in CONVERSATIONS.items():
        tools = TOOLS if conv_name.startswith("tool_calls") else None
        kwargs = dict(tools=tools, add_generation_prompt=True, **template_kwargs)
        expected, got = _both(hf[name], ours[name], messages, **kwargs)
        if isinstance(expected, Exception):  # DeepSeek-V3's template wants string arguments
            assert conv_name == "tool_calls" and isinstance(got, TokenizerError), expected
            continue
        assert got == expected, conv_name
        ids = hf[name].apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        assert ours[name].encode(got, add_special_tokens=False) == list(ids)


def test_qwen3_enable_thinking_changes_prompt(ours):
    messages = CONVERSATIONS["single_user"]
    on = ours["qwen3"].apply_chat_template(messages)
    off = ours["qwen3"].apply_chat_template(messages, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"


# --- sandbox globals and filters, compared with transformers -----------------------------------

FEATURE_TEMPLATES = {
    "tojson_indent": "{{ tools | tojson(indent=2) }}|{{ messages[0] | tojson }}",
    "tojson_options": "{{ {'b': 'é', 'a': 1} | tojson(ensure_ascii=True, sort_keys=True) }}",
    "loop_controls": (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    ),
    "namespace_dict": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }} {{ dict(a=1, b=bos_token) }}"
    ),
    "trim_lstrip": "  {% if add_generation_prompt %}\n    yes\n  {% endif %}\nend",
    "generation_tag": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% endfor %}",
    "special_vars": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ custom }}",
}


@pytest.mark.parametrize("feature", list(FEATURE_TEMPLATES))
def test_template_features_match_transformers(feature, hf, ours):
    messages = CONVERSATIONS["multi_turn_system"]
    expected, got = _both(
        hf["deepseek_v3"],
        ours["deepseek_v3"],
        messages,
        tools=TOOLS,
        chat_template=FEATURE_TEMPLATES[feature],
        add_generation_prompt=True,
        custom="x",
    )
    assert not isinstance(expected, Exception), expected
    assert got == expected


def test_strftime_now(ours):
    tok = ours["olmoe"]
    before = datetime.now().strftime("%Y-%m-%d")
    text = tok.apply_chat_template(
        [{"role": "user"}], chat_template="{{ strftime_now('%Y-%m-%d') }}"
    )
    assert text in {before, datetime.now().strftime("%Y-%m-%d")}


@pytest.mark.parametrize(
    "template,match",
    [
        ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant"),
        ("{% set _ = messages.append(1) %}", "unsafe"),  # immutable sandbox
        ("{{ ''.__class__.__mro__ }}", "__mro__|unsafe|undefined"),
        ("{% set ns = namespace(_x=1) %}", "_x"),
        ("{% for %}", "chat template"),  # syntax error
    ],
)
def test_template_errors_are_tokenizer_errors(template, match, ours):
    with pytest.raises(TokenizerError, match=match):
        ours["olmoe"].apply_chat_template(
            [{"role": "user", "content": "x"}], chat_template=template
        )


# --- template lookup ----------------------------------------------------------------------------


def test_no_template_and_empty_conversation(ours):
    with pytest.raises(TokenizerError, match="no chat template"):
        ours["olmoe"].apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="empty"):
        ours["qwen3"].apply_chat_template([])


def test_chat_template_jinja_and_named_templates(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = tmp_path / "tok"
    shutil.copytree(td.built_dirs()["mixtral_v1"], d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "T{{ tools | length }}{{ messages[-1].content }}"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    messages = CONVERSATIONS["single_user"]
    ours, hf = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    for tools in (None, TOOLS):
        expected = hf.apply_chat_template(messages, tools=tools, tokenize=False)
        assert ours.apply_chat_template(messages, tools=tools) == expected
    assert ours.apply_chat_template(messages, tools=TOOLS).startswith("T1")
    # chat_template.jinja is the default template when present, as in transformers
    (d / "chat_template.jinja").write_text("{{ bos_token }}J{{ messages[0].content }}")
    ours, hf = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    expected = hf.apply_chat_template(messages, tokenize=False)
    assert ours.apply_chat_template(messages) == expected == "<s>JHello"
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": 5}))
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: chat_template"):
        Tokenizer.from_dir(d)


def test_none_values_dropped_and_reasoning_aliases(hf, ours):
    messages = [
        {"role": "user", "content": "x", "name": None},
        {"role": "assistant", "content": "y", "thinking": "t"},
    ]
    template = (
        "{{ messages[0].name is defined }}|{{ messages[1].reasoning_content }}"
        "|{{ messages[1].thinking }}"
    )
    expected, got = _both(hf["qwen3"], ours["qwen3"], messages, chat_template=template)
    assert got == expected == "False|t|t"
