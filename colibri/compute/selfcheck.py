"""`python -m colibri selfcheck`: every kernel at every supported ISA level on random data,
compared with the numpy references (colibri.compute.ref), printed as one table.

Kernels join the check by appending a function to CHECKS (or decorating it with @register):
it takes a numpy Generator and returns CheckResults; the runner calls it once per ISA level
with that level forced, and a result passes when err <= tol.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from colibri.compute import ops, ref

# Max |y - ref| / (|x| @ |W|^T): f32 accumulation (about sqrt(cols) * 2^-24 in practice)
# against a float64 reference.
MATMUL_TOL = 2e-6
# ||y - ref|| / ||ref|| of the whole expert FFN (three chained f32 matmuls, expf/tanhf).
FFN_TOL = 2e-5


@dataclass(frozen=True)
class CheckResult:
    """One comparison: `err` in the unit the check documents, passing when err <= tol."""

    kernel: str
    case: str
    err: float
    tol: float

    @property
    def ok(self) -> bool:
        return bool(self.err <= self.tol)


Check = Callable[[np.random.Generator], list[CheckResult]]
CHECKS: list[Check] = []


def register(fn: Check) -> Check:
    """Add a check to the self-check (decorator)."""
    CHECKS.append(fn)
    return fn


def matmul_err(y: np.ndarray, want: np.ndarray, x: np.ndarray, w: np.ndarray) -> float:
    """Max |y - want| relative to |x| @ |W|^T, so cancellation in a dot product is fair."""
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T + 1e-30
    return float(np.max(np.abs(y - want) / scale))


def _weights(rng: np.random.Generator, qt: ops.QType, rows: int, cols: int):
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2, (rows, 1))).astype(np.float32)
    data = ref.quantize(w, qt)
    return data, ref.dequantize(data, qt, (rows, cols))


@register
def check_quant(rng: np.random.Generator) -> list[CheckResult]:
    """Quantize/dequantize vs gguf: err = fraction of differing bytes / float bits (tol 0)."""
    out = []
    for qt in ops.QType:
        x = (rng.standard_normal((8, 256)) * rng.uniform(1e-3, 1e3, (8, 1))).astype(np.float32)
        q = ops.quantize(x, qt)
        want = ref.quantize(x, qt)
        out.append(CheckResult("quantize", qt.name, float(np.mean(q != want)), 0.0))
        deq = ops.dequantize(want, qt, x.shape).view(np.uint32)
        bits = ref.dequantize(want, qt, x.shape).view(np.uint32)
        out.append(CheckResult("dequantize", qt.name, float(np.mean(deq != bits)), 0.0))
    return out


@register
def check_matmul(rng: np.random.Generator) -> list[CheckResult]:
    """matmul vs float64 numpy on the dequantized weights (err: see matmul_err)."""
    out = []
    for qt in ops.QType:
        cols = 256 if qt in (ops.QType.Q4_0, ops.QType.Q4_1, ops.QType.Q8_0) else 250
        data, w = _weights(rng, qt, 37, cols)
        for n in (1, 5, 16):
            x = rng.standard_normal((n, cols)).astype(np.float32)
            y = ops.matmul(data, qt, x, np.empty((n, 37), np.float32))
            err = matmul_err(y, ref.matmul(w, x), x, w)
            out.append(CheckResult("matmul", f"{qt.name} n={n}", err, MATMUL_TOL))
    return out


@register
def check_expert_ffn(rng: np.random.Generator) -> list[CheckResult]:
    """expert_ffn with biases and routing weights vs float64 numpy (relative L2 error)."""
    out = []
    d_model, d_ff, n = 128, 96, 3
    for qt in (ops.QType.Q4_0, ops.QType.Q8_0, ops.QType.BF16):
        (g, gf), (u, uf), (d, df) = (
            _weights(rng, qt, d_ff, d_model),
            _weights(rng, qt, d_ff, d_model),
            _weights(rng, qt, d_model, d_ff),
        )
        x = (0.5 * rng.standard_normal((n, d_model))).astype(np.float32)
        bg, bu = rng.standard_normal((2, d_ff)).astype(np.float32)
        bd = rng.standard_normal(d_model).astype(np.float32)
        rw = rng.uniform(0.1, 1, n).astype(np.float32)
        for act in ops.Act:
            y = ops.expert_ffn(
                np.zeros((n, d_model), np.float32), x, g, u, d, qt, d_model, d_ff, act=act,
                gate_bias=bg, up_bias=bu, down_bias=bd, row_weight=rw, limit=3.0,
            )  # fmt: skip
            want = ref.expert_ffn(x, gf, uf, df, int(act), bg, bu, bd, rw, limit=3.0)
            err = float(np.linalg.norm(y - want) / np.linalg.norm(want))
            out.append(CheckResult("expert_ffn", f"{qt.name} {act.name.lower()}", err, FFN_TOL))
    return out


def run(levels: list[ops.ISA], seed: int = 0) -> dict[ops.ISA, list[CheckResult]]:
    """Run every registered check at each level (restoring the level in use after)."""
    before = ops.isa()
    results: dict[ops.ISA, list[CheckResult]] = {}
    try:
        for level in levels:
            ops.set_isa(level)
            rng = np.random.default_rng(seed)
            results[level] = [r for check in CHECKS for r in check(rng)]
    finally:
        ops.set_isa(before)
    return results


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--isa",
        choices=[level.name.lower() for level in ops.ISA],
        action="append",
        help="check only this level (repeatable; default: every level this CPU supports)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def run_cli(args: argparse.Namespace) -> int:
    best = ops.best_isa()
    levels = [ops.ISA[s.upper()] for s in args.isa] if args.isa else list(ops.ISA)
    runnable = [lv for lv in levels if lv <= best]
    results = run(runnable, args.seed)
    print(f"colibri selfcheck: CPU/build best level {best.name}, default threads "
          f"{ops.default_threads()}; cells: error / tolerance")  # fmt: skip
    header = f"{'kernel':<12} {'case':<22}" + "".join(f" {lv.name.lower():>18}" for lv in levels)
    print(header)
    print("-" * len(header))
    failed = 0
    rows = results[runnable[0]] if runnable else []
    for i, r in enumerate(rows):
        cells = []
        for lv in levels:
            if lv not in results:
                cells.append(f"{'not on this CPU':>18}")
                continue
            res = results[lv][i]
            failed += not res.ok
            cells.append(f"{res.err:8.1e}/{res.tol:.0e} {'ok' if res.ok else 'FAIL':>4}")
        print(f"{r.kernel:<12} {r.case:<22}" + "".join(f" {c:>18}" for c in cells))
    total = len(rows) * len(runnable)
    print(f"{total - failed}/{total} checks passed" + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0
