"""Batch invariance of the Q8_0-activation kernels (DESIGN.md §6): a row's output is the same
bits whether it is computed alone (matvec), in a pair, or in a batch that takes the GEMM
path, at every ISA level, and equal to the scalar twin's (per block an exact int32 dot, then
acc = fma(isum, d_w * d_x, acc) in block order, MXFP4 with d_w = e8m0_half(e); FP8: 16-lane
f32 dots per 128-column block; see csrc/quant.c, csrc/kquants.c). The server batches concurrent
requests and relies on this; so does the expert FFN, whose token count per expert varies with
routing."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from colibri.compute import ops
from tests.kernel_util import random_weights

QTYPES = [ops.QType.Q4_0, ops.QType.Q8_0, ops.QType.MXFP4, ops.QType.FP8]


def _levels() -> list[ops.ISA]:
    return [i for i in ops.ISA if i <= ops.best_isa()]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(1, 32), (13, 64), (229, 1056), (45, 1440), (64, 4128)])
def test_matmul_q8_rows_same_alone_or_batched(qt, rows, cols):
    rng = np.random.default_rng(rows + cols)
    data, _w = random_weights(rng, qt, rows, cols)
    n = 70  # > one 64-row panel of the GEMM, with a tail of x-row tiles
    x = (rng.standard_normal((n, cols)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
    xq = ops.quantize_act(x)
    try:
        ops.set_isa(ops.ISA.SCALAR)
        want = ops.matmul_q8(data, qt, xq, np.empty((n, rows), np.float32))
        for level in _levels():
            ops.set_isa(level)
            for t in (1, 2):
                full = ops.matmul_q8(data, qt, xq, np.empty((n, rows), np.float32), nthreads=t)
                np.testing.assert_array_equal(_bits(full), _bits(want), err_msg=level.name)
                for i in (0, 1, n - 1):  # alone: the matvec path
                    one = ops.matmul_q8(data, qt, xq[i], np.empty(rows, np.float32), nthreads=t)
                    np.testing.assert_array_equal(_bits(one), _bits(want[i]))
                for i in (0, 5):  # pairs and triples: the small-batch and GEMM thresholds
                    for m in (2, 3):
                        part = ops.matmul_q8(
                            data, qt, xq[i : i + m], np.empty((m, rows), np.float32), nthreads=t
                        )
                        np.testing.assert_array_equal(_bits(part), _bits(want[i : i + m]))
    finally:
        ops.set_isa(ops.best_isa())


F32_ACT = [ops.QType.F32, ops.QType.F16, ops.QType.BF16, ops.QType.Q4_0, ops.QType.Q4_1,
           ops.QType.Q8_0]  # fmt: skip


@pytest.mark.parametrize("qt", F32_ACT, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(13, 64), (40, 192), (45, 1440)])
def test_matmul_f32_rows_same_alone_or_batched(qt, rows, cols):
    """The f32-activation matmul (`--activations f32`, the f32 / f16 / bf16 dense weights)
    tiles x rows by 4, 2 and 1: every tile size accumulates a row in the same order, so a
    row's bits do not depend on its batch (AVX2 once used 4 accumulators for 1 and 2 rows
    and 2 for 4: a 13-token prompt batched with a 27-token one changed its logits)."""
    if qt in (ops.QType.F32, ops.QType.F16, ops.QType.BF16):
        cols += 8  # the float formats' < 32 column tail too
    rng = np.random.default_rng(rows * cols)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    data = w if qt == ops.QType.F32 else ops.quantize(w, qt)
    n = 40
    x = rng.standard_normal((n, cols)).astype(np.float32)
    try:
        for level in _levels():
            ops.set_isa(level)
            for t in (1, 2):
                full = ops.matmul(data, qt, x, np.empty((n, rows), np.float32), nthreads=t)
                for i, m in ((0, 1), (n - 1, 1), (0, 2), (3, 3), (5, 7), (0, 13), (13, 27)):
                    part = ops.matmul(
                        data, qt, x[i : i + m], np.empty((m, rows), np.float32), nthreads=t
                    )
                    np.testing.assert_array_equal(
                        _bits(part), _bits(full[i : i + m]), err_msg=f"{level.name} rows {i}+{m}"
                    )
    finally:
        ops.set_isa(ops.best_isa())


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
def test_expert_ffn_q8_rows_same_alone_or_batched(qt):
    """The fused FFN (gate/up, activation, down, bias and routing weight) on Q8_0
    activations: each token's row the same bits alone as among 9 tokens."""
    rng = np.random.default_rng(7)
    d_model, d_ff, n = 256, 96, 9
    gate, _ = random_weights(rng, qt, d_ff, d_model)
    up, _ = random_weights(rng, qt, d_ff, d_model)
    down, _ = random_weights(rng, qt, d_model, d_ff)
    x = rng.standard_normal((n, d_model)).astype(np.float32)
    rw = rng.uniform(0.1, 1, n).astype(np.float32)
    bias = rng.standard_normal(d_model).astype(np.float32)

    def ffn(rows: slice) -> np.ndarray:
        xs = np.ascontiguousarray(x[rows])
        out = np.empty_like(xs)
        return ops.expert_ffn(
            out, xs, gate, up, down, qt, d_model, d_ff, down_bias=bias,
            row_weight=np.ascontiguousarray(rw[rows]), accumulate=False, act_q8=True,
        )  # fmt: skip

    try:
        ops.set_isa(ops.ISA.SCALAR)
        want = ffn(slice(0, n))
        for level in _levels():
            ops.set_isa(level)
            np.testing.assert_array_equal(_bits(ffn(slice(0, n))), _bits(want))
            for i in range(n):
                np.testing.assert_array_equal(_bits(ffn(slice(i, i + 1))), _bits(want[i : i + 1]))
    finally:
        ops.set_isa(ops.best_isa())


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(
                next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
            )
    except OSError:
        return set()


_FLAGS = _cpu_flags()
_AVX512 = {"avx512f", "avx512bw", "avx512vl"} <= _FLAGS
_BUILDS = [("avx2", "avx2" in _FLAGS and "fma" in _FLAGS), ("avx512", _AVX512),
           ("avx512vnni", _AVX512 and "avx512_vnni" in _FLAGS)]  # fmt: skip


@pytest.mark.parametrize(
    "kind,qt",
    [("mxfp4", ops.QType.MXFP4), ("kqg", ops.QType.Q4_K), ("kqg", ops.QType.Q6_K)],
    ids=["MXFP4", "Q4_K", "Q6_K"],
)
def test_every_simd_build_same_bits_as_scalar_twin(kind, qt):
    """The rows kernels of every build the CPU runs, called directly (ISA dispatch picks one:
    the AVX-512 build without VNNI never runs on a VNNI machine otherwise): MXFP4 on Q8_0
    (arch/matmul_mxfp4.inc) and Q4_K / Q6_K on Q8_K (arch/kquants_gemm.inc) give their scalar
    twin's bits for 1 to 70 x rows, with bias, routing scale, accumulation and a row range
    starting mid-tile."""
    import colibri._kernels as kmod

    builds = [b for b, ok in _BUILDS if ok]
    if not builds:
        pytest.skip("no AVX2 on this CPU")
    so = ctypes.CDLL(kmod.__file__)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    names = {"mxfp4": ("clb_kq_mmq_rows_ref", "clb_mxfp4_rows_"),
             "kqg": ("clb_kqg_rows_ref", "clb_kqg_rows_")}[kind]  # fmt: skip
    fns = {b: getattr(so, names[1] + b) for b in ["ref", *builds] if b != "ref"}
    fns["ref"] = getattr(so, names[0])
    for f in fns.values():
        f.restype = None
        f.argtypes = [ctypes.c_int, p, i64, p, i64, p, i64, i64, i64, i64, i64, p, p, ctypes.c_int]
    rng = np.random.default_rng(int(qt))
    rows, cols = 45, 512
    data, _ = random_weights(rng, qt, rows, cols)
    data = np.ascontiguousarray(data)
    rb = data.nbytes // rows
    for n in (1, 2, 3, 5, 9, 17, 70):
        x = (rng.standard_normal((n, cols)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
        xq = np.ascontiguousarray(ops.quantize_act(x) if kind == "mxfp4" else ops.quantize_q8_k(x))
        bias = rng.standard_normal(rows).astype(np.float32)
        scale = rng.uniform(0.1, 2, n).astype(np.float32)
        y0 = rng.standard_normal((n, rows)).astype(np.float32)
        got = {}
        for b, f in fns.items():
            y = y0.copy()
            f(int(qt), y.ctypes.data, rows, data.ctypes.data, rb, xq.ctypes.data, xq.shape[-1],
              cols, n, 3, rows, bias.ctypes.data, scale.ctypes.data, 1)  # fmt: skip
            got[b] = y
        assert not np.array_equal(got["ref"][:, 3:], y0[:, 3:])
        for b in builds:
            np.testing.assert_array_equal(_bits(got[b]), _bits(got["ref"]), err_msg=f"{b} n={n}")
