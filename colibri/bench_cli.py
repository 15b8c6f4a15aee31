"""`colibri bench`: the benchmark suite lives in the source checkout's bench/ folder (it needs fio,
llama.cpp builds and big scratch files, so it is not part of the installed package); this
module finds it next to the colibri package and hands over to bench/suite.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _suite():
    if not (ROOT / "bench" / "suite.py").is_file():
        return None
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import suite

    return suite


def configure_parser(p: argparse.ArgumentParser) -> None:
    suite = _suite()
    if suite is not None:
        p.description = suite.__doc__.splitlines()[0]
        suite.configure_parser(p)


def run_cli(args: argparse.Namespace) -> int:
    suite = _suite()
    if suite is None:
        print(f"colibri bench: needs a source checkout (no bench/suite.py next to {ROOT})",
              file=sys.stderr)  # fmt: skip
        return 2
    return suite.run_cli(args)
