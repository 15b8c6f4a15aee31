"""Request bodies of the OpenAI and Anthropic endpoints, validated with pydantic.

Types are strict, as OpenAI's API checks them: `max_tokens: true`, `"5"` or `5.0` is a 400
(pydantic's lax mode would read them as 1 and 5), `stream: "yes"` too; an integer is a number.
OpenAI endpoints refuse an unknown top-level field as OpenAI does ("unrecognized request
argument supplied: X", 400 naming it): a typo such as `max_token` or `temprature` would
otherwise be ignored silently. OpenAI fields that do not change the answer (`user`,
`metadata`, `store`, `service_tier`, `parallel_tool_calls`, prompt cache and safety ids) are
accepted and ignored; those colibri cannot honour (n > 1, suffix, best_of > 1, a non-text
`response_format`, `logit_bias`, audio, non-text content...) are refused naming the field.
Fields inside messages and the Anthropic endpoint's top level stay lenient (clients echo
back what they received, Claude Code sends fields of newer API versions). `top_k: -1` is
vLLM's "off", as 0 is colibri's. Sampling values are range-checked by
colibri.sampling.SamplingParams, whose errors also name the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from colibri.serve.errors import APIError


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


# OpenAI request fields that do not change the tokens: accepted, ignored
_HARMLESS = {
    "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
}  # fmt: skip
# OpenAI request fields colibri does not implement, each with the value that means "none"
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "functions": ([],),
    "function_call": ("none",),
    "reasoning_effort": (),
    "verbosity": (),
    "moderation": (),
}


class _OpenAIRequest(_Request):
    """A top-level OpenAI body: unknown fields refused (see the module docstring)."""

    @model_validator(mode="after")
    def _no_unknown_fields(self) -> _OpenAIRequest:
        for key, value in (self.model_extra or {}).items():
            if key in _HARMLESS or value is None:
                continue
            if key in _UNSUPPORTED:
                if value in _UNSUPPORTED[key]:
                    continue
                raise _Refused(f"{key} is not supported by colibri (got {value!r:.60})", key)
            raise _Refused(f"unrecognized request argument supplied: {key}", key)
        return self


class _Refused(ValueError):
    """A field refused by name (parse() turns it into a 400 with param=field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_OpenAIRequest):
    """The sampling options of `colibri run`, with OpenAI's and vLLM's names."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the EOS

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, v: int | None) -> int | None:
        return 0 if v == -1 else v  # vLLM's "off" is -1, colibri's 0

    def sampling(self) -> dict[str, Any]:
        """The engine's sampling keyword arguments that the request sets."""
        keys = (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "seed",
        )
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if self.stop is not None:
            out["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1, description="only 1 is supported")


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Request):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Request):
    # OpenAI's roles; "developer" (OpenAI's newer name for system) reaches templates as system
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        # OpenAI: only an assistant message may omit its content (it has tool calls instead)
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        # "required" and a named function need constrained decoding, which colibri lacks
        if v not in (None, "auto", "none"):
            raise ValueError(f"only 'auto' and 'none' are supported (got {v!r:.60})")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and "messages" in v:  # the template's messages are `messages`
            raise ValueError("'messages' is the request's own field, not a template variable")
        return v


class AnthropicMessage(_Request):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Request):
    """POST /v1/messages (Anthropic)."""

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    def sampling(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k")}
        out = {k: v for k, v in out.items() if v is not None}
        if self.stop_sequences:
            out["stop"] = tuple(self.stop_sequences)
        return out


def parse(cls: type[_Request], body: Any) -> Any:
    """Validate a decoded JSON body as `cls`; an APIError 400 names the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        cause = err.get("ctx", {}).get("error")  # a validator's ValueError
        if isinstance(cause, _Refused):
            raise APIError(400, str(cause), param=cause.param) from None
        loc = ".".join(str(p) for p in err["loc"])
        where = _where(err["loc"])
        if isinstance(cause, ValueError):  # our validators' messages say what was given
            raise APIError(400, f"{where}: {cause}", param=loc) from None
        given = "" if err["type"] == "missing" else f" (got {err.get('input')!r:.60})"
        raise APIError(400, f"{where}: {err['msg']}{given}", param=loc) from None


def _where(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role' (OpenAI's spelling of a field)."""
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else f".{p}" if out else str(p)
    return out
