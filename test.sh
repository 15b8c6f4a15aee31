#!/usr/bin/env bash
# Run colibri's tests (sets everything up on first use, test dependencies included).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh test
.venv/bin/python -m ruff check colibri tests tools
.venv/bin/python -m ruff format --check colibri tests tools
exec .venv/bin/python -m pytest -q "$@"
