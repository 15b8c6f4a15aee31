"""Routing traces: which experts each token used at each layer.

Trace file (colibri's own; NumPy .npz, written atomically):
  experts  int32   [num_tokens, num_layers, top_k]   chosen expert ids, -1 where a layer is
                                                     missing (dense layer or not recorded)
  weights  float32 [num_tokens, num_layers, top_k]   their combine weights (0 where missing)
  scores   float32 [num_tokens, num_layers, num_experts]  router scores (optional key)
  meta     0-d str  JSON: {"format": "colibri-routing-trace", "version": 1, "num_experts": E,
                     "model_type": ..., "source": ..., "boundaries": [first token of each
                     sequence]}
Tokens are decode (or prefill) steps in order; `boundaries` marks where a new prompt starts.

Also reads the real Mixtral-8x7B trace (JSONL, one line per (problem, token, layer):
{"problem_id", "layer", "token_idx", "experts": [a, b], "gating_probs": [p, 1 - p]}) with
`load_mixtral_jsonl`.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colibri.errors import ColibriError

TRACE_FORMAT, TRACE_VERSION = "colibri-routing-trace", 1


class TraceError(ColibriError):
    """A routing trace file is missing, malformed or of another version."""


@dataclass
class RoutingTrace:
    """experts: int32 [T, L, k] (-1 = missing); weights: float32 [T, L, k];
    scores: float32 [T, L, E] or None; num_experts: E; meta: free-form (JSON-able)."""

    experts: np.ndarray
    weights: np.ndarray
    num_experts: int
    scores: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def num_layers(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    def steps(self) -> Iterator[tuple[int, int, list[int]]]:
        """(token, layer, experts) in execution order, skipping missing layers."""
        for t in range(self.num_tokens):
            for layer in range(self.num_layers):
                row = self.experts[t, layer]
                if row[0] >= 0:
                    yield t, layer, [int(e) for e in row if e >= 0]

    def save(self, path: str | os.PathLike) -> None:
        """Write the .npz described in the module docstring (temp file + rename). Raises
        TraceError naming `path` when it cannot be written (no space, no permission); the
        temporary file is removed."""
        path = os.fspath(path)
        meta = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "num_experts": self.num_experts,
            **self.meta,
        }
        arrays = {
            "experts": self.experts.astype(np.int32),
            "meta": np.array(json.dumps(meta)),
            "weights": self.weights.astype(np.float32),
        }
        if self.scores is not None:
            arrays["scores"] = self.scores.astype(np.float32)
        tmp = f"{path}.tmp{os.getpid()}.npz"
        try:
            np.savez(tmp, **arrays)
            os.replace(tmp, path)
        except BaseException as exc:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise TraceError(f"{path}: cannot write the trace: {exc.strerror or exc}") from None
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> RoutingTrace:
        """Read a trace written by `save` (or `RoutingTraceWriter`). Raises TraceError."""
        if os.path.isdir(path):
            raise TraceError(f"{path}: is a directory, not a routing trace (.npz)")
        if os.path.isfile(path) and not zipfile.is_zipfile(path):  # not numpy's pickle advice
            raise TraceError(
                f"{path}: not a colibri routing trace (an .npz from `colibri run --trace`; "
                "a Mixtral trace ends in .jsonl)"
            )
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                experts, weights = z["experts"], z["weights"]
                scores = z["scores"] if "scores" in z.files else None
        except (OSError, KeyError, ValueError) as exc:
            raise TraceError(f"{path}: not a colibri routing trace ({exc})") from None
        if not isinstance(meta, dict):
            raise TraceError(f"{path}: meta is a {type(meta).__name__}, not a JSON object")
        if meta.get("format") != TRACE_FORMAT or meta.get("version") != TRACE_VERSION:
            raise TraceError(
                f"{path}: format {meta.get('format')!r} version "
                f"{meta.get('version')!r}, expected {TRACE_FORMAT!r} "
                f"version {TRACE_VERSION}"
            )
        if experts.ndim != 3 or weights.shape != experts.shape:
            raise TraceError(
                f"{path}: experts {experts.shape} / weights {weights.shape} "
                "must both be [tokens, layers, top_k]"
            )
        num_experts = meta.pop("num_experts", None)
        if not (isinstance(num_experts, int) and not isinstance(num_experts, bool)):
            raise TraceError(f"{path}: meta.num_experts {num_experts!r} is not an integer")
        if num_experts < 1:
            raise TraceError(f"{path}: meta.num_experts {num_experts} must be at least 1")
        if experts.dtype.kind not in "iu":
            raise TraceError(f"{path}: experts has dtype {experts.dtype}, expected integers")
        if experts.size and (experts.min() < -1 or experts.max() >= num_experts):
            bad = experts[(experts < -1) | (experts >= num_experts)].flat[0]
            raise TraceError(
                f"{path}: expert id {int(bad)} out of range (-1 = missing, 0..{num_experts - 1})"
            )
        for k in ("format", "version"):
            meta.pop(k)
        return cls(experts, weights, num_experts, scores, meta)


class RoutingTraceWriter:
    """Collects routing decisions as the engine runs; `save(path)` writes the trace.

    Args: num_layers, top_k, num_experts; keep_scores: also store router scores [E].
    """

    def __init__(
        self,
        num_layers: int,
        top_k: int,
        num_experts: int,
        *,
        keep_scores: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.keep_scores = keep_scores
        self.meta = dict(meta or {})
        self.meta.setdefault("boundaries", [])
        self._experts: list[np.ndarray] = []
        self._weights: list[np.ndarray] = []
        self._scores: list[np.ndarray] = []

    def new_sequence(self) -> None:
        """Mark that the next token starts a new prompt."""
        self.meta["boundaries"].append(len(self._experts))

    def record(
        self,
        token: int,
        layer: int,
        experts: Sequence[int],
        weights: Sequence[float],
        scores: Sequence[float] | None = None,
    ) -> None:
        """Record layer `layer` of token `token` (tokens counted from 0, in order, across
        sequences). experts/weights: top_k ids and combine weights; scores: [num_experts]."""
        while len(self._experts) <= token:
            self._experts.append(np.full((self.num_layers, self.top_k), -1, np.int32))
            self._weights.append(np.zeros((self.num_layers, self.top_k), np.float32))
            if self.keep_scores:
                self._scores.append(np.zeros((self.num_layers, self.num_experts), np.float32))
        if len(experts) != self.top_k or len(weights) != self.top_k:
            raise ValueError(
                f"token {token} layer {layer}: expected {self.top_k} experts and "
                f"weights, got {len(experts)} and {len(weights)}"
            )
        self._experts[token][layer] = experts
        self._weights[token][layer] = weights
        if self.keep_scores and scores is not None:
            self._scores[token][layer] = scores

    def trace(self) -> RoutingTrace:
        shape = (0, self.num_layers, self.top_k)
        experts = np.stack(self._experts) if self._experts else np.zeros(shape, np.int32)
        weights = np.stack(self._weights) if self._weights else np.zeros(shape, np.float32)
        scores = np.stack(self._scores) if self.keep_scores and self._scores else None
        return RoutingTrace(experts, weights, self.num_experts, scores, dict(self.meta))

    def save(self, path: str | os.PathLike) -> None:
        self.trace().save(path)


def load_mixtral_jsonl(
    path: str | os.PathLike, *, num_layers: int = 32, num_experts: int = 8
) -> RoutingTrace:
    """The real Mixtral-8x7B trace (see module docstring) as a RoutingTrace: tokens ordered by
    problem then token_idx, missing (token, layer) pairs as -1. Raises TraceError."""
    rows: dict[tuple[int, int], dict[int, tuple[list[int], list[float]]]] = {}
    top_k = 0
    try:
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    key = (int(r["problem_id"]), int(r["token_idx"]))
                    layer, experts = int(r["layer"]), [int(e) for e in r["experts"]]
                    weights = [float(w) for w in r["gating_probs"]]
                except (ValueError, KeyError, TypeError) as exc:
                    raise TraceError(f"{path}:{lineno}: bad routing record ({exc})") from None
                if not 0 <= layer < num_layers or any(not 0 <= e < num_experts for e in experts):
                    raise TraceError(
                        f"{path}:{lineno}: layer {layer} / experts {experts} out "
                        f"of range ({num_layers} layers, {num_experts} experts)"
                    )
                top_k = max(top_k, len(experts))
                rows.setdefault(key, {})[layer] = (experts, weights)
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror}") from None
    keys = sorted(rows)
    experts_a = np.full((len(keys), num_layers, top_k), -1, np.int32)
    weights_a = np.zeros((len(keys), num_layers, top_k), np.float32)
    boundaries = []
    for t, key in enumerate(keys):
        if t == 0 or key[0] != keys[t - 1][0]:
            boundaries.append(t)
        for layer, (e, w) in rows[key].items():
            experts_a[t, layer, : len(e)] = e
            weights_a[t, layer, : len(w)] = w
    meta = {
        "model_type": "mixtral",
        "source": os.path.basename(os.fspath(path)),
        "boundaries": boundaries,
    }
    return RoutingTrace(experts_a, weights_a, num_experts, None, meta)
