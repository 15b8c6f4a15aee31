"""argparse value types of the checked command-line options (run, chat, serve, eval, plan...).

Each type raises `argparse.ArgumentTypeError` with a message that starts "must ..." and ends
"(got VALUE)"; cli.py's parser prints it as one line after the option's name, e.g.
`colibri run: --ctx must be a whole number >= 1 (got '0')`, and exits 2 before any model is
opened. The ranges are the ones SamplingParams (colibri/sampling.py) and EngineOptions
(colibri/engine.py) check; tests/test_cli.py holds the two sets of rules together.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from colibri.io.reader import MAX_QUEUE_DEPTH


def parse_size(text: str) -> int:
    """'512M', '4G', '1.5GiB', '123456' -> bytes. Raises ValueError naming the value."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"invalid size {text!r} (examples: 512M, 4G, 1.5GiB)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    try:
        return int(float(m.group(1)) * scale)
    except ValueError:
        raise ValueError(f"invalid size {text!r} (examples: 512M, 4G, 1.5GiB)") from None


def _negative(text: str) -> bool:
    return text.strip().startswith("-")


def size_arg(text: str) -> int:
    """parse_size for argparse (its message reaches the user); 0 is accepted."""
    if _negative(text):
        raise argparse.ArgumentTypeError(f"must be a number of bytes >= 0 (got {text!r})")
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_size(text: str) -> int:
    """A byte count > 0 (an expert cache budget), e.g. 512M, 4G."""
    n = 0 if _negative(text) else size_arg(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes (got {text!r})")
    return n


def whole(lo: int, note: str = "", *, hi: int | None = None) -> Callable[[str], int]:
    """The argparse type of a whole number >= lo (and <= hi when given); `note` (e.g.
    "0: off") ends the message."""
    tail = f"; {note}" if note else ""
    rule = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < lo or (hi is not None and n > hi):
            raise argparse.ArgumentTypeError(f"must be a whole number {rule}{tail} (got {text!r})")
        return n

    parse.__name__ = f"whole {rule}"
    return parse


def number(
    lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False, note: str = ""
) -> Callable[[str], float]:
    """The argparse type of a finite number in the interval lo..hi (open ends as told)."""
    if hi == math.inf:
        rule = f"> {lo:g}" if lo_open else f">= {lo:g}"
    else:
        rule = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    tail = f"; {note}" if note else ""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        ok = (
            math.isfinite(v)
            and (v > lo if lo_open else v >= lo)
            and (v < hi if hi_open else v <= hi)
        )
        if not ok:
            raise argparse.ArgumentTypeError(f"must be a number {rule}{tail} (got {text!r})")
        return v

    parse.__name__ = f"number {rule}"
    return parse


ctx_tokens = whole(1)  # --ctx: context tokens
# --queue-depth: reads in flight (colibri/io/reader.py's range: an out-of-range depth is
# refused, not quietly turned into thread reads)
queue_depth = whole(1, "io_uring's ring limit", hi=MAX_QUEUE_DEPTH)

# a value such as `--budget -1G` would otherwise read as an option ("expected one argument"):
# argparse takes an argument that matches this for a value (a negative number) when the parser
# has no option that looks like one; the types above then refuse it by name
NEGATIVE_VALUE = re.compile(r"^-(\d[\w.]*|\.\d[\w.]*)$")
