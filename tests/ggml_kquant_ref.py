"""A numpy port of ggml's reference K-quant quantizers (ggml-quants.c: quantize_row_q4_K_ref,
quantize_row_q5_K_ref, quantize_row_q6_K_ref with make_qkx2_quants / make_qx_quants), written
independently of colibri's C port and vectorized over blocks, for the quantization-error tests.
gguf-py has no K-quant quantizer. Float32 arithmetic as ggml; numpy's pairwise sums may order
additions differently from C, so a few blocks can pick another candidate scale."""

from __future__ import annotations

import numpy as np

F32 = np.float32
QK_K = 256


def _nearest(v: np.ndarray) -> np.ndarray:
    return np.rint(v).astype(np.int32)  # ggml's nearest_int: round half to even


def _qkx2(x, w, nmax, rmin, rdelta, nstep):
    """make_qkx2_quants over groups x, w [N, n]: (scale [N], the_min [N], L [N, n])."""
    mn = np.minimum(x.min(1), F32(0))
    mx = x.max(1)
    sum_w = w.sum(1, dtype=F32)
    sum_x = (w * x).sum(1, dtype=F32)
    flat = mx == mn
    rng = np.where(flat, F32(1), mx - mn)
    iscale = F32(nmax) / rng
    scale = F32(1) / iscale
    L = np.clip(_nearest(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    diff = scale[:, None] * L + mn[:, None] - x
    best = (w * diff * diff).sum(1, dtype=F32)
    for step in range(nstep + 1):  # ggml updates min (and so max - min) as it goes
        rng = np.where(flat, F32(1), mx - mn)
        isc = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / rng
        La = np.clip(_nearest(isc[:, None] * (x - mn[:, None])), 0, nmax)
        Lf = La.astype(F32)
        sl = (w * Lf).sum(1, dtype=F32)
        sl2 = (w * Lf * Lf).sum(1, dtype=F32)
        sxl = (w * Lf * x).sum(1, dtype=F32)
        D = sum_w * sl2 - sl * sl
        with np.errstate(divide="ignore", invalid="ignore"):
            ts = (sum_w * sxl - sum_x * sl) / D
            tm = (sl2 * sum_x - sl * sxl) / D
            pos = tm > 0
            ts = np.where(pos, sxl / sl2, ts)
            tm = np.where(pos, F32(0), tm)
            d = ts[:, None] * Lf + tm[:, None] - x
            err = (w * d * d).sum(1, dtype=F32)
        upd = (D > 0) & (err < best) & ~flat
        L = np.where(upd[:, None], La, L)
        best = np.where(upd, err, best)
        scale = np.where(upd, ts, scale)
        mn = np.where(upd, tm, mn)
    scale = np.where(flat, F32(0), scale)
    L = np.where(flat[:, None], 0, L)
    return scale.astype(F32), (-mn).astype(F32), L


def _qx(x, nmax):
    """make_qx_quants(rmse_type=1, no weights) over groups x [N, n]: (scale [N], L [N, n])."""
    idx = np.abs(x).argmax(1)
    mx = x[np.arange(len(x)), idx]
    zero = np.abs(mx) < F32(1e-15)
    mx = np.where(zero, F32(1), mx)
    w = x * x

    def levels(isc):
        return np.clip(_nearest(isc[:, None] * x), -nmax, nmax - 1)

    iscale = F32(-nmax) / mx
    L = levels(iscale)
    Lf = L.astype(F32)
    sumlx = (w * x * Lf).sum(1, dtype=F32)
    suml2 = (w * Lf * Lf).sum(1, dtype=F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        isc = -(F32(nmax) + F32(0.1) * F32(step)) / mx
        La = levels(isc)
        Lf = La.astype(F32)
        slx = (w * x * Lf).sum(1, dtype=F32)
        sl2 = (w * Lf * Lf).sum(1, dtype=F32)
        upd = (sl2 > 0) & (slx * slx > best * sl2)
        with np.errstate(divide="ignore", invalid="ignore"):
            ns = slx / sl2
        L = np.where(upd[:, None], La, L)
        scale = np.where(upd, ns, scale)
        best = np.where(upd, ns * slx, best)
    return np.where(zero, F32(0), scale).astype(F32), np.where(zero[:, None], 0, L + nmax)


def quantize_k(x: np.ndarray, kind: str) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> dequantized float32 of ggml's reference
    quantizer for kind 'q4_k' / 'q5_k' / 'q6_k' (the values its blocks decode to)."""
    x = np.ascontiguousarray(x, F32)
    blocks = x.reshape(-1, QK_K)
    nb = len(blocks)
    f16 = np.float16
    if kind in ("q4_k", "q5_k"):
        nmax = 15 if kind == "q4_k" else 31
        rmin, nstep = (-1.0, 20) if kind == "q4_k" else (-0.5, 15)
        g = blocks.reshape(nb * 8, 32)
        av = np.sqrt((g * g).sum(1, dtype=F32) / F32(32))
        w = av[:, None] + np.abs(g)
        sc, mins, _ = _qkx2(g, w, nmax, rmin, 0.1, nstep)
        sc, mins = sc.reshape(nb, 8), mins.reshape(nb, 8)
        max_sc, max_mn = sc.max(1), mins.max(1)
        with np.errstate(divide="ignore"):
            inv_s = np.where(max_sc > 0, F32(63) / max_sc, F32(0))
            inv_m = np.where(max_mn > 0, F32(63) / max_mn, F32(0))
        ls = np.minimum(63, _nearest(inv_s[:, None] * sc).astype(np.uint8))
        lm = np.minimum(63, _nearest(inv_m[:, None] * mins).astype(np.uint8))
        d = (max_sc / F32(63)).astype(f16).astype(F32)
        dmin = (max_mn / F32(63)).astype(f16).astype(F32)
        dj = d[:, None] * ls.astype(F32)  # [nb, 8]
        dm = dmin[:, None] * lm.astype(F32)
        xs = blocks.reshape(nb, 8, 32)
        with np.errstate(divide="ignore", invalid="ignore"):
            L = np.clip(_nearest((xs + dm[..., None]) / dj[..., None]), 0, nmax)
        L = np.where((dj == 0)[..., None], 0, L)  # the level is irrelevant where d * sc = 0
        return (dj[..., None] * L.astype(F32) - dm[..., None]).reshape(x.shape)
    assert kind == "q6_k"
    g = blocks.reshape(nb * 16, 16)
    sc, _L = _qx(g, 32)
    sc = sc.reshape(nb, 16)
    idx = np.abs(sc).argmax(1)
    max_scale = sc[np.arange(nb), idx]
    zero = np.abs(max_scale) < F32(1e-15)
    max_scale = np.where(zero, F32(1), max_scale)
    iscale = F32(-128) / max_scale
    d = (F32(1) / iscale).astype(f16).astype(F32)
    q_sc = np.minimum(127, _nearest(iscale[:, None] * sc)).astype(np.int8).astype(F32)
    dj = d[:, None] * q_sc  # [nb, 16]
    xs = blocks.reshape(nb, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.clip(_nearest(xs / dj[..., None]), -32, 31)
    L = np.where((dj == 0)[..., None], 0, L)  # the level is irrelevant where d * sc = 0
    out = dj[..., None] * L.astype(F32)
    return np.where(zero[:, None, None], F32(0), out).reshape(x.shape)
