"""Batch invariance of the Q8_0-activation kernels (DESIGN.md §6): a row's output is the same
bits whether it is computed alone (matvec), in a pair, or in a batch that takes the GEMM
path, at every ISA level, and equal to the scalar twin's (per block an exact int32 dot, then
acc = fma(isum, d_w * d_x, acc) in block order, MXFP4 with d_w = e8m0_half(e); FP8: 16-lane
f32 dots per 128-column block; see csrc/quant.c, csrc/kquants.c). The server batches concurrent
requests and relies on this; so does the expert FFN, whose token count per expert varies with
routing."""

from __future__ import annotations

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
