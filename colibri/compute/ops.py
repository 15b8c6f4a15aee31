"""The only importer of the compiled kernel library (`colibri._kernels`).

Every wrapper checks dtypes, shapes, contiguity and alignment, passes numpy buffers to C
without copying, and turns C error codes into `KernelError`s that say what was wrong.
Outputs are caller-allocated (`out=`), so hot paths allocate nothing.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from colibri.errors import KernelError

try:
    from colibri._kernels import ffi, lib
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "colibri's C kernels are not built; run `pip install -e .` (or ./test.sh)"
    ) from exc


class QType(enum.IntEnum):
    """Storage types; values equal GGML's ggml_type (and gguf.GGMLQuantizationType), except
    FP8 (200, not a GGML type): float8 e4m3fn rows with an f32 scale per 128 columns (block
    layouts: docs/FORMAT.md, csrc/kquants.h)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    IQ4_XS = 23
    BF16 = 30
    MXFP4 = 39
    FP8 = 200

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
    -3: "number of columns is not a multiple of the block size (32; 256 for K-quants, IQ4_XS)",
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
    """Force a level (tests, benchmarks): ISA, 'scalar' / 'avx2' / 'avx512' or 0 / 1 / 2.
    Raises KernelError for an unknown level or one this CPU (or build) cannot run."""
    try:
        level = ISA[level.upper()] if isinstance(level, str) else ISA(level)
    except (KeyError, ValueError):
        valid = ", ".join(i.name.lower() for i in ISA)
        raise KernelError(f"unknown ISA level {level!r} (valid: {valid})") from None
    _check(lib.clb_isa_set(int(level)), f"set_isa({level.name})")


def amx_supported() -> bool:
    """Whether AMX int8 tiles are usable here: the CPU has amx_tile and amx_int8 (and
    AVX512-VNNI), the OS enables the tile state and Linux granted this process XTILEDATA."""
    return bool(lib.clb_amx_supported())


def amx() -> bool:
    """Whether the Q4_0 / Q8_0 GEMM on Q8_0 activations (prefill batches) runs on AMX tiles
    now: supported, not turned off (COLIBRI_AMX=0, set_amx(False)) and the AVX-512 level in
    use. The results are the same bits either way."""
    return bool(lib.clb_amx_get())


def set_amx(on: bool) -> None:
    """Turn the AMX GEMM on or off (tests, benchmarks). Raises KernelError to turn it on where
    amx_supported() is False."""
    _check(lib.clb_amx_set(1 if on else 0), f"set_amx({bool(on)}): AMX")


def default_threads() -> int:
    """Kernel threads used when nthreads <= 0: the number of physical cores."""
    return int(lib.clb_default_threads())


if os.environ.get("COLIBRI_ISA"):
    try:
        set_isa(os.environ["COLIBRI_ISA"])
    except KernelError as exc:
        raise KernelError(f"environment variable COLIBRI_ISA: {exc}") from None

# ---- quantization, matmul, expert FFN ------------------------------------------------------

Buffer = np.ndarray | memoryview | bytes | bytearray
_F32 = np.dtype(np.float32)


class Act(enum.IntEnum):
    """Expert FFN activations (clb_act); formulas in csrc/colibri.h."""

    SILU = 0
    GELU = 1
    SWIGLU_OAI = 2
    SILU_CLAMP = 3


def _nbytes(buf: Buffer, name: str) -> int:
    """Size of a weight buffer; it must be C-contiguous (passed to C without copying)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise KernelError(f"{name} must be C-contiguous")
        return buf.nbytes
    if isinstance(buf, bytes | bytearray):
        return len(buf)
    if isinstance(buf, memoryview):
        if not buf.c_contiguous:
            raise KernelError(f"{name} must be C-contiguous")
        return buf.nbytes
    raise KernelError(f"{name} must be a numpy array, memoryview, bytes or bytearray")


def row_nbytes(qtype: QType | str | int, cols: int) -> int:
    """Bytes of one row of `cols` weights stored as `qtype` (GGML layout: 32-weight blocks of
    18 (Q4_0), 20 (Q4_1) or 34 (Q8_0) bytes; 4/2/2 bytes an element for F32/F16/BF16).

    Raises KernelError if `cols` is not a multiple of the block size (32) for block formats.
    """
    return _row_nbytes(QType.parse(qtype), int(cols))


@functools.lru_cache(maxsize=1024)
def _row_nbytes(qt: QType, cols: int) -> int:
    nb = int(lib.clb_row_nbytes(int(qt), cols))
    _check(nb, f"row_nbytes({qt.name}, cols={cols})")
    return nb


def _fp(a: np.ndarray | None):
    """float * into a (validated) float32 array without copying; NULL for None."""
    return ffi.NULL if a is None else ffi.from_buffer("float[]", a)


def quantize(x: np.ndarray, qtype: QType | str | int, out: np.ndarray | None = None) -> np.ndarray:
    """Quantize float rows x[..., cols] to `qtype`, byte-identical to `gguf.quants.quantize`
    for the types gguf quantizes (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4). Q4_K, Q5_K,
    Q6_K: the algorithm of ggml's quantize_row_q*_K_ref (gguf has none). FP8: per 128x128
    tile of the rows (counted from the first row of x flattened to 2-D: pass one matrix per
    call), scale = amax / 448 and e4m3 = x / scale rounded to nearest even (DeepSeek-V3).

    Returns uint8 [..., row_nbytes(qtype, cols)] (written into `out` if given). x is converted
    to C-contiguous float32 first (a copy only if needed). Raises KernelError for a type not
    in QUANTIZE_TYPES, a bad shape, cols not a multiple of the block size (32, 256 for the
    K-quants) or a wrong `out`.
    """
    qt = QType.parse(qtype)
    if qt not in QUANTIZE_TYPES:
        raise KernelError(f"quantize: {qt.name} has no quantizer (an import-only type)")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim < 1:
        raise KernelError("quantize: x must have at least one dimension")
    cols = x.shape[-1]
    shape = (*x.shape[:-1], row_nbytes(qt, cols))
    if out is None:
        out = np.empty(shape, np.uint8)
    elif (
        not isinstance(out, np.ndarray)
        or out.dtype != np.uint8
        or out.shape != shape
        or not out.flags.c_contiguous
    ):
        raise KernelError(f"quantize: out must be a C-contiguous uint8 array of shape {shape}")
    rows = x.size // cols if cols else 0
    rc = lib.clb_quantize(int(qt), _ptr(out), _ptr(x, "float *"), rows, cols)
    _check(rc, f"quantize({qt.name}, shape={x.shape})")
    return out


def dequantize(
    data: Buffer, qtype: QType | str | int, shape: tuple[int, ...], out: np.ndarray | None = None
) -> np.ndarray:
    """Decode `qtype` bytes holding a tensor of `shape` (rows of shape[-1] weights) to float32,
    bit-identical to `gguf.quants.dequantize`.

    Returns float32 `shape` (written into `out` if given). Raises KernelError if data is not
    exactly the tensor's size or cols is not a multiple of 32 for block formats.
    """
    qt = QType.parse(qtype)
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise KernelError("dequantize: shape must have at least one dimension")
    cols = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    want = rows * row_nbytes(qt, cols)
    if (got := _nbytes(data, "dequantize: data")) != want:
        raise KernelError(f"dequantize: data has {got} bytes, {qt.name} {shape} needs {want}")
    if out is None:
        out = np.empty(shape, np.float32)
    elif _f32(out, "dequantize: out", writable=True).shape != shape:
        raise KernelError(f"dequantize: out has shape {out.shape}, expected {shape}")
    rc = lib.clb_dequantize(int(qt), _ptr(out, "float *"), _ptr(data), rows, cols)
    _check(rc, f"dequantize({qt.name}, shape={shape})")
    return out


def _rows_x(x: np.ndarray, out: np.ndarray, what: str) -> tuple[int, int, int]:
    """(n, cols, rows) for x [cols] / [n, cols] and out [rows] / [n, rows]."""
    if not (isinstance(x, np.ndarray) and x.dtype == _F32 and x.flags.c_contiguous):
        _f32(x, f"{what}: x")  # raises, naming the problem
    if not (isinstance(out, np.ndarray) and out.dtype == _F32 and out.flags.c_contiguous):
        _f32(out, f"{what}: out")
    if not out.flags.writeable:
        raise KernelError(f"{what}: out must be writable")
    if x.ndim not in (1, 2) or out.ndim != x.ndim or x.shape[:-1] != out.shape[:-1]:
        raise KernelError(
            f"{what}: x {x.shape} and out {out.shape} must be [cols] and [rows], "
            "or [n, cols] and [n, rows]"
        )
    n = x.shape[0] if x.ndim == 2 else 1
    return n, x.shape[-1], out.shape[-1]


def matmul(
    w: Buffer, qtype: QType | str | int, x: np.ndarray, out: np.ndarray, nthreads: int = 0
) -> np.ndarray:
    """out[n, rows] = x[n, cols] @ W[rows, cols]^T, f32 activations and accumulation.

    w: any C-contiguous buffer holding W row-major in `qtype` (rows * row_nbytes bytes, e.g. a
    numpy view into an expert record); rows is taken from out.shape[-1] and cols from
    x.shape[-1]. x, out: float32, C-contiguous, either 1-D (matvec) or 2-D with the same n.
    nthreads <= 0 means default_threads(). Runs in C with the GIL released; allocates nothing.
    Returns out. Raises KernelError on any shape, dtype or size mismatch.
    """
    qt = qtype if type(qtype) is QType else QType.parse(qtype)
    n, cols, rows = _rows_x(x, out, "matmul")
    want = rows * _row_nbytes(qt, cols)
    if (got := _nbytes(w, "matmul: w")) != want:
        raise KernelError(f"matmul: w has {got} bytes, {qt.name} [{rows}, {cols}] needs {want}")
    rc = lib.clb_matmul(qt, _fp(out), ffi.from_buffer(w), _fp(x), rows, cols, n, nthreads)
    if rc:
        _check(rc, f"matmul({qt.name}, rows={rows}, cols={cols}, n={n})")
    return out


# Weight types with a path on Q8_0 activations (matmul_q8, expert_ffn(act_q8=True)): integer
# dots for the GGML block types, f32 dots on the Q8_0 values for FP8.
Q8_ACT_TYPES = frozenset(QType) - {QType.F32, QType.F16, QType.BF16, QType.Q4_1}
# Types `quantize` can produce (the rest are import-only: GGUF / hub bytes kept as they are).
QUANTIZE_TYPES = frozenset(QType) - {QType.Q2_K, QType.Q3_K, QType.IQ4_NL, QType.IQ4_XS}


def quantize_act(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Activations x float32 [..., cols] -> Q8_0 blocks uint8 [..., row_nbytes(Q8_0, cols)] for
    matmul_q8: per 32 values d = max|x| / 127 (stored f16) and q = round(x / d), which is
    ggml's quantize_row_q8_0_ref and byte-identical to gguf.quants.quantize(x, Q8_0).
    Raises KernelError if cols is not a multiple of 32 or `out` is wrong."""
    return quantize(x, QType.Q8_0, out)


def _matmul_act_args(
    what: str,
    w: Buffer,
    qt: QType,
    types: frozenset[QType],
    xq: np.ndarray,
    out: np.ndarray,
    act_name: str,
    block_nbytes: int,
    block_cols: int,
) -> tuple[int, int, int]:
    """Check matmul_q8 / matmul_q8k's arguments (weights of `types`, xq rows of `act_name`
    blocks of block_nbytes bytes per block_cols values); returns (n, cols, rows)."""
    if qt not in types:
        valid = ", ".join(sorted(q.name for q in types))
        raise KernelError(f"{what}: weights must be one of {valid}, got {qt.name}")
    if not (isinstance(xq, np.ndarray) and xq.dtype == np.uint8 and xq.flags.c_contiguous):
        raise KernelError(f"{what}: xq must be a C-contiguous uint8 numpy array ({act_name})")
    _f32(out, f"{what}: out", writable=True)
    if xq.ndim not in (1, 2) or out.ndim != xq.ndim or xq.shape[:-1] != out.shape[:-1]:
        raise KernelError(
            f"{what}: xq {xq.shape} and out {out.shape} must be [row bytes] and [rows], "
            "or [n, row bytes] and [n, rows]"
        )
    if xq.shape[-1] % block_nbytes:
        raise KernelError(f"{what}: xq rows of {xq.shape[-1]} bytes are not {act_name} blocks")
    n = xq.shape[0] if xq.ndim == 2 else 1
    cols, rows = xq.shape[-1] // block_nbytes * block_cols, out.shape[-1]
    want = rows * _row_nbytes(qt, cols)
    if (got := _nbytes(w, f"{what}: w")) != want:
        raise KernelError(f"{what}: w has {got} bytes, {qt.name} [{rows}, {cols}] needs {want}")
    return n, cols, rows


def matmul_q8(
    w: Buffer, qtype: QType | str | int, xq: np.ndarray, out: np.ndarray, nthreads: int = 0
) -> np.ndarray:
    """out[n, rows] = xq[n, cols] @ W[rows, cols]^T on Q8_0-quantized activations (llama.cpp's
    CPU path, ggml_vec_dot_q4_0_q8_0 / ggml_vec_dot_q8_0_q8_0): per 32-weight block the exact
    int8 x int8 dot, times f32(d_w) * f32(d_x), summed in f32. The other Q8_ACT_TYPES: per 16
    weights the exact dot of the weight levels with x's, times the sub-block scale (plus the
    min times x's level sum) and d_x, in f32 (ggml's K-quant dots, on Q8_0 instead of Q8_K
    activations); MXFP4: ggml_vec_dot_mxfp4_q8_0 in scalar form (per block the exact int32
    dot of the E2M1 levels, fma'd by d_x * 2^(e-128) into one f32 sum in block order); FP8:
    x_s = d_x q_x (exact), then per 128-column block 16 f32 lanes of fma(w, x_s) times the
    block scale (the same bits for any n).

    w: Q8_ACT_TYPES bytes [rows, row_nbytes] (any C-contiguous buffer); xq: uint8
    [n, row_nbytes(Q8_0, cols)] or 1-D, from quantize_act; out: float32 [n, rows] or [rows]
    (same ndim as xq). Runs with the GIL released, allocates nothing. Returns out.
    Raises KernelError for another weight type or any shape, dtype or size mismatch.
    """
    qt = qtype if type(qtype) is QType else QType.parse(qtype)
    n, cols, rows = _matmul_act_args("matmul_q8", w, qt, Q8_ACT_TYPES, xq, out, "Q8_0", 34, 32)
    rc = lib.clb_matmul_q8(qt, _fp(out), ffi.from_buffer(w), _ptr(xq), rows, cols, n, nthreads)
    if rc:
        _check(rc, f"matmul_q8({qt.name}, rows={rows}, cols={cols}, n={n})")
    return out


# ---- X16-packed weights (decode layout of a Q4_0 / Q8_0 / MXFP4 matrix in RAM) -------------
# Rows in tiles of 16 stored as the AVX-512 matvec reads them (colibri.h: clb_pack_x16): one
# sequential stream of 64-byte loads with no shuffles. Tile-aligned row ranges keep their byte
# ranges, so views of whole tiles stay packed matrices. matmul_q8_x16 gives matmul_q8's bits.
X16_TYPES = frozenset({QType.Q4_0, QType.Q8_0, QType.MXFP4})


def x16_ok(qtype: QType | str | int, rows: int, cols: int) -> bool:
    """True when a [rows, cols] matrix of `qtype` has the X16 layout: Q4_0, Q8_0 or MXFP4,
    rows a multiple of 16, cols a multiple of 64."""
    return bool(lib.clb_x16_ok(int(QType.parse(qtype)), int(rows), int(cols)))


def x16_fast() -> bool:
    """True when packing pays: matmul_q8_x16 runs its own kernels (AVX512-VNNI at the current
    ISA level) and AMX does not take the batches (its tiles read GGML rows). Elsewhere it
    unpacks tiles for the row-major kernels, slower than matmul_q8 on GGML rows: the model
    packs only where this is True."""
    return bool(lib.clb_x16_fast())


HUGE_PAGE = 2 << 20


def empty_huge(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] on its own anonymous mapping, 2 MiB-aligned and advised for transparent
    huge pages (madvise MADV_HUGEPAGE; refused: normal pages), for weights a kernel streams
    (4 KiB pages stop the hardware prefetchers at every page and miss the TLB). The mapping
    lives as long as the array (and its views)."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # whole huge pages after aligning
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError):
        m.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(m, dtype=np.uint8)
    skip = -a.__array_interface__["data"][0] % HUGE_PAGE
    return a[skip : skip + nbytes]


def _x16_convert(fn, what: str, w: np.ndarray, qtype, cols: int, out) -> np.ndarray:
    qt = QType.parse(qtype)
    if not (isinstance(w, np.ndarray) and w.dtype == np.uint8 and w.ndim == 2
            and w.flags.c_contiguous):  # fmt: skip
        raise KernelError(f"{what}: w must be a C-contiguous uint8 [rows, row_nbytes] array")
    rows = w.shape[0]
    if not x16_ok(qt, rows, cols) or w.shape[1] != _row_nbytes(qt, cols):
        raise KernelError(f"{what}: {qt.name} [{rows}, {cols}] ({w.shape}) has no X16 layout")
    if out is None:
        out = np.empty_like(w)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.shape == w.shape
              and out.flags.c_contiguous and out.flags.writeable):  # fmt: skip
        raise KernelError(f"{what}: out must be a writable C-contiguous uint8 {w.shape} array")
    _check(fn(int(qt), ffi.from_buffer(out), ffi.from_buffer(w), rows, cols), what)
    return out


def pack_x16(
    w: np.ndarray, qtype: QType | str | int, cols: int, out: np.ndarray | None = None
) -> np.ndarray:
    """GGML rows w uint8 [rows, row_nbytes(qtype, cols)] -> the same bytes in the X16 layout
    (a new array, or `out`, which may be w itself: packed in place). Raises KernelError when
    x16_ok(qtype, rows, cols) is False or an array is wrong."""
    return _x16_convert(lib.clb_pack_x16, "pack_x16", w, qtype, cols, out)


def unpack_x16(
    w: np.ndarray, qtype: QType | str | int, cols: int, out: np.ndarray | None = None
) -> np.ndarray:
    """The inverse of pack_x16 (X16 bytes -> GGML rows); same arguments and errors."""
    return _x16_convert(lib.clb_unpack_x16, "unpack_x16", w, qtype, cols, out)


def matmul_q8_x16(
    w: np.ndarray, qtype: QType | str | int, xq: np.ndarray, out: np.ndarray, nthreads: int = 0
) -> np.ndarray:
    """matmul_q8 on X16-packed weights (pack_x16): out[n, rows] = xq[n, cols] @ W^T, the same
    bits as matmul_q8 on the GGML rows. w uint8 [rows, row_nbytes]; xq, out as matmul_q8.
    Raises KernelError on a shape without the X16 layout or any mismatch."""
    qt = qtype if type(qtype) is QType else QType.parse(qtype)
    n, cols, rows = _matmul_act_args("matmul_q8_x16", w, qt, X16_TYPES, xq, out, "Q8_0", 34, 32)
    rc = lib.clb_matmul_q8_x16(qt, _fp(out), ffi.from_buffer(w), _ptr(xq), rows, cols, n, nthreads)
    if rc:
        _check(rc, f"matmul_q8_x16({qt.name}, rows={rows}, cols={cols}, n={n})")
    return out


# Weight types with a GEMM on Q8_K activations (matmul_q8k).
Q8K_ACT_TYPES = frozenset({QType.Q4_K, QType.Q5_K, QType.Q6_K})
Q8K_BLOCK_NBYTES = 292  # ggml's block_q8_K: f32 d, 256 int8, 16 int16 sums


def quantize_q8_k(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Activations x float32 [..., cols] -> Q8_K blocks uint8 [..., cols // 256 * 292] for
    matmul_q8k: per 256 values the one of largest magnitude m becomes -127, d = m / -127 (f32),
    q = round-half-even(x * -127 / m) capped at 127, plus the int16 sums of q per 16 (ggml's
    quantize_row_q8_K_ref). Raises KernelError if cols is not a multiple of 256 or `out` is
    wrong."""
    x = _f32(np.ascontiguousarray(x, np.float32), "quantize_q8_k: x")
    cols = x.shape[-1] if x.ndim else 0
    if x.ndim == 0 or cols % 256:
        raise KernelError(f"quantize_q8_k: cols {cols} is not a multiple of 256")
    shape = (*x.shape[:-1], cols // 256 * Q8K_BLOCK_NBYTES)
    if out is None:
        out = np.empty(shape, np.uint8)
    elif out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise KernelError(f"quantize_q8_k: out must be C-contiguous uint8 {shape}")
    rc = lib.clb_quantize_q8_k(_ptr(out), _fp(x), x.size // cols if cols else 0, cols)
    if rc:
        _check(rc, f"quantize_q8_k(cols={cols})")
    return out


def matmul_q8k(
    w: Buffer, qtype: QType | str | int, xq: np.ndarray, out: np.ndarray, nthreads: int = 0
) -> np.ndarray:
    """out[n, rows] = xq[n, cols] @ W[rows, cols]^T for K-quant weights on Q8_K activations, a
    GEMM tiled over the x rows (the tokens routed to an expert): per 256-weight block the exact
    int32 sums of ggml's vec_dot_q4_K_q8_K / vec_dot_q6_K_q8_K (levels x q per sub-block times
    its scale; the mins times x's sums), then acc = fma(sumi, d_w d_x, acc) (and
    fma(-summ, dmin_w d_x, acc)) in block order: the same bits at every ISA level and batch
    size (csrc/kquants_gemm.h).

    w: Q4_K / Q5_K / Q6_K bytes [rows, row_nbytes]; xq: uint8 [n, cols // 256 * 292] or 1-D,
    from quantize_q8_k; out: float32 [n, rows] or [rows] (same ndim as xq). Returns out.
    Raises KernelError for another weight type or any shape, dtype or size mismatch."""
    qt = qtype if type(qtype) is QType else QType.parse(qtype)
    n, cols, rows = _matmul_act_args(
        "matmul_q8k", w, qt, Q8K_ACT_TYPES, xq, out, "Q8_K", Q8K_BLOCK_NBYTES, 256
    )
    rc = lib.clb_matmul_q8k(qt, _fp(out), ffi.from_buffer(w), _ptr(xq), rows, cols, n, nthreads)
    if rc:
        _check(rc, f"matmul_q8k({qt.name}, rows={rows}, cols={cols}, n={n})")
    return out


_tls = threading.local()


_SCRATCH_KEEP = 8 << 20  # bytes: larger scratch (long prefill chunks) is not kept


def _scratch(kind: str, size: int, dtype: type) -> np.ndarray:
    """A per-thread buffer of >= size elements, kept between calls up to _SCRATCH_KEEP bytes
    (decode allocates nothing): only for scratch that does not outlive the kernel call."""
    buf = getattr(_tls, kind, None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, 1), dtype)
        if buf.nbytes <= _SCRATCH_KEEP:
            setattr(_tls, kind, buf)
    return buf


def _opt_f32(a: np.ndarray | None, size: int, name: str) -> np.ndarray | None:
    if a is not None and _f32(a, name).size != size:
        raise KernelError(f"{name} must have {size} elements, got {a.size}")
    return a


def _ffn_args(
    what: str,
    out: np.ndarray,
    x: np.ndarray,
    weights: tuple[Buffer, Buffer, Buffer],
    qts: tuple[QType, ...],
    d_model: int,
    d_ff: int,
    act: Act | str | int,
    biases: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None],
    row_weight: np.ndarray | None,
) -> tuple[Act, int]:
    """Check an expert FFN's arguments (gate / up / down stored as qts); returns (act, n)."""
    if len(qts) != 3:
        raise KernelError(f"{what}: qtypes must be (gate, up, down), got {len(qts)} types")
    a = act if type(act) is Act else Act[act.upper()] if isinstance(act, str) else Act(act)
    n, cols, rows = _rows_x(x, out, what)
    if cols != d_model or rows != d_model:
        raise KernelError(f"{what}: x {x.shape} and out {out.shape} need d_model={d_model}")
    g_qt, u_qt, d_qt = qts
    wants = (d_ff * _row_nbytes(g_qt, d_model), d_ff * _row_nbytes(u_qt, d_model),
             d_model * _row_nbytes(d_qt, d_ff))  # fmt: skip
    for name, buf, qt, want in zip(("gate", "up", "down"), weights, qts, wants, strict=True):
        if (got := _nbytes(buf, f"{what}: {name}")) != want:
            raise KernelError(f"{what}: {name} has {got} bytes, {qt.name} needs {want}")
    gate_bias, up_bias, down_bias = biases
    _opt_f32(gate_bias, d_ff, f"{what}: gate_bias")
    _opt_f32(up_bias, d_ff, f"{what}: up_bias")
    _opt_f32(down_bias, d_model, f"{what}: down_bias")
    _opt_f32(row_weight, n, f"{what}: row_weight")
    return a, n


def _ffn_scratch(
    scratch: np.ndarray | None,
    act_q8: bool,
    qts: tuple[QType, ...],
    n: int,
    d_model: int,
    d_ff: int,
) -> tuple[np.ndarray, object]:
    """expert_ffn's f32 scratch (checked, or the per-thread one) and Q8_0 scratch (NULL unless
    act_q8, whose weight types it checks)."""
    if scratch is None:
        scratch = _scratch("ffn", 2 * n * d_ff, np.float32)
    elif _f32(scratch, "expert_ffn: scratch", writable=True).size < 2 * n * d_ff:
        raise KernelError(f"expert_ffn: scratch needs >= {2 * n * d_ff} float32 elements")
    qs = ffi.NULL
    if act_q8:
        if bad := [q.name for q in qts if q not in Q8_ACT_TYPES]:
            got = bad[0] if len(qts) == 1 else bad
            raise KernelError(f"expert_ffn: act_q8 needs Q8_ACT_TYPES weights, got {got}")
        qs = ffi.from_buffer(
            _scratch(
                "ffn_q8", n * (_row_nbytes(QType.Q8_0, d_model) + _row_nbytes(QType.Q8_0, d_ff)),
                np.uint8,
            )
        )  # fmt: skip
    return scratch, qs


def expert_ffn(
    out: np.ndarray,
    x: np.ndarray,
    gate: Buffer,
    up: Buffer,
    down: Buffer,
    qtype: QType | str | int,
    d_model: int,
    d_ff: int,
    *,
    act: Act | str | int = Act.SILU,
    gate_bias: np.ndarray | None = None,
    up_bias: np.ndarray | None = None,
    down_bias: np.ndarray | None = None,
    row_weight: np.ndarray | None = None,
    accumulate: bool = True,
    alpha: float = 1.702,
    limit: float = 7.0,
    scratch: np.ndarray | None = None,
    act_q8: bool = False,
    nthreads: int = 0,
    qtypes: tuple[QType | str | int, QType | str | int, QType | str | int] | None = None,
    x16: bool = False,
) -> np.ndarray:
    """One routed expert on n token rows: out (+)= row_weight * down(act(gate x, up x)).

    x, out: float32 [d_model] or [n, d_model]. gate, up: [d_ff, d_model] and down:
    [d_model, d_ff] in `qtype`, any C-contiguous buffers (e.g. numpy views into a slab slot,
    no copies). act: "silu" (SwiGLU), "gelu" (tanh approximation) or "swiglu_oai" (gpt-oss:
    g = min(g, limit), u = clamp(u, -limit, limit), (u + 1) * g * sigmoid(alpha * g), as HF
    GptOssExperts). Biases float32 [d_ff] / [d_ff] / [d_model], added before the activation
    (gate, up) or the routing weight (down). row_weight float32 [n] scales each row's output.
    accumulate=False overwrites out. scratch float32 with >= 2 * n * d_ff elements (None: a
    per-thread buffer kept between calls). act_q8=True (Q4_0 / Q8_0 weights only): x and
    h are quantized to Q8_0 and the matmuls are integer dots as in matmul_q8 (its small Q8_0
    scratch is a per-thread buffer kept between calls). qtypes: (gate, up, down) storage types
    when they differ (a record of a mixed GGUF quant); `qtype` is then ignored. Returns out.
    act "silu_clamp" (DeepSeek-V4, HF DeepseekV4Experts): silu(min(g, limit)) *
    clamp(u, -limit, limit). x16: gate, up, down are X16-packed (pack_x16; act_q8, one
    X16_TYPES type, x16_ok shapes), the same bits.
    Raises KernelError on bad shapes, or act_q8 with a weight type outside Q8_ACT_TYPES.
    """
    if qtypes is not None:
        if x16:
            raise KernelError("expert_ffn: x16 takes one type for gate, up and down")
        return _expert_ffn_mixed(
            out, x, gate, up, down, tuple(QType.parse(q) for q in qtypes), d_model, d_ff,
            act=act, gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias,
            row_weight=row_weight, accumulate=accumulate, alpha=alpha, limit=limit,
            scratch=scratch, act_q8=act_q8, nthreads=nthreads,
        )  # fmt: skip
    qt = qtype if type(qtype) is QType else QType.parse(qtype)
    a, n = _ffn_args(
        "expert_ffn", out, x, (gate, up, down), (qt, qt, qt), d_model, d_ff, act,
        (gate_bias, up_bias, down_bias), row_weight,
    )  # fmt: skip
    if x16 and not (act_q8 and qt in X16_TYPES and x16_ok(qt, d_ff, d_model)
                    and x16_ok(qt, d_model, d_ff)):  # fmt: skip
        raise KernelError(f"expert_ffn: x16 needs act_q8, an X16_TYPES type and x16_ok shapes, "
                          f"got {qt.name} d_model={d_model} d_ff={d_ff}")  # fmt: skip
    scratch, qs = _ffn_scratch(scratch, act_q8, (qt,), n, d_model, d_ff)
    rc = (lib.clb_expert_ffn_x16 if x16 else lib.clb_expert_ffn)(
        qt, _fp(out), _fp(scratch), _fp(x), ffi.from_buffer(gate), ffi.from_buffer(up),
        ffi.from_buffer(down), _fp(gate_bias), _fp(up_bias), _fp(down_bias), _fp(row_weight),
        n, d_model, d_ff, a, alpha, limit, bool(accumulate), qs, nthreads,
    )  # fmt: skip
    if rc:
        _check(rc, f"expert_ffn({qt.name}, n={n}, d_model={d_model}, d_ff={d_ff})")
    return out


def expert_ffn_q8k(
    out: np.ndarray,
    x: np.ndarray,
    gate: Buffer,
    up: Buffer,
    down: Buffer,
    qtypes: tuple[QType | str | int, QType | str | int, QType | str | int],
    d_model: int,
    d_ff: int,
    *,
    act: Act | str | int = Act.SILU,
    gate_bias: np.ndarray | None = None,
    up_bias: np.ndarray | None = None,
    down_bias: np.ndarray | None = None,
    row_weight: np.ndarray | None = None,
    accumulate: bool = True,
    alpha: float = 1.702,
    limit: float = 7.0,
    nthreads: int = 0,
) -> np.ndarray:
    """expert_ffn for a record whose gate / up / down (`qtypes`) are all Q4_K / Q5_K / Q6_K, on
    Q8_K activations: x and h quantized as quantize_q8_k, the three products by matmul_q8k's
    GEMM over the n token rows (bits independent of n, the ISA level and the thread count).
    Arguments and result as expert_ffn (d_model, d_ff multiples of 256). Raises KernelError on
    another type or bad shapes."""
    qts = tuple(q if type(q) is QType else QType.parse(q) for q in qtypes)
    if len(qts) != 3 or any(q not in Q8K_ACT_TYPES for q in qts):
        raise KernelError(f"expert_ffn_q8k: gate/up/down must be Q4_K, Q5_K or Q6_K, got {qts}")
    a, n = _ffn_args(
        "expert_ffn_q8k", out, x, (gate, up, down), qts, d_model, d_ff, act,
        (gate_bias, up_bias, down_bias), row_weight,
    )  # fmt: skip
    scratch = _scratch("ffn", 2 * n * d_ff, np.float32)
    rc = lib.clb_expert_ffn_q8k(
        *qts, _fp(out), _fp(scratch), _fp(x), ffi.from_buffer(gate), ffi.from_buffer(up),
        ffi.from_buffer(down), _fp(gate_bias), _fp(up_bias), _fp(down_bias), _fp(row_weight),
        n, d_model, d_ff, a, alpha, limit, bool(accumulate), nthreads,
    )  # fmt: skip
    if rc:
        _check(rc, f"expert_ffn_q8k({qts}, n={n}, d_model={d_model}, d_ff={d_ff})")
    return out


def _expert_ffn_mixed(
    out: np.ndarray,
    x: np.ndarray,
    gate: Buffer,
    up: Buffer,
    down: Buffer,
    qts: tuple[QType, ...],
    d_model: int,
    d_ff: int,
    *,
    act: Act | str | int,
    gate_bias: np.ndarray | None,
    up_bias: np.ndarray | None,
    down_bias: np.ndarray | None,
    row_weight: np.ndarray | None,
    accumulate: bool,
    alpha: float,
    limit: float,
    scratch: np.ndarray | None,
    act_q8: bool,
    nthreads: int,
) -> np.ndarray:
    """expert_ffn with a storage type per tensor (clb_expert_ffn_mixed); see expert_ffn."""
    a, n = _ffn_args(
        "expert_ffn", out, x, (gate, up, down), qts, d_model, d_ff, act,
        (gate_bias, up_bias, down_bias), row_weight,
    )  # fmt: skip
    g_qt, u_qt, d_qt = qts
    scratch, qs = _ffn_scratch(scratch, act_q8, qts, n, d_model, d_ff)
    rc = lib.clb_expert_ffn_mixed(
        g_qt, u_qt, d_qt, _fp(out), _fp(scratch), _fp(x), ffi.from_buffer(gate),
        ffi.from_buffer(up), ffi.from_buffer(down), _fp(gate_bias), _fp(up_bias),
        _fp(down_bias), _fp(row_weight), n, d_model, d_ff, a, alpha, limit, bool(accumulate),
        qs, nthreads,
    )  # fmt: skip
    if rc:
        names = "/".join(q.name for q in qts)
        _check(rc, f"expert_ffn({names}, n={n}, d_model={d_model}, d_ff={d_ff})")
    return out


def expert_ffn_group(
    out: np.ndarray,
    x: np.ndarray,
    records: Sequence[Buffer],
    spans: Mapping[str, tuple[int, int]],
    qtypes: tuple[QType | str | int, QType | str | int, QType | str | int],
    row_off: np.ndarray,
    d_model: int,
    d_ff: int,
    *,
    act: Act | str | int = Act.SILU,
    row_weight: np.ndarray | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    act_q8: bool = False,
    q8k: bool = False,
    nthreads: int = 0,
    x16: bool = False,
) -> np.ndarray:
    """Several experts of one layer in one kernel call (clb_expert_ffn_group): expert e, whose
    record is records[e] (uint8 buffers, e.g. slab slots), runs on the rows
    x[row_off[e] : row_off[e + 1]] and writes out's same rows, exactly as expert_ffn
    (accumulate=False; act_q8 as there) or, with q8k, expert_ffn_q8k on those rows alone.

    x, out: float32 [n, d_model]; row_off: int64 [len(records) + 1], non-decreasing from 0 to
    n; row_weight: float32 [n] or None. spans: tensor name -> (byte offset, nbytes) inside
    every record, for "gate", "up", "down" and optionally "gate_bias", "up_bias",
    "down_bias" (f32); qtypes: (gate, up, down) storage types, the same for every record.
    One Python call for a layer's ready experts instead of one per expert (serve's batches
    run tens of experts a layer). x16: gate, up and down are X16-packed in every record
    (pack_x16; act_q8, not q8k, X16_TYPES with x16_ok shapes), the same bits. Returns out.
    Raises KernelError on bad shapes, spans that do not fit a record, or types the chosen path
    does not take."""
    qts = tuple(q if type(q) is QType else QType.parse(q) for q in qtypes)
    what = "expert_ffn_group"
    if q8k and (len(qts) != 3 or any(q not in Q8K_ACT_TYPES for q in qts)):
        raise KernelError(f"{what}: q8k needs Q4_K, Q5_K or Q6_K gate/up/down, got {qts}")
    if len(qts) != 3:
        raise KernelError(f"{what}: qtypes must be (gate, up, down), got {len(qts)} types")
    if x16 and (
        q8k
        or not act_q8
        or not x16_ok(qts[0], d_ff, d_model)
        or not x16_ok(qts[1], d_ff, d_model)
        or not x16_ok(qts[2], d_model, d_ff)
    ):
        raise KernelError(f"{what}: x16 needs act_q8, X16_TYPES and x16_ok shapes, got {qts}")
    a = act if type(act) is Act else Act[act.upper()] if isinstance(act, str) else Act(act)
    n, cols, rows = _rows_x(x, out, what)
    if x.ndim != 2 or cols != d_model or rows != d_model:
        raise KernelError(f"{what}: x {x.shape} and out {out.shape} need [n, {d_model}]")
    g_qt, u_qt, d_qt = qts
    wants = (d_ff * _row_nbytes(g_qt, d_model), d_ff * _row_nbytes(u_qt, d_model),
             d_model * _row_nbytes(d_qt, d_ff))  # fmt: skip
    for name, qt, want in zip(("gate", "up", "down"), qts, wants, strict=True):
        if spans[name][1] != want:
            raise KernelError(f"{what}: {name} is {spans[name][1]} bytes, {qt.name}: {want}")
    _opt_f32(row_weight, n, f"{what}: row_weight")
    row_off = np.ascontiguousarray(row_off, dtype=np.int64)
    if (
        row_off.shape != (len(records) + 1,)
        or row_off[0] != 0
        or row_off[-1] != n
        or (np.diff(row_off) < 0).any()
    ):
        raise KernelError(
            f"{what}: row_off must rise from 0 to {n} (the rows of x) in {len(records) + 1} "
            f"entries, got {row_off.tolist()}"
        )
    end = max(o + nb for o, nb in spans.values())
    bias_names = ("gate_bias", "up_bias", "down_bias")
    bias_sizes = {"gate_bias": d_ff, "up_bias": d_ff, "down_bias": d_model}
    for name in bias_names:
        if name in spans and spans[name][1] != 4 * bias_sizes[name]:
            raise KernelError(f"{what}: {name} spans {spans[name][1]} bytes, needs "
                              f"{4 * bias_sizes[name]}")  # fmt: skip
    keep = []
    ptrs: dict[str, list[Any]] = {k: [] for k in ("gate", "up", "down", *bias_names)}
    for e, rec in enumerate(records):
        if (nb := _nbytes(rec, f"{what}: records[{e}]")) < end:
            raise KernelError(f"{what}: records[{e}] has {nb} bytes, its spans need {end}")
        base = ffi.cast("uint8_t *", ffi.from_buffer(rec))
        keep.append(rec)
        for name in ptrs:
            if name in spans:
                ptrs[name].append(base + spans[name][0])
    biases = [
        ffi.new("float *[]", [ffi.cast("float *", p) for p in ptrs[b]]) if ptrs[b] else ffi.NULL
        for b in bias_names
    ]
    m = int(np.diff(row_off).max()) if len(records) else 0
    scratch = _scratch("ffn", 2 * max(m, 1) * d_ff, np.float32)
    qs = ffi.NULL
    if act_q8 and not q8k:
        scratch, qs = _ffn_scratch(scratch, True, qts, max(m, 1), d_model, d_ff)
    rc = lib.clb_expert_ffn_group(
        len(records), *qts, bool(q8k), bool(x16), _fp(out), _fp(scratch), _fp(x),
        ffi.new("void *[]", ptrs["gate"]), ffi.new("void *[]", ptrs["up"]),
        ffi.new("void *[]", ptrs["down"]), *biases, _fp(row_weight),
        ffi.cast("int64_t *", ffi.from_buffer(row_off)), d_model, d_ff, a, alpha, limit, qs,
        nthreads,
    )  # fmt: skip
    del keep
    if rc:
        names = "/".join(q.name for q in qts)
        _check(rc, f"{what}({names}, {len(records)} experts, n={n}, d_model={d_model})")
    return out


def mem_read(buf: Buffer, nthreads: int = 0) -> int:
    """Read every byte of `buf` (any C-contiguous buffer) once with vector loads on nthreads
    threads (<= 0: default_threads()), GIL released; returns the XOR of its 64-bit words
    (little-endian; a tail of < 8 bytes XORed in bytewise), which makes the reads observable.
    Time it for the streaming read bandwidth (bench/, DESIGN.md §8)."""
    nbytes = _nbytes(buf, "mem_read: buf")
    out = ffi.new("int64_t *")
    _check(lib.clb_mem_read(out, ffi.from_buffer(buf), nbytes, nthreads), "mem_read")
    return int(out[0]) & 0xFFFFFFFFFFFFFFFF


def cache_flush(buf: Buffer) -> None:
    """Evict every cache line of `buf` (any C-contiguous buffer) from every cache level
    (x86 clflush) and fence: its next read comes from memory. For benchmarks that time reads
    of a working set an L3 could hold (bench/, bench.kernels.l3_evictor). GIL held; about
    5 ms per 64 MiB here."""
    _check(lib.clb_cache_flush(ffi.from_buffer(buf), _nbytes(buf, "cache_flush: buf")),
           "cache_flush")  # fmt: skip


# ---- small ops (norms, rope, softmax, top-k, activations) and attention -----------------------


# dtype tuples for _arr (_F32 above stays a dtype: _rows_x's fast path compares with it)
_F32S = (np.dtype(np.float32),)
_F32_F16 = (np.dtype(np.float32), np.dtype(np.float16))
_I32 = (np.dtype(np.int32),)


def _arr(
    a: object,
    name: str,
    dtypes: tuple[np.dtype, ...] = _F32S,
    *,
    ndim: int | None = None,
    writable: bool = False,
) -> np.ndarray:
    """Check one kernel argument: numpy array, dtype in `dtypes`, C-contiguous, ndim."""
    if not isinstance(a, np.ndarray) or a.dtype not in dtypes:
        got = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
        want = " or ".join(d.name for d in dtypes)
        raise KernelError(f"{name} must be a {want} numpy array, got {got}")
    if not a.flags.c_contiguous:
        raise KernelError(f"{name} must be C-contiguous")
    if ndim is not None and a.ndim != ndim:
        raise KernelError(f"{name} must have {ndim} dimensions, got shape {a.shape}")
    if writable and not a.flags.writeable:
        raise KernelError(f"{name} must be writable")
    return a


def _same_shape(out: np.ndarray, x: np.ndarray, what: str) -> None:
    if out.shape != x.shape:
        raise KernelError(f"{what}: out has shape {out.shape}, x has shape {x.shape}")


def rmsnorm(out: np.ndarray, x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: out = x / sqrt(mean(x**2) + eps) * w (as HF's LlamaRMSNorm,
    in f32). x, out: float32 [..., d] (out may be x); w: float32 [d] or None (= 1). Returns out.
    Raises KernelError on wrong dtypes or shapes, or eps < 0."""
    _arr(x, "rmsnorm: x")
    _arr(out, "rmsnorm: out", writable=True)
    _same_shape(out, x, "rmsnorm")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise KernelError(f"rmsnorm: x must have a non-empty last axis, got shape {x.shape}")
    d = x.shape[-1]
    if not eps >= 0.0:
        raise KernelError(f"rmsnorm: eps={eps} must be >= 0")
    if w is not None and _arr(w, "rmsnorm: w").shape != (d,):
        raise KernelError(f"rmsnorm: w has shape {w.shape}, expected ({d},)")
    rc = lib.clb_rmsnorm(
        _ptr(out, "float *"), _ptr(x, "float *"), _ptr(w, "float *"), x.size // d, d, eps
    )
    if rc:
        _check(rc, f"rmsnorm(d={d}, eps={eps})")
    return out


_ROPE_MODES = {"neox": 0, "interleaved": 1}


def rope(
    x: np.ndarray,
    pos: np.ndarray,
    inv_freq: np.ndarray,
    rot_dim: int | None = None,
    mscale: float = 1.0,
    mode: str = "neox",
) -> np.ndarray:
    """Rotary position embedding, in place on x: float32 [n_tokens, n_heads, head_dim].

    Token t's first rot_dim dims of every head are rotated by angles pos[t] * inv_freq[i]
    (f32, as HF's rotary embedding), with cos and sin scaled by mscale (YaRN's attention
    factor). mode "neox" pairs (x[i], x[i + rot_dim/2]) (HF's rotate_half: Llama, Mixtral,
    Qwen); "interleaved" pairs (x[2i], x[2i+1]) (GPT-J, GLM, DeepSeek's rope part, in GGML's
    layout). pos: int32 [n_tokens]; inv_freq: float32 [rot_dim/2]; rot_dim defaults to
    head_dim (smaller for partial rotary). Returns x. Raises KernelError on bad arguments.
    """
    _arr(x, "rope: x", ndim=3, writable=True)
    _arr(pos, "rope: pos", _I32, ndim=1)
    _arr(inv_freq, "rope: inv_freq", ndim=1)
    n_tokens, n_heads, head_dim = x.shape
    rot_dim = head_dim if rot_dim is None else int(rot_dim)
    if mode not in _ROPE_MODES:
        raise KernelError(f"rope: mode must be 'neox' or 'interleaved', got {mode!r}")
    if rot_dim < 2 or rot_dim % 2 or rot_dim > head_dim:
        raise KernelError(f"rope: rot_dim {rot_dim} must be even and in [2, head_dim={head_dim}]")
    if pos.shape != (n_tokens,):
        raise KernelError(f"rope: pos has shape {pos.shape}, expected ({n_tokens},)")
    if inv_freq.shape != (rot_dim // 2,):
        raise KernelError(
            f"rope: inv_freq has shape {inv_freq.shape}, expected ({rot_dim // 2},) for "
            f"rot_dim={rot_dim}"
        )
    rc = lib.clb_rope(
        _ptr(x, "float *"),
        _ptr(pos, "int32_t *"),
        _ptr(inv_freq, "float *"),
        n_tokens,
        n_heads,
        head_dim,
        rot_dim,
        mscale,
        _ROPE_MODES[mode],
    )
    if rc:
        _check(rc, f"rope(shape={x.shape}, rot_dim={rot_dim}, mode={mode})")
    return x


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in place: x float32 [..., d], max-subtracted. Returns x.
    A row that is all -inf becomes NaN (as torch). Raises KernelError on a wrong array."""
    _arr(x, "softmax: x", writable=True)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise KernelError(f"softmax: x must have a non-empty last axis, got shape {x.shape}")
    if lib.clb_softmax(_ptr(x, "float *"), x.size // x.shape[-1], x.shape[-1]):
        raise KernelError(f"softmax: invalid arguments (shape {x.shape})")
    return x


def logsumexp(x: np.ndarray, nthreads: int = 0) -> np.ndarray:
    """log(sum(exp(x))) over the last axis of x float32 [..., d] -> float64 [...]: the row's
    max m plus the log of the sum of exp(x - m), the exps in f32 (Cephes' polynomial, about
    1 ulp), summed in f32 over blocks of 256 values and the blocks in f64; rows spread over
    nthreads (<= 0: the default). The log-softmax of a row is x - logsumexp(x) (scoring:
    perplexity, log-likelihoods) without a second [..., d] array. A row that is all -inf
    gives NaN. Raises KernelError on a wrong array."""
    _arr(x, "logsumexp: x")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise KernelError(f"logsumexp: x must have a non-empty last axis, got shape {x.shape}")
    out = np.empty(x.shape[:-1], dtype=np.float64)
    n = x.size // x.shape[-1]
    if lib.clb_logsumexp(_ptr(out, "double *"), _ptr(x, "float *"), n, x.shape[-1], nthreads):
        raise KernelError(f"logsumexp: invalid arguments (shape {x.shape})")
    return out


def topk(
    x: np.ndarray,
    k: int,
    idx_out: np.ndarray | None = None,
    val_out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The k largest entries of each row of x: float32 [..., d], in descending order, ties
    broken by the lowest index, NaN ranked last (the order of numpy's
    argsort(-x, kind="stable")). Returns (idx int32 [..., k], val float32 [..., k]), written
    into idx_out / val_out when given (no allocation). Raises KernelError unless 0 <= k <= d."""
    _arr(x, "topk: x")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise KernelError(f"topk: x must have a non-empty last axis, got shape {x.shape}")
    d = x.shape[-1]
    if not 0 <= k <= d:
        raise KernelError(f"topk: k={k} must be in [0, d={d}]")
    shape = (*x.shape[:-1], k)
    idx = np.empty(shape, np.int32) if idx_out is None else idx_out
    val = np.empty(shape, np.float32) if val_out is None else val_out
    _arr(idx, "topk: idx_out", _I32, writable=True)
    _arr(val, "topk: val_out", writable=True)
    if idx.shape != shape or val.shape != shape:
        raise KernelError(f"topk: idx_out {idx.shape} and val_out {val.shape} must be {shape}")
    rc = lib.clb_topk(
        _ptr(idx, "int32_t *"), _ptr(val, "float *"), _ptr(x, "float *"), x.size // d, d, k
    )
    if rc:
        _check(rc, f"topk(d={d}, k={k})")
    return idx, val


def silu(out: np.ndarray, x: np.ndarray) -> np.ndarray:
    """out = x * sigmoid(x), elementwise; float32, same shape, out may be x. Returns out."""
    _arr(x, "silu: x")
    _arr(out, "silu: out", writable=True)
    _same_shape(out, x, "silu")
    if lib.clb_silu(_ptr(out, "float *"), _ptr(x, "float *"), x.size):
        raise KernelError(f"silu: invalid arguments (shape {x.shape})")
    return out


def gelu(out: np.ndarray, x: np.ndarray) -> np.ndarray:
    """out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (gelu_pytorch_tanh), elementwise;
    float32, same shape, out may be x. Returns out."""
    _arr(x, "gelu: x")
    _arr(out, "gelu: out", writable=True)
    _same_shape(out, x, "gelu")
    if lib.clb_gelu(_ptr(out, "float *"), _ptr(x, "float *"), x.size):
        raise KernelError(f"gelu: invalid arguments (shape {x.shape})")
    return out


def attention(
    out: np.ndarray,
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    n_kv: int,
    q_pos0: int,
    scale: float,
    window: int = 0,
    sinks: np.ndarray | None = None,
    nthreads: int = 0,
) -> np.ndarray:
    """Causal grouped-query attention of n_q queries over a KV cache (decode: n_q = 1).

    q: float32 [n_q, n_heads, dk]; k_cache: [n_ctx, n_kv_heads, dk] and v_cache:
    [n_ctx, n_kv_heads, dv], both float32 or both float16, positions 0..n_kv-1 valid
    (n_kv <= n_ctx); out: float32 [n_q, n_heads, dv], not overlapping the inputs. Query i sits
    at position q_pos0 + i (q_pos0 + n_q <= n_kv) and attends to keys j <= q_pos0 + i, and if
    window > 0 only to j > q_pos0 + i - window (HF's sliding_window). Query head h reads KV
    head h // (n_heads // n_kv_heads). sinks: float32 [n_heads] or None, a per-head logit that
    joins the softmax denominator only (gpt-oss). Online softmax, no scratch memory; runs on
    nthreads threads (<= 0: default_threads()) with the GIL released. Returns out.
    Raises KernelError on inconsistent shapes, dtypes or positions.
    """
    _arr(q, "attention: q", ndim=3)
    _arr(k_cache, "attention: k_cache", _F32_F16, ndim=3)
    _arr(v_cache, "attention: v_cache", _F32_F16, ndim=3)
    _arr(out, "attention: out", ndim=3, writable=True)
    n_q, n_heads, dk = q.shape
    n_ctx, n_kv_heads, dk_cache = k_cache.shape
    dv = v_cache.shape[2]
    if v_cache.dtype != k_cache.dtype:
        raise KernelError(
            f"attention: k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}; use one dtype"
        )
    if dk_cache != dk:
        raise KernelError(f"attention: q head size {dk} != k_cache head size {dk_cache}")
    if v_cache.shape[:2] != (n_ctx, n_kv_heads):
        raise KernelError(
            f"attention: v_cache shape {v_cache.shape} does not match k_cache {k_cache.shape}"
        )
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise KernelError(
            f"attention: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}"
        )
    if out.shape != (n_q, n_heads, dv):
        raise KernelError(f"attention: out has shape {out.shape}, expected {(n_q, n_heads, dv)}")
    if not 0 <= n_kv <= n_ctx:
        raise KernelError(f"attention: n_kv={n_kv} must be in [0, cache length {n_ctx}]")
    if q_pos0 < 0 or q_pos0 + n_q > n_kv:
        raise KernelError(
            f"attention: queries at positions {q_pos0}..{q_pos0 + n_q - 1} need n_kv >= "
            f"{q_pos0 + n_q}, got n_kv={n_kv}"
        )
    if not math.isfinite(scale):
        raise KernelError(f"attention: scale={scale} must be finite")
    if window < 0:
        raise KernelError(f"attention: window={window} must be >= 0 (0 = no sliding window)")
    if sinks is not None and _arr(sinks, "attention: sinks").shape != (n_heads,):
        raise KernelError(f"attention: sinks has shape {sinks.shape}, expected ({n_heads},)")
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if np.may_share_memory(out, a):
            raise KernelError(f"attention: out overlaps {name}")
    rc = lib.clb_attention(
        _ptr(out, "float *"),
        _ptr(q, "float *"),
        _ptr(k_cache),
        _ptr(v_cache),
        int(k_cache.dtype == np.float16),
        n_q,
        n_kv,
        q_pos0,
        n_heads,
        n_kv_heads,
        dk,
        dv,
        scale,
        window,
        _ptr(sinks, "float *"),
        nthreads,
    )
    if rc:
        _check(rc, f"attention(q={q.shape}, k_cache={k_cache.shape}, n_kv={n_kv})")
    return out


def index_scores(
    out: np.ndarray,
    q: np.ndarray,
    w: np.ndarray,
    k: np.ndarray,
    n_kv: int,
    q_pos0: int,
    scale: float,
    nthreads: int = 0,
) -> np.ndarray:
    """DeepSeek Sparse Attention indexer scores (DeepSeek-V3.2 / GLM-5, transformers
    DeepseekV32Indexer): out[i, t] = sum_h w[i, h] * relu(scale * q[i, h] . k[t]) for the keys
    t <= q_pos0 + i, -inf for later t.

    q: float32 [n_q, n_heads, d]; w: float32 [n_q, n_heads] (the head weights, already scaled);
    k: float32 or float16 [n_ctx, d], rows 0..n_kv-1 valid; out: float32 [n_q, n_kv]. Runs on
    nthreads threads (<= 0: default_threads()) with the GIL released. Returns out. Raises
    KernelError on inconsistent shapes, dtypes or positions.
    """
    _arr(q, "index_scores: q", ndim=3)
    _arr(w, "index_scores: w", ndim=2)
    _arr(k, "index_scores: k", _F32_F16, ndim=2)
    _arr(out, "index_scores: out", ndim=2, writable=True)
    n_q, n_heads, d = q.shape
    if w.shape != (n_q, n_heads):
        raise KernelError(f"index_scores: w has shape {w.shape}, expected {(n_q, n_heads)}")
    if k.shape[1] != d:
        raise KernelError(f"index_scores: key size {k.shape[1]} != query head size {d}")
    if not 0 <= n_kv <= k.shape[0]:
        raise KernelError(f"index_scores: n_kv={n_kv} must be in [0, key rows {k.shape[0]}]")
    if q_pos0 < 0 or q_pos0 + n_q > n_kv:
        raise KernelError(
            f"index_scores: queries at positions {q_pos0}..{q_pos0 + n_q - 1} need n_kv >= "
            f"{q_pos0 + n_q}, got n_kv={n_kv}"
        )
    if out.shape != (n_q, n_kv):
        raise KernelError(f"index_scores: out has shape {out.shape}, expected {(n_q, n_kv)}")
    if not math.isfinite(scale):
        raise KernelError(f"index_scores: scale={scale} must be finite")
    rc = lib.clb_index_scores(
        _ptr(out, "float *"), _ptr(q, "float *"), _ptr(w, "float *"), _ptr(k),
        int(k.dtype == np.float16), n_q, n_kv, q_pos0, n_heads, d, float(scale), nthreads,
    )  # fmt: skip
    if rc:
        _check(rc, f"index_scores(q={q.shape}, k={k.shape}, n_kv={n_kv})")
    return out


def gated_delta_rule(
    out: np.ndarray,
    state: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    nthreads: int = 0,
) -> np.ndarray:
    """The gated delta rule, recurrent form, over n tokens (Gated DeltaNet, arXiv:2412.06464;
    transformers' torch_recurrent_gated_delta_rule): per value head h and token t,
    S_h *= exp(g[t, h]); S_h += k (beta (v - S_h^T k))^T; out[t, h] = S_h^T q, with key head
    h // (n_heads // n_k_heads).

    q, k: float32 [n, n_k_heads, dk], l2-normalised, q already scaled by dk**-0.5;
    v: float32 [n, n_heads, dv] (dv <= 1024); g (log decay, <= 0), beta: float32 [n, n_heads];
    state: float32 [n_heads, dk, dv], updated in place; out: float32 [n, n_heads, dv].
    Runs on nthreads threads (<= 0: default_threads()) split by head. Returns out.
    Raises KernelError on inconsistent shapes or dtypes.
    """
    _arr(q, "gated_delta_rule: q", ndim=3)
    _arr(k, "gated_delta_rule: k", ndim=3)
    _arr(v, "gated_delta_rule: v", ndim=3)
    _arr(g, "gated_delta_rule: g", ndim=2)
    _arr(beta, "gated_delta_rule: beta", ndim=2)
    _arr(state, "gated_delta_rule: state", ndim=3, writable=True)
    _arr(out, "gated_delta_rule: out", ndim=3, writable=True)
    n, n_k_heads, dk = q.shape
    n_heads, dv = v.shape[1:]
    if k.shape != q.shape:
        raise KernelError(f"gated_delta_rule: k has shape {k.shape}, q has {q.shape}")
    if v.shape[0] != n or out.shape != v.shape:
        raise KernelError(
            f"gated_delta_rule: v {v.shape} and out {out.shape} must be [{n}, n_heads, dv]"
        )
    if g.shape != (n, n_heads) or beta.shape != (n, n_heads):
        raise KernelError(
            f"gated_delta_rule: g {g.shape} and beta {beta.shape} must be {(n, n_heads)}"
        )
    if state.shape != (n_heads, dk, dv):
        raise KernelError(
            f"gated_delta_rule: state has shape {state.shape}, expected {(n_heads, dk, dv)}"
        )
    if n_heads % n_k_heads:
        raise KernelError(
            f"gated_delta_rule: {n_heads} value heads is not a multiple of {n_k_heads} key heads"
        )
    if dv > 1024:
        raise KernelError(f"gated_delta_rule: dv={dv} > 1024")
    rc = lib.clb_gated_delta_rule(
        _ptr(out, "float *"),
        _ptr(state, "float *"),
        _ptr(q, "float *"),
        _ptr(k, "float *"),
        _ptr(v, "float *"),
        _ptr(g, "float *"),
        _ptr(beta, "float *"),
        n,
        n_heads,
        n_k_heads,
        dk,
        dv,
        nthreads,
    )
    if rc:
        _check(rc, f"gated_delta_rule(q={q.shape}, v={v.shape})")
    return out


# ---- MLA kv_b_proj in its storage type ----------------------------------------------------


def _mla_args(
    kv_b: Buffer,
    qt: QType,
    x: np.ndarray,
    out: np.ndarray,
    nope: int,
    dv: int,
    rank: int,
    what: str,
) -> tuple[int, int]:
    """(n, n_heads) after checking x / out are [n, n_heads, *] and kv_b's size."""
    _arr(x, f"{what}: x", _X_DTYPES, ndim=3)
    _arr(out, f"{what}: out", ndim=3, writable=True)
    n, heads = out.shape[:2]
    if x.shape[:2] != (n, heads):
        raise KernelError(f"{what}: x {x.shape} and out {out.shape} differ in tokens or heads")
    if min(nope, dv, rank) < 0:
        raise KernelError(f"{what}: nope={nope}, dv={dv}, rank={rank} must be >= 0")
    want = heads * (nope + dv) * _row_nbytes(qt, rank)
    if (got := _nbytes(kv_b, f"{what}: kv_b")) != want:
        raise KernelError(
            f"{what}: kv_b has {got} bytes, {qt.name} [{heads * (nope + dv)}, {rank}] needs {want}"
        )
    if np.may_share_memory(out, x):
        raise KernelError(f"{what}: out overlaps x")
    return n, heads


_X_DTYPES = (np.dtype(np.float32), np.dtype(np.uint8))


def mla_absorb_q(
    kv_b: Buffer,
    qtype: QType | str | int,
    q: np.ndarray,
    out: np.ndarray,
    *,
    nope: int,
    dv: int,
    rank: int,
    nthreads: int = 0,
) -> np.ndarray:
    """The absorbed MLA query (DeepSeek-V2, arXiv:2405.04434 section 2.1.2), kv_b_proj read in
    its storage type: out[t, h, :rank] = W_UK_h^T q[t, h, :nope] = sum_j q[t, h, j] W_UK_h[j].

    kv_b: kv_b_proj W [n_heads * (nope + dv), rank] in `qtype` (any C-contiguous buffer; head
    h's rows are W_UK_h [nope, rank] then W_UV_h [dv, rank]); q: f32 [n, n_heads, dq >= nope];
    out: f32 [n, n_heads, dout >= rank] (the rest of each head is left alone). f32
    activations and accumulation (j order). Threads over heads, GIL released. Returns out.
    Raises KernelError for a wrong dtype, shape or kv_b size.
    """
    qt = QType.parse(qtype)
    if not (isinstance(q, np.ndarray) and q.dtype == np.float32):
        raise KernelError("mla_absorb_q: q must be a float32 numpy array")
    n, heads = _mla_args(kv_b, qt, q, out, nope, dv, rank, "mla_absorb_q")
    if q.shape[2] < nope or out.shape[2] < rank:
        raise KernelError(f"mla_absorb_q: q {q.shape} needs >= {nope}, out {out.shape} >= {rank}")
    rc = lib.clb_mla_absorb_q(
        qt, _fp(out), ffi.from_buffer(kv_b), _fp(q), n, heads, nope, dv, rank, q.shape[2],
        out.shape[2], nthreads,
    )  # fmt: skip
    _check(rc, f"mla_absorb_q({qt.name}, q={q.shape}, rank={rank})")
    return out


def mla_values(
    kv_b: Buffer,
    qtype: QType | str | int,
    lat: np.ndarray,
    out: np.ndarray,
    *,
    nope: int,
    rank: int,
    nthreads: int = 0,
) -> np.ndarray:
    """MLA's output per head from the attention output over latents, kv_b_proj read in its
    storage type: out[t, h] = W_UV_h lat[t, h, :rank] (f32 activations).

    kv_b as mla_absorb_q's, dv = out.shape[2]; lat: f32 [n, n_heads, dl >= rank]; out: f32
    [n, n_heads, dv]. Returns out. Raises KernelError for a wrong dtype, shape or kv_b size."""
    qt = QType.parse(qtype)
    if not (isinstance(lat, np.ndarray) and lat.dtype == np.float32):
        raise KernelError("mla_values: lat must be a float32 numpy array")
    dv = out.shape[2] if isinstance(out, np.ndarray) and out.ndim == 3 else -1
    n, heads = _mla_args(kv_b, qt, lat, out, nope, dv, rank, "mla_values")
    if lat.shape[2] < rank:
        raise KernelError(f"mla_values: lat {lat.shape} needs >= {rank} values a head")
    rc = lib.clb_mla_values(
        qt, _fp(out), ffi.from_buffer(kv_b), _fp(lat), n, heads, nope, dv, rank, lat.shape[2],
        nthreads,
    )  # fmt: skip
    _check(rc, f"mla_values({qt.name}, lat={lat.shape}, rank={rank})")
    return out


def mla_values_q8(
    kv_b: Buffer,
    qtype: QType | str | int,
    xq: np.ndarray,
    out: np.ndarray,
    *,
    nope: int,
    nthreads: int = 0,
) -> np.ndarray:
    """mla_values on Q8_0 activations (as matmul_q8): xq uint8 [n, n_heads,
    row_nbytes(Q8_0, rank)] is quantize_act of lat[:, :, :rank]; kv_b in Q4_0 or Q8_0.
    Returns out f32 [n, n_heads, dv]. Raises KernelError for another weight type or a wrong
    dtype, shape or size."""
    qt = QType.parse(qtype)
    if qt not in Q8_ACT_TYPES:
        raise KernelError(f"mla_values_q8: weights must be Q4_0 or Q8_0, got {qt.name}")
    if not (isinstance(xq, np.ndarray) and xq.dtype == np.uint8 and xq.ndim == 3):
        raise KernelError("mla_values_q8: xq must be a uint8 array [n, n_heads, Q8_0 bytes]")
    if xq.shape[2] % 34:
        raise KernelError(f"mla_values_q8: xq rows of {xq.shape[2]} bytes are not Q8_0 blocks")
    rank = xq.shape[2] // 34 * 32
    dv = out.shape[2] if isinstance(out, np.ndarray) and out.ndim == 3 else -1
    n, heads = _mla_args(kv_b, qt, xq, out, nope, dv, rank, "mla_values_q8")
    rc = lib.clb_mla_values_q8(
        qt, _fp(out), ffi.from_buffer(kv_b), _ptr(xq), n, heads, nope, dv, rank, nthreads
    )
    _check(rc, f"mla_values_q8({qt.name}, xq={xq.shape})")
    return out
