"""Rotary position embedding tables: inverse frequencies and the attention scaling factor.

Ports transformers' `modeling_rope_utils` (default, linear, llama3, yarn, proportional) to numpy, in
float32 like the reference, so angles match it bit for bit before cos/sin. The rotation itself
is the C kernel `ops.rope`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of a config.json in either spelling, as one dict.

    transformers 5 writes `rope_parameters` ({"rope_type", "rope_theta", ...}); hub files use
    `rope_theta` plus an optional `rope_scaling` ({"type" or "rope_type", "factor", ...}).
    Returns a dict with at least "rope_type" and "rope_theta".
    """
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in config and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = config["partial_rotary_factor"]
    return params


def inv_freq(
    params: dict[str, Any], dim: int, max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """Inverse frequencies f32[dim // 2] for `dim` rotated dims, and the cos/sin scale.

    Raises ValueError naming an unsupported `rope_type`.
    Sources: RoFormer (arXiv:2104.09864); linear position interpolation (arXiv:2306.15595);
    Llama 3.1 frequency scaling (Meta's reference `apply_scaling`); YaRN (arXiv:2309.00071),
    as implemented by transformers; "proportional" (Gemma 4,
    `_compute_proportional_rope_parameters`): `dim` is the whole head, of whose dim // 2
    angles the first int(partial_rotary_factor * dim // 2) rotate at the default frequencies
    of `dim` and the rest have frequency 0 (cos 1, sin 0: those pairs pass unrotated).
    """
    base = float(params["rope_theta"])
    kind = params["rope_type"]
    freq = np.float32(1.0) / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    freq = freq.astype(np.float32)
    if kind == "default":
        return freq, 1.0
    if kind == "linear":
        return (freq / np.float32(params["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_ctx = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / freq
        scaled = np.where(wavelen > low_wavelen, freq / factor, freq)
        with np.errstate(divide="ignore", invalid="ignore"):  # low == high (Llama 4 Scout)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if kind == "yarn":
        return _yarn(params, dim, base, max_position_embeddings)
    if kind == "proportional":  # Gemma 4: the first angles rotate, the rest stay (freq 0)
        angles = int(float(params.get("partial_rotary_factor", 1.0)) * dim // 2)
        out = np.zeros(dim // 2, dtype=np.float32)
        out[:angles] = freq[:angles]
        return (out / np.float32(params.get("factor", 1.0))).astype(np.float32), 1.0
    raise ValueError(f"config field rope_type: unsupported value {kind!r}")


def _yarn(params: dict[str, Any], dim: int, base: float, max_pos: int) -> tuple[np.ndarray, float]:
    old_ctx = params.get("original_max_position_embeddings") or max_pos
    factor = params.get("factor") or max_pos / old_ctx
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
    return freq.astype(np.float32), float(attention_factor)
