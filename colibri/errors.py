"""Exceptions users see. Every message names the file, tensor or field at fault."""


class ColibriError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero."""


class StoreError(ColibriError):
    """A model store (or a checkpoint being converted) is missing, malformed or corrupt."""


class ConversionError(ColibriError):
    """A source checkpoint cannot be converted (unsupported, inconsistent or truncated)."""


class KernelError(ColibriError):
    """A kernel was called with arguments it cannot handle (shape, dtype, format)."""


class ReadError(ColibriError, OSError):
    """An expert record could not be read (names the file, offset and length)."""


class TokenizerError(ColibriError):
    """Tokenizer or chat-template files are missing or invalid, or a template failed to render."""


class PromptTooLongError(ColibriError, ValueError):
    """A prompt has more tokens than allowed: n_tokens of at most max_tokens."""

    def __init__(self, n_tokens: int, max_tokens: int) -> None:
        super().__init__(f"the prompt has {n_tokens} tokens, more than {max_tokens}")
        self.n_tokens, self.max_tokens = n_tokens, max_tokens


class SamplingError(ColibriError, ValueError):
    """A sampling parameter is out of range or of the wrong type (names the field)."""
