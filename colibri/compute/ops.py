"""The only importer of the compiled kernel library (`colibri._kernels`).

Every wrapper checks dtypes, shapes, contiguity and alignment, passes numpy buffers to C
without copying, and turns C error codes into `KernelError`s that say what was wrong.
Outputs are caller-allocated (`out=`), so hot paths allocate nothing.
"""

from __future__ import annotations

import enum
import os

import numpy as np

from colibri.errors import KernelError

try:
    from colibri._kernels import ffi, lib
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "colibri's C kernels are not built; run `pip install -e .` (or ./test.sh)"
    ) from exc


class QType(enum.IntEnum):
    """Storage types; values equal GGML's ggml_type (and gguf.GGMLQuantizationType)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    BF16 = 30

    @classmethod
    def parse(cls, name: str | int | QType) -> QType:
        """'q4_0' / 'Q4_0' / 2 / QType.Q4_0 -> QType.Q4_0; ValueError names the bad value."""
        if isinstance(name, QType):
            return name
        if isinstance(name, int):
            return cls(name)
        try:
            return cls[name.upper()]
        except KeyError:
            valid = ", ".join(q.name.lower() for q in cls)
            raise ValueError(f"unknown quant type {name!r} (valid: {valid})") from None


class ISA(enum.IntEnum):
    SCALAR = 0
    AVX2 = 1
    AVX512 = 2


_ERRORS = {
    -1: "invalid size or pointer argument",
    -2: "unknown quant type",
    -3: "number of columns is not a multiple of the block size (32)",
    -4: "instruction set not supported by this CPU or build",
}


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise KernelError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


def _ptr(a: np.ndarray | memoryview | bytes | bytearray | None, ctype: str = "void *"):
    """A cffi pointer into a buffer without copying (NULL for None)."""
    if a is None:
        return ffi.NULL
    return ffi.cast(ctype, ffi.from_buffer(a))


def _f32(a: np.ndarray, name: str, *, writable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous:
        raise KernelError(f"{name} must be a C-contiguous float32 numpy array")
    if writable and not a.flags.writeable:
        raise KernelError(f"{name} must be writable")
    return a


def isa() -> ISA:
    """The instruction-set level the kernels currently use."""
    return ISA(lib.clb_isa_get())


def best_isa() -> ISA:
    """The best level this CPU and build support."""
    return ISA(lib.clb_isa_detect())


def set_isa(level: ISA | str | int) -> None:
    """Force a level (tests, benchmarks). Raises KernelError if the CPU cannot run it."""
    level = ISA[level.upper()] if isinstance(level, str) else ISA(level)
    _check(lib.clb_isa_set(int(level)), f"set_isa({level.name})")


def default_threads() -> int:
    """Kernel threads used when nthreads <= 0: the number of physical cores."""
    return int(lib.clb_default_threads())


if os.environ.get("COLIBRI_ISA"):
    set_isa(os.environ["COLIBRI_ISA"])

# ---- quantization, matmul, expert FFN ------------------------------------------------------

# ---- small ops (norms, rope, softmax, top-k, activations) and attention -----------------------
