"""numpy reference implementations of colibri's kernels (the oracles the C code is tested
against). Slow, obviously correct, float64 where it matters."""

from __future__ import annotations

import numpy as np

# ---- quantization, matmul, expert FFN
# The oracle for the storage formats is gguf-py (llama.cpp's own numpy implementation); these
# wrappers only add colibri's [rows, row_nbytes] byte layout.


FP8 = 200  # colibri's FP8 rows (not a GGML type): ops.QType.FP8
FP8_BLOCK = 128
# types gguf.quants.quantize implements: f32 f16 q4_0 q4_1 q5_0 q5_1 q8_0 bf16 mxfp4 (the
# K-quants and IQ4 types it only dequantizes)
GGUF_QUANTIZE = frozenset((0, 1, 2, 3, 6, 7, 8, 30, 39))


def quantize(x: np.ndarray, qtype: int) -> np.ndarray:
    """x float [..., cols] -> uint8 [..., row_nbytes] exactly as `gguf.quants.quantize` (for the
    types in GGUF_QUANTIZE; gguf raises NotImplementedError for the others)."""
    import gguf

    x = np.ascontiguousarray(x, dtype=np.float32)
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(qtype)))
    return np.ascontiguousarray(q).view(np.uint8).reshape(*x.shape[:-1], -1)


def dequantize(data: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 bytes of a tensor of `shape` -> float32 `shape` via `gguf.quants.dequantize`, or
    for FP8 rows `fp8_dequantize`."""
    import gguf

    if int(qtype) == FP8:
        return fp8_dequantize(data, shape)
    raw = np.frombuffer(memoryview(data).cast("B"), np.uint8).reshape(*shape[:-1], -1)
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype))).reshape(shape)


def e4m3_to_f32(b: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes (uint8) -> float32, by the format's definition: bias 7, exponent 0
    subnormal (m / 8 * 2^-6), S.1111.111 NaN, no infinities."""
    b = np.asarray(b, np.uint8)
    e = ((b >> 3) & 15).astype(np.int32)
    m = (b & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * np.exp2(e - 7.0))
    v = np.where((e == 15) & (b & 7 == 7), np.nan, v)
    return np.where(b & 0x80, -v, v).astype(np.float32)


def fp8_dequantize(data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """FP8 rows (docs/FORMAT.md: ceil(cols / 128) f32 scales, then cols e4m3fn bytes) of a
    tensor of `shape` -> float32: e4m3 value * its block's scale, as DeepSeek-V3's
    weight_dequant (w.float() * scale_inv)."""
    cols = shape[-1]
    ns = -(-cols // FP8_BLOCK)
    raw = np.frombuffer(memoryview(data).cast("B"), np.uint8).reshape(-1, 4 * ns + cols)
    scales = raw[:, : 4 * ns].copy().view(np.float32)
    vals = e4m3_to_f32(raw[:, 4 * ns :])
    return (vals * np.repeat(scales, FP8_BLOCK, axis=1)[:, :cols]).reshape(shape)


# (byte offset, kind) of the scale fields of each block type, which random test blocks set to
# sane values (kind "f16": a positive half in [1e-3, 5e-2]; "e8m0": an exponent near 2^0)
_SCALE_FIELDS = {
    6: [(0, "f16")],  # q5_0
    7: [(0, "f16"), (2, "f16")],  # q5_1 (d, m)
    10: [(80, "f16"), (82, "f16")],  # q2_k (d, dmin)
    11: [(108, "f16")],  # q3_k
    12: [(0, "f16"), (2, "f16")],  # q4_k
    13: [(0, "f16"), (2, "f16")],  # q5_k
    14: [(208, "f16")],  # q6_k
    20: [(0, "f16")],  # iq4_nl
    23: [(0, "f16")],  # iq4_xs
    39: [(0, "e8m0")],  # mxfp4
}


def random_blocks(rng: np.random.Generator, qtype: int, rows: int, cols: int) -> np.ndarray:
    """Random valid stored rows uint8 [rows, row_nbytes] of a block type: random bytes with the
    scale fields set to sane values (FP8: scales in [1e-3, 1e-1], e4m3 bytes without NaN)."""
    import gguf

    if int(qtype) == FP8:
        ns = -(-cols // FP8_BLOCK)
        sc = rng.uniform(1e-3, 1e-1, (rows, ns)).astype(np.float32).view(np.uint8)
        v = rng.integers(0, 255, (rows, cols), dtype=np.uint8)
        v[(v & 0x7F) == 0x7F] = 0x7E  # no NaN codes
        return np.concatenate([sc, v], axis=1)
    bs, tb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(qtype))]
    raw = rng.integers(0, 256, (rows, cols // bs, tb), dtype=np.uint8)
    for off, kind in _SCALE_FIELDS.get(int(qtype), []):
        if kind == "f16":
            h = rng.uniform(1e-3, 5e-2, raw.shape[:2]).astype(np.float16)
            raw[..., off : off + 2] = h.view(np.uint8).reshape(*raw.shape[:2], 2)
        else:
            raw[..., off] = rng.integers(120, 130, raw.shape[:2])
    return raw.reshape(rows, -1)


def weights(
    rng: np.random.Generator, qtype: int, rows: int, cols: int
) -> tuple[np.ndarray, np.ndarray]:
    """(stored bytes [rows, row_nbytes], dequantized float32 [rows, cols]) for kernel tests:
    gguf's quantizer on random rows of varied scale where gguf has one (GGUF_QUANTIZE), else
    random valid blocks (random_blocks); dequantized by gguf (FP8: fp8_dequantize)."""
    if int(qtype) in GGUF_QUANTIZE:
        w = rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2, (rows, 1))
        data = quantize(w.astype(np.float32), qtype)
    else:
        data = random_blocks(rng, qtype, rows, cols)
    return data, dequantize(data, qtype, (rows, cols))


def matmul(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x[n, cols] @ w[rows, cols]^T in float64 (w already dequantized)."""
    return x.astype(np.float64) @ w.astype(np.float64).T


def _act(g: np.ndarray, u: np.ndarray, act: int, alpha: float, limit: float) -> np.ndarray:
    if act == 0:  # SiLU (SwiGLU)
        return g / (1 + np.exp(-g)) * u
    if act == 1:  # GELU, tanh approximation (HF gelu_pytorch_tanh)
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
    if act == 3:  # DeepSeek-V4 (DeepseekV4Experts._apply_gate): clamp, then SwiGLU
        g = np.minimum(g, limit)
        return g / (1 + np.exp(-g)) * np.clip(u, -limit, limit)
    # gpt-oss (HF GptOssExperts): clamp, then (up + 1) * gate * sigmoid(alpha * gate)
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + 1) * g / (1 + np.exp(-alpha * g))


def expert_ffn(
    x: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    down: np.ndarray,
    act: int = 0,
    gate_bias: np.ndarray | None = None,
    up_bias: np.ndarray | None = None,
    down_bias: np.ndarray | None = None,
    row_weight: np.ndarray | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> np.ndarray:
    """row_weight * (down(act(gate x + bg, up x + bu)) + bd) in float64; x [n, d_model],
    gate/up [d_ff, d_model], down [d_model, d_ff] (dequantized)."""
    g = matmul(gate, x) + (0 if gate_bias is None else gate_bias)
    u = matmul(up, x) + (0 if up_bias is None else up_bias)
    o = matmul(down, _act(g, u, act, alpha, limit)) + (0 if down_bias is None else down_bias)
    return o if row_weight is None else o * row_weight.astype(np.float64)[:, None]


# ---- small ops and attention


def rmsnorm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """x / sqrt(mean(x**2, -1) + eps) * w over the last axis (HF LlamaRMSNorm); float32 out."""
    x64 = x.astype(np.float64)
    y = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (y if w is None else y * w.astype(np.float64)).astype(np.float32)


def rope(
    x: np.ndarray,
    pos: np.ndarray,
    inv_freq: np.ndarray,
    rot_dim: int | None = None,
    mscale: float = 1.0,
    mode: str = "neox",
) -> np.ndarray:
    """Rotary embedding of x [n_tokens, n_heads, head_dim] (returns a new array).

    The angle pos * inv_freq is rounded to float32 as in HF's rotary embedding; cos/sin and
    the rotation run in float64. neox: HF's rotate_half over the first rot_dim dims;
    interleaved: pairs (2i, 2i+1)."""
    head_dim = x.shape[-1]
    rot_dim = head_dim if rot_dim is None else rot_dim
    theta = (pos.astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]).astype(
        np.float64
    )
    cos = (np.cos(theta) * mscale)[:, None, :]  # [n_tokens, 1, rot_dim/2]
    sin = (np.sin(theta) * mscale)[:, None, :]
    y = x.astype(np.float64)
    if mode == "neox":
        a, b = y[..., : rot_dim // 2].copy(), y[..., rot_dim // 2 : rot_dim].copy()
        y[..., : rot_dim // 2] = a * cos - b * sin
        y[..., rot_dim // 2 : rot_dim] = b * cos + a * sin
    else:
        a, b = y[..., 0:rot_dim:2].copy(), y[..., 1:rot_dim:2].copy()
        y[..., 0:rot_dim:2] = a * cos - b * sin
        y[..., 1:rot_dim:2] = b * cos + a * sin
    return y.astype(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    """Max-subtracted softmax over the last axis, float64 math, float32 out."""
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(idx int32, val float32) of the k largest per row, descending, ties to the lowest
    index, NaN last: a stable argsort of -x."""
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :k].astype(np.int32)
    return idx, np.take_along_axis(x, idx, axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), float64 math, float32 out."""
    x64 = x.astype(np.float64)
    return (x64 / (1.0 + np.exp(-x64))).astype(np.float32)


def gelu(x: np.ndarray) -> np.ndarray:
    """gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), float32 out."""
    x64 = x.astype(np.float64)
    u = np.sqrt(2.0 / np.pi) * (x64 + 0.044715 * x64**3)
    return (0.5 * x64 * (1.0 + np.tanh(u))).astype(np.float32)


def attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    n_kv: int,
    q_pos0: int,
    scale: float,
    window: int = 0,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Causal GQA attention with an explicit mask (see ops.attention for the layouts).

    q [n_q, n_heads, dk]; caches [n_ctx, n_kv_heads, d]; returns float32 [n_q, n_heads, dv].
    Query i (position q_pos0 + i) sees key j iff j <= q_pos0 + i and, with a window,
    j > q_pos0 + i - window. A sink is an extra logit column whose probability is dropped."""
    n_q, n_heads, _ = q.shape
    group = n_heads // k_cache.shape[1]
    k = np.repeat(k_cache[:n_kv].astype(np.float64), group, axis=1)  # [n_kv, n_heads, dk]
    v = np.repeat(v_cache[:n_kv].astype(np.float64), group, axis=1)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) * scale  # [n_heads, n_q, n_kv]
    qpos = q_pos0 + np.arange(n_q)[:, None]
    kpos = np.arange(n_kv)[None, :]
    visible = kpos <= qpos
    if window > 0:
        visible &= kpos > qpos - window
    s = np.where(visible[None], s, -np.inf)
    if sinks is not None:
        sink_col = np.broadcast_to(sinks.astype(np.float64)[:, None, None], (n_heads, n_q, 1))
        s = np.concatenate([s, sink_col], axis=-1)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        p = p[..., :-1]
    return np.einsum("hqk,khd->qhd", p, v).astype(np.float32)


# ---- Gated DeltaNet


def gated_delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule token by token in float64 (oracle of ops.gated_delta_rule):
    q, k [n, n_k_heads, dk], v [n, n_heads, dv], g, beta [n, n_heads], state
    [n_heads, dk, dv]. Returns (out [n, n_heads, dv], final state), both float64."""
    n, hk, _ = q.shape
    hv = v.shape[1]
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape, dtype=np.float64)
    for t in range(n):
        for h in range(hv):
            kt, qt = k[t, h // (hv // hk)].astype(np.float64), q[t, h // (hv // hk)]
            s[h] *= np.exp(np.float64(g[t, h]))
            u = (v[t, h] - s[h].T @ kt) * beta[t, h]
            s[h] += np.outer(kt, u)
            out[t, h] = s[h].T @ qt.astype(np.float64)
    return out, s
