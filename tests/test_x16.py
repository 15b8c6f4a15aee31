"""X16-packed Q4_0 / Q8_0 weights (ops.pack_x16, ops.matmul_q8_x16, Linear.pack_x16): the
layout against a numpy construction of it, and the packed matmul against the row-major one
(bit for bit, every ISA level, batch sizes on both sides of the packed kernel's 15 x rows)
and against the independent numpy reference of tests/test_q8_activations.py."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.compute import ops
from colibri.errors import KernelError
from colibri.model import Linear
from tests.kernel_util import MATMUL_TOL, random_weights
from tests.test_q8_activations import q8_reference

QTYPES = [ops.QType.Q4_0, ops.QType.Q8_0]


def numpy_x16(w: np.ndarray, qt: ops.QType, cols: int) -> np.ndarray:
    """The X16 layout built with numpy: per 16-row tile and pair of blocks, the 2 x 16 f16
    scales, then per block G groups of (16 rows x 4 quant bytes)."""
    rows, nb = w.shape[0], cols // 32
    bb = 18 if qt == ops.QType.Q4_0 else 34
    g = (bb - 2) // 4
    t = w.reshape(rows // 16, 16, nb, bb)
    sc = t[..., :2].transpose(0, 2, 1, 3).reshape(rows // 16, nb // 2, 64)
    q = t[..., 2:].reshape(rows // 16, 16, nb, g, 4).transpose(0, 2, 3, 1, 4)
    q = q.reshape(rows // 16, nb // 2, 2 * g * 64)
    return np.concatenate([sc, q], axis=2).reshape(w.shape)


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(16, 64), (48, 128), (32, 4160)])
def test_pack_layout_vs_numpy_and_round_trip(qt, rows, cols):
    rng = np.random.default_rng(rows + cols)
    w, _ = random_weights(rng, qt, rows, cols)
    assert ops.x16_ok(qt, rows, cols)
    p = ops.pack_x16(w, qt, cols)
    np.testing.assert_array_equal(p, numpy_x16(w, qt, cols))
    np.testing.assert_array_equal(ops.unpack_x16(p, qt, cols), w)
    inplace = w.copy()
    assert ops.pack_x16(inplace, qt, cols, out=inplace) is inplace
    np.testing.assert_array_equal(inplace, p)
    assert ops.unpack_x16(inplace, qt, cols, out=inplace) is inplace
    np.testing.assert_array_equal(inplace, w)


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(16, 64), (80, 192), (272, 1088)])
def test_matmul_q8_x16_bit_equal_to_rows(isa, qt, rows, cols):
    """Every batch size gives matmul_q8's bits on the GGML rows (the packed kernel up to 15 x
    rows on AVX512-VNNI, unpacked tiles after and on the other levels), 1 and 2 threads, 1-D
    x; and the independent reference's values."""
    rng = np.random.default_rng(rows * 31 + cols)
    w, _ = random_weights(rng, qt, rows, cols)
    p = ops.pack_x16(w, qt, cols)
    x = rng.standard_normal((40, cols)).astype(np.float32)
    x[1] *= 1e-3
    xq = ops.quantize_act(x)
    for n in (1, 2, 3, 4, 5, 15, 16, 17, 40):
        for t in (1, 2):
            want = ops.matmul_q8(w, qt, xq[:n], np.empty((n, rows), np.float32), nthreads=t)
            got = ops.matmul_q8_x16(p, qt, xq[:n], np.full((n, rows), np.nan, np.float32), t)
            np.testing.assert_array_equal(got, want, err_msg=f"n={n} t={t}")
    y1 = ops.matmul_q8_x16(p, qt, xq[7], np.empty(rows, np.float32))
    np.testing.assert_array_equal(y1, got[7])
    ref, mag = q8_reference(w, qt, x)
    assert np.max(np.abs(got - ref) / mag) <= MATMUL_TOL


def test_x16_bad_arguments():
    rng = np.random.default_rng(0)
    w, _ = random_weights(rng, ops.QType.Q8_0, 16, 96)  # 3 blocks: no pairs
    assert not ops.x16_ok(ops.QType.Q8_0, 16, 96)
    assert not ops.x16_ok(ops.QType.Q8_0, 24, 128)  # not whole tiles
    assert not ops.x16_ok(ops.QType.Q4_1, 16, 128)
    with pytest.raises(KernelError):
        ops.pack_x16(w, ops.QType.Q8_0, 96)
    w, _ = random_weights(rng, ops.QType.Q4_0, 16, 128)
    with pytest.raises(KernelError):
        ops.pack_x16(w, ops.QType.Q8_0, 128)  # wrong row size for the type
    with pytest.raises(KernelError):
        ops.pack_x16(w, ops.QType.Q4_0, 128, out=np.empty((16, 71), np.uint8))
    xq = ops.quantize_act(np.ones(128, np.float32))
    with pytest.raises(KernelError):
        ops.matmul_q8_x16(w, ops.QType.Q4_1, xq, np.empty(16, np.float32))
    with pytest.raises(KernelError):
        ops.matmul_q8_x16(w[:8], ops.QType.Q4_0, xq, np.empty(8, np.float32))


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
def test_linear_pack_keeps_bits(qt):
    """Linear.pack_x16 (the model's LM head and attention projections) packs in place where
    this CPU has the kernel and the shape the layout, and its outputs keep their bits."""
    rng = np.random.default_rng(5)
    rows, cols = 48, 256
    w, _ = random_weights(rng, qt, rows, cols)
    bias = rng.standard_normal(rows).astype(np.float32)
    lin = Linear(w.copy(), qt, rows, cols, bias, act_q8=True)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    want = [lin(x[:n]) for n in (1, 2, 5)]
    buf = lin.w
    assert lin.pack_x16() == ops.x16_fast()
    if lin.x16:
        assert lin.w is buf  # in place
        np.testing.assert_array_equal(lin.w, numpy_x16(w, qt, cols))
        assert not lin.pack_x16()  # once
    for n, y in zip((1, 2, 5), want, strict=True):
        np.testing.assert_array_equal(lin(x[:n]), y)
    f32 = Linear(w.copy(), qt, rows, cols, None, act_q8=False)
    assert not f32.pack_x16() and not f32.x16  # f32 activations keep GGML rows
