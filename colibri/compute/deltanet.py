"""Gated DeltaNet's sequence mixing (Qwen3-Next, Qwen3.5): the causal depthwise convolution
with its state, and the gated delta rule in its chunked form. The recurrent form is the C
kernel `ops.gated_delta_rule`; both carry the per-sequence state (model.KVCache) across calls.

Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule"
(arXiv:2412.06464), as transformers 5.24 implements it (modeling_qwen3_next.py:
causal_conv1d_fn / causal_conv1d_update, torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule, l2norm). All math f32, like the reference.
"""

from __future__ import annotations

import numpy as np

from colibri.compute import ops


def causal_conv1d(x: np.ndarray, state: np.ndarray, w: np.ndarray) -> np.ndarray:
    """silu(depthwise causal conv1d) over time, continuing from `state`.

    x: f32 [n, channels] (this call's inputs); state: f32 [kernel - 1, channels], the previous
    inputs, oldest first (zeros at the start of a sequence), replaced by the last kernel - 1
    inputs; w: f32 [channels, kernel] (conv1d.weight without its middle axis, no bias).
    Returns f32 [n, channels]: y[t, c] = silu(sum_j w[c, j] * x_ext[t + j, c]) with x_ext the
    state followed by x.
    """
    n, kernel = x.shape[0], w.shape[1]
    ext = np.concatenate([state, x])  # [kernel - 1 + n, channels]
    y = ext[:n] * w[:, 0]
    for j in range(1, kernel):
        y += ext[j : j + n] * w[:, j]
    state[:] = ext[n:]
    return ops.silu(y, y)


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x * rsqrt(sum(x**2, -1) + eps), f32 (transformers' / FLA's l2norm)."""
    ss = np.einsum("...i,...i->...", x, x, dtype=np.float32)
    return x * (np.float32(1.0) / np.sqrt(ss + np.float32(eps)))[..., None]


def chunk_gated_delta_rule(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
    chunk_size: int = 64,
) -> np.ndarray:
    """The gated delta rule in its chunked (WY) form; same arguments and result as the
    recurrent `ops.gated_delta_rule` (up to rounding), with state updated in place.

    q, k: f32 [n, n_k_heads, dk] (l2-normalised, q scaled by dk**-0.5); v: f32
    [n, n_heads, dv]; g, beta: f32 [n, n_heads]; state: f32 [n_heads, dk, dv].
    Within a chunk of chunk_size tokens the delta rule's updates are solved at once by
    forward substitution (the unit lower-triangular system of torch_chunk_gated_delta_rule);
    chunks then pass the state along. Returns f32 [n, n_heads, dv].
    """
    n, hk, _ = q.shape
    H, dv = v.shape[1:]
    if hk != H:
        q, k = np.repeat(q, H // hk, axis=1), np.repeat(k, H // hk, axis=1)
    C = chunk_size
    pad = (-n) % C
    N = (n + pad) // C

    def heads(x: np.ndarray) -> np.ndarray:  # [n, H, ...] -> [H, N, C, ...], zero-padded
        x = np.moveaxis(x, 1, 0)
        x = np.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return np.ascontiguousarray(x.reshape(H, N, C, *x.shape[2:]), dtype=np.float32)

    q, k, v, g, beta = heads(q), heads(k), heads(v), heads(g), heads(beta)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = np.cumsum(g, axis=-1, dtype=np.float32)  # [H, N, C]
    upper = np.triu(np.ones((C, C), dtype=bool), 1)
    diff = np.where(upper, -np.inf, cum[..., :, None] - cum[..., None, :])
    pair = np.exp(diff).astype(np.float32)  # decay from token j to i <= j's chunk-mate
    lower = np.tril(k_beta @ np.swapaxes(k, -1, -2) * pair, -1)  # strictly lower part
    intra = q @ np.swapaxes(k, -1, -2) * pair
    # (I + lower) X = [v_beta | k_beta * exp(cum)]: forward substitution, row by row
    rhs = np.concatenate([v_beta, k_beta * np.exp(cum)[..., None]], axis=-1)
    sol = np.empty_like(rhs)
    for i in range(C):
        sol[..., i, :] = rhs[..., i, :] - np.einsum(
            "...j,...jd->...d", lower[..., i, :i], sol[..., :i, :]
        )
    new_v, k_cumdecay = sol[..., :dv], sol[..., dv:]
    q_dec = q * np.exp(cum)[..., None]
    k_dec = k * np.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = np.exp(cum[..., -1])  # [H, N]
    out = np.empty((H, N, C, dv), dtype=np.float32)
    s = state
    for c in range(N):
        v_new = new_v[:, c] - k_cumdecay[:, c] @ s  # [H, C, dv]
        out[:, c] = q_dec[:, c] @ s + intra[:, c] @ v_new
        s = s * chunk_decay[:, c, None, None] + np.swapaxes(k_dec[:, c], -1, -2) @ v_new
    state[:] = s
    return np.ascontiguousarray(np.moveaxis(out.reshape(H, N * C, dv)[:, :n], 0, 1))
