"""Request bodies of the OpenAI and Anthropic endpoints, validated with pydantic.

Unknown fields are accepted and ignored (clients send many optional ones); fields colibri
cannot honour (n > 1, echo, best_of, suffix, non-text content) are refused with a 400 naming
them rather than silently ignored. Sampling values are range-checked by
colibri.sampling.SamplingParams, whose errors also name the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from colibri.serve.errors import APIError


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
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
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


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
        loc = ".".join(str(p) for p in err["loc"])
        given = "" if err["type"] == "missing" else f" (got {err.get('input')!r:.60})"
        raise APIError(400, f"{loc}: {err['msg']}{given}", param=loc) from None
