"""Q8_0-quantized activations (clb_matmul_q8, clb_expert_ffn with qscratch, the engine's
activations="q8_0") against an independent numpy reference built on gguf's quantizers:
x -> gguf.quants.quantize(x, Q8_0), then per 32-block the exact integer dot of the weight and
activation integers times f32(d_w) * f32(d_x), summed in float64. The integer parts are exact,
so only the f32 summation order separates the kernels from the reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from colibri.compute import ops, ref
from colibri.convert import convert
from colibri.engine import open_engine
from colibri.errors import KernelError
from tests import hf_models
from tests.kernel_util import FFN_TOL, MATMUL_TOL, random_weights

Q8 = gguf.GGMLQuantizationType.Q8_0
QTYPES = [ops.QType.Q4_0, ops.QType.Q8_0]


def _blocks(data: np.ndarray, qt: ops.QType, rows: int, cols: int):
    """Stored rows -> (f16 scales as float64 [rows, nb], integers int64 [rows, nb, 32])."""
    nb = cols // 32
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, nb, -1)
    d = raw[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float64)
    if qt == ops.QType.Q8_0:
        q = raw[:, :, 2:].view(np.int8).astype(np.int64)
    else:  # Q4_0: byte j holds element j (low nibble) and j + 16 (high), stored as q + 8
        qs = raw[:, :, 2:].astype(np.int64)
        q = np.concatenate([(qs & 15) - 8, (qs >> 4) - 8], axis=2)
    return d, q


def q8_reference(data: np.ndarray, qt: ops.QType, x: np.ndarray):
    """(y float64 [n, rows], magnitude [n, rows] = sum_b |d_w d_x| sum |q_w q_x|) for W stored
    as `qt` and float32 x [n, cols] quantized with gguf's Q8_0."""
    n, cols = x.shape
    rows = data.shape[0]
    xq = gguf.quants.quantize(np.ascontiguousarray(x, np.float32), Q8)
    dx, qx = _blocks(xq, ops.QType.Q8_0, n, cols)
    dw, qw = _blocks(data, qt, rows, cols)
    isum = np.einsum("rbk,nbk->nrb", qw, qx)  # exact int64
    mag = np.einsum("rbk,nbk->nrb", np.abs(qw), np.abs(qx))
    scale = dw[None, :, :] * dx[:, None, :]  # f16 * f16 is exact in float64
    return (isum * scale).sum(2), (mag * np.abs(scale)).sum(2) + 1e-30


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(1, 32), (13, 32), (37, 2048), (67, 96)])
@pytest.mark.parametrize("n", range(1, 10))
def test_matmul_q8_vs_numpy(isa, qt, rows, cols, n):
    rng = np.random.default_rng(rows * 100 + cols + n)
    data, _w = random_weights(rng, qt, rows, cols)
    x = (rng.standard_normal((n, cols)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
    xq = ops.quantize_act(x)
    np.testing.assert_array_equal(xq, ref.quantize(x, int(ops.QType.Q8_0)))  # gguf's bytes
    y = ops.matmul_q8(data, qt, xq, np.full((n, rows), np.nan, np.float32))
    want, mag = q8_reference(data, qt, x)
    assert np.max(np.abs(y - want) / mag) <= MATMUL_TOL


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
def test_matmul_q8_gemm_tiles_and_extremes(isa, qt):
    """The batch (GEMM) path: 8-row tiles with a 5-row tail, 4-row x tiles with a tail, x rows
    past the 64-row panel, chunks starting mid-matrix (2 threads); weights and x at the
    integer extremes (Q4_0 nibbles 0 and 15, Q8_0 +-127, x +-127) where int16 sums peak."""
    rng = np.random.default_rng(5)
    rows, cols, n = 229, 1056, 70
    data, _w = random_weights(rng, qt, rows, cols)
    raw = data.view(np.uint8).reshape(rows, cols // 32, -1)
    if qt == ops.QType.Q4_0:
        raw[:8, :, 2:] = rng.choice(np.array([0x00, 0xFF], np.uint8), raw[:8, :, 2:].shape)
    else:
        raw[:8, :, 2:] = rng.choice(np.array([127, 129], np.uint8), raw[:8, :, 2:].shape)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x[:5] = np.sign(x[:5])  # every element quantizes to +-127
    xq = ops.quantize_act(x)
    want, mag = q8_reference(data, qt, x)
    for t in (1, 2):
        y = ops.matmul_q8(data, qt, xq, np.full((n, rows), np.nan, np.float32), nthreads=t)
        assert np.max(np.abs(y - want) / mag) <= MATMUL_TOL


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
def test_matmul_q8_threads_and_1d(isa, qt):
    """Rows not a multiple of the 16-row tile, several chunks: the same bits for 1 and 2
    threads (chunks are fixed by the row count), 1-D xq/out as matvec."""
    rng = np.random.default_rng(11)
    data, _w = random_weights(rng, qt, 301, 1024)
    x = rng.standard_normal((3, 1024)).astype(np.float32)
    xq = ops.quantize_act(x)
    ys = [ops.matmul_q8(data, qt, xq, np.empty((3, 301), np.float32), t) for t in (1, 2)]
    np.testing.assert_array_equal(ys[0], ys[1])
    want, mag = q8_reference(data, qt, x)
    assert np.max(np.abs(ys[0] - want) / mag) <= MATMUL_TOL
    y1 = ops.matmul_q8(memoryview(data), qt, xq[1], np.empty(301, np.float32), nthreads=2)
    assert np.max(np.abs(y1 - want[1]) / mag[1]) <= MATMUL_TOL  # matvec: other sum order


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
def test_simd_matches_scalar_twin(isa, qt):
    rng = np.random.default_rng(5)
    data, _w = random_weights(rng, qt, 45, 512)
    x = rng.standard_normal((7, 512)).astype(np.float32)
    xq = ops.quantize_act(x)
    y = ops.matmul_q8(data, qt, xq, np.empty((7, 45), np.float32))
    ops.set_isa(ops.ISA.SCALAR)
    y_ref = ops.matmul_q8(data, qt, xq, np.empty((7, 45), np.float32))
    _want, mag = q8_reference(data, qt, x)
    assert np.max(np.abs(y - y_ref) / mag) <= MATMUL_TOL


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
def test_gemm_tiles_bit_equal_to_scalar_twin(qt):
    """Every SIMD level's batch GEMM (AVX512-VNNI: 16-row tiles, 8 x rows in registers; the
    others 8-row tiles) gives the scalar twin's bits: 237 rows (a 13-row tail tile, split 8 +
    5 across the 512-bit lanes), x rows past the 256-row panel with a 4-row tail, bias,
    row scale and accumulate through expert_ffn, 1 and 2 threads; and stays within the numpy
    reference's tolerance."""
    rng = np.random.default_rng(23)
    rows, cols, n = 237, 1056, 300
    data, _w = random_weights(rng, qt, rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    xq = ops.quantize_act(x)
    d_model, d_ff, m = 96, 160, 260
    g, u = (random_weights(rng, qt, d_ff, d_model)[0] for _ in range(2))
    d, _ = random_weights(rng, qt, d_model, d_ff)
    h = rng.standard_normal((m, d_model)).astype(np.float32)
    bg, bu = rng.standard_normal((2, d_ff)).astype(np.float32)
    bd = rng.standard_normal(d_model).astype(np.float32)
    rw = rng.uniform(0.1, 1, m).astype(np.float32)
    y0 = rng.standard_normal((m, d_model)).astype(np.float32)

    def run(t: int) -> tuple[np.ndarray, np.ndarray]:
        y = ops.matmul_q8(data, qt, xq, np.full((n, rows), np.nan, np.float32), nthreads=t)
        f = ops.expert_ffn(
            y0.copy(), h, g, u, d, qt, d_model, d_ff, gate_bias=bg, up_bias=bu, down_bias=bd,
            row_weight=rw, act_q8=True, nthreads=t,
        )  # fmt: skip
        return y, f

    before = ops.isa()
    try:
        ops.set_isa(ops.ISA.SCALAR)
        y_ref, f_ref = run(1)
        for level in ops.ISA:
            if ops.ISA.SCALAR < level <= ops.best_isa():
                ops.set_isa(level)
                for t in (1, 2):
                    y, f = run(t)
                    np.testing.assert_array_equal(y, y_ref, err_msg=f"{level.name}, {t} threads")
                    np.testing.assert_array_equal(f, f_ref, err_msg=f"{level.name}, {t} threads")
    finally:
        ops.set_isa(before)
    want, mag = q8_reference(data, qt, x)
    assert np.max(np.abs(y_ref - want) / mag) <= MATMUL_TOL


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize(
    "rows, cols, n",
    [(237, 1056, 12), (237, 1056, 16), (61, 1056, 28), (45, 512, 32), (45, 512, 8),
     (21, 16416, 32), (7, 544, 16), (237, 1056, 4), (61, 1056, 5), (45, 512, 11),
     (237, 1056, 20), (61, 1056, 24), (45, 512, 40), (21, 16416, 24), (7, 544, 7),
     (61, 1056, 23)],
)  # fmt: skip
def test_gemm_x_in_lanes_bit_equal_to_scalar_twin(qt, rows, cols, n):
    """Batches of x rows in the lanes (AVX512-VNNI's mmq_gemmx: weights read in place, x
    transposed; 16-lane columns, and an 8-lane last column for the 1..8 rows past a multiple
    of 16: 7, 8, 23, 24, 40 rows) give the scalar twin's bits at every SIMD level: ragged
    weight rows (tail tiles of 5, 7 rows), a matrix smaller than one tile, x panels over
    several passes (16416 columns: one 16-row column per panel), 1 and 2 threads; and every
    x row alone gives the bits it gets in the batch (batch invariance), as does a call on a
    row range's weights."""
    rng = np.random.default_rng(rows * 1000 + n)
    data, _w = random_weights(rng, qt, rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x[3] *= 1e-3  # small and large d_x in one column
    xq = ops.quantize_act(x)
    before = ops.isa()
    try:
        ops.set_isa(ops.ISA.SCALAR)
        y_ref = ops.matmul_q8(data, qt, xq, np.empty((n, rows), np.float32), nthreads=1)
        for level in ops.ISA:
            if not ops.ISA.SCALAR < level <= ops.best_isa():
                continue
            ops.set_isa(level)
            for t in (1, 2):
                y = ops.matmul_q8(data, qt, xq, np.full((n, rows), np.nan, np.float32), nthreads=t)
                np.testing.assert_array_equal(y, y_ref, err_msg=f"{level.name}, {t} threads")
            for i in (0, 3, n - 1):
                yi = ops.matmul_q8(data, qt, xq[i], np.empty(rows, np.float32))
                np.testing.assert_array_equal(yi, y_ref[i], err_msg=f"{level.name}, row {i}")
            r0 = rows // 3
            part = ops.matmul_q8(data[r0:], qt, xq, np.empty((n, rows - r0), np.float32))
            np.testing.assert_array_equal(part, y_ref[:, r0:], err_msg=f"{level.name}, rows {r0}:")
    finally:
        ops.set_isa(before)
    want, mag = q8_reference(data, qt, x)
    assert np.max(np.abs(y_ref - want) / mag) <= MATMUL_TOL


def test_quantize_act_edge_cases(isa):
    """The SIMD quantizer gives gguf's bytes: exact halves, all-zero and tiny blocks."""
    x = np.zeros((4, 64), np.float32)
    x[0] = (np.arange(64) - 32) * np.float32(127 / 64)  # x / d lands on k + 0.5
    x[1, :32] = 1e-30 * np.arange(32)
    x[2] = np.random.default_rng(0).standard_normal(64) * 1e4
    np.testing.assert_array_equal(ops.quantize_act(x), ref.quantize(x, int(ops.QType.Q8_0)))


def _q8_ffn_reference(x, g, u, d, qt, d_model, d_ff, bg, bu, bd, rw, act):
    """(y, slack): the float64 FFN whose three matmuls are q8_reference (h quantized by gguf
    from h rounded to f32, as the kernel does), and the L2 error that rounding ties allow: an
    h / d_h within 1e-3 of k + 0.5 may round either way from the kernel's f32 h (whose
    error is ~1e-6 |h|), moving the output by d_h * |down column| * row_weight."""
    gy = q8_reference(g, qt, x)[0] + bg
    uy = q8_reference(u, qt, x)[0] + bu
    h = ref._act(gy, uy, int(act), 1.702, 3.0)
    y = (q8_reference(d, qt, h.astype(np.float32))[0] + bd) * rw[:, None]
    hb = h.reshape(len(x), -1, 32)
    dh = np.abs(hb).max(axis=2, keepdims=True) / 127
    steps = np.abs(hb) / np.where(dh > 0, dh, 1)
    tie = np.abs(steps - np.floor(steps) - 0.5) < 1e-3
    col = np.linalg.norm(ref.dequantize(d, int(qt), (d_model, d_ff)), axis=0).reshape(-1, 32)
    slack = float((tie * dh * col[None] * rw[:, None, None]).sum())
    return y, slack


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("act", list(ops.Act), ids=lambda a: a.name.lower())
@pytest.mark.parametrize("n", [1, 3, 8])
def test_expert_ffn_q8_vs_numpy(isa, qt, act, n):
    rng = np.random.default_rng(n * 10 + int(act))
    d_model, d_ff = 128, 224  # d_ff: 7 blocks, chunks of whole blocks
    g, _ = random_weights(rng, qt, d_ff, d_model)
    u, _ = random_weights(rng, qt, d_ff, d_model)
    d, _ = random_weights(rng, qt, d_model, d_ff)
    x = (0.5 * rng.standard_normal((n, d_model))).astype(np.float32)
    bg, bu = rng.standard_normal((2, d_ff)).astype(np.float32)
    bd = rng.standard_normal(d_model).astype(np.float32)
    rw = rng.uniform(0.1, 1, n).astype(np.float32)
    y0 = rng.standard_normal((n, d_model)).astype(np.float32)
    for t in (1, 2):
        y = ops.expert_ffn(
            y0.copy(), x, g, u, d, qt, d_model, d_ff, act=act, gate_bias=bg, up_bias=bu,
            down_bias=bd, row_weight=rw, limit=3.0, act_q8=True, nthreads=t,
        )  # fmt: skip
        o, slack = _q8_ffn_reference(x, g, u, d, qt, d_model, d_ff, bg, bu, bd, rw, act)
        assert np.linalg.norm(y - y0 - o) <= FFN_TOL * np.linalg.norm(o) + slack


def test_q8_bad_arguments():
    w = np.zeros((4, ops.row_nbytes("q8_0", 64)), np.uint8)
    xq = ops.quantize_act(np.ones((2, 64), np.float32))
    y = np.zeros((2, 4), np.float32)
    with pytest.raises(KernelError, match=r"weights must be one of .*, got Q4_1"):
        ops.matmul_q8(w, "q4_1", xq, y)
    with pytest.raises(KernelError, match="w has 271 bytes"):
        ops.matmul_q8(w.ravel()[:-1], "q8_0", xq, y)
    with pytest.raises(KernelError, match="xq must be a C-contiguous uint8"):
        ops.matmul_q8(w, "q8_0", xq.view(np.int8), y)
    with pytest.raises(KernelError, match="not Q8_0 blocks"):
        ops.matmul_q8(w, "q8_0", xq[:, :-1].copy(), y)
    with pytest.raises(KernelError, match="act_q8 needs Q8_ACT_TYPES weights, got BF16"):
        gate = np.zeros((32, 64 * 2), np.uint8)
        ops.expert_ffn(np.zeros(64, np.float32), np.zeros(64, np.float32), gate, gate,
                       np.zeros((64, 64), np.uint8), "bf16", 64, 32, act_q8=True)  # fmt: skip


# ---- the engine option ---------------------------------------------------------------------
PROMPT_LEN, NEW_TOKENS = 32, 32


async def _teacher_forced(store, ids, tokens, **options) -> np.ndarray:
    async with open_engine(store, **options) as engine:
        seq = engine.new_sequence()
        out = [await engine.forward(seq, ids)]
        for tok in tokens[:-1]:
            out.append(await engine.forward(seq, [tok]))
    return np.stack(out).astype(np.float64)


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    logp = p - np.logaddexp.reduce(p, axis=1, keepdims=True)
    logq = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
    return float((np.exp(logp) * (logp - logq)).sum(axis=1).mean())


async def test_engine_q8_activations_close_to_float(tmp_path):
    """A tiny Mixtral in q4_0 (dense q8_0): with activations="q8_0" the logits stay as close
    to the float run as the f32-activation path (the quantized-storage KL bound of
    test_engine_exact.py), and close to that path itself."""
    model = hf_models.build("mixtral", seed=3)
    src = hf_models.save(model, tmp_path / "hf")
    ids = hf_models.find_prompt(model, 5, PROMPT_LEN, NEW_TOKENS, 1e-4)
    if ids is None:
        pytest.skip("no prompt without a near-tie in 8 tries")
    convert(src, tmp_path / "f32", quant="f32", dense_quant="f32")
    convert(src, tmp_path / "q4", quant="q4_0", dense_quant="q8_0")
    tokens, p = await hf_models.engine_greedy(tmp_path / "f32", ids, NEW_TOKENS)
    p = p.astype(np.float64)
    q_f32 = await _teacher_forced(tmp_path / "q4", ids, tokens, threads=2, activations="f32")
    q_q8 = await _teacher_forced(tmp_path / "q4", ids, tokens, threads=2, activations="q8_0")
    assert not np.array_equal(q_f32, q_q8)  # the option took effect
    kl_f32, kl_q8, kl_between = _kl(p, q_f32), _kl(p, q_q8), _kl(q_f32, q_q8)
    # top-1 agreement where the float top-1 leads by >= 0.1 logits (test_engine_exact_v2.py:
    # the tiny random models are flat, near-ties flip under any q4_0 error)
    top2 = np.sort(p, axis=1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] >= 0.1
    top1 = float((p.argmax(1) == q_q8.argmax(1))[decisive].mean())
    print(f"KL(float||q4 f32 act) {kl_f32:.2e}, KL(float||q4 q8 act) {kl_q8:.2e}, "
          f"KL(f32 act||q8 act) {kl_between:.2e}, decisive top-1 {top1:.3f} "
          f"of {decisive.sum()}")  # fmt: skip
    assert kl_q8 <= 5e-2 and top1 >= 0.8  # QUANT_BOUNDS["q4_0"] of test_engine_exact.py
    assert kl_between <= 5e-3  # Q8_0 activations add at most q8_0-storage-sized error


def test_engine_option_validated():
    from colibri.engine import EngineOptions
    from colibri.errors import ColibriError

    with pytest.raises(ColibriError, match="option activations='q4_0': must be f32, q8_0 or q8_k"):
        EngineOptions(activations="q4_0")


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize(
    "rows, cols",
    [(1, 32), (15, 64), (17, 96), (40, 128), (61, 1056), (237, 4128), (250, 544)],
)  # fmt: skip
def test_decode_matvec_bit_equal_to_scalar_twin(qt, rows, cols):
    """The decode paths (n <= 3 x rows: weight rows in the lanes, one pass over the weights)
    give the scalar twin's bits at every SIMD level: tail tiles of 1 to 15 rows (16-row tiles
    with AVX512-VNNI, 8 otherwise), 1 to 4 blocks after the last whole group of 4 (the Q4_0
    scales, one 64-byte load for 4 blocks), 1 and 2 threads; each x row alone gives the bits
    it gets in a batch of 2 and 3 (batch invariance); and bias, row scale and accumulate
    through expert_ffn for 1 to 3 tokens."""
    rng = np.random.default_rng(rows * 7919 + cols)
    data, _w = random_weights(rng, qt, rows, cols)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    x[1] *= 1e-3  # small and large d_x
    xq = ops.quantize_act(x)
    d_model, d_ff = 96, 160
    g, u = (random_weights(rng, qt, d_ff, d_model)[0] for _ in range(2))
    d, _ = random_weights(rng, qt, d_model, d_ff)
    h = rng.standard_normal((3, d_model)).astype(np.float32)
    bg, bu = rng.standard_normal((2, d_ff)).astype(np.float32)
    bd = rng.standard_normal(d_model).astype(np.float32)
    rw = rng.uniform(0.1, 1, 3).astype(np.float32)
    y0 = rng.standard_normal((3, d_model)).astype(np.float32)

    def ffn(m: int, t: int) -> np.ndarray:
        return ops.expert_ffn(
            y0[:m].copy(), h[:m], g, u, d, qt, d_model, d_ff, gate_bias=bg, up_bias=bu,
            down_bias=bd, row_weight=rw[:m], act_q8=True, nthreads=t,
        )  # fmt: skip

    before = ops.isa()
    try:
        ops.set_isa(ops.ISA.SCALAR)
        y_ref = ops.matmul_q8(data, qt, xq, np.empty((3, rows), np.float32), nthreads=1)
        f_ref = [ffn(m, 1) for m in (1, 2, 3)]
        for level in ops.ISA:
            if not ops.ISA.SCALAR < level <= ops.best_isa():
                continue
            ops.set_isa(level)
            for t in (1, 2):
                for n in (1, 2, 3):
                    y = ops.matmul_q8(data, qt, xq[:n], np.full((n, rows), np.nan, np.float32),
                                      nthreads=t)  # fmt: skip
                    np.testing.assert_array_equal(y, y_ref[:n], err_msg=f"{level.name} {t}t n={n}")
                    f = ffn(n, t)
                    np.testing.assert_array_equal(
                        f, f_ref[n - 1], err_msg=f"{level.name} ffn n={n}"
                    )
                for i in range(3):
                    yi = ops.matmul_q8(data, qt, xq[i], np.empty(rows, np.float32), nthreads=t)
                    np.testing.assert_array_equal(yi, y_ref[i], err_msg=f"{level.name} row {i}")
    finally:
        ops.set_isa(before)
    want, mag = q8_reference(data, qt, x)
    assert np.max(np.abs(y_ref - want) / mag) <= MATMUL_TOL


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [8, 9, 16, 17, 40, 53])
def test_gemm_register_tiles_bit_equal_to_scalar_twin(qt, rows):
    """The batch GEMMs (AVX2: mmq_gemm_tile below 12 x rows, Q4_0's mmq_gemm2 from 12, 16-row
    tiles x 3 x rows, a remainder of 1 taken as 2 + 2) give the scalar twin's bits for every n
    from 4 to 22 (every remainder of the x-row tiles, both sides of the switch), weight tiles
    with only their first 8 rows (9, 17, 40, 53 rows) or fewer, 1 and 2 threads; each x row
    alone gets the bits it gets in the batch."""
    rng = np.random.default_rng(rows * 31 + 7)
    cols = 160
    data, _w = random_weights(rng, qt, rows, cols)
    x = rng.standard_normal((22, cols)).astype(np.float32)
    x[2] *= 1e-3  # small and large d_x
    xq = ops.quantize_act(x)
    before = ops.isa()
    try:
        ops.set_isa(ops.ISA.SCALAR)
        y_ref = ops.matmul_q8(data, qt, xq, np.empty((22, rows), np.float32), nthreads=1)
        for level in ops.ISA:
            if not ops.ISA.SCALAR < level <= ops.best_isa():
                continue
            ops.set_isa(level)
            for n in range(4, 23):
                for t in (1, 2):
                    y = ops.matmul_q8(data, qt, xq[:n], np.full((n, rows), np.nan, np.float32),
                                      nthreads=t)  # fmt: skip
                    np.testing.assert_array_equal(y, y_ref[:n], err_msg=f"{level.name} {t}t n={n}")
            for i in (0, 2, 21):
                yi = ops.matmul_q8(data, qt, xq[i], np.empty(rows, np.float32))
                np.testing.assert_array_equal(yi, y_ref[i], err_msg=f"{level.name}, row {i}")
    finally:
        ops.set_isa(before)
