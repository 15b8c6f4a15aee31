"""The web dashboard's data: routing recorded while the server runs, and its JSON feeds.

    recorder = RoutingRecorder(num_layers, num_experts, top_k, moe_layers)
    engine.pipeline.route_observer = recorder.observe   # the pipeline's routing hook

Source of the routing: the pipeline's `route_observer` hook (colibri/pipeline.py), called once
per MoE layer of every forward pass with the batch's token ids and the router's top-k. It is
the cheapest correct source: the cache's requests only see the union of a batch's experts
(no token ids, no per-token co-activation), and the tracer slot belongs to `--trace` and
`capture_routing`. The hook runs on the event loop: it takes the cache hits and queues the
rows; one vectorised pass folds the queue in when the feeds are read (or PENDING_ROWS rows
wait), with a bounded Python loop for the top-token counters (at most TOP_PAIRS pairs, a
uniform random sample beyond).

Kept per (layer, expert), memory bounded whatever the session length:
- tokens: tokens routed to it; gets / hits: steps that asked the cache for it and how many of
  those found it in RAM (checked with ExpertCache.contains just before the request);
- recent: the tokens among the last RECENT routed at that layer (a ring buffer per layer);
- top tokens: a Space-Saving summary of TOP_SLOTS token ids (Metwally, Agrawal, El Abbadi,
  "Efficient computation of frequent and top-k elements in data streams", ICDT 2005);
- a co-activation sketch: row a of X R, where X is the expert x token-occurrence incidence
  matrix and R a random {-1, +1} hashing of occurrences into SKETCH columns, so that
  (X R)(X R)^T estimates the co-activation counts X X^T (Achlioptas, "Database-friendly random
  projections", PODS 2001).

The atlas places every expert by a spectral embedding of the co-activation graph: the
eigenvectors 2 and 3 of D^-1/2 C D^-1/2 (C = X X^T, D its degrees; Ng, Jordan & Weiss, "On
spectral clustering", NIPS 2001), obtained as the left singular vectors of D^-1/2 X R
(SVD of a [L*E, SKETCH] matrix: no L*E x L*E matrix is ever formed).
The feeds' JSON is documented in docs/DASHBOARD.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from colibri.serve.errors import APIError

log = logging.getLogger("colibri.serve")

RECENT = 64  # tokens per layer in the "recent use" window
TOP_SLOTS = 8  # token ids kept per expert (Space-Saving)
TOP_PAIRS = 8192  # (expert, token) pairs one _flush feeds the top-token counters
PENDING_ROWS = 4096  # token-layer rows queued before they are folded in
SKETCH = 128  # columns of the co-activation sketch


class RoutingRecorder:
    """Routing statistics of one server (module docstring). num_layers: the model's layers
    (dense ones stay empty); num_experts: routed experts per layer; moe_layers: indices of
    the MoE layers; cache: an ExpertCache for the hit counts (or None)."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        moe_layers: Sequence[int],
        cache: Any = None,
        seed: int = 0,
    ) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.moe_layers = list(moe_layers)
        self.cache = cache
        shape = (num_layers, num_experts)
        self._tokens = np.zeros(shape, np.int64)
        self.gets = np.zeros(shape, np.int64)
        self.hits = np.zeros(shape, np.int64)
        self.ring = np.full((num_layers, RECENT, top_k), -1, np.int32)
        self.ring_pos = np.zeros(num_layers, np.int64)
        self.sketch = np.zeros((num_layers * num_experts, SKETCH), np.float32)
        self.top: list[dict[int, int]] = [{} for _ in range(num_layers * num_experts)]
        self.routed_tokens = 0  # token-layer rows seen
        self.version = 0  # bumped by every observe (the atlas is recomputed when it moved)
        self._occurrence = np.zeros(num_layers, np.int64)  # tokens each layer has seen
        self._seed = np.uint64(seed)
        self._rng = np.random.default_rng(seed)
        self._pending: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._pending_rows = 0
        self._atlas: tuple[int, dict[str, Any]] | None = None

    # -- feeding ------------------------------------------------------------------------------
    def observe(self, layer: int, tokens: np.ndarray, experts: np.ndarray) -> None:
        """Record one MoE layer's routing: tokens int [n] (ids, -1 when unknown), experts
        int [n, k] (the router's top-k; entries < 0 are ignored). Never raises on ids out of
        range: they are dropped. Only the cache hits are taken now (they depend on the
        moment); the rest is queued and folded in by one vectorised pass (_flush) when read
        or when PENDING_ROWS rows wait, so a forward pass pays a few microseconds per layer."""
        experts = np.asarray(experts)
        if experts.ndim != 2 or not 0 <= layer < self.num_layers or not len(experts):
            return
        n, k = experts.shape
        if k != self.top_k:
            experts = experts[:, : self.top_k]
            if k < self.top_k:
                experts = np.pad(experts, ((0, 0), (0, self.top_k - k)), constant_values=-1)
        tokens = np.asarray(tokens, np.int64).reshape(-1)[:n]
        if len(tokens) < n:
            tokens = np.concatenate([tokens, np.full(n - len(tokens), -1, np.int64)])
        E = self.num_experts
        uniq = [e for e in set(experts.ravel().tolist()) if 0 <= e < E]
        self.gets[layer, uniq] += 1
        if self.cache is not None:
            contains = self.cache.contains
            hit = [e for e in uniq if contains(layer, e)]
            if hit:
                self.hits[layer, hit] += 1
        self._pending.append((layer, tokens, experts))
        self._pending_rows += n
        self.routed_tokens += n
        self.version += 1
        if self._pending_rows >= PENDING_ROWS:
            self._flush()

    def _flush(self) -> None:
        """Fold the queued observations into the counters, the recent windows, the sketch
        and the top-token summaries, all layers at once."""
        if not self._pending:
            return
        pend, self._pending, self._pending_rows = self._pending, [], 0
        L, E = self.num_layers, self.num_experts
        lay = np.concatenate([np.full(len(e), layer, np.int64) for layer, _, e in pend])
        tok = np.concatenate([t for _, t, _ in pend])
        ex = np.concatenate([e for _, _, e in pend]).astype(np.int64)
        valid = (ex >= 0) & (ex < E)
        # rank of each row among its layer's rows (rows keep their order within a layer)
        counts = np.bincount(lay, minlength=L)
        order = np.argsort(lay, kind="stable")
        rank = np.empty(len(lay), np.int64)
        rank[order] = np.arange(len(lay)) - (np.cumsum(counts) - counts)[lay[order]]
        r, c = np.nonzero(valid)
        idx = lay[r] * E + ex[r, c]
        self._tokens += np.bincount(idx, minlength=L * E).reshape(L, E)
        # recent windows: each layer's last RECENT rows
        keep = rank >= counts[lay] - RECENT
        pos = (self.ring_pos[lay[keep]] + rank[keep]) % RECENT
        self.ring[lay[keep], pos] = np.where(valid, ex, -1)[keep]
        self.ring_pos += counts
        # co-activation sketch: occurrence t (the t-th token a layer saw) hashes to a column
        # and a sign; the same t at every layer is the same token, so columns line up
        h = _mix((self._occurrence[lay] + rank).astype(np.uint64) ^ self._seed)
        self._occurrence += counts
        col = (h % np.uint64(SKETCH)).astype(np.int64)
        sign = np.where((h >> np.uint64(32)) & np.uint64(1), 1.0, -1.0).astype(np.float32)
        np.add.at(self.sketch.reshape(-1), idx * SKETCH + col[r], sign[r])
        # top tokens (Space-Saving) from at most TOP_PAIRS (expert, token) pairs per pass
        t = tok[r]
        known = t >= 0
        pair = (idx[known] << 32) | t[known]
        if len(pair) > TOP_PAIRS:
            pair = self._rng.choice(pair, TOP_PAIRS, replace=False)
        if len(pair):
            keys, cnt = np.unique(pair, return_counts=True)
            top = self.top
            for key, n in zip(keys.tolist(), cnt.tolist(), strict=True):
                _space_saving(top[key >> 32], key & 0xFFFFFFFF, n)

    @property
    def tokens(self) -> np.ndarray:
        """int64 [num_layers, num_experts]: tokens routed to each expert so far."""
        self._flush()
        return self._tokens

    # -- reading ------------------------------------------------------------------------------
    def recent(self) -> np.ndarray:
        """int64 [num_layers, num_experts]: tokens routed among each layer's last RECENT."""
        self._flush()
        out = np.zeros((self.num_layers, self.num_experts), np.int64)
        for layer in self.moe_layers:
            ids = self.ring[layer].ravel()
            out[layer] = np.bincount(ids[ids >= 0], minlength=self.num_experts)
        return out

    def top_tokens(self, layer: int, expert: int, n: int = TOP_SLOTS) -> list[tuple[int, int]]:
        """The (token id, estimated count) pairs most often routed to (layer, expert), most
        frequent first (Space-Saving: counts are upper bounds, exact while the expert has
        seen at most TOP_SLOTS distinct tokens)."""
        self._flush()
        top = self.top[layer * self.num_experts + expert]
        return sorted(top.items(), key=lambda kv: (-kv[1], kv[0]))[:n]

    def atlas(self) -> dict[str, Any]:
        """The spectral layout (module docstring): {"x", "y": float lists in [-1, 1],
        "layer", "expert", "tokens": int lists, one entry per (MoE layer, expert)}. Cached
        until new routing arrives."""
        if self._atlas is not None and self._atlas[0] == self.version:
            return self._atlas[1]
        self._flush()
        layers = np.repeat(np.asarray(self.moe_layers, np.int64), self.num_experts)
        experts = np.tile(np.arange(self.num_experts, dtype=np.int64), len(self.moe_layers))
        rows = layers * self.num_experts + experts
        xy = spectral_layout(self.sketch[rows], self.tokens.reshape(-1)[rows])
        out = {
            "x": np.round(xy[:, 0].astype(np.float64), 4).tolist(),
            "y": np.round(xy[:, 1].astype(np.float64), 4).tolist(),
            "layer": layers.tolist(),
            "expert": experts.tolist(),
            "tokens": self.tokens.reshape(-1)[rows].tolist(),
        }
        self._atlas = (self.version, out)
        return out

    def load_trace(self, trace: Any) -> None:
        """Feed a RoutingTrace (colibri/io/trace.py; experts int32 [T, L, k]) as if it had
        been routed here (token ids unknown: no top tokens). Raises ValueError when its
        shape does not match this model (naming both)."""
        ex = np.asarray(trace.experts)
        if ex.ndim != 3 or ex.shape[1] != self.num_layers or trace.num_experts > self.num_experts:
            raise ValueError(
                f"routing trace of {ex.shape[1] if ex.ndim == 3 else '?'} layers x "
                f"{trace.num_experts} experts does not match this model ({self.num_layers} "
                f"layers x {self.num_experts} experts)"
            )
        none = np.full(ex.shape[0], -1, np.int64)
        for layer in range(self.num_layers):
            if (ex[:, layer, 0] >= 0).any():
                self.observe(layer, none, ex[:, layer, : self.top_k])


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele, Lea, Flood 2014): uint64 -> well-mixed uint64."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(2**64 - 1)
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(2**64 - 1)
        return x ^ (x >> np.uint64(31))


def _space_saving(top: dict[int, int], token: int, count: int) -> None:
    if token in top or len(top) < TOP_SLOTS:
        top[token] = top.get(token, 0) + count
        return
    victim = min(top, key=top.__getitem__)
    top[token] = top.pop(victim) + count


def spectral_layout(sketch: np.ndarray, degree: np.ndarray) -> np.ndarray:
    """2-D coordinates f32 [N, 2] in [-1, 1] from a co-activation sketch f32 [N, S] (rows
    whose outer products estimate the co-activation counts) and the tokens per row (for the
    normalisation): the 2nd and 3rd left singular vectors of D^-1/2 sketch (module
    docstring). Rows never routed sit on a small circle at the centre."""
    n = len(sketch)
    out = np.zeros((n, 2), np.float32)
    seen = degree > 0
    if seen.sum() >= 3:
        m = sketch[seen] / np.sqrt(degree[seen].astype(np.float32))[:, None]
        u, s, _ = np.linalg.svd(m.astype(np.float64), full_matrices=False)
        k = min(3, u.shape[1])
        xy = u[:, 1:k] * s[1:k]
        if xy.shape[1] < 2:
            xy = np.pad(xy, ((0, 0), (0, 2 - xy.shape[1])))
        xy -= np.median(xy, axis=0)
        scale = np.percentile(np.abs(xy), 98)  # one scale for both axes: distances stay true
        xy /= scale if scale > 0 else 1.0
        out[seen] = np.clip(xy, -1.0, 1.0) * 0.95
    rest = np.nonzero(~seen)[0]
    angle = np.arange(len(rest)) * 2.399963  # the golden angle: an even spread
    out[rest, 0] = 0.08 * np.cos(angle)
    out[rest, 1] = 0.08 * np.sin(angle)
    return out


def snapshot(engine: Any, recorder: RoutingRecorder, model_id: str) -> dict[str, Any]:
    """The /v1/experts JSON (docs/DASHBOARD.md)."""
    ready, reading = engine.cache.residency()
    state = np.zeros((recorder.num_layers, recorder.num_experts), np.int8)
    for layer, e in ready:
        state[layer, e] = 2
    for layer, e in reading:
        state[layer, e] = 1
    st = engine.statistics(components=False)
    stats = {k: getattr(st, k) for k in st.COUNTERS}
    for k in (
        "running",
        "waiting",
        "reads_in_flight",
        "leased",
        "cache_used_nbytes",
        "cache_budget_nbytes",
        "prefix_nbytes",
        "dense_nbytes",
    ):
        stats[k] = getattr(st, k)
    stats["hit_rate"] = st.hit_rate
    layers = recorder.moe_layers
    return {
        "object": "experts",
        "model": model_id,
        "time": time.time(),
        "num_layers": recorder.num_layers,
        "num_experts": recorder.num_experts,
        "top_k": recorder.top_k,
        "moe_layers": layers,
        "recent_window": RECENT,
        "routed_tokens": recorder.routed_tokens,
        "recent": recorder.recent()[layers].tolist(),
        "tokens": recorder.tokens[layers].tolist(),
        "gets": recorder.gets[layers].tolist(),
        "hits": recorder.hits[layers].tolist(),
        "state": state[layers].tolist(),
        "statistics": stats,
    }


STATIC = Path(__file__).parent / "static"
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def install(app: Any, service: Any, trace_path: str | None = None) -> RoutingRecorder:
    """Add the dashboard to `app`: GET / (the page), /static/NAME, /v1/experts (snapshot),
    /v1/experts/stream (SSE of snapshots), /v1/experts/atlas, /v1/experts/{layer}/{expert};
    install the recorder on the engine's pipeline hook; seed it from the RoutingTrace at
    `trace_path` (TraceError / ValueError naming the file when it is unreadable or of another
    model)."""
    eng = service.engine
    spec = eng.spec
    moe = [s.index for s in spec.layers if s.moe]
    router = spec.moe.router
    rec = RoutingRecorder(len(spec.layers), router.num_experts, router.top_k, moe, eng.cache)
    if trace_path:
        from colibri.io.trace import RoutingTrace

        trace = RoutingTrace.load(trace_path)
        try:
            rec.load_trace(trace)
        except ValueError as exc:
            raise ValueError(f"{trace_path}: {exc}") from None

    def observe(layer: int, tokens: np.ndarray, experts: np.ndarray) -> None:
        # the dashboard must never break a generation: a failure here unhooks it, once
        try:
            rec.observe(layer, tokens, experts)
        except Exception:
            log.exception("dashboard routing recorder failed; the expert feeds stop updating")
            eng.pipeline.route_observer = None

    eng.pipeline.route_observer = observe
    service.recorder = rec

    def page(name: str) -> Response:
        path = STATIC / name
        if "/" in name or name.startswith(".") or not path.is_file():
            raise APIError(404, f"no such file: /static/{name}")
        media = _TYPES.get(path.suffix, "application/octet-stream")
        return Response(path.read_bytes(), media_type=media, headers={"Cache-Control": "no-cache"})

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return page("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        return page(name)

    @app.get("/v1/experts")
    async def experts() -> dict[str, Any]:
        return snapshot(eng, rec, service.model_id)

    @app.get("/v1/experts/stream")
    async def experts_stream(request: Request, interval: float = 0.25) -> StreamingResponse:
        if not 0.05 <= interval <= 10:
            raise APIError(400, "interval must be between 0.05 and 10 seconds", param="interval")

        async def events() -> Any:
            while not await request.is_disconnected():
                yield f"data: {json.dumps(snapshot(eng, rec, service.model_id))}\n\n"
                await asyncio.sleep(interval)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/experts/atlas")
    async def atlas() -> dict[str, Any]:
        return {
            "object": "expert_atlas",
            "model": service.model_id,
            "method": "spectral embedding of the co-activation sketch (docs/DASHBOARD.md)",
            "routed_tokens": rec.routed_tokens,
            "num_layers": rec.num_layers,
            "num_experts": rec.num_experts,
            "points": rec.atlas(),
        }

    @app.get("/v1/experts/{layer}/{expert}")
    async def one(layer: int, expert: int) -> dict[str, Any]:
        if layer not in moe or not 0 <= expert < rec.num_experts:
            raise APIError(
                404,
                f"no expert ({layer}, {expert}): MoE layers are {moe[0]}..{moe[-1]}, experts "
                f"0..{rec.num_experts - 1}",
            )
        tok = eng.tokenizer
        top = []
        for tid, count in rec.top_tokens(layer, expert):
            text = tok.decode([tid]) if tok is not None else str(tid)
            top.append({"token_id": tid, "text": text, "count": count})
        gets = int(rec.gets[layer, expert])
        return {
            "object": "expert",
            "layer": layer,
            "expert": expert,
            "tokens": int(rec.tokens[layer, expert]),
            "gets": gets,
            "hits": int(rec.hits[layer, expert]),
            "hit_rate": float(rec.hits[layer, expert]) / gets if gets else None,
            "top_tokens": top,
        }

    return rec
