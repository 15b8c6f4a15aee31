"""`colibri bench`: hands over to the benchmark suite, colibri/bench/suite.py (part of the
package; its sections that make synthetic stores or build llama.cpp run the checkout's tools/
scripts and say so when they are absent)."""

from __future__ import annotations

import argparse

from colibri.bench import suite


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = suite.__doc__.splitlines()[0]
    suite.configure_parser(p)


def run_cli(args: argparse.Namespace) -> int:
    return suite.run_cli(args)
