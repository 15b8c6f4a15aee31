"""DeepSeek-V4's own math (transformers 5.24 models/deepseek_v4 is the reference): the
hyper-connection mixing, the KV compressors, the lightning indexer's selection over compressed
entries, shared-KV attention over window + compressed entries, the grouped output projection.

Pure functions of f32 arrays; projections arrive as callables (model.Linear) so every matmul
runs in the storage type's kernel. Model (colibri/model.py) owns the weights and the
per-sequence state (model.KVCache); the formulas are documented on models.spec's
HyperConnectionSpec, SharedKVSpec and CompressorSpec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from colibri.compute import ops

if TYPE_CHECKING:
    from colibri.models.spec import AttentionSpec, CompressorSpec, HyperConnectionSpec

Proj = Callable[[np.ndarray], np.ndarray]  # f32 [n, in] -> f32 [n, out]


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return (np.float32(1.0) / (np.float32(1.0) + np.exp(-z))).astype(np.float32)


def rope_tail(t: np.ndarray, pos: np.ndarray, a: AttentionSpec, inverse: bool = False) -> None:
    """Rotate the trailing a.rot_dim dims of every head of t f32 [n, heads, dim] in place,
    interleaved pairs, token s at position pos[s] (int32 [n]); inverse: by minus the angle
    (cos, -sin, as the reference's de-rotation of the attention output: the odd lanes are
    negated before and after the rotation, which is exactly that)."""
    r = a.rot_dim
    tail = np.ascontiguousarray(t[..., -r:])
    if inverse:
        tail[..., 1::2] *= -1
    ops.rope(tail, pos, a.inv_freq, rot_dim=r, mscale=a.mscale, mode="interleaved")
    if inverse:
        tail[..., 1::2] *= -1
    t[..., -r:] = tail


def hc_weights(
    x: np.ndarray, fn: Proj, base: np.ndarray, scale: np.ndarray, hc: HyperConnectionSpec,
    eps: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """(pre f32 [n, N], post f32 [n, N], comb f32 [n, N, N]) of one hyper-connection
    (DeepseekV4HyperConnection) for the streams x f32 [n, N, d]; fn is its `fn` projection,
    base [(2 + N) N], scale [3]; eps = rms_norm_eps (the input norm), hc.hc_eps the floors."""
    n, N = x.shape[0], hc.hc_mult
    flat = np.empty((n, x.shape[1] * x.shape[2]), dtype=np.float32)
    ops.rmsnorm(flat, np.ascontiguousarray(x.reshape(n, -1)), None, eps)
    mixes = fn(flat)
    e = np.float32(hc.hc_eps)
    pre = _sigmoid(mixes[:, :N] * scale[0] + base[:N]) + e
    post = np.float32(2.0) * _sigmoid(mixes[:, N : 2 * N] * scale[1] + base[N : 2 * N])
    logits = (mixes[:, 2 * N :] * scale[2] + base[2 * N :]).reshape(n, N, N)
    comb = np.exp(logits - logits.max(axis=-1, keepdims=True)).astype(np.float32)
    comb = comb / comb.sum(axis=-1, keepdims=True) + e
    comb = comb / (comb.sum(axis=-2, keepdims=True) + e)  # Sinkhorn-Knopp
    for _ in range(hc.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + e)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + e)
    return pre, post, comb.astype(np.float32)


def hc_collapse(x: np.ndarray, pre: np.ndarray) -> np.ndarray:
    """sum_j pre[:, j] * x[:, j]: streams x f32 [n, N, d] -> f32 [n, d]."""
    out = pre[:, 0, None] * x[:, 0]
    for j in range(1, x.shape[1]):  # N axpys: numpy's reduction over a short axis is slow
        out += pre[:, j, None] * x[:, j]
    return out


def hc_expand(x: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> None:
    """x[:, k] = post[:, k] * y + sum_j comb[:, j, k] * x[:, j], in place (x f32 [n, N, d],
    the block output y f32 [n, d])."""
    old = x.copy()
    for k in range(x.shape[1]):  # N * N axpys (a batched [N, N] @ [N, d] matmul is slower)
        acc = post[:, k, None] * y
        for j in range(x.shape[1]):
            acc += comb[:, j, k, None] * old[:, j]
        x[:, k] = acc


def hc_head(
    x: np.ndarray, fn: Proj, base: np.ndarray, scale: np.ndarray, hc: HyperConnectionSpec,
    eps: float,
) -> np.ndarray:  # fmt: skip
    """The final collapse (DeepseekV4HyperHead): streams x f32 [n, N, d] -> f32 [n, d]."""
    n = x.shape[0]
    flat = np.empty((n, x.shape[1] * x.shape[2]), dtype=np.float32)
    ops.rmsnorm(flat, np.ascontiguousarray(x.reshape(n, -1)), None, eps)
    pre = _sigmoid(fn(flat) * scale[0] + base) + np.float32(hc.hc_eps)
    return hc_collapse(x, pre)


def compress(
    c: CompressorSpec,
    kvx: np.ndarray,
    gx: np.ndarray,
    ape: np.ndarray,
    norm_w: np.ndarray,
    eps: float,
    buf: np.ndarray,
    entries: np.ndarray,
    pos0: int,
    a: AttentionSpec,
) -> None:
    """Feed positions pos0 .. pos0 + n - 1 to a compressor (DeepseekV4HCACompressor /
    CSACompressor / the indexer's) and write each window they close as an entry.

    kvx, gx: f32 [n, width] (wkv / wgate outputs, width = head_dim, or 2 * head_dim with
    overlap); ape f32 [compress_rate, width]; norm_w f32 [head_dim]. buf f32 [2, 2,
    compress_rate, width]: the raw (kv, gate + ape) rows of the last two windows by window
    parity (the per-sequence state); entries f32 [>= windows, head_dim]: entry w, RMSNorm'd and
    rotated (trailing rot_dim dims, position w * compress_rate), is written at row w."""
    m, D = c.compress_rate, c.head_dim
    n, width = kvx.shape
    end = pos0 + n
    # every window the chunk closes at once: the timeline from the start of the previous
    # window of pos0's (its raw rows still in buf) to the end of the last closed window
    w_lo, w_hi = pos0 // m, end // m  # windows w_lo .. w_hi - 1 close
    if w_hi > w_lo:
        first = max(0, (w_lo - 1) * m if c.overlap else w_lo * m)
        k_all = np.empty((w_hi * m - first, width), np.float32)
        g_all = np.empty_like(k_all)
        old = np.arange(first, pos0)  # rows fed before this chunk: from the window buffers
        k_all[: len(old)] = buf[0, (old // m) % 2, old % m]
        g_all[: len(old)] = buf[1, (old // m) % 2, old % m]
        new = np.arange(pos0, w_hi * m)
        k_all[len(old) :] = kvx[: len(new)]
        g_all[len(old) :] = gx[: len(new)] + ape[new % m]
        k_all = k_all.reshape(-1, m, width)  # [windows from first // m, m, width]
        g_all = g_all.reshape(-1, m, width)
        if not c.overlap:
            kv_w, g_w = k_all, g_all
        else:  # previous window's Ca half, this window's Cb half; window 0 has no Ca
            skip = w_lo - first // m  # 1: the timeline starts one window before w_lo
            cur_k, cur_g = k_all[skip:, :, D:], g_all[skip:, :, D:]
            prev_k, prev_g = k_all[:-1, :, :D], g_all[:-1, :, :D]
            if not skip:  # window 0 first: its Ca half gets softmax weight 0
                prev_k = np.concatenate([np.zeros((1, m, D), np.float32), prev_k])
                prev_g = np.concatenate([np.full((1, m, D), -np.inf, np.float32), prev_g])
            kv_w = np.concatenate([prev_k, cur_k], axis=1)
            g_w = np.concatenate([prev_g, cur_g], axis=1)
        z = np.exp(g_w - g_w.max(axis=1, keepdims=True)).astype(np.float32)
        z /= z.sum(axis=1, keepdims=True)
        rows = np.ascontiguousarray((kv_w * z).sum(axis=1, dtype=np.float32))
        ops.rmsnorm(rows, rows, norm_w, eps)
        wins = np.arange(w_lo, w_hi, dtype=np.int32)
        t = rows[:, None, :]
        rope_tail(t, wins * np.int32(m), a)
        entries[wins] = t[:, 0]
    # the raw rows of the last two windows stay in buf (by window parity), as token by token
    tail = np.arange(max(pos0, end - 2 * m), end)
    par, slot = (tail // m) % 2, tail % m
    buf[0, par, slot] = kvx[tail - pos0]
    buf[1, par, slot] = gx[tail - pos0] + ape[slot]


def select(
    iq: np.ndarray, weights: np.ndarray, keys: np.ndarray, pos0: int, compress_rate: int,
    index_topk: int, index_head_dim: int, nthreads: int = 0,
) -> list[np.ndarray]:  # fmt: skip
    """The lightning indexer's choice (DeepseekV4Indexer): for query s at position pos0 + s,
    the compressed entries it may see are w < (pos0 + s + 1) // compress_rate; all of them
    when there are at most index_topk, else the index_topk best by
    sum_h weights[s, h] relu(iq[s, h] . keys[w]) / sqrt(index_head_dim).
    iq f32 [n, heads, index_head_dim] (rotated), weights f32 [n, heads] (already scaled by
    heads**-0.5), keys f32 [>= entries, index_head_dim]. Returns per query int64 entry ids."""
    out = []
    for s in range(iq.shape[0]):
        c = (pos0 + s + 1) // compress_rate
        if c <= index_topk:
            out.append(np.arange(c))
            continue
        scores = np.empty((1, c), dtype=np.float32)
        ops.index_scores(
            scores, np.ascontiguousarray(iq[s : s + 1]), np.ascontiguousarray(weights[s : s + 1]),
            keys, n_kv=c, q_pos0=c - 1, scale=index_head_dim**-0.5, nthreads=nthreads,
        )  # fmt: skip
        out.append(np.sort(np.argpartition(-scores[0], index_topk - 1)[:index_topk]))
    return out


def attend(
    q: np.ndarray, rows: np.ndarray, base: int, entries: np.ndarray | None,
    chosen: list[np.ndarray] | None, pos0: int, a: AttentionSpec, sinks: np.ndarray,
    nthreads: int = 0,
) -> np.ndarray:  # fmt: skip
    """Shared-KV attention (DeepseekV4Attention's eager path) of queries q f32 [n, H, D] at
    positions pos0..: each attends, with the per-head sinks, to the K=V rows of the last
    a.window positions (rows f32 [m, 1, D] of positions base .. pos0 + n - 1) and the
    compressed entries chosen for it (chosen[s] ids into entries [E, D]; chosen None: every
    entry it may see, w < (pos + 1) // compress_rate; entries None: none).
    Returns f32 [n, H, D]."""
    n = q.shape[0]
    out = np.empty_like(q)
    v = a.shared_kv
    assert v is not None
    if entries is None:
        ops.attention(
            out, q, rows, rows, n_kv=len(rows), q_pos0=pos0 - base, scale=a.scale,
            window=a.window, sinks=sinks, nthreads=nthreads,
        )  # fmt: skip
        return out
    rate = v.compressor.compress_rate if v.compressor is not None else 1
    for s in range(n):
        p = pos0 + s
        lo = max(base, p - a.window + 1)
        ids = np.arange((p + 1) // rate) if chosen is None else chosen[s]
        keys = np.concatenate([rows[lo - base : p - base + 1, 0], entries[ids]])[:, None, :]
        keys = np.ascontiguousarray(keys, dtype=np.float32)
        k = keys.shape[0]
        ops.attention(
            out[s : s + 1], np.ascontiguousarray(q[s : s + 1]), keys, keys, n_kv=k,
            q_pos0=k - 1, scale=a.scale, sinks=sinks, nthreads=nthreads,
        )  # fmt: skip
    return out


def grouped_output(o: np.ndarray, o_a: tuple[Proj, ...], o_b: Proj) -> np.ndarray:
    """The grouped low-rank output projection: o f32 [n, H * D] split into len(o_a) groups,
    group g mapped by o_a[g], the concatenation by o_b. Returns f32 [n, d_model]."""
    n, g = o.shape[0], len(o_a)
    parts = o.reshape(n, g, -1)
    mid = np.concatenate([o_a[j](np.ascontiguousarray(parts[:, j])) for j in range(g)], axis=1)
    return o_b(mid)
