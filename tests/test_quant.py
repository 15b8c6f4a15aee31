"""Quantization formats: colibri's C quantize/dequantize against gguf-py, byte for byte."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from colibri.compute import ops, ref
from colibri.errors import KernelError
from tests.kernel_util import ALL_TYPES, FLOAT_TYPES, QUANT_TYPES


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _q4_1_zero_sign(q: np.ndarray) -> np.ndarray:
    """Q4_1 blocks with -0.0 scale/min replaced by +0.0. numpy's min/max of +0.0 and -0.0
    depends on its SIMD reduction order, so only the sign of a zero d or m may differ (the
    dequantized values are equal)."""
    q = q.reshape(-1, 20).copy()
    f = q[:, :4].view(np.uint16)
    f[f == 0x8000] = 0
    return q


def _check_roundtrip(x: np.ndarray, qt: ops.QType) -> None:
    got = ops.quantize(x, qt)
    want = gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(qt)))
    want = np.ascontiguousarray(want).view(np.uint8).reshape(got.shape)
    if qt == ops.QType.Q4_1:
        np.testing.assert_array_equal(_q4_1_zero_sign(got), _q4_1_zero_sign(want))
        want = got  # equal up to the sign of zero scales: dequantize our bytes below
    np.testing.assert_array_equal(got, want, err_msg=f"{qt.name} quantize bytes differ")
    deq = ops.dequantize(got, qt, x.shape)
    deq_gguf = gguf.quants.dequantize(want, gguf.GGMLQuantizationType(int(qt))).reshape(x.shape)
    np.testing.assert_array_equal(_bits(deq), _bits(deq_gguf), err_msg=f"{qt.name} dequantize")


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(1, 32), (7, 64), (3, 4, 96), (2, 1024)])
def test_random_matches_gguf(qt, shape):
    rng = np.random.default_rng(sum(shape) + int(qt))
    x = (rng.standard_normal(shape) * rng.uniform(1e-3, 1e3, (*shape[:-1], 1))).astype(np.float32)
    _check_roundtrip(x, qt)


def _special_blocks() -> dict[str, np.ndarray]:
    ramp = np.arange(32, dtype=np.float32)
    blocks = {
        "zeros": np.zeros(32, np.float32),
        "neg_zero_first": np.r_[np.float32(-0.0), np.zeros(31, np.float32)],
        # x * id lands exactly on .5: Q8_0 ties (amax 127 -> d = 1), Q4_0/Q4_1 trunc edges
        "q8_ties": np.r_[np.float32(127), ramp[:31] - 15.5].astype(np.float32),
        "q4_ties": np.r_[np.float32(-8), (ramp[:31] % 16) - 7.5].astype(np.float32),
        "q41_ties": np.r_[np.float32(0), np.float32(15), (ramp[:30] % 15) + 0.5],
        "equal_magnitudes": np.r_[np.float32(-3), np.float32(3), np.full(30, 1.5, np.float32)],
        "constant": np.full(32, 0.7, np.float32),
        "huge": np.linspace(-3e38, 3e38, 32, dtype=np.float32),
        "large_scale_f16_overflow": np.linspace(-1e6, 2e6, 32, dtype=np.float32),
        "tiny": np.linspace(-1e-30, 1e-30, 32, dtype=np.float32),
        "f16_subnormal_scale": np.linspace(-3e-6, 1e-6, 32, dtype=np.float32),
        "f32_subnormals": np.linspace(-1e-39, 1e-39, 32, dtype=np.float32),
        "one_spike": np.r_[np.float32(1e4), np.full(31, 1e-3, np.float32)],
    }
    return {k: v.astype(np.float32) for k, v in blocks.items()}


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("name", list(_special_blocks()))
def test_special_blocks_match_gguf(qt, name):
    with np.errstate(all="ignore"):
        _check_roundtrip(_special_blocks()[name].reshape(1, 32), qt)


def test_bf16_rounding_and_nan():
    # ties to even in both directions, the largest finite values, inf, NaN made quiet
    bits = np.array(
        [0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000,
         0x7F800001, 0xFFC00001, 0x00008000, 0x80018000],
        np.uint32,
    )  # fmt: skip
    x = bits.view(np.float32).reshape(1, -1)
    got = ops.quantize(x, ops.QType.BF16).view(np.uint16)
    want = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16).view(np.uint16)
    np.testing.assert_array_equal(got, want.reshape(got.shape))


@settings(max_examples=150, deadline=None)
@given(
    qt=st.sampled_from(ALL_TYPES),
    x=hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 3), st.sampled_from([32, 64])),
        elements=st.floats(-(2.0**100), 2.0**100, allow_nan=False, width=32),
    ),
)
def test_hypothesis_matches_gguf(qt, x):
    with np.errstate(all="ignore"):
        _check_roundtrip(x, qt)


@pytest.mark.parametrize("qt", FLOAT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("cols", [1, 5, 33, 100])
def test_float_formats_any_width(qt, cols):
    x = np.random.default_rng(cols).standard_normal((3, cols)).astype(np.float32)
    _check_roundtrip(x, qt)
    assert ops.row_nbytes(qt, cols) == cols * {0: 4, 1: 2, 30: 2}[int(qt)]


@pytest.mark.parametrize("qt", QUANT_TYPES, ids=lambda q: q.name)
def test_row_nbytes_matches_gguf(qt):
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(qt))]
    assert ops.row_nbytes(qt, 4096) == 4096 // block * nbytes


@pytest.mark.parametrize("qt", QUANT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("cols", [1, 31, 48, 100])
def test_block_formats_reject_partial_blocks(qt, cols):
    with pytest.raises(KernelError, match="multiple of the block size"):
        ops.row_nbytes(qt, cols)
    with pytest.raises(KernelError, match="multiple of the block size"):
        ops.quantize(np.zeros((2, cols), np.float32), qt)
    with pytest.raises(KernelError, match="multiple of the block size"):
        ops.dequantize(np.zeros(64, np.uint8), qt, (2, cols))


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown quant type"):
        ops.quantize(np.zeros((1, 32), np.float32), "q7_k")
    with pytest.raises(KernelError, match="data has 17 bytes"):
        ops.dequantize(np.zeros(17, np.uint8), "q4_0", (1, 32))
    with pytest.raises(KernelError, match="out must be"):
        ops.quantize(np.zeros((1, 32), np.float32), "q8_0", out=np.zeros(33, np.uint8))
    with pytest.raises(KernelError, match="out has shape"):
        ops.dequantize(np.zeros(34, np.uint8), "q8_0", (1, 32), out=np.zeros(32, np.float32))


def test_out_params_and_buffers():
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    out = np.empty((4, ops.row_nbytes("q4_1", 64)), np.uint8)
    assert ops.quantize(x, "q4_1", out=out) is out
    deq = np.empty((4, 64), np.float32)
    assert ops.dequantize(bytes(out), "q4_1", (4, 64), out=deq) is deq
    np.testing.assert_array_equal(deq, ref.dequantize(out, ops.QType.Q4_1, (4, 64)))


@pytest.mark.parametrize("qt", [ops.QType.Q4_0, ops.QType.Q8_0, ops.QType.F16], ids=str)
def test_large_tensor_threaded_path(qt):
    """>= 2^20 elements take the multi-threaded loops in quant.c; still byte-exact."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((1024, 1056)) * rng.uniform(1e-2, 1e2, (1024, 1))).astype(np.float32)
    _check_roundtrip(x, qt)
