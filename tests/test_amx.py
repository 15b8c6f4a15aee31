"""The AMX GEMM (csrc/arch/amx_gemm.c: Q4_0 / Q8_0 weights x Q8_0 activations on int8 tiles;
Q8_0 weights loaded in place as the A operand) gives the same bits as the AVX512-VNNI path and
the scalar twin (the int32 block sums are exact and the f32 chain is the twin's, block by
block), on ragged shapes: x rows not a multiple of the 16-row tile, weight rows not a multiple
of 16, 1 to many blocks, past the 128-row x panel; through matmul_q8 and the expert FFN (bias,
routing weight, accumulate), 1 and 2 threads. The values are also checked against the numpy
reference of test_q8_activations. Skipped only where the CPU (or OS) has no usable AMX."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from colibri.compute import ops
from colibri.errors import KernelError
from tests.kernel_util import MATMUL_TOL, random_weights
from tests.test_q8_activations import q8_reference

QTYPES = [ops.QType.Q4_0, ops.QType.Q8_0]
needs_amx = pytest.mark.skipif(not ops.amx_supported(), reason="AMX int8 not usable here")


def _run_levels(fn):
    """fn() at the scalar level, at AVX-512 without AMX and with AMX (in this order)."""
    before_isa, before_amx = ops.isa(), ops.amx()
    out = []
    try:
        ops.set_isa(ops.ISA.SCALAR)
        out.append(fn())
        ops.set_isa(ops.ISA.AVX512)
        ops.set_amx(False)
        assert not ops.amx()
        out.append(fn())
        ops.set_amx(True)
        assert ops.amx()
        out.append(fn())
    finally:
        ops.set_isa(before_isa)
        ops.set_amx(before_amx)
    return out


@needs_amx
@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize(
    "rows,cols,n",
    [(16, 32, 16), (1, 32, 12), (17, 64, 13), (37, 96, 31), (64, 2048, 16), (45, 512, 129),
     (237, 1056, 300), (13, 4096, 47)],
)  # fmt: skip
def test_amx_matmul_bit_equal(qt, rows, cols, n):
    rng = np.random.default_rng(rows * 7 + cols + n)
    data, _w = random_weights(rng, qt, rows, cols)
    x = (rng.standard_normal((n, cols)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
    xq = ops.quantize_act(x)
    for t in (1, 2):
        ref_y, vnni_y, amx_y = _run_levels(
            lambda t=t: ops.matmul_q8(data, qt, xq, np.full((n, rows), np.nan, np.float32),
                                      nthreads=t)
        )  # fmt: skip
        np.testing.assert_array_equal(vnni_y, ref_y, err_msg=f"VNNI, {t} threads")
        np.testing.assert_array_equal(amx_y, ref_y, err_msg=f"AMX, {t} threads")
    want, mag = q8_reference(data, qt, x)
    assert np.max(np.abs(amx_y - want) / mag) <= MATMUL_TOL


@needs_amx
@pytest.mark.parametrize(
    "rows,nblk,n",
    [(1, 1, 8), (15, 1, 9), (17, 2, 300), (33, 130, 7), (31, 130, 8), (100, 33, 15),
     (47, 3, 129), (16, 130, 17), (250, 5, 256), (19, 64, 1), (21, 7, 4), (9, 40, 5)],
)  # fmt: skip
def test_amx_q8w_ragged_bit_equal(rows, nblk, n):
    """Q8_0 weights as the tiles' A operand in place (amx_q8w), x rows as B: weight rows not a
    multiple of 16 (the zero-padded copy of the last tile), 1 to 130 blocks (the L1 chunks of
    32 blocks), 1 to 300 x rows (below the threshold, one x tile, several, past the panel)."""
    rng = np.random.default_rng(rows * 1009 + nblk * 31 + n)
    cols = 32 * nblk
    data, _w = random_weights(rng, ops.QType.Q8_0, rows, cols)
    x = (rng.standard_normal((n, cols)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
    xq = ops.quantize_act(x)
    for t in (1, 2):
        ref_y, vnni_y, amx_y = _run_levels(
            lambda t=t: ops.matmul_q8(data, ops.QType.Q8_0, xq,
                                      np.full((n, rows), np.nan, np.float32), nthreads=t)
        )  # fmt: skip
        np.testing.assert_array_equal(vnni_y, ref_y, err_msg=f"VNNI, {t} threads")
        np.testing.assert_array_equal(amx_y, ref_y, err_msg=f"AMX, {t} threads")
    want, mag = q8_reference(data, ops.QType.Q8_0, x)
    assert np.max(np.abs(amx_y - want) / mag) <= MATMUL_TOL


@needs_amx
def test_amx_q8w_row_alone_equals_row_in_batch():
    """Q8_0 weights: each of 300 x rows (three panels of AMX tiles) equals the same row alone
    (decode, VNNI matvec) and inside batches of 5 and 8 (one ragged AMX x tile)."""
    rng = np.random.default_rng(5)
    rows, cols, n = 37, 32 * 70, 300
    data, _w = random_weights(rng, ops.QType.Q8_0, rows, cols)
    xq = ops.quantize_act(rng.standard_normal((n, cols)).astype(np.float32))
    before = ops.isa()
    try:
        ops.set_isa(ops.ISA.AVX512)
        ops.set_amx(True)
        batch = ops.matmul_q8(data, ops.QType.Q8_0, xq, np.empty((n, rows), np.float32))
        for i in (0, 15, 16, 127, 128, 200, 299):
            one = ops.matmul_q8(
                data, ops.QType.Q8_0, xq[i : i + 1], np.empty((1, rows), np.float32)
            )
            np.testing.assert_array_equal(one[0], batch[i])
        for i, k in ((0, 8), (125, 8), (292, 8), (14, 5), (295, 5)):
            few = ops.matmul_q8(
                data, ops.QType.Q8_0, xq[i : i + k], np.empty((k, rows), np.float32)
            )
            np.testing.assert_array_equal(few, batch[i : i + k])
    finally:
        ops.set_isa(before)


@needs_amx
@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 5, 8, 16, 37])
def test_amx_expert_ffn_bit_equal(qt, n):
    """Bias, routing weight and accumulate through the FFN epilogue; n = 1 (and 5 for Q4_0) take
    the VNNI kernels (below the AMX threshold) inside the AMX dispatch: still the same bits."""
    rng = np.random.default_rng(100 + n)
    d_model, d_ff = 96, 160
    g, u = (random_weights(rng, qt, d_ff, d_model)[0] for _ in range(2))
    d, _ = random_weights(rng, qt, d_model, d_ff)
    h = rng.standard_normal((n, d_model)).astype(np.float32)
    bg, bu = rng.standard_normal((2, d_ff)).astype(np.float32)
    bd = rng.standard_normal(d_model).astype(np.float32)
    rw = rng.uniform(0.1, 1, n).astype(np.float32)
    y0 = rng.standard_normal((n, d_model)).astype(np.float32)

    def run():
        return ops.expert_ffn(
            y0.copy(), h, g, u, d, qt, d_model, d_ff, gate_bias=bg, up_bias=bu, down_bias=bd,
            row_weight=rw, act_q8=True, nthreads=2, accumulate=True,
        )  # fmt: skip

    ref_y, vnni_y, amx_y = _run_levels(run)
    np.testing.assert_array_equal(vnni_y, ref_y)
    np.testing.assert_array_equal(amx_y, ref_y)


@needs_amx
def test_amx_row_alone_equals_row_in_batch():
    """Batch invariance across the AMX threshold: each row of a 40-row batch (AMX tiles) equals
    the same row computed alone (decode, VNNI matvec)."""
    rng = np.random.default_rng(3)
    data, _w = random_weights(rng, ops.QType.Q4_0, 48, 256)
    x = rng.standard_normal((40, 256)).astype(np.float32)
    xq = ops.quantize_act(x)
    before = ops.isa()
    try:
        ops.set_isa(ops.ISA.AVX512)
        ops.set_amx(True)
        batch = ops.matmul_q8(data, ops.QType.Q4_0, xq, np.empty((40, 48), np.float32))
        for i in (0, 17, 39):
            one = ops.matmul_q8(data, ops.QType.Q4_0, xq[i : i + 1], np.empty((1, 48), np.float32))
            np.testing.assert_array_equal(one[0], batch[i])
    finally:
        ops.set_isa(before)


def test_amx_flag_follows_support_and_level():
    """Everywhere: set_amx(True) raises where AMX is not usable; AMX is never reported in use
    below the AVX-512 level; set_amx(False) always works."""
    before_isa, before_amx = ops.isa(), ops.amx()
    try:
        if not ops.amx_supported():
            with pytest.raises(KernelError, match="set_amx"):
                ops.set_amx(True)
        else:
            ops.set_amx(True)
            ops.set_isa(ops.ISA.SCALAR)
            assert not ops.amx()
            ops.set_isa(ops.ISA.AVX512)
            assert ops.amx()
        ops.set_amx(False)
        assert not ops.amx()
    finally:
        ops.set_isa(before_isa)
        if before_amx:
            ops.set_amx(True)


def test_colibri_amx_env_turns_it_off():
    code = "from colibri.compute import ops; print(ops.amx_supported(), ops.amx())"
    env = dict(os.environ, COLIBRI_AMX="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    supported, in_use = out.stdout.split()
    assert in_use == "False"
    env.pop("COLIBRI_AMX")
    env.pop("COLIBRI_ISA", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == [supported, supported]


EMU = os.path.join(os.path.dirname(__file__), "amx_emu")
CSRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")


@pytest.mark.skipif(ops.best_isa() < ops.ISA.AVX512, reason="the epilogue needs AVX-512 here")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_amx_tile_logic_emulated(tmp_path):
    """csrc/arch/amx_gemm.c on tiles emulated in C (tests/amx_emu/amx_tiles.h, the SDM's
    semantics) against the scalar twin, bit for bit: runs wherever AVX-512 does, AMX or not."""
    with open(os.path.join(CSRC, "arch", "amx_gemm.c")) as f:  # native target pragma dropped
        src = "".join(ln for ln in f if not ln.startswith("#pragma GCC target"))
    (tmp_path / "amx_gemm_src.c").write_text(src)
    isa = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512dq", "-mavx2"]
    isa += ["-mfma", "-mf16c"]
    inc = ["-I", str(tmp_path), "-I", EMU, "-I", CSRC, "-I", os.path.join(CSRC, "arch")]
    flags = ["gcc", "-O2", "-std=gnu11", "-w", *inc]
    obj = str(tmp_path / "amx_emu.o")  # only the kernel for AVX-512, as the module builds it
    subprocess.run([*flags, *isa, "-c", os.path.join(EMU, "amx_emu.c"), "-o", obj], check=True)
    srcs = [os.path.join(EMU, "harness.c")]
    srcs += [os.path.join(CSRC, f) for f in ("quant.c", "kquants.c", "pool.c", "isa.c")]
    exe = str(tmp_path / "harness")
    subprocess.run([*flags, obj, *srcs, "-o", exe, "-lm", "-pthread"], check=True)
    res = subprocess.run([exe], capture_output=True, text=True)
    assert res.returncode == 0 and " 0 mismatches" in res.stdout, res.stdout + res.stderr
