"""Routing: one implementation for every model family; the variants are data (RouterSpec).

route() turns router logits into (expert ids, weights). The pipeline uses it for the layer's
own choice and, with the next layer's router, for the prefetcher's prediction, so prediction
and choice can never disagree on how a family routes.

Variants (sources: the transformers reference implementations named below):
- softmax over all experts, top-k, optional renormalisation (Mixtral, Qwen2/3-MoE, OLMoE,
  DeepSeek-V2 with group-limited greedy and routed scaling);
- sigmoid scores, `e_score_correction_bias` added for choosing only, groups scored by the sum
  of their top-2, `topk_group` groups kept, renormalised, scaled by `routed_scaling_factor`
  (DeepSeek-V3, GLM-4.5; DeepseekV3MoE.route_tokens_to_experts);
- top-k on the logits, then softmax over the k (gpt-oss; GptOssTopKRouter);
- top-k on the logits, then sigmoid of each of the k (Llama 4; Llama4Router);
- sqrt(softplus) scores, otherwise as sigmoid without groups (DeepSeek-V4;
  DeepseekV4TopKRouter), and its hash layers, whose experts are given (`ids`: tid2eid of the
  token ids, DeepseekV4HashRouter) and only weighted by the scores.
- any of these with a learned per-expert scale multiplying the chosen weights (Gemma 4:
  softmax, top-k, renormalised, times `per_expert_scale[id]`; Gemma4TextRouter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from colibri.compute import ops


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """How a family turns router logits into expert choices (config names in comments)."""

    num_experts: int  # num_local_experts / num_experts / n_routed_experts
    top_k: int  # num_experts_per_tok
    scoring: Literal["softmax", "sigmoid", "topk_softmax", "topk_sigmoid", "sqrtsoftplus"] = (
        "softmax"
    )
    norm_topk_prob: bool = False  # renormalise the k weights to sum to 1
    n_group: int = 1  # n_group: experts split into groups for group-limited choice
    topk_group: int = 1  # topk_group: groups kept
    group_score: Literal["max", "top2_sum"] = "max"  # V2: max in group; V3: sum of top-2
    routed_scaling_factor: float = 1.0
    norm_eps: float = 0.0  # added to the renormalisation denominator (V3: 1e-20)


def route(
    spec: RouterSpec,
    logits: np.ndarray,
    correction_bias: np.ndarray | None = None,
    ids: np.ndarray | None = None,
    expert_scale: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Choose experts for each token.

    logits: f32 [n, num_experts] (router output, bias included). correction_bias: f32
    [num_experts] or None, used for choosing only. ids: int [n, top_k] experts already chosen
    (hash routing), or None. expert_scale: f32 [num_experts] or None, multiplies each chosen
    expert's final weight (Gemma 4's `router.per_expert_scale`). Returns (ids int32 [n,
    top_k], weights f32 [n, top_k]), ids in descending order of the choice score, ties to the
    lowest id (given ids: as given).
    """
    ids, weights = _route(spec, logits, correction_bias, ids)
    if expert_scale is not None:
        weights = np.ascontiguousarray(weights * expert_scale[ids], dtype=np.float32)
    return ids, weights


def _route(
    spec: RouterSpec,
    logits: np.ndarray,
    correction_bias: np.ndarray | None,
    ids: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    n, e = logits.shape
    k = spec.top_k
    if spec.scoring == "topk_softmax":
        ids, vals = ops.topk(np.ascontiguousarray(logits, dtype=np.float32), k)
        ops.softmax(vals)
        return ids, vals
    if spec.scoring == "topk_sigmoid":
        ids, vals = ops.topk(np.ascontiguousarray(logits, dtype=np.float32), k)
        sig = 1.0 / (1.0 + np.exp(-vals.astype(np.float64)))
        return ids, np.ascontiguousarray(sig, dtype=np.float32)
    scores = np.ascontiguousarray(logits, dtype=np.float32).copy()
    if spec.scoring == "softmax":
        ops.softmax(scores)
    elif spec.scoring == "sqrtsoftplus":  # torch softplus: linear above 20
        s64 = scores.astype(np.float64)
        sp = np.where(s64 > 20, s64, np.log1p(np.exp(np.minimum(s64, 20))))
        scores = np.sqrt(sp).astype(np.float32)
    else:
        scores = (1.0 / (1.0 + np.exp(-scores.astype(np.float64)))).astype(np.float32)
    choice = scores if correction_bias is None else scores + correction_bias[None, :]
    if spec.n_group > 1 and spec.topk_group < spec.n_group:
        grouped = choice.reshape(n, spec.n_group, e // spec.n_group)
        if spec.group_score == "max":
            gscore = grouped.max(axis=-1)
        else:
            gscore = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1, dtype=np.float32)
        keep, _ = ops.topk(np.ascontiguousarray(gscore, dtype=np.float32), spec.topk_group)
        mask = np.zeros((n, spec.n_group), dtype=bool)
        np.put_along_axis(mask, keep.astype(np.int64), True, axis=1)
        # dropped groups are masked as the references do: DeepseekV2TopkRouter fills 0.0 (its
        # softmax scores are > 0); DeepseekV3TopkRouter / Glm4MoeTopkRouter fill -inf (a negative
        # correction bias can push kept scores below 0, so 0.0 would pick a dropped expert)
        fill = np.float32(0.0 if spec.scoring == "softmax" else -np.inf)
        choice = np.where(np.repeat(mask, e // spec.n_group, axis=1), choice, fill)
    if ids is None:
        ids, _ = ops.topk(np.ascontiguousarray(choice, dtype=np.float32), k)
    else:
        ids = np.ascontiguousarray(ids, dtype=np.int32)
    weights = np.take_along_axis(scores, ids.astype(np.int64), axis=1)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(axis=1, keepdims=True) + np.float32(spec.norm_eps))
    if spec.routed_scaling_factor != 1.0:
        weights = weights * np.float32(spec.routed_scaling_factor)
    return ids, np.ascontiguousarray(weights, dtype=np.float32)
