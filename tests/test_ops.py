"""Small kernels (RMSNorm, RoPE, softmax, top-k, SiLU, GELU) at every ISA level against the
numpy references in colibri.compute.ref, against the scalar C twin, and against torch /
transformers where they define the semantics."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.compute import ops, ref
from colibri.errors import KernelError

# Named tolerances (f32 kernels vs float64 numpy references).
RMSNORM_TOL = {"rtol": 2e-6, "atol": 1e-6}
ROPE_TOL = {"rtol": 1e-5, "atol": 2e-6}  # cos/sin of the same f32 angle; f32 rotation
SOFTMAX_TOL = {"rtol": 2e-6, "atol": 1e-9}
ACT_TOL = {"rtol": 2e-6, "atol": 1e-6}  # |x| <= 100; atol covers tanhf's 1 + tanh cancellation
SIMD_VS_SCALAR_TOL = {"rtol": 2e-6, "atol": 1e-6}


def scalar(fn, *args):
    """fn(*args) computed by the scalar C twins (the level is restored afterwards)."""
    prev = ops.isa()
    ops.set_isa(ops.ISA.SCALAR)
    try:
        return fn(*args)
    finally:
        ops.set_isa(prev)


def rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---- RMSNorm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 5, 8, 16, 17, 33, 100, 4099])
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("with_w", [True, False])
def test_rmsnorm(isa, d, n, with_w):
    rng = np.random.default_rng(d * 10 + n)
    x = rand(rng, n, d, scale=3.0)
    w = rand(rng, d) if with_w else None
    out = ops.rmsnorm(np.empty_like(x), x, w, 1e-5)
    np.testing.assert_allclose(out, ref.rmsnorm(x, w, 1e-5), **RMSNORM_TOL)
    twin = scalar(lambda: ops.rmsnorm(np.empty_like(x), x, w, 1e-5))
    np.testing.assert_allclose(out, twin, **SIMD_VS_SCALAR_TOL)
    inplace = x.copy()
    ops.rmsnorm(inplace, inplace, w, 1e-5)  # y may alias x
    np.testing.assert_array_equal(inplace, out)


def test_rmsnorm_eps_inside_sqrt(isa):
    # all-zero row: 0 / sqrt(0 + eps) = 0, never NaN; tiny row: eps dominates
    x = np.zeros((2, 24), np.float32)
    x[1] = 1e-4
    out = ops.rmsnorm(np.empty_like(x), x, None, 1e-2)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_allclose(out[1], 1e-4 / np.sqrt(1e-8 + 1e-2), rtol=1e-6)


def test_rmsnorm_matches_hf():
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.set_num_threads(1)
    rng = np.random.default_rng(1)
    x, w = rand(rng, 3, 96, scale=2.0), rand(rng, 96)
    norm = LlamaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        want = norm(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ops.rmsnorm(np.empty_like(x), x, w, 1e-6), want, **RMSNORM_TOL)


def test_rmsnorm_rejects_bad_arguments():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(KernelError, match="float32"):
        ops.rmsnorm(np.empty_like(x), x.astype(np.float64), None, 1e-6)
    with pytest.raises(KernelError, match="w has shape"):
        ops.rmsnorm(np.empty_like(x), x, np.ones(7, np.float32), 1e-6)
    with pytest.raises(KernelError, match="out has shape"):
        ops.rmsnorm(np.empty((2, 9), np.float32), x, None, 1e-6)
    with pytest.raises(KernelError, match="C-contiguous"):
        ops.rmsnorm(np.empty((8, 2), np.float32).T, x, None, 1e-6)
    with pytest.raises(KernelError, match=r"eps=-1\.0"):
        ops.rmsnorm(np.empty_like(x), x, None, -1.0)


# ---- RoPE -------------------------------------------------------------------------------------


def inv_freq(rot_dim: int, theta: float = 10000.0) -> np.ndarray:
    return (1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float32) / rot_dim)).astype(
        np.float32
    )


# (head_dim, rot_dim): full, partial, odd half sizes, half > 64 (the cos/sin chunk size)
ROPE_SHAPES = [(8, 8), (64, 64), (64, 32), (20, 12), (6, 2), (256, 256), (160, 130)]


@pytest.mark.parametrize("mode", ["neox", "interleaved"])
@pytest.mark.parametrize(("head_dim", "rot_dim"), ROPE_SHAPES)
@pytest.mark.parametrize("mscale", [1.0, 1.37])
def test_rope(isa, mode, head_dim, rot_dim, mscale):
    rng = np.random.default_rng(head_dim + rot_dim)
    x = rand(rng, 5, 3, head_dim)
    pos = np.array([0, 1, 7, 4095, 131071], np.int32)
    freqs = inv_freq(rot_dim, 1e6 if head_dim > 100 else 1e4)
    out = ops.rope(x.copy(), pos, freqs, rot_dim, mscale, mode)
    np.testing.assert_allclose(out, ref.rope(x, pos, freqs, rot_dim, mscale, mode), **ROPE_TOL)
    np.testing.assert_array_equal(out[..., rot_dim:], x[..., rot_dim:])  # pass-through dims
    # position 0: cos = mscale, sin = 0 exactly
    np.testing.assert_array_equal(out[0, :, :rot_dim], x[0, :, :rot_dim] * np.float32(mscale))
    twin = scalar(lambda: ops.rope(x.copy(), pos, freqs, rot_dim, mscale, mode))
    np.testing.assert_allclose(out, twin, **SIMD_VS_SCALAR_TOL)


@pytest.mark.parametrize(
    ("mode", "head_dim", "rot_dim", "hf_module"),
    [
        ("neox", 64, 64, "llama"),  # rotate_half
        ("neox", 64, 32, "glm4_moe"),  # rotate_half on a partial rotary part
        ("interleaved", 64, 32, "glm"),  # pairs (2i, 2i+1), partial
    ],
)
def test_rope_matches_hf(mode, head_dim, rot_dim, hf_module):
    import importlib

    import torch

    torch.set_num_threads(1)
    apply = importlib.import_module(
        f"transformers.models.{hf_module}.modeling_{hf_module}"
    ).apply_rotary_pos_emb
    rng = np.random.default_rng(2)
    n_tokens, n_heads = 6, 4
    x = rand(rng, n_tokens, n_heads, head_dim)
    pos = np.array([0, 3, 17, 100, 2047, 9000], np.int32)
    freqs = inv_freq(rot_dim)
    mscale = 1.25
    # HF's rotary embedding: f32 angles, cos/sin of cat(freqs, freqs) times attention_scaling
    ang = torch.from_numpy(pos).float()[:, None] @ torch.from_numpy(freqs)[None, :]
    emb = torch.cat((ang, ang), dim=-1)[None]  # [1, n_tokens, rot_dim]
    cos, sin = emb.cos() * mscale, emb.sin() * mscale
    qt = torch.from_numpy(x).transpose(0, 1)[None]  # [1, n_heads, n_tokens, head_dim]
    want, _ = apply(qt, qt, cos, sin)
    want = want[0].transpose(0, 1).numpy()
    got = ops.rope(x.copy(), pos, freqs, rot_dim, mscale, mode)
    np.testing.assert_allclose(got, want, **ROPE_TOL)


def test_rope_rejects_bad_arguments():
    x = np.zeros((2, 1, 8), np.float32)
    pos = np.zeros(2, np.int32)
    with pytest.raises(KernelError, match="rot_dim 7"):
        ops.rope(x, pos, inv_freq(8)[:3], rot_dim=7)
    with pytest.raises(KernelError, match="rot_dim 10"):
        ops.rope(x, pos, inv_freq(10), rot_dim=10)
    with pytest.raises(KernelError, match="inv_freq has shape"):
        ops.rope(x, pos, inv_freq(6))
    with pytest.raises(KernelError, match="int32"):
        ops.rope(x, pos.astype(np.int64), inv_freq(8))
    with pytest.raises(KernelError, match="pos has shape"):
        ops.rope(x, np.zeros(3, np.int32), inv_freq(8))
    with pytest.raises(KernelError, match="mode"):
        ops.rope(x, pos, inv_freq(8), mode="gptj")
    with pytest.raises(KernelError, match="3 dimensions"):
        ops.rope(x[0], pos, inv_freq(8))


# ---- softmax ----------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 3, 8, 17, 256, 1001])
@pytest.mark.parametrize("spread", [1.0, 30.0, 1e4])
def test_softmax(isa, d, spread):
    rng = np.random.default_rng(d)
    x = rand(rng, 3, d, scale=spread)
    out = ops.softmax(x.copy())
    np.testing.assert_allclose(out, ref.softmax(x), **SOFTMAX_TOL)
    np.testing.assert_allclose(out.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(out, scalar(lambda: ops.softmax(x.copy())), **SIMD_VS_SCALAR_TOL)


def test_softmax_masked_entries(isa):
    x = np.array([[0.5, -np.inf, 2.0, -np.inf, -1.0, 3.0, 0.0, -np.inf, 1.0]], np.float32)
    out = ops.softmax(x.copy())
    np.testing.assert_array_equal(out[0, np.isinf(x[0])], 0.0)
    np.testing.assert_allclose(out, ref.softmax(x), **SOFTMAX_TOL)


def test_softmax_rejects_read_only():
    x = np.ones((2, 4), np.float32)
    x.flags.writeable = False
    with pytest.raises(KernelError, match="writable"):
        ops.softmax(x)


# ---- log-sum-exp -------------------------------------------------------------------------------

LSE_ATOL = 1e-6  # nats: f32 exps (about 1 ulp) of max-shifted values, their sums in f64


def lse_ref(x: np.ndarray) -> np.ndarray:
    """float64 log-sum-exp over the last axis, computed in float64 throughout."""
    xd = x.astype(np.float64)
    m = xd.max(-1, keepdims=True)
    return (m + np.log(np.exp(xd - m).sum(-1, keepdims=True)))[..., 0]


@pytest.mark.parametrize("d", [1, 3, 17, 255, 256, 257, 1001, 50304])
@pytest.mark.parametrize("spread", [1.0, 30.0])
def test_logsumexp(isa, d, spread):
    rng = np.random.default_rng(d)
    n = 3 if d > 5000 else 70  # 70 rows: several chunks, both threads
    x = rand(rng, n, d, scale=spread)
    got = ops.logsumexp(x)
    assert got.dtype == np.float64 and got.shape == (n,)
    np.testing.assert_allclose(got, lse_ref(x), rtol=0, atol=LSE_ATOL)
    np.testing.assert_allclose(got, scalar(ops.logsumexp, x), rtol=0, atol=LSE_ATOL)
    np.testing.assert_array_equal(ops.logsumexp(x, nthreads=1), got)  # rows independent
    np.testing.assert_array_equal(ops.logsumexp(x[1:2]), got[1:2])


def test_logsumexp_matches_torch(isa):
    torch = pytest.importorskip("torch")
    x = rand(np.random.default_rng(5), 2, 4, 999, scale=8.0)
    want = torch.logsumexp(torch.from_numpy(x).double(), dim=-1).numpy()
    np.testing.assert_allclose(ops.logsumexp(x), want, rtol=0, atol=LSE_ATOL)


def test_logsumexp_masked_entries_and_bad_arguments(isa):
    x = np.array([[0.5, -np.inf, 2.0, -np.inf, 3.0], [-np.inf] * 5], np.float32)
    got = ops.logsumexp(x)
    np.testing.assert_allclose(got[0], lse_ref(x[:1, [0, 2, 4]])[0], rtol=0, atol=LSE_ATOL)
    assert np.isnan(got[1])  # an all -inf row, as softmax
    with pytest.raises(KernelError, match="float32"):
        ops.logsumexp(x.astype(np.float64))
    with pytest.raises(KernelError, match="non-empty last axis"):
        ops.logsumexp(np.zeros((2, 0), np.float32))


# ---- top-k ------------------------------------------------------------------------------------
# Scalar at every level (see clb_topk); run once.


def test_topk_ties_go_to_lowest_index():
    x = np.array([[1.0, 3.0, 3.0, 2.0, 3.0, 2.0], [0.0, -0.0, 0.0, -1.0, -0.0, 5.0]], np.float32)
    idx, val = ops.topk(x, 4)
    np.testing.assert_array_equal(idx, [[1, 2, 4, 3], [5, 0, 1, 2]])
    np.testing.assert_array_equal(val, [[3, 3, 3, 2], [5, 0, 0, 0]])


@pytest.mark.parametrize(("d", "k"), [(1, 1), (8, 2), (64, 6), (256, 8), (256, 256), (160, 0)])
def test_topk_against_stable_sort(d, k):
    rng = np.random.default_rng(d + k)
    x = rng.integers(-4, 5, size=(50, d)).astype(np.float32)  # many ties
    x[0, : d // 2] = np.nan
    x[1] = rand(rng, d)
    idx, val = ops.topk(x, k)
    want_idx, want_val = ref.topk(x, k)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(val, want_val)


def test_topk_writes_into_given_outputs():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)[..., ::-1].copy()
    idx, val = np.full((2, 3, 2), -1, np.int32), np.zeros((2, 3, 2), np.float32)
    got_idx, got_val = ops.topk(x, 2, idx, val)
    assert got_idx is idx and got_val is val
    np.testing.assert_array_equal(idx, np.broadcast_to([0, 1], (2, 3, 2)))
    np.testing.assert_array_equal(val, x[..., :2])


def test_topk_rejects_bad_arguments():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(KernelError, match="k=5"):
        ops.topk(x, 5)
    with pytest.raises(KernelError, match="int32"):
        ops.topk(x, 2, idx_out=np.zeros((2, 2), np.int64))
    with pytest.raises(KernelError, match="must be"):
        ops.topk(x, 2, val_out=np.zeros((2, 3), np.float32))


# ---- SiLU, GELU -------------------------------------------------------------------------------


def act_inputs(n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    x = rand(rng, n, scale=6.0)
    edge = np.array([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0])
    x[: min(n, edge.size)] = edge[: min(n, edge.size)]
    return x


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 16, 33, 1000])
@pytest.mark.parametrize("name", ["silu", "gelu"])
def test_activation(isa, name, n):
    x = act_inputs(n)
    fn = getattr(ops, name)
    out = fn(np.empty_like(x), x)
    np.testing.assert_allclose(out, getattr(ref, name)(x), **ACT_TOL)
    np.testing.assert_allclose(out, scalar(lambda: fn(np.empty_like(x), x)), **SIMD_VS_SCALAR_TOL)
    inplace = x.copy()
    np.testing.assert_array_equal(fn(inplace, inplace), out)


def test_activations_match_torch(isa):
    import torch

    torch.set_num_threads(1)
    x = act_inputs(4099).reshape(1, 4099)
    xt = torch.from_numpy(x)
    silu = ops.silu(np.empty_like(x), x)
    gelu = ops.gelu(np.empty_like(x), x)
    np.testing.assert_allclose(silu, torch.nn.functional.silu(xt).numpy(), **ACT_TOL)
    want = torch.nn.functional.gelu(xt, approximate="tanh").numpy()
    np.testing.assert_allclose(gelu, want, **ACT_TOL)


def test_activation_rejects_mismatched_shapes():
    with pytest.raises(KernelError, match="out has shape"):
        ops.silu(np.empty(4, np.float32), np.ones(5, np.float32))
    with pytest.raises(KernelError, match="float32"):
        ops.gelu(np.empty(4, np.float32), np.ones(4, np.float16))
