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
    return ref.weights(rng, int(qt), rows, cols)


@register
def check_quant(rng: np.random.Generator) -> list[CheckResult]:
    """Quantize/dequantize vs gguf: err = fraction of differing bytes / float bits (tol 0)."""
    out = []
    for qt in ops.QType:
        x = (rng.standard_normal((8, 256)) * rng.uniform(1e-3, 1e3, (8, 1))).astype(np.float32)
        if int(qt) not in ref.GGUF_QUANTIZE:  # no gguf quantizer: decoding only
            want = ref.random_blocks(rng, int(qt), 8, 256)
            deq = ops.dequantize(want, qt, x.shape)
            bits = ref.dequantize(want, qt, x.shape)
            err = float(np.mean(deq.view(np.uint32) != bits.view(np.uint32)))
            out.append(CheckResult("dequantize", qt.name, err, 0.0))
            continue
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
        cols = 250 if qt in (ops.QType.F32, ops.QType.F16, ops.QType.BF16, ops.QType.FP8) else 256
        data, w = _weights(rng, qt, 37, cols)
        for n in (1, 5, 16):
            x = rng.standard_normal((n, cols)).astype(np.float32)
            y = ops.matmul(data, qt, x, np.empty((n, 37), np.float32))
            err = matmul_err(y, ref.matmul(w, x), x, w)
            out.append(CheckResult("matmul", f"{qt.name} n={n}", err, MATMUL_TOL))
    return out


@register
def check_matmul_q8(rng: np.random.Generator) -> list[CheckResult]:
    """matmul_q8 (Q8_0 activations) vs float64 numpy on gguf's dequantized weights and
    activations: the integer dots are exact, so the f32 bound of matmul applies."""
    out = []
    for qt in sorted(ops.Q8_ACT_TYPES):
        data, w = _weights(rng, qt, 37, 256)
        for n in (1, 5, 16):
            x = rng.standard_normal((n, 256)).astype(np.float32)
            xq = ops.quantize_act(x)
            xd = ref.dequantize(xq, int(ops.QType.Q8_0), x.shape)
            y = ops.matmul_q8(data, qt, xq, np.empty((n, 37), np.float32))
            err = matmul_err(y, ref.matmul(w, xd), xd, w)
            out.append(CheckResult("matmul_q8", f"{qt.name} n={n}", err, MATMUL_TOL))
    return out


@register
def check_expert_ffn(rng: np.random.Generator) -> list[CheckResult]:
    """expert_ffn with biases and routing weights vs float64 numpy (relative L2 error)."""
    out = []
    d_model, d_ff, n = 128, 96, 3
    for qt in (ops.QType.Q4_0, ops.QType.Q8_0, ops.QType.BF16, ops.QType.Q5_1, ops.QType.FP8):
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


# ---- small ops and attention (err: max |y - ref| / (1 + |ref|), mixed absolute/relative) ----
SMALL_OPS_TOL = 4e-6  # one f32 rounding chain of a few ops (expf, tanhf, cosf, rsqrt)
ATTENTION_TOL = 2e-5  # f32 online softmax over <= a few hundred keys


def mixed_err(y: np.ndarray, want: np.ndarray) -> float:
    """max |y - want| / (1 + |want|): absolute near 0, relative for large values."""
    y64, w64 = y.astype(np.float64), want.astype(np.float64)
    return float(np.max(np.abs(y64 - w64) / (1.0 + np.abs(w64)))) if y.size else 0.0


@register
def check_small_ops(rng: np.random.Generator) -> list[CheckResult]:
    """RMSNorm, RoPE (both pairings, partial), softmax, SiLU, GELU vs numpy; top-k: fraction of
    indices differing from a stable argsort (ties to the lowest index), tol 0."""
    out = []
    x = (rng.standard_normal((4, 301)) * 3).astype(np.float32)
    w = rng.standard_normal(301).astype(np.float32)
    y = ops.rmsnorm(np.empty_like(x), x, w, 1e-6)
    out.append(CheckResult("rmsnorm", "d=301", mixed_err(y, ref.rmsnorm(x, w, 1e-6)),
                           SMALL_OPS_TOL))  # fmt: skip
    xr = rng.standard_normal((5, 4, 96)).astype(np.float32)
    pos = rng.integers(0, 32768, 5).astype(np.int32)
    inv_freq = (1e4 ** -(np.arange(0, 64, 2) / 64)).astype(np.float32)
    for mode in ("neox", "interleaved"):
        y = ops.rope(xr.copy(), pos, inv_freq, 64, 1.2, mode)
        want = ref.rope(xr, pos, inv_freq, 64, 1.2, mode)
        out.append(CheckResult("rope", f"{mode} 64/96", mixed_err(y, want), SMALL_OPS_TOL))
    s = (rng.standard_normal((3, 257)) * 10).astype(np.float32)
    out.append(CheckResult("softmax", "d=257", mixed_err(ops.softmax(s.copy()), ref.softmax(s)),
                           SMALL_OPS_TOL))  # fmt: skip
    a = (rng.standard_normal(1003) * 8).astype(np.float32)
    for name in ("silu", "gelu"):
        y = getattr(ops, name)(np.empty_like(a), a)
        out.append(CheckResult(name, "n=1003", mixed_err(y, getattr(ref, name)(a)), SMALL_OPS_TOL))
    r = rng.integers(-3, 4, (16, 128)).astype(np.float32)  # many ties
    idx, _ = ops.topk(r, 8)
    out.append(CheckResult("topk", "8 of 128, ties", float(np.mean(idx != ref.topk(r, 8)[0])), 0.0))
    return out


@register
def check_attention(rng: np.random.Generator) -> list[CheckResult]:
    """Causal GQA attention vs numpy: decode and prefill, f32/f16 KV, window, sinks, MLA dims."""
    out = []
    cases = [  # label, n_q, n_kv, n_heads, n_kv_heads, dk, dv, kv dtype, window, sinks
        ("decode f16 8:2", 1, 300, 8, 2, 64, 64, np.float16, 0, False),
        ("decode f16 w128 sinks", 1, 300, 8, 2, 64, 64, np.float16, 128, True),
        ("prefill MLA 192/128", 24, 64, 4, 4, 192, 128, np.float32, 0, False),
        ("prefill 16:2 w16 sinks", 24, 64, 16, 2, 64, 64, np.float32, 16, True),
    ]
    for case, n_q, n_kv, nh, nkv, dk, dv, dt, window, with_sinks in cases:
        q = rng.standard_normal((n_q, nh, dk)).astype(np.float32)
        k = rng.standard_normal((n_kv, nkv, dk)).astype(dt)
        v = rng.standard_normal((n_kv, nkv, dv)).astype(dt)
        sinks = rng.standard_normal(nh).astype(np.float32) if with_sinks else None
        y = np.empty((n_q, nh, dv), np.float32)
        ops.attention(y, q, k, v, n_kv, n_kv - n_q, dk**-0.5, window, sinks)
        want = ref.attention(q, k, v, n_kv, n_kv - n_q, dk**-0.5, window, sinks)
        out.append(CheckResult("attention", case, mixed_err(y, want), ATTENTION_TOL))
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
