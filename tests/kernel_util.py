"""Shared helpers for the kernel tests: ISA levels to run, named tolerances."""

from __future__ import annotations

import numpy as np

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
