"""Attention kernel at every ISA level against the numpy reference (explicit mask), the scalar C
twin, torch's scaled_dot_product_attention and transformers' gpt-oss eager attention (sinks,
HF's own sliding-window mask functions)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.compute import ops, ref
from colibri.errors import KernelError

# Named tolerances: f32 accumulation over <= a few hundred keys vs float64 references.
ATTN_TOL = {"rtol": 1e-4, "atol": 2e-6}
SIMD_VS_SCALAR_TOL = {"rtol": 1e-4, "atol": 2e-6}
# logits of +-300 carry f32 rounding of ~2e-5 each, which exp turns into weight errors as large
LARGE_LOGIT_TOL = {"rtol": 1e-3, "atol": 1e-3}


def make(rng, n_q, n_ctx, n_heads, n_kv_heads, dk, dv, dtype, sinks=False):
    q = rng.standard_normal((n_q, n_heads, dk)).astype(np.float32)
    k = rng.standard_normal((n_ctx, n_kv_heads, dk)).astype(dtype)
    v = rng.standard_normal((n_ctx, n_kv_heads, dv)).astype(dtype)
    s = (rng.standard_normal(n_heads) * 2).astype(np.float32) if sinks else None
    return q, k, v, s


def run(q, k, v, n_kv, q_pos0, scale, window=0, sinks=None, nthreads=0):
    out = np.full((q.shape[0], q.shape[1], v.shape[2]), np.nan, np.float32)
    return ops.attention(out, q, k, v, n_kv, q_pos0, scale, window, sinks, nthreads)


# (n_q, n_kv, q_pos0): decode at 0 / mid cache, prefill from 0, chunked prefill
POSITIONS = [(1, 1, 0), (1, 77, 76), (13, 13, 0), (9, 70, 61), (40, 100, 60)]
# (n_heads, n_kv_heads, dk, dv): MHA, GQA, MQA, group > 8 heads (tiles split a group),
# MLA (dk 192, dv 128), odd sizes, head sizes > 256 (K/V rows read in place, not copied)
HEADS = [
    (4, 4, 64, 64),
    (8, 2, 40, 24),
    (6, 1, 7, 5),
    (20, 2, 32, 32),
    (4, 4, 192, 128),
    (2, 1, 288, 264),
]


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize(("n_q", "n_kv", "q_pos0"), POSITIONS)
@pytest.mark.parametrize(("n_heads", "n_kv_heads", "dk", "dv"), HEADS)
@pytest.mark.parametrize(("window", "sinks"), [(0, False), (0, True), (5, False), (33, True)])
def test_attention(isa, kv_dtype, n_q, n_kv, q_pos0, n_heads, n_kv_heads, dk, dv, window, sinks):
    rng = np.random.default_rng(n_q * 1000 + n_kv + dk)
    q, k, v, s = make(rng, n_q, n_kv + 3, n_heads, n_kv_heads, dk, dv, kv_dtype, sinks)
    scale = 1.0 / np.sqrt(dk)
    out = run(q, k, v, n_kv, q_pos0, scale, window, s)
    want = ref.attention(q, k, v, n_kv, q_pos0, scale, window, s)
    np.testing.assert_allclose(out, want, **ATTN_TOL)
    if isa != ops.ISA.SCALAR:
        ops.set_isa(ops.ISA.SCALAR)
        twin = run(q, k, v, n_kv, q_pos0, scale, window, s)
        np.testing.assert_allclose(out, twin, **SIMD_VS_SCALAR_TOL)


def test_window_one_sees_only_itself(isa):
    rng = np.random.default_rng(3)
    q, k, v, _ = make(rng, 5, 12, 4, 2, 16, 8, np.float32)
    out = run(q, k, v, 12, 7, 0.3, window=1)
    np.testing.assert_allclose(out, np.repeat(v[7:12], 2, axis=1), rtol=1e-6)


def test_sinks(isa):
    rng = np.random.default_rng(4)
    q, k, v, _ = make(rng, 3, 20, 4, 2, 16, 8, np.float16)
    plain = run(q, k, v, 20, 17, 0.25)
    np.testing.assert_array_equal(
        run(q, k, v, 20, 17, 0.25, sinks=np.full(4, -np.inf, np.float32)), plain
    )
    # a dominant sink takes almost all probability mass: the output shrinks towards 0
    big = run(q, k, v, 20, 17, 0.25, sinks=np.full(4, 40.0, np.float32))
    assert np.abs(big).max() < 1e-10
    # a sink of logit c scales the output by Z / (Z + e^c), Z = sum of the key weights
    logits = np.einsum("qhd,khd->qhk", q.astype(np.float64), np.repeat(k[:20], 2, 1)) * 0.25
    qpos = 17 + np.arange(3)[:, None, None]
    z = np.where(np.arange(20)[None, None] <= qpos, np.exp(logits), 0).sum(-1)
    got = run(q, k, v, 20, 17, 0.25, sinks=np.zeros(4, np.float32))
    np.testing.assert_allclose(got, plain * (z / (z + 1.0))[..., None], **ATTN_TOL)


def test_large_logits_do_not_overflow(isa):
    rng = np.random.default_rng(5)
    q, k, v, _ = make(rng, 4, 300, 4, 2, 64, 64, np.float32)
    out = run(q, k, v, 300, 296, 40.0)  # logits of order +-1e3: naive exp overflows
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref.attention(q, k, v, 300, 296, 40.0), **LARGE_LOGIT_TOL)


def test_threads_give_identical_results(isa):
    rng = np.random.default_rng(6)
    q, k, v, s = make(rng, 33, 200, 8, 2, 64, 64, np.float16, sinks=True)
    one = run(q, k, v, 200, 167, 0.125, 50, s, nthreads=1)
    np.testing.assert_array_equal(run(q, k, v, 200, 167, 0.125, 50, s, nthreads=2), one)
    np.testing.assert_array_equal(run(q, k, v, 200, 167, 0.125, 50, s, nthreads=0), one)


def test_prefill_equals_decode_steps(isa):
    rng = np.random.default_rng(7)
    q, k, v, _ = make(rng, 10, 10, 8, 4, 32, 32, np.float32)
    prefill = run(q, k, v, 10, 0, 0.2, window=4)
    for i in range(10):
        np.testing.assert_array_equal(
            run(q[i : i + 1], k, v, i + 1, i, 0.2, window=4)[0], prefill[i]
        )


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize(("window", "sinks"), [(0, False), (45, True)])
# groups of 4 query heads (one decode row: the in-place K/V micro-kernels on AVX-512), with
# head sizes that are and are not multiples of the vector width, 6 and 1
@pytest.mark.parametrize(
    ("n_heads", "n_kv_heads", "dk"), [(8, 2, 64), (8, 2, 40), (32, 8, 128), (6, 1, 40), (3, 3, 24)]
)
def test_rows_identical_in_any_chunking(isa, kv_dtype, window, sinks, n_heads, n_kv_heads, dk):
    """A query row's output bits do not depend on which rows share its call (batch invariance
    over many 32-key blocks and tile shapes): one prefill of 150 rows, the same rows in chunks
    of 1, 7 and 64, and one row alone at each of several positions."""
    rng = np.random.default_rng(11)
    n = 150
    q, k, v, s = make(rng, n, n, n_heads, n_kv_heads, dk, dk, kv_dtype, sinks)
    whole = run(q, k, v, n, 0, 0.15, window, s)
    np.testing.assert_allclose(whole, ref.attention(q, k, v, n, 0, 0.15, window, s), **ATTN_TOL)
    for chunk in (1, 7, 64):
        for p0 in range(0, n, chunk):
            p1 = min(n, p0 + chunk)
            part = run(q[p0:p1], k, v, p1, p0, 0.15, window, s)
            np.testing.assert_array_equal(part, whole[p0:p1], err_msg=f"chunk {chunk} at {p0}")


def test_mixtral_shape_long_prefill(isa):
    """Mixtral's heads (32 query heads over 8 KV heads of 128) over 600 positions, a prefill
    continuing a cached prefix, on two threads: the numpy reference within ATTN_TOL."""
    rng = np.random.default_rng(12)
    q, k, v, _ = make(rng, 344, 600, 32, 8, 128, 128, np.float32)
    got = run(q, k, v, 600, 256, 128**-0.5, nthreads=2)
    np.testing.assert_allclose(got, ref.attention(q, k, v, 600, 256, 128**-0.5), **ATTN_TOL)


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("window", [0, 6])
def test_matches_torch_sdpa(kv_dtype, window):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    rng = np.random.default_rng(8)
    n_q, n_kv, q_pos0, n_heads, n_kv_heads, d = 16, 40, 24, 8, 2, 64
    q, k, v, _ = make(rng, n_q, n_kv, n_heads, n_kv_heads, d, d, kv_dtype)
    qpos = q_pos0 + torch.arange(n_q)[:, None]
    kpos = torch.arange(n_kv)[None, :]
    mask = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    t = lambda a: torch.from_numpy(a.astype(np.float32)).transpose(0, 1)[None]  # noqa: E731
    want = F.scaled_dot_product_attention(
        t(q), t(k), t(v), attn_mask=mask, scale=0.125, enable_gqa=True
    )
    want = want[0].transpose(0, 1).numpy()
    np.testing.assert_allclose(run(q, k, v, n_kv, q_pos0, 0.125, window), want, **ATTN_TOL)


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("window", [0, 1, 7])
def test_matches_hf_gpt_oss(kv_dtype, window):
    """Sinks and sliding window exactly as transformers' gpt-oss: its eager_attention_forward
    with the mask built by HF's own mask functions (sliding_window_overlay: kv > q - window)."""
    import types

    import torch
    from transformers.masking_utils import (
        causal_mask_function,
        sliding_window_causal_mask_function,
    )
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.set_num_threads(1)
    rng = np.random.default_rng(9)
    n_q, n_kv, q_pos0, n_heads, n_kv_heads, dk, dv = 12, 30, 18, 8, 2, 64, 64
    q, k, v, s = make(rng, n_q, n_kv, n_heads, n_kv_heads, dk, dv, kv_dtype, sinks=True)
    fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
    b, h = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)
    allowed = torch.tensor(
        [
            [bool(fn(b, h, torch.tensor(q_pos0 + i), torch.tensor(j))) for j in range(n_kv)]
            for i in range(n_q)
        ]
    )
    mask = torch.zeros(n_q, n_kv).masked_fill(~allowed, float("-inf"))[None, None]
    module = types.SimpleNamespace(
        num_key_value_groups=n_heads // n_kv_heads, sinks=torch.from_numpy(s), training=False
    )
    t = lambda a: torch.from_numpy(a.astype(np.float32)).transpose(0, 1)[None]  # noqa: E731
    want, _ = eager_attention_forward(module, t(q), t(k), t(v), mask, scaling=0.125)
    want = want[0].numpy()  # eager returns [batch, n_q, n_heads, dv]
    np.testing.assert_allclose(run(q, k, v, n_kv, q_pos0, 0.125, window, s), want, **ATTN_TOL)


def test_rejects_bad_arguments():
    rng = np.random.default_rng(10)
    q, k, v, _ = make(rng, 2, 8, 4, 2, 16, 8, np.float32)
    out = np.empty((2, 4, 8), np.float32)
    with pytest.raises(KernelError, match="one dtype"):
        ops.attention(out, q, k, v.astype(np.float16), 8, 6, 0.25)
    with pytest.raises(KernelError, match="need n_kv >= 8"):
        ops.attention(out, q, k, v, 7, 6, 0.25)
    with pytest.raises(KernelError, match=r"n_kv=9 must be in \[0, cache length 8\]"):
        ops.attention(out, q, k, v, 9, 6, 0.25)
    with pytest.raises(KernelError, match="not a multiple"):
        ops.attention(out, q[:, :3].copy(), k, v, 8, 6, 0.25)
    with pytest.raises(KernelError, match="out has shape"):
        ops.attention(np.empty((2, 4, 16), np.float32), q, k, v, 8, 6, 0.25)
    with pytest.raises(KernelError, match="head size"):
        ops.attention(out, q[..., :8].copy(), k, v, 8, 6, 0.25)
    with pytest.raises(KernelError, match="float32 or float16"):
        ops.attention(out, q, k.astype(np.float64), v.astype(np.float64), 8, 6, 0.25)
    with pytest.raises(KernelError, match="sinks has shape"):
        ops.attention(out, q, k, v, 8, 6, 0.25, sinks=np.zeros(2, np.float32))
    with pytest.raises(KernelError, match="window"):
        ops.attention(out, q, k, v, 8, 6, 0.25, window=-1)
    buf = np.zeros(192, np.float32)
    with pytest.raises(KernelError, match="overlaps q"):
        ops.attention(buf[:64].reshape(2, 4, 8), buf[32:160].reshape(2, 4, 16), k, v, 8, 6, 0.25)
    with pytest.raises(KernelError, match="C-contiguous"):
        ops.attention(out, q, k[::2], v[::2], 4, 2, 0.25)
