"""Shared helpers for the kernel tests: ISA levels to run, named tolerances."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

from colibri.compute import ops
from colibri.compute.selfcheck import FFN_TOL, MATMUL_TOL, matmul_err  # named tolerances

QUANT_TYPES = [ops.QType.Q4_0, ops.QType.Q4_1, ops.QType.Q8_0]
FLOAT_TYPES = [ops.QType.F32, ops.QType.F16, ops.QType.BF16]
ALL_TYPES = QUANT_TYPES + FLOAT_TYPES


# the issue-15 types (csrc/kquants.h); K-quants and IQ4_XS need cols % 256 == 0
KQUANT_TYPES = [
    ops.QType.Q5_0, ops.QType.Q5_1, ops.QType.Q2_K, ops.QType.Q3_K, ops.QType.Q4_K,
    ops.QType.Q5_K, ops.QType.Q6_K, ops.QType.MXFP4, ops.QType.IQ4_NL, ops.QType.IQ4_XS,
    ops.QType.FP8,
]  # fmt: skip
SUPER_TYPES = {ops.QType.Q2_K, ops.QType.Q3_K, ops.QType.Q4_K, ops.QType.Q5_K, ops.QType.Q6_K}
SUPER_TYPES |= {ops.QType.IQ4_XS}


def random_weights(rng: np.random.Generator, qtype: ops.QType, rows: int, cols: int):
    """(stored bytes [rows, row_nbytes], dequantized float32 [rows, cols]): gguf's quantizer
    where it has one, else random valid blocks; dequantized by gguf (ref.weights)."""
    from colibri.compute import ref

    return ref.weights(rng, int(qtype), rows, cols)


__all__ = ["FFN_TOL", "MATMUL_TOL", "matmul_err"]


# ---- AVX-512 kernels emulated on SIMDe (machines without AVX-512; csrc/build_kernels.py) ----
EMU = os.path.join(os.path.dirname(__file__), "avx512_emu")
CSRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")


def needs_avx512_emulation(test):
    """Skip where AVX-512 runs natively (the native tests cover it) or gcc / SIMDe's headers
    (libsimde-dev) are missing."""
    test = pytest.mark.skipif(
        not os.path.isdir("/usr/include/simde") or shutil.which("gcc") is None,
        reason="needs gcc and SIMDe headers (libsimde-dev) to emulate AVX-512",
    )(test)
    native = ops.best_isa() >= ops.ISA.AVX512
    return pytest.mark.skipif(native, reason="AVX-512 runs natively here")(test)


def run_avx512_emulated(tmp_path, arch_file: str, harness: str, csrc_files: list[str]) -> None:
    """Compile csrc/arch/`arch_file` (its native `#pragma GCC target` dropped) on SIMDe's
    portable AVX-512, link it with tests/avx512_emu/`harness` and `csrc_files`, run it, and
    assert it reports " 0 mismatches" against the scalar twins."""
    src = tmp_path / f"emu_{arch_file}"
    with open(os.path.join(CSRC, "arch", arch_file)) as f:
        src.write_text("".join(ln for ln in f if not ln.startswith("#pragma GCC target")))
    inc = ["-I", EMU, "-I", CSRC, "-I", os.path.join(CSRC, "arch")]
    flags = ["gcc", "-O1", "-std=gnu11", "-DSIMDE_NO_NATIVE", "-w", *inc]
    obj, exe = str(tmp_path / "emu.o"), str(tmp_path / "harness")
    subprocess.run([*flags, "-c", str(src), "-o", obj], check=True)
    srcs = [os.path.join(EMU, harness)] + [os.path.join(CSRC, f) for f in csrc_files]
    subprocess.run([*flags, *srcs, obj, "-o", exe, "-lm", "-pthread"], check=True)
    res = subprocess.run([exe], capture_output=True, text=True)
    assert res.returncode == 0 and " 0 mismatches" in res.stdout, res.stdout
