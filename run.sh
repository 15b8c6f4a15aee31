#!/usr/bin/env bash
# Run colibri on the embedded default model (sets everything up on first use).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh run
exec .venv/bin/python -m colibri run "$@"
