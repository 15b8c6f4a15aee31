"""clb_expert_ffn against a float64 numpy reference and HF transformers' GptOssExperts."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.compute import ops, ref
from colibri.errors import KernelError
from tests.kernel_util import (
    ALL_TYPES,
    FFN_TOL,
    random_weights,
)


def _expert(rng, qt, d_model, d_ff):
    gate, gate_f = random_weights(rng, qt, d_ff, d_model)
    up, up_f = random_weights(rng, qt, d_ff, d_model)
    down, down_f = random_weights(rng, qt, d_model, d_ff)
    # one contiguous record, like a slab slot: the kernel gets views into it
    record = np.concatenate([gate.ravel(), up.ravel(), down.ravel()])
    views = np.split(record, [gate.size, gate.size + up.size])
    return views, (gate_f, up_f, down_f)


def _rel(y, want):
    return float(np.linalg.norm(y - want) / np.linalg.norm(want))


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("act", list(ops.Act), ids=lambda a: a.name)
@pytest.mark.parametrize("n", [1, 5])
def test_ffn_vs_numpy(isa, qt, act, n):
    rng = np.random.default_rng(int(qt) * 10 + int(act) + n)
    d_model, d_ff = 96, 160
    (gate, up, down), wf = _expert(rng, qt, d_model, d_ff)
    x = (rng.standard_normal((n, d_model)) * 0.5).astype(np.float32)
    biases = [rng.standard_normal(k).astype(np.float32) for k in (d_ff, d_ff, d_model)]
    rw = rng.uniform(0.1, 1, n).astype(np.float32)
    y0 = rng.standard_normal((n, d_model)).astype(np.float32)
    # limit 3 so that the gpt-oss clamps are active on some entries
    kw = dict(act=act, alpha=1.702, limit=3.0)
    plain = ref.expert_ffn(x, *wf, act=int(act), limit=3.0)
    y = ops.expert_ffn(y0.copy(), x, gate, up, down, qt, d_model, d_ff, **kw)  # accumulates
    assert _rel(y - y0, plain) <= FFN_TOL
    y = ops.expert_ffn(
        y0.copy(), x, gate, up, down, qt, d_model, d_ff, gate_bias=biases[0],
        up_bias=biases[1], down_bias=biases[2], row_weight=rw, **kw,
    )  # fmt: skip
    want = y0 + ref.expert_ffn(x, *wf, int(act), *biases, rw, limit=3.0)
    assert _rel(y - y0, want - y0) <= FFN_TOL
    y = ops.expert_ffn(y0.copy(), x, gate, up, down, qt, d_model, d_ff, accumulate=False, **kw)
    assert _rel(y, plain) <= FFN_TOL


def test_ffn_matches_gpt_oss_experts(isa):
    """The SWIGLU_OAI path equals transformers' GptOssExperts (interleaved gate_up_proj)."""
    torch = pytest.importorskip("torch")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.set_num_threads(1)
    d_model, d_ff, n = 64, 96, 4
    cfg = GptOssConfig(hidden_size=d_model, intermediate_size=d_ff, num_local_experts=1)
    rng = np.random.default_rng(0)
    g, u = rng.standard_normal((2, d_ff, d_model)).astype(np.float32) * 0.6
    dn = rng.standard_normal((d_model, d_ff)).astype(np.float32) * 0.2
    bg, bu = rng.standard_normal((2, d_ff)).astype(np.float32)
    bd = rng.standard_normal(d_model).astype(np.float32)
    x = rng.standard_normal((n, d_model)).astype(np.float32)
    rw = rng.uniform(0.2, 1, (n, 1)).astype(np.float32)
    experts = GptOssExperts(cfg)
    gate_up = np.empty((d_model, 2 * d_ff), np.float32)
    gate_up[:, ::2], gate_up[:, 1::2] = g.T, u.T
    bias = np.empty(2 * d_ff, np.float32)
    bias[::2], bias[1::2] = bg, bu
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.from_numpy(gate_up)[None])
        experts.gate_up_proj_bias.copy_(torch.from_numpy(bias)[None])
        experts.down_proj.copy_(torch.from_numpy(np.ascontiguousarray(dn.T))[None])
        experts.down_proj_bias.copy_(torch.from_numpy(bd)[None])
        want = experts(
            torch.from_numpy(x), torch.zeros((n, 1), dtype=torch.long), torch.from_numpy(rw)
        ).numpy()
    y = ops.expert_ffn(
        np.zeros((n, d_model), np.float32), x, g, u, dn, "f32", d_model, d_ff,
        act="swiglu_oai", gate_bias=bg, up_bias=bu, down_bias=bd, row_weight=rw.ravel(),
        alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
    )  # fmt: skip
    assert _rel(y, want) <= FFN_TOL


def test_ffn_threads_scratch_and_1d(isa):
    rng = np.random.default_rng(5)
    (gate, up, down), wf = _expert(rng, ops.QType.Q4_0, 256, 512)
    x = rng.standard_normal(256).astype(np.float32)
    scratch = np.empty(2 * 512, np.float32)
    outs = [
        ops.expert_ffn(np.zeros(256, np.float32), x, gate, up, down, "q4_0", 256, 512,
                       scratch=scratch, nthreads=t)
        for t in (1, 2, 3, 0)
    ]  # fmt: skip
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_array_equal(outs[0], outs[3])
    assert _rel(outs[0], ref.expert_ffn(x[None], *wf)[0]) <= FFN_TOL


def test_ffn_bad_arguments():
    (gate, up, down), _ = _expert(np.random.default_rng(0), ops.QType.Q8_0, 64, 96)
    x, y = np.zeros((2, 64), np.float32), np.zeros((2, 64), np.float32)
    with pytest.raises(KernelError, match="down has"):
        ops.expert_ffn(y, x, gate, up, down[:-1], "q8_0", 64, 96)
    with pytest.raises(KernelError, match="need d_model=32"):
        ops.expert_ffn(y, x, gate, up, down, "q8_0", 32, 96)
    with pytest.raises(KernelError, match="scratch needs"):
        ops.expert_ffn(y, x, gate, up, down, "q8_0", 64, 96, scratch=np.zeros(10, np.float32))
    with pytest.raises(KernelError, match="row_weight must have 2"):
        ops.expert_ffn(y, x, gate, up, down, "q8_0", 64, 96, row_weight=np.ones(3, np.float32))
    with pytest.raises(KernelError, match="multiple of the block size"):
        ops.expert_ffn(y, x, gate, up, down, "q8_0", 64, 90)
    with pytest.raises(KeyError):
        ops.expert_ffn(y, x, gate, up, down, "q8_0", 64, 96, act="relu")
