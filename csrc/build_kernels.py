"""cffi build script for colibri's kernel library (out-of-line API mode).

The cdef is csrc/colibri.h itself; every csrc/*.c and csrc/arch/*.c file is compiled into
`colibri._kernels`. SIMD files select their ISA with `#pragma GCC target`, so the library
runs on any x86-64 and picks the level at run time (see clb_isa_detect). Threads: our own
pool (csrc/pool.c), not OpenMP.
"""

from __future__ import annotations

import glob
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _rel(path: str) -> str:
    # setuptools wants source paths relative to the project root
    return os.path.relpath(path, ROOT)


def _sources() -> list[str]:
    files = sorted(glob.glob(os.path.join(HERE, "*.c")))
    files += sorted(glob.glob(os.path.join(HERE, "arch", "*.c")))
    return [_rel(f) for f in files if not os.path.basename(f).startswith("uring")]


with open(os.path.join(HERE, "colibri.h")) as f:
    _header = f.read()

ffibuilder = FFI()
ffibuilder.cdef(_header)
ffibuilder.set_source(
    "colibri._kernels",
    '#include "colibri.h"',
    sources=_sources(),
    include_dirs=[_rel(HERE)],
    extra_compile_args=["-O3", "-std=gnu11", "-pthread", "-fno-math-errno", "-Wall"],
    extra_link_args=["-pthread", "-lm"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=ROOT, verbose=False)
