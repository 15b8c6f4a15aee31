"""ops.expert_ffn_group (one kernel call for several experts of a layer, the server's decode
steps): each expert's rows get the very bits of ops.expert_ffn / expert_ffn_q8k on those rows
alone, at every ISA level the machine has, and the result matches a float64 numpy FFN on the
dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.compute import ops
from tests.kernel_util import random_weights

CASES = [  # (gate/up/down types, q8k path, biases)
    ((ops.QType.Q4_0,) * 3, False, False),
    ((ops.QType.Q8_0,) * 3, False, True),
    ((ops.QType.Q4_K, ops.QType.Q4_K, ops.QType.Q6_K), False, False),
    ((ops.QType.Q4_K, ops.QType.Q4_K, ops.QType.Q6_K), True, True),
]


def _records(rng, qts, d_model, d_ff, n_experts, biases):
    """n_experts records (uint8, 4096-padded) of gate, up, down (+ f32 biases), their spans
    and each expert's dequantized (gate, up, down, biases)."""
    shapes = {"gate": (d_ff, d_model), "up": (d_ff, d_model), "down": (d_model, d_ff)}
    records, floats, spans = [], [], {}
    for _ in range(n_experts):
        parts, fl, off = [], {}, 0
        for (name, shape), qt in zip(shapes.items(), qts, strict=True):
            data, w = random_weights(rng, qt, *shape)
            spans[name] = (off, data.nbytes)
            parts.append(data.ravel())
            fl[name] = w.astype(np.float64)
            off += data.nbytes
        if biases:
            for name, size in (("gate_bias", d_ff), ("up_bias", d_ff), ("down_bias", d_model)):
                b = rng.standard_normal(size).astype(np.float32)
                spans[name] = (off, b.nbytes)
                parts.append(b.view(np.uint8))
                fl[name] = b.astype(np.float64)
                off += b.nbytes
        rec = np.zeros((off + 4095) // 4096 * 4096, np.uint8)
        rec[:off] = np.concatenate(parts)
        records.append(rec)
        floats.append(fl)
    return records, spans, floats


@pytest.mark.parametrize("qts,q8k,biases", CASES, ids=lambda c: str(c))
def test_group_bits_equal_single_expert_calls(qts, q8k, biases):
    rng = np.random.default_rng(11)
    d_model, d_ff = 256, 256
    counts = [3, 0, 1, 5, 2]  # an expert with no rows is skipped
    records, spans, floats = _records(rng, qts, d_model, d_ff, len(counts), biases)
    n = sum(counts)
    x = rng.standard_normal((n, d_model)).astype(np.float32)
    rw = rng.uniform(0.1, 1, n).astype(np.float32)
    row_off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    try:
        for level in [i for i in ops.ISA if i <= ops.best_isa()]:
            ops.set_isa(level)
            _check_group(qts, q8k, records, spans, floats, x, rw, row_off, d_model, d_ff)
    finally:
        ops.set_isa(ops.best_isa())


def _check_group(qts, q8k, records, spans, floats, x, rw, row_off, d_model, d_ff):
    n = len(x)
    got = ops.expert_ffn_group(
        np.full((n, d_model), np.nan, np.float32), x, records, spans, qts, row_off, d_model, d_ff,
        row_weight=rw, act_q8=True, q8k=q8k, nthreads=2,
    )  # fmt: skip
    for e, rec in enumerate(records):
        a, b = row_off[e], row_off[e + 1]
        if a == b:
            continue
        part = {k: rec[o : o + nb] for k, (o, nb) in spans.items()}
        bias = {k: part[k].view(np.float32) if k in part else None
                for k in ("gate_bias", "up_bias", "down_bias")}  # fmt: skip
        xs, out = np.ascontiguousarray(x[a:b]), np.empty((b - a, d_model), np.float32)
        args = (out, xs, part["gate"], part["up"], part["down"])
        kw = dict(row_weight=np.ascontiguousarray(rw[a:b]), accumulate=False, **bias)
        if q8k:
            want = ops.expert_ffn_q8k(*args, qts, d_model, d_ff, **kw)
        else:
            want = ops.expert_ffn(*args, qts[0], d_model, d_ff, act_q8=True, qtypes=qts, **kw)
        np.testing.assert_array_equal(got[a:b].view(np.uint32), want.view(np.uint32))
        # and the FFN itself, in float64 on the dequantized weights (Q8 activations: ~1e-2)
        f = floats[e]
        g = xs.astype(np.float64) @ f["gate"].T + f.get("gate_bias", 0)
        u = xs.astype(np.float64) @ f["up"].T + f.get("up_bias", 0)
        h = g / (1 + np.exp(-g)) * u
        ref = ((h @ f["down"].T) + f.get("down_bias", 0)) * rw[a:b, None]
        err = np.abs(got[a:b] - ref).max() / np.abs(ref).max()
        assert err < 0.05, err


def test_group_bad_arguments_are_named():
    rng = np.random.default_rng(3)
    qts = (ops.QType.Q8_0,) * 3
    records, spans, _ = _records(rng, qts, 64, 32, 2, False)
    x = np.zeros((4, 64), np.float32)
    with pytest.raises(ops.KernelError, match="row_off"):
        ops.expert_ffn_group(np.empty_like(x), x, records, spans, qts, np.array([0, 3, 2]), 64, 32)
    with pytest.raises(ops.KernelError, match="records\\[1\\]"):
        ops.expert_ffn_group(
            np.empty_like(x), x, [records[0], records[1][:100]], spans, qts, np.array([0, 2, 4]),
            64, 32,
        )  # fmt: skip
    with pytest.raises(ops.KernelError, match="gate"):
        bad = {**spans, "gate": (0, 10)}
        ops.expert_ffn_group(np.empty_like(x), x, records, bad, qts, np.array([0, 2, 4]), 64, 32)
    with pytest.raises(ops.KernelError, match="q8k"):
        ops.expert_ffn_group(
            np.empty_like(x), x, records, spans, qts, np.array([0, 2, 4]), 64, 32, q8k=True
        )
