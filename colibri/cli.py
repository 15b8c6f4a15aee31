"""`python -m colibri` / `colibri`: one entry point, one subcommand per job.

Each subcommand lives in the module that owns the job; that module provides
`configure_parser(parser)` and `run_cli(args) -> int`. Errors derived from ColibriError (and
OSError) print as one line and exit 1; `--debug` shows the traceback. SIGTERM and SIGHUP
stop convert, export-gguf, replay and bench like Ctrl-C: their temporary output is removed.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import signal
import sys
from typing import Any, NoReturn

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("colibri.run", "generate text from a prompt (default: the embedded demo model)"),
    "chat": ("colibri.run", "interactive multi-turn chat using the model's chat template"),
    "serve": ("colibri.serve.cli", "OpenAI/Anthropic-compatible HTTP server (default: the demo)"),
    "web": ("colibri.serve.web", "colibri serve, with its web dashboard opened in a browser"),
    "convert": ("colibri.convert", "convert a Hugging Face or GGUF checkpoint into a store"),
    "inspect": ("colibri.inspect", "describe a store and optionally verify its checksums"),
    "export-gguf": ("colibri.export_gguf", "write a store as a GGUF file for llama.cpp"),
    "replay": ("colibri.io.replay", "replay a routing trace through the reader and cache"),
    "selfcheck": ("colibri.compute.selfcheck", "check every kernel against its reference"),
    "eval": ("colibri.eval.cli", "measure quality: perplexity, KL vs a reference, benchmarks"),
    "bench": ("colibri.bench_cli", "report: colibri vs llama.cpp vs this machine's limits"),
    "plan": ("colibri.plan", "what a run will keep in RAM and how fast it can decode"),
    "doctor": ("colibri.doctor", "why a run is slow: io_uring, O_DIRECT, huge pages, memory, disk"),
    "tune": ("colibri.tune", "measure disk, memory and threads once; save the machine profile"),
    "mirror": ("colibri.io.mirror", "copy a store's experts file to another drive, verified"),
    "shard": ("colibri.cluster.shard", "split a store's experts into per-node stores (--cluster)"),
}


# commands that write a temporary output: SIGTERM / SIGHUP unwind them like Ctrl-C does, so
# the temporary is removed (the default action would kill the process and leave it behind)
CLEAN_UP_ON_SIGNAL = ("convert", "export-gguf", "replay", "bench")


class Signalled(BaseException):
    """SIGTERM or SIGHUP arrived (raised in the main thread, unwinding every `with` and
    `finally`); `signum` is the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_signalled(signum: int, _frame: object) -> None:
    raise Signalled(signum)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `colibri run: --ctx must be a whole number >= 1 ...`
    (no usage block in front; `--help` has it), exit code 2. The subcommands' parsers are of
    this class too (add_subparsers makes them so). A value such as `-1G` is a value, not an
    option (colibri.options.NEGATIVE_VALUE), so `--budget -1G` is refused by its type."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from colibri.options import NEGATIVE_VALUE

        self._negative_number_matcher = NEGATIVE_VALUE

    def error(self, message: str) -> NoReturn:
        m = re.fullmatch(r"argument COMMAND: invalid choice: '([^']*)'.*", message, re.S)
        if m:  # not argparse's "(choose from 'run', 'chat', ...)" in quotes
            near = difflib.get_close_matches(m.group(1), COMMANDS, n=1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            self.exit(
                2,
                f"{self.prog}: unknown command '{m.group(1)}'; {hint}commands: "
                f"{', '.join(COMMANDS)}\n",
            )
        m = re.fullmatch(r"argument ([^:]+): (.*)", message, re.S)
        if m:  # "argument --budget/--ram-budget: msg" -> "--budget msg"
            names = m.group(1).split("/")
            name = names[0] if names[0].startswith("--") else "/".join(names[:2])
            why = m.group(2)
            message = f"{name} {why}" if why.startswith("must") else f"{name}: {why}"
        else:
            message += f" (`{self.prog} --help` lists the options)"
        self.exit(2, f"{self.prog}: {message}\n")

    def command_parser(self, args: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the subcommand `args` chose (this one when none)."""
        return getattr(self, "commands", {}).get(getattr(args, "command", None), self)


def build_parser() -> Parser:
    parser = Parser(prog="colibri", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}
    for name, (module, help_) in COMMANDS.items():
        p = parser.commands[name] = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
        try:
            mod = importlib.import_module(module)
        except ImportError:
            # not built yet in this checkout: the command says so when used
            p.set_defaults(_module=module, _missing=True)
            continue
        if name == "chat" and hasattr(mod, "configure_chat_parser"):
            mod.configure_chat_parser(p)
            p.set_defaults(_run=mod.run_chat_cli)
        else:
            mod.configure_parser(p)
            p.set_defaults(_run=mod.run_cli)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command of `argv` (default sys.argv[1:]); returns the exit code (argparse's
    errors exit 2 by SystemExit). A reader that goes away (`colibri plan --json | head -1`)
    ends the command quietly with 141 (128 + SIGPIPE, what a shell shows for `yes | head`)."""
    try:
        try:
            return _main(argv)
        finally:  # argparse's --help exits too: flush here, not at exit ("Exception ignored")
            sys.stdout.flush()
    except BrokenPipeError:
        # stdout's reader is gone: point stdout at /dev/null so the interpreter's final flush
        # does not complain ("Exception ignored ... BrokenPipeError") and exit quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    from colibri.errors import ColibriError

    try:
        parser = build_parser()  # imports every command's module: Ctrl-C can land here
    except KeyboardInterrupt:
        print("\ncolibri: interrupted", file=sys.stderr)
        return 130
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand's parser: "colibri run: unrecognized arguments: ..."
        parser.command_parser(args).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_missing", False):
        print(
            f"colibri: error: command {args.command!r} is not available in this build",
            file=sys.stderr,
        )
        return 2
    if args.command in CLEAN_UP_ON_SIGNAL:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _raise_signalled)
    try:
        return int(args._run(args) or 0)
    except Signalled as exc:  # the command's own cleanup (temporary output) has run
        print(f"\ncolibri: stopped by {signal.Signals(exc.signum).name}", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("\ncolibri: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        raise  # main(): quiet
    except (ColibriError, OSError, ValueError) as exc:
        if args.debug:
            raise
        if isinstance(exc, OSError) and exc.filename and exc.strerror:
            exc = f"{exc.filename}: {exc.strerror}"  # not "[Errno 2] ..."
        print(f"colibri: error: {exc}", file=sys.stderr)
        return 1
