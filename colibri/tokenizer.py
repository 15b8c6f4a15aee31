"""Tokenizer, chat templates, incremental detokenization and stop strings.

A thin layer over Hugging Face `tokenizers` (encoding, decoding) and `jinja2` (chat templates) that
reproduces what transformers 5 does with the same files: special tokens and BOS/EOS insertion
as `TokenizersBackend`, the chat-template sandbox of
`transformers/utils/chat_template_utils.py`, the special-token variables passed to templates.

Files read from a model store or checkpoint directory (docs/FORMAT.md):
    tokenizer.json           required: the `tokenizers` pipeline (vocab, merges, added tokens,
                             and the post-processor that adds BOS/EOS, as transformers 5 uses it)
    tokenizer_config.json    optional: bos/eos/pad/unk tokens, extra special tokens,
                             chat_template (string or list of {name, template})
    special_tokens_map.json  optional, legacy: named special tokens (when the config has no
                             added_tokens_decoder, as transformers reads it)
    chat_template.jinja      optional: overrides the config's template (transformers' order)
    generation_config.json   optional: eos_token_id (int or list), bos_token_id, pad_token_id
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from colibri.errors import PromptTooLongError, TokenizerError

__all__ = ["IncrementalDecoder", "StopChecker", "Tokenizer", "check_utf8"]

# Named special tokens, in transformers' SPECIAL_TOKENS_ATTRIBUTES order.
_SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning is passed under; templates read `reasoning_content` (transformers).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def check_utf8(text: str, what: str) -> str:
    """Return `text` if it is valid Unicode text (encodable as UTF-8), else raise
    TokenizerError naming `what` and the first bad character: bytes that were not UTF-8 reach
    Python as lone surrogates (argv and stdin decode with surrogateescape)."""
    if not isinstance(text, str):
        raise TokenizerError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        bad = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"lone surrogate U+{c:04X}"
        raise TokenizerError(
            f"{what} is not valid UTF-8 text ({bad} at character {e.start})"
        ) from None
    return text


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise TokenizerError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, where: str) -> str | None:
    """A special token given as a string or a serialized AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{where}: special token must be a string or an AddedToken, got {value!r}")


class Tokenizer:
    """A model's tokenizer and chat template(s).

    Build it with `Tokenizer.from_dir(path)`. Token ids are Python ints; text is `str`.

    Attributes:
        bos_token, eos_token, pad_token, unk_token: the named special tokens (str or None).
        bos_token_id, pad_token_id: ids (generation_config.json first, else the tokenizer's).
        eos_token_ids: frozenset of ids that end generation: generation_config.json's
            `eos_token_id` (int or list) plus the tokenizer's eos token.
        chat_templates: {name: jinja source}; "default" is used unless tools select "tool_use".
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        extra_special_tokens: Sequence[str] = (),
        chat_templates: Mapping[str, str] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        source: str = "<memory>",
    ) -> None:
        self._backend = backend
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_templates = dict(chat_templates or {})
        # {template name: the file it came from}, for error messages
        self.template_files: dict[str, str] = {}
        # bounds of one apply_chat_template() render: wall time (s) and output/value size
        # (characters or items); past either it raises TokenizerError naming the file
        self.template_seconds = TEMPLATE_SECONDS
        self.template_max_chars = TEMPLATE_MAX_CHARS
        # transformers' _post_init: every named and extra special token becomes a special added
        # token (matched whole in text, dropped by skip_special_tokens); unknown ones get new ids.
        named = [
            AddedToken(t, special=True, normalized=False) for t in self.special_tokens.values()
        ]
        extra = [AddedToken(t, special=True, normalized=False) for t in extra_special_tokens]
        backend.add_special_tokens(named + extra)
        gen = dict(generation_config or {})
        self.bos_token_id = self._id_from(gen.get("bos_token_id"), self.bos_token)
        self.pad_token_id = self._id_from(gen.get("pad_token_id"), self.pad_token)
        eos = gen.get("eos_token_id")
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.eos_token is not None:
            eos_ids.add(self.token_to_id(self.eos_token))
        if not all(isinstance(i, int) for i in eos_ids):
            raise TokenizerError(f"{source}: eos_token_id must be an int or a list of ints: {eos}")
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)

    # --- construction -----------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer files of a store or checkpoint directory (see the module docstring).

        Raises:
            TokenizerError: tokenizer.json is missing (a SentencePiece tokenizer.model alone must
                first be converted to tokenizer.json, e.g. with transformers' converter), or a
                file is not valid JSON / not a `tokenizers` file, or a special-token or
                chat_template entry is malformed. Names the file.
        """
        root = Path(path)
        if not root.is_dir():
            raise TokenizerError(f"{root}: not a directory")
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            hint = " (only tokenizer.model found: convert it first)" * (
                (root / "tokenizer.model").is_file()
            )
            raise TokenizerError(f"{tok_file}: missing{hint}")
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"{tok_file}: not a valid tokenizers file: {e}") from e

        config = _read_json(root / "tokenizer_config.json") or {}
        where = str(root / "tokenizer_config.json")
        special = {n: _token_content(config.get(n), where) for n in _SPECIAL_NAMES}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
        legacy_map = _read_json(root / "special_tokens_map.json")
        if legacy_map and "added_tokens_decoder" not in config:
            where_map = str(root / "special_tokens_map.json")
            for name in _SPECIAL_NAMES:
                if legacy_map.get(name) is not None:
                    special[name] = _token_content(legacy_map[name], where_map)
        extra = [_token_content(t, where) for t in extra]

        templates: dict[str, str] = {}
        cfg_template = config.get("chat_template")
        if isinstance(cfg_template, str):
            templates["default"] = cfg_template
        elif isinstance(cfg_template, list):
            for item in cfg_template:
                if not (isinstance(item, dict) and {"name", "template"} <= item.keys()):
                    raise TokenizerError(
                        f"{where}: chat_template list items need name and template"
                    )
                templates[item["name"]] = item["template"]
        elif cfg_template is not None:
            raise TokenizerError(f"{where}: chat_template must be a string or a list")
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                templates["default"] = jinja_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{jinja_file}: cannot read: {e}") from e

        files = {name: where for name in templates}
        if jinja_file.is_file():
            files["default"] = str(jinja_file)
        tok = cls(
            backend,
            special_tokens=special,
            extra_special_tokens=[t for t in extra if t],
            chat_templates=templates,
            generation_config=_read_json(root / "generation_config.json"),
            source=str(root),
        )
        tok.template_files = files
        return tok

    def _id_from(self, configured: Any, token: str | None) -> int | None:
        if isinstance(configured, int):
            return configured
        return None if token is None else self.token_to_id(token)

    # --- tokens -----------------------------------------------------------------------------

    bos_token = property(lambda self: self.special_tokens.get("bos_token"))
    eos_token = property(lambda self: self.special_tokens.get("eos_token"))
    pad_token = property(lambda self: self.special_tokens.get("pad_token"))
    unk_token = property(lambda self: self.special_tokens.get("unk_token"))

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (ids are < vocab_size)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int:
        """The id of a token string. Raises TokenizerError if it is not in the vocabulary."""
        tid = self._backend.token_to_id(token)
        if tid is None:
            raise TokenizerError(f"{self.source}: token {token!r} is not in the vocabulary")
        return tid

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of an id (its vocabulary form, e.g. 'Ġthe' or '▁the'), or None."""
        return self._backend.id_to_token(token_id)

    def encode(
        self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> list[int]:
        """Token ids of `text`.

        With `add_special_tokens`, BOS/EOS are added by tokenizer.json's post-processor, as in
        transformers 5, which ignores tokenizer_config.json's add_bos_token/add_eos_token when a
        tokenizer.json exists. Special tokens written in the text (e.g. "<|im_start|>") are
        matched as single tokens, as transformers does by default. Chat prompts rendered by
        `apply_chat_template` already carry their BOS: encode them with add_special_tokens=False.
        The tokenizer runs with the GIL released (tokenizers' encode_batch; its encode holds
        it), so other threads run meanwhile (a server's event loop, when this runs in a worker
        thread). Raises PromptTooLongError when the text has more than `max_tokens` tokens
        (the id list of a long text is then never built).
        """
        check_utf8(text, "text to encode")
        enc = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if max_tokens is not None and len(enc) > max_tokens:
            raise PromptTooLongError(len(enc), max_tokens)
        return enc.ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` through tokenizer.json's decoder (byte fallback, "▁" to space, ...).

        Incomplete UTF-8 byte sequences decode to U+FFFD. No clean_up_tokenization_spaces: that is
        a WordPiece step which transformers itself skips for BPE tokenizers.
        """
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(
        self, context_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDecoder:
        """An `IncrementalDecoder` for tokens generated after `context_ids` (e.g. the prompt)."""
        return IncrementalDecoder(self, context_ids, skip_special_tokens)

    # --- chat templates ---------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """The template source: a name in `chat_templates`, a literal template, or the default
        ("tool_use" when tools are given and that template exists), as transformers chooses.

        Raises TokenizerError if the model has no chat template.
        """
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise TokenizerError(
                f"{self.source}: several chat templates and no default: "
                f"choose one of {sorted(self.chat_templates)}"
            )
        raise TokenizerError(
            f"{self.source}: no chat template (tokenizer_config.json has no chat_template "
            "and there is no chat_template.jinja)"
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text the model expects.

        Args:
            messages: dicts with "role" and "content" (and e.g. "tool_calls", "reasoning_content"
                or its aliases "thinking"/"reasoning"); keys whose value is None are dropped.
            add_generation_prompt: append the assistant header (default True, unlike transformers'
                False, because colibri renders prompts to generate from).
            tools: JSON-schema tool descriptions (dicts), passed to the template as `tools`.
            chat_template: a template name or a literal template (default: the model's).
            **template_kwargs: extra template variables, e.g. `enable_thinking=False` for Qwen3;
                they override the special-token variables (bos_token, eos_token, ...).

        Returns the rendered text; tokenize it with `encode(text, add_special_tokens=False)`.

        Raises:
            TokenizerError: no template, a template syntax error, or the template raised
                (`raise_exception`, e.g. a role it does not support, or a Python error such as
                a TypeError on an unexpected argument type), or rendering went past
                `template_seconds` (default 10 s) or produced a value or output longer than
                `template_max_chars` (16 Mi characters); names the template's file.
        """
        source = self.get_chat_template(chat_template, tools)
        if chat_template is not None:
            name = chat_template if chat_template in self.chat_templates else None
        elif tools is not None and "tool_use" in self.chat_templates:
            name = "tool_use"
        else:
            name = "default"
        where = self.template_files.get(name, self.source) if name else self.source
        if not messages:
            raise TokenizerError("apply_chat_template: empty conversation")
        chat = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise TokenizerError(f"apply_chat_template: messages must be dicts, got {m!r}")
            m = {k: v for k, v in m.items() if v is not None}
            reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            chat.append(m)
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise TokenizerError("apply_chat_template: tools must be JSON-schema dicts")
        variables = {**self.special_tokens, **template_kwargs}
        limits = _LIMITS
        limits.seconds, limits.max_chars = self.template_seconds, self.template_max_chars
        limits.deadline = time.monotonic() + self.template_seconds
        try:
            template = _compile_template(source)
            parts, size = [], 0
            for part in template.generate(
                messages=chat,
                tools=None if tools is None else [dict(t) for t in tools],
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            ):
                size += len(part)
                if size > limits.max_chars:
                    raise _TemplateLimit(f"output exceeds {limits.max_chars} characters")
                _check_time()
                parts.append(part)
            return "".join(parts)
        except _TemplateLimit as e:
            raise TokenizerError(f"{where}: chat template stopped: {e}") from None
        except Exception as e:  # hub templates are code: TemplateError, TypeError, ...
            raise TokenizerError(f"{where}: chat template: {type(e).__name__}: {e}") from e
        finally:
            limits.deadline = None


# --- bounds on template rendering ---------------------------------------------------------
# A template is code from the checkpoint: nested loops or doubling strings must not render for
# ever or fill memory. Every loop over range(), call, filter, concatenation (~) and the
# operators + * ** % check the render's deadline, and values or output longer than the
# size bound are refused (for * and ** before they are computed).

TEMPLATE_SECONDS = 10.0
TEMPLATE_MAX_CHARS = 1 << 24  # 16 Mi characters (a 128k-token prompt is ~0.5 Mi)
_LIMITS = threading.local()  # the deadline and bounds of the render running in this thread


class _TemplateLimit(Exception):
    """A chat template exceeded its time or size bound."""


def _check_time() -> None:
    deadline = getattr(_LIMITS, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise _TemplateLimit(f"rendering took longer than {_LIMITS.seconds:g} s")


def _max_chars() -> int:
    return getattr(_LIMITS, "max_chars", TEMPLATE_MAX_CHARS)


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > _max_chars():
        raise _TemplateLimit(f"a value of {len(value)} items exceeds {_max_chars()}")
    return value


class _BoundedRange:
    """range() for templates: at most jinja's sandbox MAX_RANGE items, and iteration checks
    the render's deadline (nested loops multiply)."""

    def __init__(self, *args: int) -> None:
        self._range = jinja2.sandbox.safe_range(*args)

    def __iter__(self) -> Iterator[int]:
        for x in self._range:
            _check_time()
            yield x

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, i: Any) -> Any:
        return self._range[i]

    def __contains__(self, x: Any) -> bool:
        return x in self._range

    def __reversed__(self) -> Iterator[int]:
        return iter(_BoundedList(reversed(self._range)))


class _BoundedList:
    def __init__(self, it: Iterable[Any]) -> None:
        self._it = it

    def __iter__(self) -> Iterator[Any]:
        for x in self._it:
            _check_time()
            yield x


def _bounded_filter(f: Any) -> Any:
    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_time()
        return _check_size(f(*args, **kwargs))

    return bounded


class _BoundedCodeGenerator(CodeGenerator):
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the bounds above."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def bounded_concat(self, values: Iterable[Any]) -> str:
        _check_time()
        values = [str(v) for v in values]
        if sum(map(len, values)) > _max_chars():
            raise _TemplateLimit(f"a string of more than {_max_chars()} characters (~)")
        return "".join(values)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_time()
        seq = (str, bytes, list, tuple)
        if operator == "*":
            n, s = (left, right) if isinstance(right, seq) else (right, left)
            if isinstance(s, seq) and isinstance(n, int) and len(s) * n > _max_chars():
                raise _TemplateLimit(f"a value of {len(s) * n} items exceeds {_max_chars()}")
        big_power = isinstance(left, int) and isinstance(right, int) and abs(left) > 1
        if operator == "**" and big_power and right * math.log2(abs(left)) > 4096:
            raise _TemplateLimit(f"{left} ** {right} is too large")
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_time()
        if isinstance(getattr(__obj, "__self__", None), str) and any(
            isinstance(a, int) and a > _max_chars() for a in (*args, *kwargs.values())
        ):  # "x".center(10**9), .ljust, .zfill ...: refused before allocating
            raise _TemplateLimit(f"an argument above {_max_chars()} to {__obj.__name__}")
        return _check_size(super().call(__context, __obj, *args, **kwargs))


# --- jinja sandbox, as transformers/utils/chat_template_utils.py ----------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders
    its body unchanged; colibri does not compute assistant masks."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    # Unlike jinja's own tojson: no HTML escaping, and indent/separators/sort_keys are exposed.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    # `dict(...)` without exposing the dict type itself to the template.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces reject underscore-prefixed attributes (no reaching CPython internals).
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} not allowed")


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = _BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.filters = {k: _bounded_filter(f) for k, f in env.filters.items()}
    env.globals["range"] = _BoundedRange
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


# --- streaming --------------------------------------------------------------------------------


class IncrementalDecoder:
    """Turns generated token ids into text deltas, one token at a time.

    Algorithm (as vLLM's `detokenize_incrementally` and TGI): decode a window of the previous
    tokens plus the new ones and emit the part past the window's previous text; hold back while
    that text ends in U+FFFD (an incomplete UTF-8 sequence: byte-fallback tokens like <0xE2>, or
    byte-level BPE pieces of a character). Decoding a window that starts at an earlier token keeps
    SentencePiece's leading "▁" of the new token (the decoder strips it only at a window's start).
    The deltas concatenated equal `decode(context + generated)[len(decode(context)):]` whenever
    the context ends on a character boundary, and `decode(generated)` with no context. A context
    that ends inside a character (its text ends in U+FFFD for 1-3 unfinished bytes) counts
    those bytes as not yet shown: the deltas equal `decode(context + generated)` past
    `decode(context)` without that U+FFFD, so the character streams whole once completed.

    A truly invalid byte sequence after shown text comes out as U+FFFD per bad byte (Python's
    errors="replace"), where `decode` of the whole sequence would also rewrite the bytes before it.

    `push(token_id) -> str` returns the new text (possibly ""); `flush() -> str` returns what is
    still held back at the end of generation.
    """

    # Tokens of context decoded before the first new one (vLLM's initial offset), at least.
    CONTEXT_WINDOW = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        context_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(context_ids)
        start = max(len(context) - self.CONTEXT_WINDOW, 0)
        # A window must not start inside a character: its orphan bytes would turn the whole run of
        # byte-fallback tokens that follows into U+FFFD. Move back to a clean start.
        while start > 0 and self._tok.decode(context[start:], self._skip).startswith("\ufffd"):
            start -= 1
        self._ids = context[start:]
        self._prefix = 0  # window start
        self._read = len(self._ids)  # end of the text already emitted
        self._prefix_text = self._decode(self._prefix, self._read)
        # A context that ends inside a character (a generation cut at max_tokens mid-emoji,
        # continued): its unfinished bytes (U+FFFD in its text, at most 3 bytes) count as not
        # shown yet, so the character comes out whole once generated tokens complete it.
        for _ in range(3):
            if self._prefix_text.endswith("\ufffd"):
                self._prefix_text = self._prefix_text[:-1]

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (may be empty)."""
        self._ids.append(int(token_id))
        text = self._decode(self._prefix)
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        delta = self._new_text(text)
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        return delta

    def flush(self) -> str:
        """Return the held-back text (call once, after the last token)."""
        delta = self._new_text(self._decode(self._prefix))
        self._prefix = self._read = len(self._ids)
        self._prefix_text = ""
        return delta

    def _new_text(self, window_text: str) -> str:
        if window_text.startswith(self._prefix_text):
            return window_text[len(self._prefix_text) :]
        # An invalid byte run after emitted text: `tokenizers` turns the whole run of byte tokens
        # into U+FFFD, rewriting text already shown. Decode the unsent tokens alone instead.
        return self._decode(self._read)


class StopChecker:
    """Finds stop strings in streamed text, across token boundaries.

    `push(delta) -> (text, stopped)`: `text` is safe to show: it holds back the longest tail that
    could begin a stop string, and on a match ends just before the earliest stop string
    (OpenAI semantics: the stop string is not part of the output); after a match `stopped` is
    True and further pushes return ("", True). `flush()` returns the held-back tail when
    generation ends for another reason.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise TokenizerError(f"stop strings must be non-empty strings: {list(stop)!r}")
        self.stop = tuple(stop)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string found (the earliest in the text)

    def push(self, delta: str) -> tuple[str, bool]:
        """Add streamed text; return (text to emit, whether a stop string was reached)."""
        if self.stopped:
            return "", True
        buf = self._held + delta
        hits = [(i, s) for s in self.stop if (i := buf.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: h[0])
            self.stopped, self._held = True, ""
            return buf[:at], True
        keep = 0
        for s in self.stop:  # longest suffix of buf that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Return the held-back text (when generation ends without a stop string)."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held
