"""Shared helpers for the kernel tests: ISA levels to run, named tolerances."""

from __future__ import annotations

import numpy as np

from colibri.compute import ops
from colibri.compute.selfcheck import FFN_TOL, MATMUL_TOL, matmul_err  # named tolerances

QUANT_TYPES = [ops.QType.Q4_0, ops.QType.Q4_1, ops.QType.Q8_0]
FLOAT_TYPES = [ops.QType.F32, ops.QType.F16, ops.QType.BF16]
ALL_TYPES = QUANT_TYPES + FLOAT_TYPES


def random_weights(rng: np.random.Generator, qtype: ops.QType, rows: int, cols: int):
    """(stored bytes [rows, row_nbytes], dequantized float32 [rows, cols]) via gguf."""
    from colibri.compute import ref

    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2, (rows, 1))).astype(np.float32)
    data = ref.quantize(w, qtype)
    return data, ref.dequantize(data, qtype, (rows, cols))


__all__ = ["FFN_TOL", "MATMUL_TOL", "matmul_err"]
