"""cffi build script for colibri's io_uring shim (`colibri.io._uring`, API mode).

liburing's prep/submit/wait helpers are static inline functions, so they are reached through
small wrappers in csrc/uring.c. When liburing's headers are missing the module is still built,
without io_uring: `lib.clb_uring_built()` returns 0 and colibri falls back to the thread reader
(and says so at run time).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _have_liburing() -> bool:
    if os.environ.get("COLIBRI_NO_URING"):
        return False
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(
                "#include <liburing.h>\nint main(void){struct io_uring r;"
                "return io_uring_queue_init(1,&r,0);}\n"
            )
        try:
            res = subprocess.run(
                [cc, src, "-o", os.path.join(tmp, "probe"), "-luring"], capture_output=True
            )
        except OSError:
            return False
        return res.returncode == 0


HAVE_URING = _have_liburing()
if not HAVE_URING:
    print(
        "colibri: liburing headers/library not found: building WITHOUT io_uring "
        "(install liburing-dev to enable it); reads fall back to threads.",
        file=sys.stderr,
    )

with open(os.path.join(HERE, "uring.h")) as f:
    _header = f.read()

ffibuilder = FFI()
ffibuilder.cdef(_header)
ffibuilder.set_source(
    "colibri.io._uring",
    '#include <stddef.h>\n#include <stdint.h>\n#include "uring.h"',
    sources=[os.path.relpath(os.path.join(HERE, "uring.c"), ROOT)],
    include_dirs=[os.path.relpath(HERE, ROOT)],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    define_macros=[("CLB_HAVE_URING", "1")] if HAVE_URING else [],
    libraries=["uring"] if HAVE_URING else [],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=ROOT, verbose=False)
