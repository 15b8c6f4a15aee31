"""The issue-15 storage types (csrc/kquants.h): Q5_0, Q5_1, Q2_K..Q6_K, MXFP4, IQ4_NL, IQ4_XS
and FP8 rows. Oracles: gguf's dequantizers and quantizers (bit-exact), torch's float8_e4m3fn,
a numpy port of ggml's reference K-quant quantizers (tests/ggml_kquant_ref.py) for the
quantization error, and float64 dequantize-then-matmul references for the kernels."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from colibri.compute import ops, ref
from colibri.errors import KernelError, StoreError
from colibri.io import format as fmt
from tests import ggml_kquant_ref
from tests.kernel_util import (
    FFN_TOL,
    KQUANT_TYPES,
    MATMUL_TOL,
    SUPER_TYPES,
    matmul_err,
    needs_avx512_emulation,
    run_avx512_emulated,
)

GGML_TYPES = [q for q in KQUANT_TYPES if q != ops.QType.FP8]
Q8 = gguf.GGMLQuantizationType.Q8_0


def _cols(qt: ops.QType, k: int = 1) -> int:
    return 256 * k if qt in SUPER_TYPES else 32 * (2 * k + 1)


# ---- storage: bytes and decoding ---------------------------------------------------------


@pytest.mark.parametrize("qt", GGML_TYPES, ids=lambda q: q.name)
def test_dequantize_bit_exact_vs_gguf(qt):
    """C dequantizer == gguf.quants.dequantize, bit for bit (signed zeros included), on random
    valid blocks and on fully random bytes (NaN/inf scales too); row sizes match gguf's."""
    rng = np.random.default_rng(int(qt))
    rows, cols = 7, _cols(qt, 2)
    bs, tb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(qt))]
    assert ops.row_nbytes(qt, cols) == fmt.row_nbytes(qt.name.lower(), cols) == cols // bs * tb
    for data in (
        ref.random_blocks(rng, int(qt), rows, cols),
        rng.integers(0, 256, (rows, cols // bs * tb), dtype=np.uint8),
    ):
        with np.errstate(all="ignore"):
            want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(int(qt)))
        got, want = ops.dequantize(data, qt, (rows, cols)), want.reshape(rows, cols)
        nan = np.isnan(want)  # NaN from inf * 0 etc.: same places, the sign bit is arbitrary
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("qt", [ops.QType.Q5_0, ops.QType.Q5_1, ops.QType.MXFP4], ids=str)
def test_quantize_bytes_equal_gguf(qt):
    """q5_0 / q5_1 / mxfp4 quantizers give gguf.quants.quantize's bytes (ggml's reference)."""
    rng = np.random.default_rng(3)
    for x in (
        rng.standard_normal((16, 96)) * rng.uniform(1e-3, 1e3, (16, 1)),
        rng.standard_t(2, (16, 96)) * 0.02,  # heavy tails
        np.zeros((2, 96)),
    ):
        x = x.astype(np.float32)
        np.testing.assert_array_equal(ops.quantize(x, qt), ref.quantize(x, int(qt)))


def _weights_dist(rng, kind, shape):
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    # heavy-tailed: Student-t (3 dof) with per-row scales and a few large outliers
    w = rng.standard_t(3, shape) * rng.uniform(0.005, 0.05, (shape[0], 1))
    w[rng.random(shape) < 1e-3] *= 30
    return w.astype(np.float32)


@pytest.mark.parametrize("kind", ["normal", "heavy"])
@pytest.mark.parametrize("qt", ["q4_k", "q5_k", "q6_k"])
def test_kquant_quantizer_error_matches_ggml_reference(qt, kind):
    """RMSE of our quantizer <= that of ggml's reference quantizer (numpy port) * 1.002 on the
    same weights, and nearly all values identical (the port sums in another order); also
    better than the 32-block type of the same bit width."""
    rng = np.random.default_rng(11 if kind == "normal" else 12)
    x = _weights_dist(rng, kind, (48, 1024))
    ours = ops.dequantize(ops.quantize(x, qt), qt, x.shape)
    theirs = ggml_kquant_ref.quantize_k(x, qt)
    rmse, rmse_ref = (float(np.sqrt(np.mean((v - x) ** 2))) for v in (ours, theirs))
    assert rmse <= rmse_ref * 1.002
    assert np.mean(ours == theirs) > 0.97
    simple = {"q4_k": "q4_0", "q5_k": "q5_0", "q6_k": "q5_1"}[qt]
    d = ops.dequantize(ops.quantize(x, simple), simple, x.shape)
    assert rmse < float(np.sqrt(np.mean((d - x) ** 2)))


@pytest.mark.parametrize("kind", ["normal", "heavy"])
@pytest.mark.parametrize("qt", ["q5_0", "q5_1"])
def test_q5_quantizer_error_equals_gguf(qt, kind):
    rng = np.random.default_rng(13)
    x = _weights_dist(rng, kind, (32, 512))
    ours = ops.dequantize(ops.quantize(x, qt), qt, x.shape)
    theirs = ref.dequantize(
        ref.quantize(x, int(ops.QType.parse(qt))), int(ops.QType.parse(qt)), x.shape
    )
    assert np.sqrt(np.mean((ours - x) ** 2)) <= np.sqrt(np.mean((theirs - x) ** 2)) * (1 + 1e-6)


def test_kquant_quantizer_edge_blocks():
    """All-zero, constant and single-spike super-blocks quantize to finite values; zeros stay
    exactly zero."""
    x = np.zeros((4, 512), np.float32)
    x[1] = 0.25
    x[2, 7] = 3.0
    x[3] = np.linspace(-1, 1, 512)
    for qt in ("q4_k", "q5_k", "q6_k"):
        d = ops.dequantize(ops.quantize(x, qt), qt, x.shape)
        assert np.isfinite(d).all()
        np.testing.assert_array_equal(d[0], 0)
        assert np.abs(d[2, 7] - 3.0) < 0.1


def test_fp8_e4m3_decoding_vs_torch():
    """All 256 e4m3fn codes: the numpy reference and the C decoder (scale 1) equal torch's
    float8_e4m3fn -> float32 (NaN codes included)."""
    codes = np.arange(256, dtype=np.uint8)
    want = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(ref.e4m3_to_f32(codes), want)
    rows = fmt.fp8_rows(codes.reshape(1, 256), np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(ops.dequantize(rows, "fp8", (1, 256))[0], want)


def test_fp8_matvec_q8_every_code_vs_torch(isa):
    """FP8 matvec on Q8_0 activations (the kernels' f16 route to e4m3) over all 256 codes:
    the row without NaN codes equals float64 torch-decoded weights @ gguf-dequantized xq, the
    row holding the NaN codes gives NaN, and each equals the batched (n = 3) result."""
    codes = np.arange(256, dtype=np.uint8)
    clean = np.where((codes & 0x7F) == 0x7F, 0, codes).astype(np.uint8)
    rng = np.random.default_rng(11)
    rows = fmt.fp8_rows(np.stack([clean, codes]), np.array([[0.5, 3.0]], np.float32))
    w = torch.from_numpy(np.stack([clean, codes])).view(torch.float8_e4m3fn).double().numpy()
    w[:, :128] *= 0.5
    w[:, 128:] *= 3.0
    x = rng.standard_normal((3, 256)).astype(np.float32)
    xq = ops.quantize_act(x)
    xd = ref.dequantize(xq, int(ops.QType.Q8_0), x.shape).astype(np.float64)
    y3 = ops.matmul_q8(rows, "fp8", xq, np.empty((3, 2), np.float32))
    for i in range(3):
        y = ops.matmul_q8(rows, "fp8", xq[i], np.empty(2, np.float32))
        want = w[0] @ xd[i]
        assert abs(y[0] - want) <= 1e-5 * (np.abs(w[0]) @ np.abs(xd[i])), (i, y[0], want)
        assert np.isnan(y[1]) and np.isnan(y3[i, 1])
        assert abs(y3[i, 0] - want) <= 1e-5 * (np.abs(w[0]) @ np.abs(xd[i]))


@pytest.mark.parametrize("rows,cols", [(7, 224), (10, 352), (5, 192), (13, 128)])
def test_fp8_q8_gemm_tiles_same_bits_as_scalar_twin(isa, rows, cols):
    """FP8 on Q8_0 batches (arch/kquants_simd.inc kq_fp8_gemm: tiles of 3-4 weight rows x 4 x
    rows over 128-column blocks, a last block 32 / 64 / 96 wide): every x-row tail (n = 2..7,
    past one 64-row chunk: 65, 67), ragged row tiles and a row holding a NaN code give the
    scalar twin's bits, and they stay within MATMUL_TOL of float64 torch-decoded weights."""
    rng = np.random.default_rng(rows * 7 + cols)
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN code but in the last row
    codes[-1, cols // 2] = 0xFF
    scales = rng.uniform(0.01, 4, (1, -(-cols // 128))).astype(np.float32)
    packed = fmt.fp8_rows(codes, np.repeat(scales, -(-rows // 128), axis=0))
    w = torch.from_numpy(codes).view(torch.float8_e4m3fn).double().numpy()
    w *= np.repeat(scales[0], 128)[:cols]
    for n in (2, 3, 4, 5, 7, 65, 67):
        x = (rng.standard_normal((n, cols)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
        xq = ops.quantize_act(x)
        y = ops.matmul_q8(packed, "fp8", xq, np.full((n, rows), np.nan, np.float32))
        level = ops.isa()
        ops.set_isa(ops.ISA.SCALAR)
        try:
            want = ops.matmul_q8(packed, "fp8", xq, np.full((n, rows), np.nan, np.float32))
        finally:
            ops.set_isa(level)
        np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
        assert np.isnan(y[:, -1]).all() and not np.isnan(y[:, :-1]).any()
        np.testing.assert_array_equal(y.view(np.uint32)[:, :-1], want.view(np.uint32)[:, :-1])
        xd = ref.dequantize(xq, int(ops.QType.Q8_0), x.shape)
        assert matmul_err(y[:, :-1], ref.matmul(w[:-1], xd), xd, w[:-1]) <= MATMUL_TOL, n


@pytest.mark.parametrize("rows,cols", [(200, 300), (128, 128), (1, 77), (257, 129)])
def test_fp8_hub_layout_roundtrip(rows, cols):
    """DeepSeek-V3's weight (e4m3) + weight_scale_inv (128x128 blocks, ragged edges) -> store
    rows -> dequantized equals torch's weight.float() * scale_inv broadcast over the blocks, in
    C and in numpy; fp8_unrows gives the hub tensors back bit for bit."""
    rng = np.random.default_rng(rows + cols)
    w = torch.randn(rows, cols).mul(3).to(torch.float8_e4m3fn)
    grid = (-(-rows // 128), -(-cols // 128))
    s = torch.rand(grid) * 0.01 + 1e-4
    full = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    want = (w.float() * full).numpy()
    packed = fmt.fp8_rows(w.view(torch.uint8).numpy(), s.numpy())
    assert (
        packed.shape == (rows, fmt.row_nbytes("fp8", cols)) == (rows, ops.row_nbytes("fp8", cols))
    )
    np.testing.assert_array_equal(ops.dequantize(packed, "fp8", (rows, cols)), want)
    np.testing.assert_array_equal(ref.fp8_dequantize(packed, (rows, cols)), want)
    wb, sb = fmt.fp8_unrows(packed, cols)
    np.testing.assert_array_equal(wb, w.view(torch.uint8).numpy())
    np.testing.assert_array_equal(sb, s.numpy())
    with pytest.raises(StoreError, match=r"weight_scale_inv has shape \[1, 1\]"):
        fmt.fp8_rows(w.view(torch.uint8).numpy()[:, :1].repeat(200, 1), np.ones((1, 1)))
    del rng


@pytest.mark.parametrize("rows,cols", [(300, 200), (128, 256), (5, 40)])
def test_fp8_quantize_like_deepseek(rows, cols):
    """--quant fp8 from float: per 128x128 tile scale = amax / 448 and e4m3 = torch's cast of
    x / scale (DeepSeek-V3's block quantization), ragged edge tiles included."""
    rng = np.random.default_rng(rows)
    x = (rng.standard_t(4, (rows, cols)) * 0.02).astype(np.float32)
    got = ops.quantize(x, "fp8")
    xt = torch.from_numpy(x)
    grid = (-(-rows // 128), -(-cols // 128))
    scale = torch.zeros(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            scale[i, j] = xt[128 * i : 128 * i + 128, 128 * j : 128 * j + 128].abs().max() / 448
    full = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    q = (xt / full).to(torch.float8_e4m3fn)
    want = fmt.fp8_rows(q.view(torch.uint8).numpy(), scale.numpy())
    np.testing.assert_array_equal(got, want)
    err = ops.dequantize(got, "fp8", x.shape) - x
    assert np.sqrt(np.mean(err**2)) < 0.05 * np.sqrt(np.mean(x**2))


def test_type_tables_agree():
    """io/format.py's qtype table (the store) and the C kernels (ops) agree on every type's
    row size, and on which types have a quantizer."""
    for qt in ops.QType:
        name = qt.name.lower()
        assert name in fmt.QTYPES
        for cols in (256, 512, 1280):
            assert ops.row_nbytes(qt, cols) == fmt.row_nbytes(name, cols), (name, cols)
    want = {q.name.lower() for q in ops.QUANTIZE_TYPES}
    assert want == set(fmt.QTYPES) - set(fmt.IMPORT_ONLY_QTYPES)


def test_bad_arguments():
    with pytest.raises(KernelError, match="multiple of the block size"):
        ops.row_nbytes("q4_k", 128)
    with pytest.raises(KernelError, match="Q3_K has no quantizer"):
        ops.quantize(np.zeros((1, 256), np.float32), "q3_k")
    with pytest.raises(StoreError, match="q6_k needs a multiple of 256 columns"):
        fmt.row_nbytes("q6_k", 96)
    assert fmt.row_nbytes("fp8", 129) == 8 + 129


# ---- kernels -------------------------------------------------------------------------------


def _shapes(qt):
    if qt in SUPER_TYPES:
        return [(1, 256), (13, 512), (67, 768)]
    if qt == ops.QType.FP8:
        return [(1, 250), (13, 96), (67, 300), (9, 512)]
    return [(1, 32), (13, 96), (67, 544), (9, 512)]


@pytest.mark.parametrize("qt", KQUANT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 2, 5, 17])
def test_matmul_vs_dequantized_reference(isa, qt, n):
    """f32 activations: matmul == float64 x @ dequant(W)^T within MATMUL_TOL, every shape."""
    for rows, cols in _shapes(qt):
        rng = np.random.default_rng(rows * 31 + cols + n)
        data, w = ref.weights(rng, int(qt), rows, cols)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        y = ops.matmul(data, qt, x, np.full((n, rows), np.nan, np.float32))
        assert matmul_err(y, ref.matmul(w, x), x, w) <= MATMUL_TOL, (rows, cols)


@pytest.mark.parametrize("qt", KQUANT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 2, 5, 17])
def test_matmul_q8_vs_dequantized_reference(isa, qt, n):
    """Q8_0 activations: matmul_q8 == float64 dequant(xq) @ dequant(W)^T (gguf's Q8_0 bytes
    for xq): the integer sums are exact, only the f32 scaling differs."""
    for rows, cols in _shapes(qt):
        if cols % 32:
            continue
        rng = np.random.default_rng(rows * 17 + cols + n)
        data, w = ref.weights(rng, int(qt), rows, cols)
        x = (rng.standard_normal((n, cols)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
        xq = ops.quantize_act(x)
        xd = ref.dequantize(xq, int(ops.QType.Q8_0), x.shape)
        y = ops.matmul_q8(data, qt, xq, np.full((n, rows), np.nan, np.float32))
        assert matmul_err(y, ref.matmul(w, xd), xd, w) <= MATMUL_TOL, (rows, cols)


@pytest.mark.parametrize("qt", KQUANT_TYPES, ids=lambda q: q.name)
def test_simd_matches_scalar_twin_and_threads(isa, qt):
    """The ISA's kernels against the scalar twin (both activation kinds), 1-D x, and the
    same bits for any thread count."""
    rng = np.random.default_rng(5)
    cols = 1024
    data, w = ref.weights(rng, int(qt), 301, cols)
    x = rng.standard_normal((6, cols)).astype(np.float32)
    xq = ops.quantize_act(x)
    y = ops.matmul(data, qt, x, np.empty((6, 301), np.float32))
    yq = ops.matmul_q8(data, qt, xq, np.empty((6, 301), np.float32))
    for nt in (1, 2, 3):
        np.testing.assert_array_equal(
            ops.matmul(data, qt, x, np.empty((6, 301), np.float32), nt), y
        )
    y1 = ops.matmul(data, qt, x[0], np.empty(301, np.float32))
    np.testing.assert_array_equal(y1, y[0])
    level = ops.isa()
    ops.set_isa(ops.ISA.SCALAR)
    try:
        y_ref = ops.matmul(data, qt, x, np.empty((6, 301), np.float32))
        yq_ref = ops.matmul_q8(data, qt, xq, np.empty((6, 301), np.float32))
    finally:
        ops.set_isa(level)
    assert matmul_err(y, y_ref, x, w) <= MATMUL_TOL
    xd = ref.dequantize(xq, int(ops.QType.Q8_0), x.shape)
    assert matmul_err(yq, yq_ref, xd, w) <= MATMUL_TOL


def _q8_ffn_reference(x, gf, uf, df, rw):
    """(y, slack) of the SwiGLU FFN on Q8_0 activations: x and h (rounded to f32) quantized by
    gguf, float64 matmuls of the dequantized values; slack = the L2 change that rounding ties
    of h allow (h / d_h within 1e-3 of k + 0.5 may round either way from the kernel's f32 h),
    as tests/test_q8_activations.py."""
    xd = ref.dequantize(ref.quantize(x, 8), 8, x.shape).astype(np.float64)
    h = ref._act(xd @ gf.astype(np.float64).T, xd @ uf.astype(np.float64).T, 0, 1.702, 7.0)
    h32 = h.astype(np.float32)
    hd = ref.dequantize(ref.quantize(h32, 8), 8, h32.shape).astype(np.float64)
    y = (hd @ df.astype(np.float64).T) * rw[:, None]
    hb = h32.reshape(len(x), -1, 32)
    dh = np.abs(hb).max(axis=2, keepdims=True) / 127
    steps = np.abs(hb) / np.where(dh > 0, dh, 1)
    tie = np.abs(steps - np.floor(steps) - 0.5) < 1e-3
    col = np.linalg.norm(df, axis=0).reshape(-1, 32)
    return y, float((tie * dh * col[None] * rw[:, None, None]).sum())


@pytest.mark.parametrize(
    "types",
    [("q4_k", "q4_k", "q6_k"), ("q5_k", "q5_k", "q5_k"), ("fp8", "fp8", "fp8"),
     ("mxfp4", "mxfp4", "q8_0"), ("iq4_xs", "q3_k", "q2_k"), ("q5_1", "q5_0", "q4_0")],
    ids="/".join,
)  # fmt: skip
@pytest.mark.parametrize("act_q8", [False, True], ids=["f32", "q8"])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-g) of large |g|
def test_expert_ffn_per_tensor_types(isa, types, act_q8):
    """A record whose gate / up / down have their own types (mixed GGUF quants) against the
    float64 FFN of the dequantized weights (q8: of gguf's Q8_0 round trips of x and h)."""
    rng = np.random.default_rng(len("".join(types)))
    d_model, d_ff, n = 512, 256, 3
    qts = [ops.QType.parse(t) for t in types]
    (g, gf), (u, uf), (d, df) = (
        ref.weights(rng, int(qts[0]), d_ff, d_model),
        ref.weights(rng, int(qts[1]), d_ff, d_model),
        ref.weights(rng, int(qts[2]), d_model, d_ff),
    )
    x = (0.5 * rng.standard_normal((n, d_model))).astype(np.float32)
    rw = rng.uniform(0.1, 1, n).astype(np.float32)
    y = ops.expert_ffn(
        np.zeros((n, d_model), np.float32), x, g, u, d, "q4_0", d_model, d_ff,
        row_weight=rw, act_q8=act_q8, qtypes=types,
    )  # fmt: skip
    if act_q8:
        want, slack = _q8_ffn_reference(x, gf, uf, df, rw)
    else:
        want, slack = ref.expert_ffn(x, gf, uf, df, 0, row_weight=rw), 0.0
    assert np.linalg.norm(y - want) <= FFN_TOL * np.linalg.norm(want) + slack
    if len(set(types)) == 1:  # the single-type entry point gives the same bits
        y1 = ops.expert_ffn(
            np.zeros((n, d_model), np.float32), x, g, u, d, types[0], d_model, d_ff,
            row_weight=rw, act_q8=act_q8,
        )  # fmt: skip
        np.testing.assert_array_equal(y1, y)
    with pytest.raises(KernelError, match="down has"):
        ops.expert_ffn(
            np.zeros((n, d_model), np.float32), x, g, u, d[:-1], "q4_0", d_model, d_ff,
            qtypes=types,
        )  # fmt: skip


@needs_avx512_emulation
def test_kquants_avx512_emulated(tmp_path):
    """arch/kquants_avx512.c compiled on SIMDe's portable AVX-512 against the scalar twins:
    every issue-15 type, f32 and Q8_0 activations (tests/avx512_emu/kq_harness.c)."""
    files = ["quant.c", "kquants.c", "pool.c", "isa.c"]
    run_avx512_emulated(tmp_path, "kquants_avx512.c", "kq_harness.c", files)


def test_mxfp4_hub_layout_vs_transformers():
    """gpt-oss hub blocks / scales -> store mxfp4 rows -> dequantized equals transformers' own
    MXFP4 loader (convert_moe_packed_tensors, f32) bit for bit, C and gguf alike."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(9)
    E, out_f, G = 2, 6, 4  # in_features = 128
    blocks = rng.integers(0, 256, (E, out_f, G, 16), dtype=np.uint8)
    scales = rng.integers(118, 134, (E, out_f, G), dtype=np.uint8)
    want = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )  # [E, in, out]
    want = want.transpose(1, 2).numpy()  # back to W [E, out, in]
    rows = fmt.mxfp4_rows(blocks, scales)
    assert rows.shape == (E, out_f, fmt.row_nbytes("mxfp4", 32 * G))
    got = ops.dequantize(rows, "mxfp4", (E, out_f, 32 * G))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ref.dequantize(rows, 39, (E, out_f, 32 * G)), want)
    with pytest.raises(StoreError, match=r"mxfp4 blocks \[2, 6, 4, 16\] and scales \[2, 6\]"):
        fmt.mxfp4_rows(blocks, scales[..., 0])
