#!/usr/bin/env bash
# Set up colibri in ./.venv: system packages (as root, Debian), the venv, the package with its
# C kernels, and with "test" the test dependencies. Safe to run again: it only redoes what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
want="${1:-run}"
PY="${PYTHON:-python3}"

# System packages: a C compiler, liburing (io_uring), fio (benchmarks). Optional when not root:
# without liburing the build still succeeds and colibri reads with threads instead.
need=()
command -v cc >/dev/null 2>&1 || need+=(build-essential)
[ -f /usr/include/liburing.h ] || need+=(liburing-dev)
command -v fio >/dev/null 2>&1 || need+=(fio)
# SIMDe headers let the tests run the AVX-512 kernels emulated on CPUs without AVX-512
[ "$want" != test ] || [ -d /usr/include/simde ] || need+=(libsimde-dev)
# the dashboard's browser tests drive Debian's chromium through Playwright (nothing downloaded)
[ "$want" != test ] || command -v chromium >/dev/null 2>&1 || need+=(chromium)
"$PY" -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
"$PY" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' || need+=(python3-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "colibri setup: installing ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "colibri setup: missing system packages (${need[*]}); install them for io_uring, fio (and chromium: the browser tests)" >&2
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.colibri-$want"
if [ ! -f "$stamp" ] || [ -n "$(find pyproject.toml setup.py csrc -newer "$stamp" -print -quit)" ] \
   || ! ls colibri/_kernels*.so >/dev/null 2>&1; then
  # in-place builds from scripts/dev-build (cpython-tagged) would shadow pip's abi3 modules
  rm -f colibri/_kernels.cpython-*.so colibri/io/_uring.cpython-*.so
  extra="[bench]"  # matplotlib for `colibri bench`
  [ "$want" = test ] && extra="[test,bench,cluster]"  # cluster: Ray, for tests/test_cluster.py
  echo "colibri setup: installing colibri$extra into .venv (log: .venv/install.log)" >&2
  # pip's and setuptools' chatter goes to the log; shown only if the install fails
  if ! { .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip &&
         .venv/bin/python -m pip install -q --disable-pip-version-check -e ".$extra"; } \
       > .venv/install.log 2>&1; then
    grep -v "^WARNING: Location" .venv/install.log >&2
    echo "colibri setup: pip install failed (full log: .venv/install.log)" >&2
    exit 1
  fi
  touch "$stamp"
fi
