"""The resident part of a model and the synchronous math of one layer.

Model holds the dense weights (embeddings, attention, norms, routers, shared experts, dense
MLPs, output head) loaded from a store, and offers the steps pipeline.py strings together.
Nothing here awaits: these functions run in the engine's compute thread, while the event loop
keeps reaping expert reads. All activations are f32 [n_tokens, ...].
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colibri.compute import deltanet, dsv4, moe, ops
from colibri.compute.ops import QType
from colibri.errors import KernelError, StoreError
from colibri.io.format import ExpertLayout, ExpertRecord, Store
from colibri.models.spec import GEMMA_NORMS, AttentionSpec, LayerSpec, ModelSpec

_F32 = QType.parse("f32")
GDR_CHUNK = 64  # Gated DeltaNet: chunk size of the chunked form (Model.gdr_chunked)


def pad_rows(x: np.ndarray, multiple: int) -> np.ndarray:
    """x [n, ...] with zero rows appended up to a multiple of `multiple` rows (x itself when
    n already is one). The kernels compute every row the same way whenever the row count is
    a multiple of 4 (tests/test_batching.py), which makes padded calls batch-invariant."""
    extra = -x.shape[0] % multiple
    if not extra:
        return x
    return np.concatenate([x, np.zeros((extra, *x.shape[1:]), dtype=x.dtype)])


# Weight types whose Q8_0-activation kernels (ops.matmul_q8, ops.expert_ffn with act_q8)
# compute every row the same bits whatever the number of rows in the call
# (tests/test_batch_invariance.py, tests/test_serve_stacking.py): calls on them may stack the
# rows of several sequences without changing any sequence's result (FP8 and MXFP4 too, since
# their matvec and batch paths compute alike).
ROW_INVARIANT_QTYPES = ops.Q8_ACT_TYPES
# Weight types whose f32-activation matmul (ops.matmul) computes every row the same bits
# whatever the number of rows in the call: x rows tiled by 4, 2 and 1 in one accumulation
# order (tests/test_batch_invariance.py, tests/test_batching.py). The f32 routers and the
# hyper-connection maps run there.
F32_ROW_INVARIANT_QTYPES = frozenset(
    (QType.F32, QType.F16, QType.BF16, QType.Q4_0, QType.Q4_1, QType.Q8_0)
)

# MLA kv_b_proj storage types read as stored (ops.mla_absorb_q / mla_values); others are
# dequantized to f32 at load (f32 itself: the f32 arrays are the stored values, same output).
MLA_KV_B_QTYPES = frozenset((QType.Q4_0, QType.Q4_1, QType.Q8_0))


class Linear:
    """y = x W^T (+ b) for W [rows, cols] in any storage type, b f32 [rows] or None.
    act_q8: quantize x to Q8_0 and use integer dots (ops.matmul_q8) when W is quantized.
    act_q8k (with act_q8): Q8_K activations (ops.matmul_q8k) when W is Q4_K / Q5_K / Q6_K and
    cols a multiple of 256 (llama.cpp's K-quant path: faster, and as batch invariant).
    pad: run the kernel on x padded with zero rows to a multiple of `pad` rows (1: never)."""

    pad = 1
    x16 = False  # w holds X16-packed bytes (pack_x16): matmul_q8_x16, same bits

    def __init__(
        self,
        w: np.ndarray,
        qtype: QType,
        rows: int,
        cols: int,
        bias: np.ndarray | None,
        act_q8: bool = False,
        act_q8k: bool = False,
    ):
        self.w, self.qtype, self.rows, self.cols, self.bias = w, qtype, rows, cols, bias
        self.act_q8 = act_q8 and qtype in ops.Q8_ACT_TYPES and cols % 32 == 0  # fp8: any cols
        self.act_q8k = act_q8k and self.act_q8 and qtype in ops.Q8K_ACT_TYPES and cols % 256 == 0
        # rows need no padding to be batch-invariant
        self._q8_invariant = self.act_q8 and qtype in ROW_INVARIANT_QTYPES

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + (0 if self.bias is None else self.bias.nbytes)

    @property
    def row_invariant(self) -> bool:
        """True when each row's output is the same bits whatever rows share the call: the
        Q8_0-activation kernels of ROW_INVARIANT_QTYPES, or any kernel when calls are
        padded to a multiple of 4 rows (pad 4)."""
        return (self.act_q8 and self.qtype in ROW_INVARIANT_QTYPES) or self.pad % 4 == 0

    def __call__(
        self, x: np.ndarray, out: np.ndarray | None = None, nthreads: int = 0
    ) -> np.ndarray:
        """x f32 [n, cols] -> f32 [n, rows] (written into out when given)."""
        if self.pad > 1 and x.shape[0] % self.pad and not self._q8_invariant:
            y = self(pad_rows(x, self.pad), nthreads=nthreads)[: x.shape[0]]
            if out is None:
                return y
            out[...] = y
            return out
        if out is None:
            out = np.empty((x.shape[0], self.rows), dtype=np.float32)
        if self.act_q8k:
            ops.matmul_q8k(self.w, self.qtype, ops.quantize_q8_k(x), out, nthreads=nthreads)
        elif self.x16:
            ops.matmul_q8_x16(self.w, self.qtype, ops.quantize_act(x), out, nthreads=nthreads)
        elif self.act_q8:
            ops.matmul_q8(self.w, self.qtype, ops.quantize_act(x), out, nthreads=nthreads)
        else:
            ops.matmul(self.w, self.qtype, x, out, nthreads=nthreads)
        if self.bias is not None:
            out += self.bias
        return out

    def x16_packable(self) -> bool:
        """Whether pack_x16 applies: this Linear runs on Q8_0 activations, its type and shape
        have the X16 layout and this CPU has the kernel (ops.x16_fast)."""
        w = self.w
        return (self.act_q8 and not self.act_q8k and not self.x16 and ops.x16_fast()
                and self.qtype in ops.X16_TYPES and ops.x16_ok(self.qtype, self.rows, self.cols)
                and isinstance(w, np.ndarray) and w.dtype == np.uint8 and w.ndim == 2
                and w.flags.c_contiguous)  # fmt: skip

    def pack_x16(self, out: np.ndarray | None = None) -> bool:
        """Replace W by its X16 layout (ops.pack_x16: the AVX-512 matvec's own order, one
        sequential stream) in `out` (uint8, W's size; default a mapping of its own on huge
        pages, ops.empty_huge) when x16_packable(); results keep their bits. Only for
        Linears used through __call__ (W's bytes are no longer GGML rows; views of the old W
        keep the old bytes). Returns whether it packed."""
        if not self.x16_packable():
            return False
        w = self.w
        out = ops.empty_huge(w.nbytes) if out is None else out
        self.w = ops.pack_x16(w, self.qtype, self.cols, out=out.reshape(w.shape))
        self.x16 = True
        return True


def _rows_exact(lin: Linear) -> bool:
    """True when lin(x) computes each row of x the same bits whatever rows share the call:
    Linear.row_invariant, or the f32-activation matmul on F32_ROW_INVARIANT_QTYPES."""
    return lin.row_invariant or (not lin.act_q8 and lin.qtype in F32_ROW_INVARIANT_QTYPES)


def _fuse(parts: tuple[Linear, ...]) -> Linear | None:
    """One Linear over the rows of `parts` (same type, columns and bias presence), so q, k and
    v take one quantization of their input and one kernel call; each row is computed as in
    its own matrix (kernels are row-independent), so results are identical. The parts' weights
    become views into the fused array (no second copy). None when they do not match."""
    p0 = parts[0]
    same = all(
        p.qtype == p0.qtype and p.cols == p0.cols and p.act_q8 == p0.act_q8 and
        p.act_q8k == p0.act_q8k and (p.bias is None) == (p0.bias is None) and
        p.x16 == p0.x16 and
        p.w.ndim == p0.w.ndim and p.w.shape[1:] == p0.w.shape[1:]
        for p in parts
    )  # fmt: skip
    if not same:
        return None
    w = np.ascontiguousarray(np.concatenate([p.w for p in parts]))
    bias = None if p0.bias is None else np.concatenate([p.bias for p in parts])
    fused = Linear(w, p0.qtype, sum(p.rows for p in parts), p0.cols, bias, p0.act_q8, p0.act_q8k)
    fused.pad, fused.x16 = p0.pad, p0.x16
    r = 0
    for p in parts:
        p.w, p.bias = w[r : r + p.rows], None if bias is None else bias[r : r + p.rows]
        r += p.rows
    return fused


@dataclass
class KVCache:
    """Per-sequence keys and values, preallocated to the context length.

    k[layer]: [n_ctx, n_kv_heads, head_dim], v[layer]: [n_ctx, n_kv_heads, v_head_dim],
    f32 or f16; `length` tokens are filled. Memory: layers * n_ctx * n_kv * (dk + dv) * itemsize.
    Multi-head latent attention layers keep the compressed form instead: k[layer] is
    v[layer] (one array), [n_ctx, 1, kv_lora_rank + qk_rope_head_dim] holding the normed latent
    then the rotated rope key; memory layers * n_ctx * (kv_lora_rank + rope) * itemsize.
    DSA layers (spec.IndexerSpec) with their own indexer also keep its keys:
    index_k[layer] [n_ctx, index_head_dim] (None for other layers); index_sel holds the top-k
    selection of the last full indexer layer for the tokens being computed (int32
    [n_tokens, k], -1 padding), which "shared" layers reuse.
    Gated DeltaNet layers (LayerSpec.linear_attn) keep a fixed-size state instead, always f32:
    conv[layer] [linear_conv_kernel_dim - 1, conv_dim], the conv's last inputs, and
    recurrent[layer] [linear_num_value_heads, linear_key_head_dim, linear_value_head_dim];
    their k/v entries are empty, and conv/recurrent are None for attention layers. Layers
    that reuse an earlier layer's keys and values (AttentionSpec.kv_shared_from, Gemma 4's
    num_kv_shared_layers) have empty k/v entries too and read that layer's. That state
    summarises every token so far: a sequence can grow but never be cut back (`length` only
    moves forward on hybrid models).
    DeepSeek-V4 layers (spec.SharedKVSpec) keep the K=V rows of the last sliding_window
    positions in k[layer] (is v[layer]), a ring [min(sliding_window, n_ctx), 1, head_dim]
    (position p in row p % rows); with a compressor, compressed[layer] [n_ctx // rate + 1,
    head_dim] (f32) holds its entries and compress_buf[layer] [2, 2, rate, width] (f32) the raw
    rows of the last two windows (spec.CompressorSpec); a CSA layer's indexer keeps its entries
    in index_k[layer] [n_ctx // rate + 1, index_head_dim] and its window rows in
    index_buf[layer]. Ring and window rows summarise the recent positions: like Gated DeltaNet
    state, only snapshot() / restore() take such a sequence back (they copy them).
    Layers with AttentionSpec.kv_ring (Gemma 4's sliding layers) whose window is below n_ctx
    (ring_layers) keep k[layer] [window, n_kv_heads, head_dim] and v[layer] likewise, rings
    of the last `window` positions (ring_window); memory per such layer is bounded by the
    window whatever the context. Their rows are snapshotted and restored the same way. While a
    forward runs, window_rows[layer] holds (pos0, k rows, v rows, base) of a ring layer whose
    cache later layers share (kv_shared_from), for those layers to read: the ring itself
    already holds the chunk's last rows then. The last layer sharing it drops them.
    """

    k: list[np.ndarray]
    v: list[np.ndarray]
    n_ctx: int
    length: int = 0
    conv: list[np.ndarray | None] = field(default_factory=list)
    recurrent: list[np.ndarray | None] = field(default_factory=list)
    index_k: list[np.ndarray | None] = field(default_factory=list)
    index_sel: np.ndarray | None = None
    compressed: list[np.ndarray | None] = field(default_factory=list)
    compress_buf: list[np.ndarray | None] = field(default_factory=list)
    index_buf: list[np.ndarray | None] = field(default_factory=list)
    ring: bool = False  # DeepSeek-V4: k / v are rings of the window's rows
    ring_layers: tuple[int, ...] = ()  # kv_ring layers whose k / v are rings (window < n_ctx)
    window_rows: dict[int, tuple[int, np.ndarray, np.ndarray, int]] = field(default_factory=dict)

    @property
    def recurrent_state(self) -> bool:
        """Whether the cache holds Gated DeltaNet state or DeepSeek-V4 compressor windows,
        which cannot be cut back."""
        return any(c is not None for c in self.conv) or self.ring or bool(self.ring_layers)

    def _window_arrays(self) -> list[np.ndarray | None]:
        """The arrays holding only recent positions, which snapshot() copies: DeepSeek-V4's
        compressor windows and window rings, the kv_ring layers' key and value rings."""
        out = self.compress_buf + self.index_buf + self.k if self.ring else []
        for i in self.ring_layers:
            out += [self.k[i], self.v[i]]
        return out

    def snapshot(self) -> tuple[int, list[np.ndarray | None], list[np.ndarray | None]]:
        """(length, copies of the conv / recurrent state): what restore() needs to return
        here later (keys and values before `length` are never overwritten by later tokens)."""
        copy = [None if a is None else a.copy() for a in self.conv]
        if self.ring or self.ring_layers:  # window rings, DeepSeek-V4's compressor windows
            bufs = [None if b is None else b.copy() for b in self._window_arrays()]
            recurrent = [None if a is None else a.copy() for a in self.recurrent]
            return self.length, copy, recurrent, bufs  # type: ignore[return-value]
        return self.length, copy, [None if a is None else a.copy() for a in self.recurrent]

    def restore(self, snap: tuple[int, list[np.ndarray | None], list[np.ndarray | None]]) -> None:
        """Return to a snapshot() of this cache taken at a length <= the current one."""
        length, conv, recurrent, *bufs = snap
        if length > self.length:
            raise ValueError(f"snapshot at {length} tokens is past the cache's {self.length}")
        for dst, src in zip(self.conv + self.recurrent, conv + recurrent, strict=True):
            if dst is not None:
                dst[...] = src
        if bufs:  # the window rings, DeepSeek-V4's compressor windows
            for dst, src in zip(self._window_arrays(), bufs[0], strict=True):
                if dst is not None:
                    dst[...] = src
        self.length = length

    @staticmethod
    def nbytes_for(spec: ModelSpec, n_ctx: int, dtype: type = np.float32) -> int:
        """Bytes `allocate(spec, n_ctx, dtype)` would take (computed, nothing allocated)."""
        per_token, fixed = 0, 0
        for layer in spec.layers:
            a = layer.attention
            if getattr(a, "shared_kv", None) is not None:  # DeepSeek-V4: its own arrays
                fixed += _v4_cache_nbytes(a, n_ctx, np.dtype(dtype).itemsize)
                continue
            if getattr(a, "kv_shared_from", None) is not None:  # reads an earlier layer's cache
                continue
            if _ring_rows(a, n_ctx) < n_ctx:  # Gemma 4 sliding layers: a ring of window rows
                rows = _ring_rows(a, n_ctx) * a.n_kv_heads * (a.head_dim + a.v_head_dim)
                fixed += rows * np.dtype(dtype).itemsize
                continue
            if a.mla is not None:
                per_token += a.mla.kv_lora_rank + a.rot_dim
            else:
                per_token += a.n_kv_heads * (a.head_dim + a.v_head_dim)
            if a.indexer is not None and not a.indexer.shared:  # DSA indexer keys
                per_token += a.indexer.index_head_dim
        return per_token * n_ctx * np.dtype(dtype).itemsize + fixed

    @classmethod
    def allocate(cls, spec: ModelSpec, n_ctx: int, dtype: type = np.float32) -> KVCache:
        """Zeroed keys and values for `n_ctx` tokens. Raises MemoryError when they do not
        fit (callers check nbytes_for against the available memory first)."""
        k, v = [], []
        index_k: list[np.ndarray | None] = []
        conv: list[np.ndarray | None] = []
        recurrent: list[np.ndarray | None] = []
        compressed: list[np.ndarray | None] = []
        bufs: dict[str, list[np.ndarray | None]] = {"cmp": [], "idx": []}
        rings: list[int] = []
        for layer in spec.layers:
            a = layer.attention
            g = layer.linear_attn
            x = a.indexer
            own = x is not None and not x.shared
            v4 = getattr(a, "shared_kv", None)  # stand-in specs (tests) may lack it
            rows = n_ctx if v4 is None or v4.index_compressor is None else _v4_entries(v4, n_ctx)
            index_k.append(np.zeros((rows, x.index_head_dim), dtype=dtype) if own else None)
            for key, c in (("cmp", v4 and v4.compressor), ("idx", v4 and v4.index_compressor)):
                width = c.head_dim * (1 + c.overlap) if c else 0
                bufs[key].append(
                    np.zeros((2, 2, c.compress_rate, width), np.float32) if c else None
                )
            c = v4.compressor if v4 is not None else None
            compressed.append(
                np.zeros((_v4_entries(v4, n_ctx), a.head_dim), np.float32) if c else None
            )
            conv.append(
                None
                if g is None
                else np.zeros((g.linear_conv_kernel_dim - 1, g.conv_dim), np.float32)
            )
            recurrent.append(
                None
                if g is None
                else np.zeros(
                    (g.linear_num_value_heads, g.linear_key_head_dim, g.linear_value_head_dim),
                    np.float32,
                )
            )
            if g is not None or getattr(a, "kv_shared_from", None) is not None:  # no own keys
                k.append(np.zeros((0, 1, 1), dtype=dtype))
                v.append(k[-1])
                continue
            if v4 is not None:  # DeepSeek-V4: K = V, one head, a ring of the window's rows
                k.append(np.zeros((min(v4.sliding_window, n_ctx), 1, a.head_dim), dtype=dtype))
                v.append(k[-1])
                continue
            if _ring_rows(a, n_ctx) < n_ctx:  # Gemma 4 sliding layers: rings of window rows
                k.append(np.zeros((a.window, a.n_kv_heads, a.head_dim), dtype=dtype))
                v.append(np.zeros((a.window, a.n_kv_heads, a.v_head_dim), dtype=dtype))
                rings.append(len(k) - 1)
                continue
            if a.mla is not None:
                latent = np.zeros((n_ctx, 1, a.mla.kv_lora_rank + a.rot_dim), dtype=dtype)
                k.append(latent)
                v.append(latent)
                continue
            k.append(np.zeros((n_ctx, a.n_kv_heads, a.head_dim), dtype=dtype))
            v.append(np.zeros((n_ctx, a.n_kv_heads, a.v_head_dim), dtype=dtype))
        return cls(
            k, v, n_ctx, conv=conv, recurrent=recurrent, index_k=index_k,
            compressed=compressed, compress_buf=bufs["cmp"], index_buf=bufs["idx"],
            ring=any(getattr(s.attention, "shared_kv", None) for s in spec.layers),
            ring_layers=tuple(rings),
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        arrays = {id(a): a for a in (*self.k, *self.v)}  # MLA layers share one array
        arrays |= {id(a): a for a in (*self.conv, *self.recurrent) if a is not None}
        arrays |= {id(a): a for a in self.index_k if a is not None}
        arrays |= {
            id(a): a for a in (*self.compressed, *self.compress_buf, *self.index_buf)
            if a is not None
        }  # fmt: skip
        return sum(a.nbytes for a in arrays.values())


def ring_window(
    ring: np.ndarray, new: np.ndarray, pos0: int, window: int
) -> tuple[np.ndarray, int]:
    """The rows a chunk of queries at positions pos0 .. pos0 + n - 1 sees through a sliding
    window, from a ring of the last positions' rows (position p in row p % len(ring), len(ring)
    >= window - 1 or every position so far), and the chunk's last rows written into the ring.

    ring: [rows, ...] (f32 or f16; updated in place); new: [n, ...] the chunk's rows (any float
    dtype; stored, and returned, in the ring's dtype). Returns (rows, base): rows [pos0 + n -
    base, ...] of positions base .. pos0 + n - 1 (the ring's rows, then the chunk's), base =
    max(0, pos0 - window + 1). Used by DeepSeek-V4's window and Gemma 4's sliding layers.
    """
    base, n = max(0, pos0 - window + 1), new.shape[0]
    new = new.astype(ring.dtype)
    rows = np.concatenate([ring[np.arange(base, pos0) % len(ring)], new])
    keep = min(n, len(ring))
    ring[np.arange(pos0 + n - keep, pos0 + n) % len(ring)] = new[n - keep :]
    return rows, base


def _ring_rows(a: AttentionSpec, n_ctx: int) -> int:
    """Rows of a layer's key / value ring: its window for a kv_ring layer, else n_ctx."""
    return min(a.window, n_ctx) if getattr(a, "kv_ring", False) and a.window > 0 else n_ctx


def _v4_entries(v4: Any, n_ctx: int) -> int:
    """Rows of a DeepSeek-V4 layer's compressed-entry arrays for n_ctx positions."""
    return n_ctx // v4.compressor.compress_rate + 1


def _v4_cache_nbytes(a: AttentionSpec, n_ctx: int, itemsize: int) -> int:
    """Bytes of one DeepSeek-V4 layer's KVCache arrays (KVCache.allocate's)."""
    v4 = a.shared_kv
    total = min(v4.sliding_window, n_ctx) * a.head_dim * itemsize
    for c in (v4.compressor, v4.index_compressor):
        if c is not None:
            total += 2 * 2 * c.compress_rate * c.head_dim * (1 + c.overlap) * 4
    if v4.compressor is not None:
        total += _v4_entries(v4, n_ctx) * a.head_dim * 4
    if v4.index_compressor is not None:
        total += _v4_entries(v4, n_ctx) * v4.index_compressor.head_dim * itemsize
    return total


class Model:
    """Dense weights of one store, resident in RAM, and the per-layer steps.

    activations: "q8_0" (quantized weights multiply Q8_0-quantized activations, see
    ops.matmul_q8; float weights stay f32), "q8_k" (the default: as q8_0, but experts whose
    gate, up and down are all Q8K_ACT_TYPES run ops.expert_ffn_q8k on Q8_K activations, the
    shared expert and dense MLP by the same rule, and dense Q8K_ACT_TYPES matrices
    ops.matmul_q8k) or "f32" (exact).
    pad: every matmul and expert FFN runs on rows padded to a multiple of `pad` (4: each
    row's result is the same in any batch; 1: no padding, fastest alone). dense=False loads no
    dense tensor: only expert_ffn works (an expert owner on another machine, colibri/cluster).
    Raises StoreError when a tensor the spec names is missing or has the wrong shape.
    """

    def __init__(
        self,
        store: Store,
        spec: ModelSpec,
        nthreads: int = 0,
        activations: str = "q8_k",
        pad: int = 1,
        dense: bool = True,
    ):
        self.store, self.spec, self.nthreads, self.pad = store, spec, nthreads, pad
        if activations not in ("f32", "q8_0", "q8_k"):
            raise ValueError(f"activations={activations!r}: must be f32, q8_0 or q8_k")
        self.act_q8 = activations in ("q8_0", "q8_k")
        self.act_q8k = activations == "q8_k"
        # Gated DeltaNet prefill of >= GDR_CHUNK tokens in the chunked form (numpy) instead of
        # the recurrent C kernel; off: on the real Qwen3.5 shape the kernel is ~3x faster
        # (0.4 vs 1.3 ms per token and layer at 256 tokens, one thread). Same results.
        self.gdr_chunked = False
        self._names = set(store.dense_names())
        self.hc_head: tuple[Linear, np.ndarray, np.ndarray] | None = None
        self.ple: dict[str, Any] | None = None  # Gemma 4 per-layer inputs
        # kv_ring layer -> the last layer reading its cache (kv_shared_from; KVCache.window_rows)
        self._ring_sharers = {
            la.attention.kv_shared_from: la.index
            for la in spec.layers
            if la.attention.kv_shared_from is not None
            and getattr(spec.layers[la.attention.kv_shared_from].attention, "kv_ring", False)
        }
        if dense:
            self._load_dense()
        layout = store.layout
        self.d_ff = layout.d_ff
        # per layer (None = the default layout): tensor spans, (gate, up, down) types, act_q8
        self._experts = {
            key: self._expert_plan(store.layout_for(key) if key is not None else layout)
            for key in [None, *store.moe_layers]
        }
        self.expert_qtype = self._experts[None][1][0]  # the default layout's gate type
        # records reach expert_ffn(_group) X16-packed (x16_record, run by the engine's cache
        # on each read when every record stays resident)
        self.x16_experts = False

    # ---- loading -------------------------------------------------------------------------
    def _load_dense(self) -> None:
        spec = self.spec
        self.embed_w, self.embed_qtype = self._raw(
            f"{spec.embed}.weight", (spec.vocab_size, spec.d_model)
        )
        self.final_norm = self._vector(f"{spec.final_norm}.weight", spec.d_model)
        if spec.norm_offset:
            self.final_norm = self.final_norm + np.float32(spec.norm_offset)
        self.lm_head = self._linear(spec.lm_head, spec.vocab_size, spec.d_model)
        self.ple = self._load_ple() if spec.per_layer_input is not None else None
        self.layers = [self._load_layer(layer) for layer in spec.layers]
        self._pack_x16()
        if spec.hc is not None:  # DeepSeek-V4's hyper-connection head
            N = spec.hc.hc_mult
            self.hc_head = (
                self._f32_linear(spec.hc.head_fn, N, N * spec.d_model),
                self._vector(spec.hc.head_base, N),
                self._vector(spec.hc.head_scale, 1),
            )

    def _pack_x16(self) -> None:
        """The decode layout (Linear.pack_x16) for the dense weights every token streams from
        memory: the LM head, the projections of plain attention layers (q, k, v fused or not,
        o) and dense MLPs / shared experts (gate, up, down together, _x16_ffn_ok); other
        Linears keep GGML rows (some are read as rows: MLA's kv_b). All of them go into one
        mapping on huge pages (ops.empty_huge), each at a 4 KiB boundary: a mapping each
        would round every tensor up to whole 2 MiB pages (+18 MiB of RSS on the demo model)."""
        todo: list[Linear] = [self.lm_head] if self.lm_head.x16_packable() else []
        fused: list[tuple[dict[str, Any], list[Linear]]] = []  # layers whose qkv is packed
        for spec, w in zip(self.spec.layers, self.layers, strict=True):
            a = spec.attention
            if spec.linear_attn is not None or a.shared_kv is not None or a.mla is not None:
                continue
            parts = [w[k] for k in ("q", "k", "v") if k in w]
            if "qkv" in w:  # the parts are views into it: pack it when they stay whole tiles
                if all(p.rows % 16 == 0 for p in parts) and w["qkv"].x16_packable():
                    todo.append(w["qkv"])
                    fused.append((w, parts))
            else:
                todo += [p for p in parts if p.x16_packable()]
            if isinstance(w.get("o"), Linear) and w["o"].x16_packable():
                todo.append(w["o"])
        for w in self.layers:  # dense MLPs and shared experts: all three packed, or none
            for kind in ("mlp", "shared"):
                if kind in w and self._x16_ffn_ok(w[kind]):
                    todo += list(w[kind])
        if not todo:
            return
        page = 4096
        spans = [-(-lin.w.nbytes // page) * page for lin in todo]
        arena, off = ops.empty_huge(sum(spans)), 0
        for lin, span in zip(todo, spans, strict=True):
            lin.pack_x16(out=arena[off : off + lin.w.nbytes])  # (the old W goes)
            off += span
        for w, parts in fused:  # q, k, v (and k + v: kv_rows) become views of the packed
            qkv, r = w["qkv"], 0  # rows, whole tiles: packed too (the old rows can go)
            for p in parts:
                p.w, p.x16 = qkv.w[r : r + p.rows], True
                r += p.rows
            if "kv_rows" in w:
                kv, nq = w["kv_rows"], parts[0].rows
                kv.w, kv.x16 = qkv.w[nq : nq + kv.rows], True

    @staticmethod
    def _x16_ffn_ok(lins: tuple[Linear, Linear, Linear]) -> bool:
        """Whether a dense FFN's (gate, up, down) can run X16-packed (ops.expert_ffn x16):
        one X16 type on Q8_0 activations, shapes with the layout, a CPU with the kernels."""
        gate, up, down = lins
        qt = gate.qtype
        return (
            ops.x16_fast()
            and qt in ops.X16_TYPES
            and all(lin.qtype == qt and lin.act_q8 and not lin.act_q8k for lin in lins)
            and all(isinstance(lin.w, np.ndarray) and lin.w.dtype == np.uint8 for lin in lins)
            and ops.x16_ok(qt, gate.rows, gate.cols)
            and ops.x16_ok(qt, up.rows, up.cols)
            and ops.x16_ok(qt, down.rows, down.cols)
        )

    def _expert_plan(
        self, layout: ExpertLayout
    ) -> tuple[dict[str, tuple[int, int]], tuple[QType, ...], bool]:
        """(tensor name -> (offset, nbytes), (gate, up, down) qtypes, act_q8) of a layout."""
        spans = {name: (t.offset, t.nbytes) for name, t in layout.tensors.items()}
        qts = tuple(QType.parse(q) for q in layout.weight_qtypes)
        blocks = layout.d_model % 32 == 0 and layout.d_ff % 32 == 0  # Q8_0 rows (fp8: any)
        return spans, qts, self.act_q8 and blocks and all(q in ops.Q8_ACT_TYPES for q in qts)

    def _raw(
        self, name: str, shape: tuple[int, ...], widen: bool = False
    ) -> tuple[np.ndarray, QType]:
        """Tensor `name` as stored (f16/bf16 kept 2 bytes wide for the kernels), or widened
        to float32 when `widen`; checked against the logical `shape`."""
        if name not in self._names:
            raise StoreError(f"{self.store.path}: dense tensor {name!r} is missing")
        data, qtype, logical = self.store.dense(name, widen=widen)
        if tuple(logical) != tuple(shape):
            raise StoreError(
                f"{self.store.path}: tensor {name!r} has shape {list(logical)}, "
                f"expected {list(shape)}"
            )
        return data, QType.parse(qtype)

    def _vector(self, name: str, n: int) -> np.ndarray:
        data, qtype = self._raw(name, (n,), widen=True)
        if qtype not in (QType.F32, QType.F16, QType.BF16):  # block bytes are no floats
            raise StoreError(
                f"{self.store.path}: dense tensor {name!r} is {qtype.name.lower()}; norms, "
                "biases and vectors must be f32, f16 or bf16"
            )
        return np.ascontiguousarray(data, dtype=np.float32)

    def _linear(self, prefix: str, rows: int, cols: int) -> Linear:
        w, qtype = self._raw(f"{prefix}.weight", (rows, cols))
        bias = self._vector(f"{prefix}.bias", rows) if f"{prefix}.bias" in self._names else None
        lin = Linear(w, qtype, rows, cols, bias, act_q8=self.act_q8, act_q8k=self.act_q8k)
        lin.pad = self.pad
        return lin

    def _f32_linear(self, name: str, rows: int, cols: int) -> Linear:
        """A bare-named 2-D f32 tensor (hyper-connection maps) as a Linear without bias."""
        w, _ = self._raw(name, (rows, cols), widen=True)
        return Linear(np.ascontiguousarray(w, dtype=np.float32), _F32, rows, cols, None)

    def _load_shared_kv(self, spec: LayerSpec) -> dict[str, object]:
        """DeepSeek-V4 attention weights (spec.SharedKVSpec): q_a, q_a_norm, q_b, kv, kv_norm,
        o_a as one Linear per group (views of its row blocks), o_b; the compressors' wkv, wgate,
        ape, norm (prefixes cmp_ / idx_cmp_), the indexer's wq_b and weights_proj; the
        hyper-connection maps; a hash layer's tid2eid (int32 [vocab, top_k], checked)."""
        a, d, n = spec.attention, self.spec.d_model, spec.names
        v, H, hd = a.shared_kv, a.n_heads, a.head_dim
        w: dict[str, object] = {
            "q_a": self._linear(n["q_a"], v.q_lora_rank, d),
            "q_a_norm": self._vector(f"{n['q_a_norm']}.weight", v.q_lora_rank),
            "q_b": self._linear(n["q_b"], H * hd, v.q_lora_rank),
            "kv": self._linear(n["kv"], hd, d),
            "kv_norm": self._vector(f"{n['kv_norm']}.weight", hd),
            "o_b": self._linear(n["o_b"], d, v.o_groups * v.o_lora_rank),
        }
        g, r = v.o_groups, v.o_lora_rank
        o_a = self._linear(n["o_a"], g * r, H * hd // g)
        groups = []
        for j in range(g):
            part = Linear(
                o_a.w[j * r : (j + 1) * r], o_a.qtype, r, o_a.cols, None, self.act_q8, self.act_q8k
            )
            part.pad = self.pad
            groups.append(part)
        w["o_a"] = tuple(groups)
        for pre, c in (("cmp", v.compressor), ("idx_cmp", v.index_compressor)):
            if c is None:
                continue
            width = c.head_dim * (1 + c.overlap)
            w[f"{pre}_wkv"] = self._linear(n[f"{pre}_wkv"], width, d)
            w[f"{pre}_wgate"] = self._linear(n[f"{pre}_wgate"], width, d)
            ape, _ = self._raw(n[f"{pre}_ape"], (c.compress_rate, width), widen=True)
            w[f"{pre}_ape"] = np.ascontiguousarray(ape, dtype=np.float32)
            w[f"{pre}_norm"] = self._vector(f"{n[f'{pre}_norm']}.weight", c.head_dim)
        if v.index_compressor is not None:
            x = a.indexer
            w["idx_wq_b"] = self._linear(n["idx_wq_b"], x.index_n_heads * x.index_head_dim,
                                         v.q_lora_rank)  # fmt: skip
            w["idx_weights_proj"] = self._linear(n["idx_weights_proj"], x.index_n_heads, d)
        hc = self.spec.hc
        if hc is not None:
            N = hc.hc_mult
            for b in ("attn", "ffn"):
                w[f"hc_{b}_fn"] = self._f32_linear(n[f"hc_{b}_fn"], (2 + N) * N, N * d)
                w[f"hc_{b}_base"] = self._vector(n[f"hc_{b}_base"], (2 + N) * N)
                w[f"hc_{b}_scale"] = self._vector(n[f"hc_{b}_scale"], 3)
        if spec.hash_routed:
            k, E = self.spec.moe.router.top_k, self.spec.moe.router.num_experts
            table, _ = self._raw(n["tid2eid"], (self.spec.vocab_size, k), widen=True)
            ids = np.asarray(table, dtype=np.float64)
            if not (np.isfinite(ids).all() and (ids == np.round(ids)).all()
                    and ids.min() >= 0 and ids.max() < E):  # fmt: skip
                raise StoreError(
                    f"{self.store.path}: {n['tid2eid']} must hold expert ids in [0, {E})"
                )
            w["tid2eid"] = ids.astype(np.int32)
        return w

    def _load_mla(self, spec: LayerSpec, absorbed: bool = False) -> dict[str, object]:
        """MLA weights. kv_b_proj [n_heads * (nope + v), kv_lora_rank] stored in a block type
        (MLA_KV_B_QTYPES) stays so, as the Linear "kv_b" (its bytes resident, read per head by
        ops.mla_absorb_q / mla_values); stored float (f32, or f16/bf16 widened by the store) it
        is kept absorbed, f32: w_uk [n_heads, nope, rank] (maps a query's nope part into the
        latent space) and w_uv_t [n_heads, rank, v] (maps an attention output over latents to
        values). absorbed: always the f32 arrays (the DSA layers' per-head path)."""
        a, d, n = spec.attention, self.spec.d_model, spec.names
        m, H = a.mla, a.n_heads
        r, nope = m.kv_lora_rank, m.qk_nope_head_dim
        w: dict[str, object] = {}
        if m.q_lora_rank is None:
            w["q"] = self._linear(n["q"], H * a.head_dim, d)
        else:
            w["q_a"] = self._linear(n["q_a"], m.q_lora_rank, d)
            w["q_a_norm"] = self._vector(f"{n['q_a_norm']}.weight", m.q_lora_rank)
            w["q_b"] = self._linear(n["q_b"], H * a.head_dim, m.q_lora_rank)
        w["kv_a"] = self._linear(n["kv_a"], r + a.rot_dim, d)
        w["kv_a_norm"] = self._vector(f"{n['kv_a_norm']}.weight", r)
        kv_b = self._linear(n["kv_b"], H * (nope + a.v_head_dim), r)
        if kv_b.bias is not None:
            raise StoreError(f"{self.store.path}: {n['kv_b']}.bias is not expected (MLA)")
        if not absorbed and kv_b.qtype in MLA_KV_B_QTYPES and kv_b.w.dtype == np.uint8:
            w["kv_b"] = kv_b  # read in its block type by ops.mla_absorb_q / mla_values
            return w | {"o": self._linear(n["o"], d, H * a.v_head_dim)}
        full = ops.dequantize(kv_b.w, kv_b.qtype, (kv_b.rows, r)).reshape(H, -1, r)
        w["w_uk"] = np.ascontiguousarray(full[:, :nope, :])
        w["w_uv_t"] = np.ascontiguousarray(full[:, nope:, :].transpose(0, 2, 1))
        w["o"] = self._linear(n["o"], d, H * a.v_head_dim)
        return w

    def _load_ple(self) -> dict[str, object]:
        """Per-layer input embedding weights (models.spec.PerLayerInputSpec): the table as
        stored (rows dequantized per token), the projection and its norm."""
        p, d = self.spec.per_layer_input, self.spec.d_model
        lp = len(self.spec.layers) * p.hidden_size_per_layer_input
        table = self._raw(f"{p.embed}.weight", (p.vocab_size_per_layer_input, lp))
        return {
            "embed": table,
            "projection": self._linear(p.projection, lp, d),
            "norm": self._vector(f"{p.norm}.weight", p.hidden_size_per_layer_input),
        }

    def _load_indexer(self, spec: LayerSpec) -> dict[str, object]:
        """The DSA indexer's weights (spec.IndexerSpec): wq_b, wk, weights_proj and the
        LayerNorm k_norm's weight and bias."""
        x, n, d = spec.attention.indexer, spec.names, self.spec.d_model
        hd, q_rank = x.index_head_dim, spec.attention.mla.q_lora_rank
        return {
            "idx_wq_b": self._linear(n["idx_wq_b"], x.index_n_heads * hd, q_rank),
            "idx_wk": self._linear(n["idx_wk"], hd, d),
            "idx_k_norm": self._vector(f"{n['idx_k_norm']}.weight", hd),
            "idx_k_norm_bias": self._vector(f"{n['idx_k_norm']}.bias", hd),
            "idx_weights_proj": self._linear(n["idx_weights_proj"], x.index_n_heads, d),
        }

    def _load_layer(self, spec: LayerSpec) -> dict[str, object]:
        a, d, n = spec.attention, self.spec.d_model, spec.names
        w: dict[str, object] = {
            "input_norm": self._vector(f"{n['input_norm']}.weight", d),
            "post_norm": self._vector(f"{n['post_norm']}.weight", d),
        }
        if spec.linear_attn is not None:
            w |= self._load_linear_attn(spec)
        elif a.shared_kv is not None:
            w |= self._load_shared_kv(spec)
        elif a.mla is not None:
            w |= self._load_mla(spec, absorbed=a.indexer is not None)
            if a.indexer is not None:  # absorbed kv_b per head, laid out for ops.matmul
                w["w_uk_t"] = np.ascontiguousarray(w.pop("w_uk").transpose(0, 2, 1))
                w["w_uv"] = np.ascontiguousarray(w.pop("w_uv_t").transpose(0, 2, 1))
                if not a.indexer.shared:
                    w |= self._load_indexer(spec)
        elif a.kv_shared_from is not None or a.k_eq_v:  # Gemma 4: no v_proj (or no k/v)
            w["q"] = self._linear(n["q"], a.n_heads * a.head_dim, d)
            if a.kv_shared_from is None:
                w["k"] = self._linear(n["k"], a.n_kv_heads * a.head_dim, d)
            w["o"] = self._linear(n["o"], d, a.n_heads * a.v_head_dim)
        else:
            w |= {
                "q": self._linear(n["q"], a.n_heads * a.head_dim * (1 + a.output_gate), d),
                "k": self._linear(n["k"], a.n_kv_heads * a.head_dim, d),
                "v": self._linear(n["v"], a.n_kv_heads * a.v_head_dim, d),
                "o": self._linear(n["o"], d, a.n_heads * a.v_head_dim),
            }
            if (qkv := _fuse((w["q"], w["k"], w["v"]))) is not None:
                w["qkv"] = qkv
                # k and v as one Linear (their rows of qkv, a view): the keys and values of
                # rows whose queries are not needed (Model.attention_rows)
                nq = w["q"].rows
                kv = Linear(
                    qkv.w[nq:], qkv.qtype, qkv.rows - nq, qkv.cols,
                    None if qkv.bias is None else qkv.bias[nq:], qkv.act_q8, qkv.act_q8k,
                )  # fmt: skip
                kv.pad = qkv.pad
                w["kv_rows"] = kv
        if a.qk_norm == "head":
            w["q_norm"] = self._vector(f"{n['q_norm']}.weight", a.head_dim)
            if "k_norm" in n:  # absent on layers sharing another's keys (kv_shared_from)
                w["k_norm"] = self._vector(f"{n['k_norm']}.weight", a.head_dim)
        elif a.qk_norm == "full":
            w["q_norm"] = self._vector(f"{n['q_norm']}.weight", a.n_heads * a.head_dim)
            w["k_norm"] = self._vector(f"{n['k_norm']}.weight", a.n_kv_heads * a.head_dim)
        if a.sinks:
            w["sinks"] = self._vector(n["sinks"], a.n_heads)
        moe_spec = self.spec.moe
        if spec.moe:
            w["router"] = self._linear(n["router"], moe_spec.router.num_experts, d)
            if n.get("correction_bias") == f"{n['router']}.bias":  # DeepSeek-V4's gate.bias
                w["router"].bias = None  # is the correction bias, not the router's
            if "correction_bias" in n:
                w["correction_bias"] = self._vector(
                    n["correction_bias"], moe_spec.router.num_experts
                )
        for kind in ("shared", "mlp"):
            if f"{kind}_gate_proj" in n:
                gate_name = n[f"{kind}_gate_proj"]
                rows = self.store.manifest["dense"][f"{gate_name}.weight"]["shape"][0]
                w[kind] = tuple(
                    self._linear(n[f"{kind}_{p}_proj"], *shape)
                    for p, shape in (("gate", (rows, d)), ("up", (rows, d)), ("down", (d, rows)))
                )
        if "shared_expert_gate" in n:
            w["shared_expert_gate"] = self._linear(n["shared_expert_gate"], 1, d)
        w |= self._load_gemma(spec)
        if self.spec.norm_offset:  # zero-centred RMSNorm weights (ModelSpec.norm_offset)
            for role in ("input_norm", "post_norm", "q_norm", "k_norm"):
                if role in w:
                    w[role] = w[role] + np.float32(self.spec.norm_offset)
        return w

    def _load_gemma(self, spec: LayerSpec) -> dict[str, object]:
        """The Gemma 4 roles a layer has (LayerSpec: sandwich norms, router scales, per-layer
        input gate and projection, layer_scalar); {} for other families."""
        n, d = spec.names, self.spec.d_model
        w: dict[str, object] = {
            role: self._vector(f"{n[role]}.weight", d) for role in GEMMA_NORMS if role in n
        }
        if "router_scale" in n:
            w["router_scale"] = self._vector(n["router_scale"], d)
        if "per_expert_scale" in n:
            e = self.spec.moe.router.num_experts
            w["per_expert_scale"] = self._vector(n["per_expert_scale"], e)
        if "layer_scalar" in n:
            w["layer_scalar"] = self._vector(n["layer_scalar"], 1)
        if "ple_gate" in n:
            p = self.spec.per_layer_input.hidden_size_per_layer_input
            w["ple_gate"] = self._linear(n["ple_gate"], p, d)
            w["ple_proj"] = self._linear(n["ple_proj"], d, p)
        return w

    def _load_linear_attn(self, spec: LayerSpec) -> dict[str, object]:
        """Gated DeltaNet weights (models.spec.GatedDeltaNetSpec). Qwen3-Next's fused
        in_proj_qkvz / in_proj_ba outputs are grouped per key head; `qkvz_order` / `ba_order`
        gather them into [q | k | v | z] and [b | a] (head-major within each)."""
        g, d, n = spec.linear_attn, self.spec.d_model, spec.names
        assert g is not None
        hk, hv = g.linear_num_key_heads, g.linear_num_value_heads
        dk, dv, r = g.linear_key_head_dim, g.linear_value_head_dim, hv // hk
        w: dict[str, object] = {}
        if g.fused_qkvz:
            w["in_proj_qkvz"] = self._linear(n["in_proj_qkvz"], 2 * g.key_dim + 2 * g.value_dim, d)
            w["in_proj_ba"] = self._linear(n["in_proj_ba"], 2 * hv, d)
            idx = np.arange(hk * (2 * dk + 2 * r * dv)).reshape(hk, -1)
            cuts = np.cumsum([0, dk, dk, r * dv, r * dv])
            w["qkvz_order"] = np.concatenate(
                [idx[:, a:b].ravel() for a, b in itertools.pairwise(cuts)]
            )
            idx = np.arange(2 * hv).reshape(hk, 2 * r)
            w["ba_order"] = np.concatenate([idx[:, :r].ravel(), idx[:, r:].ravel()])
        else:
            w["in_proj_qkv"] = self._linear(n["in_proj_qkv"], g.conv_dim, d)
            w["in_proj_z"] = self._linear(n["in_proj_z"], g.value_dim, d)
            w["in_proj_b"] = self._linear(n["in_proj_b"], hv, d)
            w["in_proj_a"] = self._linear(n["in_proj_a"], hv, d)
        kernel = g.linear_conv_kernel_dim
        conv, _ = self._raw(f"{n['conv1d']}.weight", (g.conv_dim, 1, kernel))
        w["conv1d"] = np.ascontiguousarray(conv, dtype=np.float32).reshape(g.conv_dim, kernel)
        w["dt_bias"] = self._vector(n["dt_bias"], hv)
        w["A"] = -np.exp(self._vector(n["A_log"], hv))
        w["linear_norm"] = self._vector(f"{n['linear_norm']}.weight", dv)
        w["o"] = self._linear(n["o"], d, g.value_dim)
        return w

    @property
    def dense_nbytes(self) -> int:
        """Bytes of resident weights (all dense tensors of the store)."""
        total = self.embed_w.nbytes + self.final_norm.nbytes + self.lm_head.nbytes
        for w in self.layers:
            for key, v in w.items():
                if key in ("qkv", "kv_rows"):  # views of q, k and v's weights
                    continue
                items = v if isinstance(v, tuple) else (v,)
                total += sum(i.nbytes for i in items)
        if self.spec.lm_head == self.spec.embed:
            total -= self.lm_head.nbytes
        if self.hc_head is not None:
            total += sum(i.nbytes for i in self.hc_head)
        if self.ple is not None:
            total += self.ple["embed"][0].nbytes + self.ple["projection"].nbytes
            total += self.ple["norm"].nbytes
        return total

    # ---- steps ---------------------------------------------------------------------------
    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """tokens int [n] -> f32 [n, d_model]."""
        out = np.empty((len(tokens), self.spec.d_model), dtype=np.float32)
        ops.dequantize(self.embed_w[tokens], self.embed_qtype, out.shape, out=out)
        if self.spec.embed_scale != 1.0:  # Gemma: times sqrt(hidden_size), in f32
            out *= np.float32(self.spec.embed_scale)
        if self.spec.hc is not None:  # hyper-connections: hc_mult copies, f32 [n, N, d_model]
            return np.repeat(out[:, None, :], self.spec.hc.hc_mult, axis=1)
        return out

    def per_layer_inputs(self, tokens: np.ndarray, x: np.ndarray) -> np.ndarray | None:
        """Gemma 4's per-layer inputs (models.spec.PerLayerInputSpec) of tokens int [n] with
        embeddings x f32 [n, d_model] (embed()): f32 [n, num_layers, P], or None when the
        model has none. Gemma4TextModel.get_per_layer_inputs + project_per_layer_inputs."""
        if self.ple is None:
            return None
        p, n, L = self.spec.per_layer_input, len(tokens), len(self.spec.layers)
        P = p.hidden_size_per_layer_input
        table, qtype = self.ple["embed"]
        emb = np.empty((n, L * P), dtype=np.float32)
        ops.dequantize(table[tokens], qtype, emb.shape, out=emb)
        emb *= np.float32(P**0.5)
        proj = self.ple["projection"](x, nthreads=self.nthreads)
        proj *= np.float32(self.spec.d_model**-0.5)
        proj = proj.reshape(n * L, P)
        ops.rmsnorm(proj, proj, self.ple["norm"], self.spec.norm_eps)
        out = proj.reshape(n, L, P) + emb.reshape(n, L, P)
        out *= np.float32(2.0**-0.5)
        return out

    def attention(self, i: int, x: np.ndarray, kv: KVCache, pos0: int) -> None:
        """x += attention(input_norm(x)) for layer i; writes the layer's keys/values at
        positions pos0 .. pos0 + n - 1 of kv. x: f32 [n, d_model], updated in place."""
        w, n = self.layers[i], x.shape[0]
        if self.spec.layers[i].attention.shared_kv is not None:  # DeepSeek-V4, x [n, N, d]
            pre, post, comb = self._hc(i, "attn", x)
            h = dsv4.hc_collapse(x, pre)
            ops.rmsnorm(h, h, w["input_norm"], self.spec.norm_eps)
            dsv4.hc_expand(x, self._attention_v4(i, h, kv, pos0), post, comb)
            return
        h = np.empty_like(x)
        ops.rmsnorm(h, x, w["input_norm"], self.spec.norm_eps)
        if self.spec.layers[i].linear_attn is not None:
            out = self._gated_deltanet(i, h, kv)
        elif self.spec.layers[i].attention.indexer is not None:
            out = self._attention_dsa(i, h, kv, pos0)
        elif self.spec.layers[i].attention.mla is not None:
            out = self._attention_mla(i, h, kv, pos0)
        elif self.spec.layers[i].attention.v_norm:
            out = self._attention_gemma(i, h, kv, pos0)
        else:
            out = self._attention_gqa(i, h, kv, pos0)
        y = w["o"](out.reshape(n, -1), nthreads=self.nthreads)
        if "attn_post_norm" in w:  # Gemma: the attention output is normed before the residual
            ops.rmsnorm(y, y, w["attn_post_norm"], self.spec.norm_eps)
        x += y

    def _plain_gqa(self, i: int, exact: bool = False) -> bool:
        """True when layer i is grouped-query attention (no linear attention, MLA, DSA,
        DeepSeek-V4 or Gemma 4 attention, no hyper-connections) whose projections are
        row-invariant (Linear.row_invariant; with `exact` also the f32-activation matmuls
        of _rows_exact): its rows may be stacked (or, exact, left out)."""
        w, a = self.layers[i], self.spec.layers[i].attention
        lins = [w["qkv"]] if "qkv" in w else [w.get("q"), w.get("k"), w.get("v")]
        if exact:
            lins = [w.get("q"), w.get("kv_rows", w.get("k")), w.get("v")]
        plain = (
            self.spec.layers[i].linear_attn is None
            and a.indexer is None
            and a.mla is None
            and a.shared_kv is None
            and self.spec.hc is None
            and not a.v_norm  # Gemma 4: its own attention, output normed before the residual
            and "attn_post_norm" not in w
        )
        ok = _rows_exact if exact else (lambda x: x.row_invariant)
        return plain and all(x is not None and ok(x) for x in [*lins, w["o"]])

    def _rows_core(self, i: int) -> Any:
        """The attention of layer i as f(i, h, kv, pos0, q_start) -> f32 [n - q_start, heads,
        dv] (every row's cache entries, the queries and output of rows q_start.. only) when
        it has one and its projections are row-exact (_rows_exact), else None: multi-head
        latent attention (no DSA indexer) with kv_b_proj read in its block type
        (ops.mla_absorb_q / mla_values, row by row), Gemma 4's attention."""
        spec, w = self.spec.layers[i], self.layers[i]
        a = spec.attention
        if spec.linear_attn is not None or a.shared_kv is not None or self.spec.hc is not None:
            return None
        lins = [w[k] for k in ("q", "q_a", "q_b", "kv_a", "k", "v", "o") if k in w]
        if not all(_rows_exact(lin) for lin in lins):
            return None
        if a.mla is not None and a.indexer is None and "kv_b" in w:
            return self._attention_mla if "attn_post_norm" not in w else None
        return self._attention_gemma if a.v_norm and a.mla is None else None

    def attention_batch(
        self, i: int, xs: list[np.ndarray], kvs: list[KVCache], pos0: list[int]
    ) -> None:
        """attention(i, xs[s], kvs[s], pos0[s]) for every sequence s, with the same bits: when
        layer i is grouped-query attention whose q/k/v/o kernels are row-invariant
        (Linear.row_invariant), the sequences' rows are stacked for the projections (one
        weight pass for the batch) and only the attention proper runs per sequence."""
        if len(xs) < 2 or not self._plain_gqa(i):
            for x, kv, p in zip(xs, kvs, pos0, strict=True):
                self.attention(i, x, kv, p)
            return
        w = self.layers[i]
        x = np.concatenate(xs)
        h = np.empty_like(x)
        ops.rmsnorm(h, x, w["input_norm"], self.spec.norm_eps)
        q, k, v = self._gqa_project(i, h)
        outs, r = [], 0
        for xi, kv, p in zip(xs, kvs, pos0, strict=True):
            n = xi.shape[0]
            outs.append(self._gqa_core(i, q[r : r + n], k[r : r + n], v[r : r + n], kv, p))
            r += n
        y = w["o"](np.concatenate(outs).reshape(x.shape[0], -1), nthreads=self.nthreads)
        r = 0
        for xi in xs:
            xi += y[r : r + xi.shape[0]]
            r += xi.shape[0]

    def attention_rows(
        self,
        i: int,
        xs: list[np.ndarray],
        kvs: list[KVCache],
        pos0: list[int],
        starts: list[int],
    ) -> list[np.ndarray]:
        """Layer i's attention for sequences whose later computation needs only their rows
        from starts[s] on (the last layer of a forward: the rows whose logits are wanted).
        Every row's keys and values (and any state later tokens read: recurrent and conv
        state, compressor windows, indexer keys, shared caches) are written as
        attention_batch(i, xs, kvs, pos0) writes them; returns per sequence its rows
        x_s[starts[s]:] after the attention's residual, f32 [n_s - starts[s], ...] (views of
        xs or new arrays), the bits attention_batch gives them.

        Grouped-query attention with row-invariant projections (_plain_gqa, exact) projects
        keys and values of every row but queries, attention and the output projection of the
        kept rows only (each kernel computes a row alike whatever rows share its call; the
        attention's key blocks sit on absolute positions), the sequences' rows stacked as
        attention_batch stacks them; any other attention runs on every row, then the kept
        rows are taken. Multi-head latent attention and Gemma 4's (_rows_core) likewise write
        every row's cache entries and compute queries, attention and output of the kept
        rows (a Gemma 4 layer reading another's keys: nothing for the other rows)."""
        core = self._rows_core(i)
        if core is not None:  # keys / latents of every row, the rest of the kept rows
            w, res = self.layers[i], []
            for x, kv, p, s in zip(xs, kvs, pos0, starts, strict=True):
                h = np.empty_like(x)
                ops.rmsnorm(h, x, w["input_norm"], self.spec.norm_eps)
                out = core(i, h, kv, p, s)
                y = w["o"](out.reshape(len(out), -1), nthreads=self.nthreads)
                if "attn_post_norm" in w:  # Gemma: normed before the residual
                    ops.rmsnorm(y, y, w["attn_post_norm"], self.spec.norm_eps)
                res.append(x[s:] + y)
            return res
        if not self._plain_gqa(i, exact=True):
            self.attention_batch(i, xs, kvs, pos0)
            return [x[s:] for x, s in zip(xs, starts, strict=True)]
        if len(xs) > 1 and not self._plain_gqa(i):  # f32 activations: calls per sequence
            return [
                self.attention_rows(i, [x], [kv], [p], [s])[0]
                for x, kv, p, s in zip(xs, kvs, pos0, starts, strict=True)
            ]
        w, t = self.layers[i], self.nthreads
        x = np.concatenate(xs) if len(xs) > 1 else xs[0]
        h = np.empty_like(x)
        ops.rmsnorm(h, x, w["input_norm"], self.spec.norm_eps)
        offs = np.cumsum([0] + [len(xi) for xi in xs])
        keep = np.concatenate(
            [np.arange(o + s, o + len(xi)) for o, s, xi in zip(offs, starts, xs, strict=False)]
        )
        hq = h[keep] if len(keep) < len(h) else h
        q = w["q"](hq, nthreads=t)
        if "kv_rows" in w:  # one quantization of h and one kernel call for k and v
            kv_all = w["kv_rows"](h, nthreads=t)
            nk = w["k"].rows
            k, v = kv_all[:, :nk], kv_all[:, nk:]
            if len(h) > 1:  # column slices of a batch are strided; the kernels want rows
                k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        else:
            k, v = w["k"](h, nthreads=t), w["v"](h, nthreads=t)
        outs, r = [], 0
        for xi, kv, p, o, s in zip(xs, kvs, pos0, offs, starts, strict=False):
            n, m = len(xi), len(xi) - s
            outs.append(self._gqa_core(i, q[r : r + m], k[o : o + n], v[o : o + n], kv, p, s))
            r += m
        y = w["o"](np.concatenate(outs).reshape(len(keep), -1), nthreads=t)
        res, r = [], 0
        for xi, s in zip(xs, starts, strict=True):
            m = len(xi) - s
            res.append(xi[s:] + y[r : r + m])
            r += m
        return res

    def _gqa_project(self, i: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q, k, v (f32 [n, rows], C-contiguous) of layer i's GQA on its normed input h."""
        w, n = self.layers[i], h.shape[0]
        if "qkv" in w:  # one quantization of h and one kernel call for q, k and v
            qkv = w["qkv"](h, nthreads=self.nthreads)
            nq, nk = w["q"].rows, w["k"].rows
            q, k, v = qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :]
            if n > 1:  # column slices of a batch are strided; the kernels want rows
                q, k, v = (np.ascontiguousarray(t) for t in (q, k, v))
            return q, k, v
        return (
            w["q"](h, nthreads=self.nthreads),
            w["k"](h, nthreads=self.nthreads),
            w["v"](h, nthreads=self.nthreads),
        )

    def _attention_gqa(self, i: int, h: np.ndarray, kv: KVCache, pos0: int) -> np.ndarray:
        """Grouped-query attention of layer i on its normed input h f32 [n, d_model]; writes
        the keys/values of positions pos0.. into kv. Returns f32 [n, n_heads, v_head_dim]."""
        return self._gqa_core(i, *self._gqa_project(i, h), kv, pos0)

    def _gqa_core(
        self,
        i: int,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        kv: KVCache,
        pos0: int,
        q_start: int = 0,
    ) -> np.ndarray:
        """GQA of layer i after the projections: k, v f32 [n, kv rows] of positions pos0 ..
        pos0 + n - 1 (written into kv), q f32 [m, q rows] of the last m = n - q_start of them
        (C-contiguous; q/k are normed and rotated in place). Returns f32
        [m, n_heads, v_head_dim]."""
        spec, w = self.spec.layers[i], self.layers[i]
        a, n, m = spec.attention, k.shape[0], q.shape[0]
        if m != n - q_start:
            raise ValueError(f"{m} query rows for {n} keys from row {q_start}")
        gate = None
        if a.output_gate:  # per head [query | output gate] (AttentionSpec.output_gate)
            qg = q.reshape(m, a.n_heads, 2 * a.head_dim)
            q = np.ascontiguousarray(qg[:, :, : a.head_dim]).reshape(m, -1)
            gate = qg[:, :, a.head_dim :]
        if a.qk_norm == "full":
            ops.rmsnorm(q, q, w["q_norm"], self.spec.norm_eps)
            ops.rmsnorm(k, k, w["k_norm"], self.spec.norm_eps)
        if a.clip_qkv is not None:  # after the q/k norm, as OlmoeAttention clamps
            for t in (q, k, v):
                np.clip(t, -a.clip_qkv, a.clip_qkv, out=t)
        q = q.reshape(m, a.n_heads, a.head_dim)
        k = k.reshape(n, a.n_kv_heads, a.head_dim)
        if a.qk_norm == "head":
            ops.rmsnorm(
                q.reshape(-1, a.head_dim),
                q.reshape(-1, a.head_dim),
                w["q_norm"],
                self.spec.norm_eps,
            )
            ops.rmsnorm(
                k.reshape(-1, a.head_dim),
                k.reshape(-1, a.head_dim),
                w["k_norm"],
                self.spec.norm_eps,
            )
        pos = np.arange(pos0, pos0 + n, dtype=np.int32)
        qpos = pos[q_start:]
        if a.rot_dim > 0:  # rot_dim 0: a no-RoPE layer (Llama 4 no_rope_layers)
            ops.rope(q, qpos, a.inv_freq, rot_dim=a.rot_dim, mscale=a.mscale, mode=a.rope_mode)
            ops.rope(k, pos, a.inv_freq, rot_dim=a.rot_dim, mscale=a.mscale, mode=a.rope_mode)
        if a.qk_norm == "l2" or a.floor_scale > 0:
            self._llama4_qk(a, q, k, qpos)
        kv.k[i][pos0 : pos0 + n] = k
        kv.v[i][pos0 : pos0 + n] = v.reshape(n, a.n_kv_heads, a.v_head_dim)
        out = np.empty((m, a.n_heads, a.v_head_dim), dtype=np.float32)
        if a.attention_chunk_size > 0:
            self._chunked_attention(i, out, q, kv, pos0 + q_start)
        else:
            ops.attention(
                out,
                q,
                kv.k[i],
                kv.v[i],
                n_kv=pos0 + n,
                q_pos0=pos0 + q_start,
                scale=a.scale,
                window=a.window,
                sinks=w.get("sinks"),
                nthreads=self.nthreads,
            )
        if gate is not None:
            out *= np.float32(1.0) / (np.float32(1.0) + np.exp(-gate))
        return out

    def _attention_gemma(
        self, i: int, h: np.ndarray, kv: KVCache, pos0: int, q_start: int = 0
    ) -> np.ndarray:
        """Gemma 4 attention of layer i on its normed input h f32 [n, d_model]
        (Gemma4TextAttention): per-head RMSNorm of q and k (weights) and of v (none), RoPE on
        q and k, softmax scale `a.scale`, the layer's sliding window. With k_eq_v the values
        are the key projection before its norm; with kv_shared_from the layer computes only
        queries and attends to that layer's cache (already holding these positions). Writes
        its own keys/values of positions pos0.. into kv: into its rings on kv.ring_layers
        (ring_window; one token is written in place and attends to the ring as it is, whose
        rows are then exactly its window's). With q_start, the queries and output of rows
        q_start.. only. Returns f32 [n - q_start, n_heads, head_dim]."""
        a, w, n = self.spec.layers[i].attention, self.layers[i], h.shape[0]
        eps, hd, m = self.spec.norm_eps, a.head_dim, n - q_start
        pos = np.arange(pos0, pos0 + n, dtype=np.int32)
        q = w["q"](h[q_start:] if q_start else h, nthreads=self.nthreads)
        q = q.reshape(m, a.n_heads, hd)
        ops.rmsnorm(q, q, w["q_norm"], eps)
        qpos = pos[q_start:]
        ops.rope(q, qpos, a.inv_freq, rot_dim=a.rot_dim, mscale=a.mscale, mode=a.rope_mode)
        src = i if a.kv_shared_from is None else a.kv_shared_from
        keys, values, base = kv.k[src], kv.v[src], 0
        if a.kv_shared_from is None:
            k = w["k"](h, nthreads=self.nthreads).reshape(n, a.n_kv_heads, hd)
            v = k.copy() if a.k_eq_v else w["v"](h, nthreads=self.nthreads)
            v = v.reshape(n, a.n_kv_heads, hd)
            ops.rmsnorm(k, k, w["k_norm"], eps)
            ops.rope(k, pos, a.inv_freq, rot_dim=a.rot_dim, mscale=a.mscale, mode=a.rope_mode)
            ops.rmsnorm(v, v, None, eps)
            if i in kv.ring_layers and n == 1:  # decode: the row into the ring, read in place
                kv.k[i][pos0 % a.window], kv.v[i][pos0 % a.window] = k[0], v[0]
            elif i in kv.ring_layers:  # the window's rows, the chunk's last ones into the rings
                keys, base = ring_window(kv.k[i], k, pos0, a.window)
                values, _ = ring_window(kv.v[i], v, pos0, a.window)
                if i in self._ring_sharers:
                    kv.window_rows[i] = (pos0, keys, values, base)
            else:
                kv.k[i][pos0 : pos0 + n] = k
                kv.v[i][pos0 : pos0 + n] = v
        if src in kv.ring_layers and n == 1:
            # one query: the ring holds exactly the rows it sees (positions base .. pos0, in
            # rotated order: attention does not depend on the keys' order), no copy
            base = max(0, pos0 - a.window + 1)
        elif a.kv_shared_from is not None and src in kv.ring_layers:  # the rows src saw
            at, keys, values, base = kv.window_rows[src]
            if at != pos0:
                raise ValueError(f"layer {i}: layer {src}'s window rows are of another chunk")
            if self._ring_sharers[src] == i:
                del kv.window_rows[src]
        out = np.empty((m, a.n_heads, hd), dtype=np.float32)
        ops.attention(
            out, q, keys, values, n_kv=pos0 + n - base, q_pos0=pos0 + q_start - base,
            scale=a.scale, window=a.window, nthreads=self.nthreads,
        )  # fmt: skip
        return out

    def _llama4_qk(self, a: AttentionSpec, q: np.ndarray, k: np.ndarray, pos: np.ndarray) -> None:
        """Llama4TextAttention after RoPE, in place on q f32 [m, H, d] and k [n, KV, d]: the
        weightless per-head RMSNorm (Llama4TextL2Norm, eps rms_norm_eps) when qk_norm is "l2",
        and attention temperature tuning when floor_scale > 0: q times
        1 + attn_scale * log1p(floor((pos + 1) / floor_scale)), in f32 as the reference, pos
        int32 [m] the queries' positions."""
        if a.qk_norm == "l2":
            ones = np.ones(a.head_dim, dtype=np.float32)
            for t in (q, k):
                flat = t.reshape(-1, a.head_dim)
                ops.rmsnorm(flat, flat, ones, self.spec.norm_eps)
        if a.floor_scale > 0:
            p = pos.astype(np.float32)
            f = np.floor((p + np.float32(1.0)) / np.float32(a.floor_scale))
            s = np.log1p(f) * np.float32(a.attn_scale) + np.float32(1.0)
            q *= s.astype(np.float32)[:, None, None]

    def _chunked_attention(
        self, i: int, out: np.ndarray, q: np.ndarray, kv: KVCache, pos0: int
    ) -> None:
        """Chunked local attention (Llama 4 attention_chunk_size C): the query at position p
        attends to keys j <= p with j // C == p // C (HF create_chunked_causal_mask). The
        queries are split at chunk boundaries and each group attends to its chunk's slice of
        the cache. out f32 [n, H, dv] is written."""
        a = self.spec.layers[i].attention
        C, n = a.attention_chunk_size, q.shape[0]
        t = 0
        while t < n:
            p = pos0 + t
            start = (p // C) * C
            m = min(n - t, start + C - p)
            ops.attention(
                out[t : t + m],
                np.ascontiguousarray(q[t : t + m]),
                kv.k[i][start:],
                kv.v[i][start:],
                n_kv=p + m - start,
                q_pos0=p - start,
                scale=a.scale,
                nthreads=self.nthreads,
            )
            t += m

    def _gated_deltanet(self, i: int, h: np.ndarray, kv: KVCache) -> np.ndarray:
        """Gated DeltaNet of layer i on its normed input h f32 [n, d_model] (Qwen3NextGatedDeltaNet
        / Qwen3_5MoeGatedDeltaNet), continuing the sequence's conv and recurrent state in kv.
        The recurrent kernel, or with `gdr_chunked` the chunked form for prefills of at least
        GDR_CHUNK tokens. Returns f32 [n, value_dim], before out_proj."""
        g, w = self.spec.layers[i].linear_attn, self.layers[i]
        assert g is not None
        n, t = h.shape[0], self.nthreads
        hk, hv = g.linear_num_key_heads, g.linear_num_value_heads
        dk, dv, kd = g.linear_key_head_dim, g.linear_value_head_dim, g.key_dim
        if g.fused_qkvz:
            qkvz = w["in_proj_qkvz"](h, nthreads=t)[:, w["qkvz_order"]]
            ba = w["in_proj_ba"](h, nthreads=t)[:, w["ba_order"]]
            mixed, z = qkvz[:, : g.conv_dim], qkvz[:, g.conv_dim :]
            b, a = ba[:, :hv], ba[:, hv:]
        else:
            mixed = w["in_proj_qkv"](h, nthreads=t)
            z = w["in_proj_z"](h, nthreads=t)
            b, a = w["in_proj_b"](h, nthreads=t), w["in_proj_a"](h, nthreads=t)
        x = deltanet.causal_conv1d(np.ascontiguousarray(mixed), kv.conv[i], w["conv1d"])
        q = deltanet.l2norm(x[:, :kd].reshape(n, hk, dk)) * np.float32(dk**-0.5)
        k = deltanet.l2norm(x[:, kd : 2 * kd].reshape(n, hk, dk))
        v = np.ascontiguousarray(x[:, 2 * kd :].reshape(n, hv, dv))
        beta = np.float32(1.0) / (np.float32(1.0) + np.exp(-b))
        sp = a + w["dt_bias"]  # softplus as torch: linear above 20
        sp = np.where(sp > 20, sp, np.log1p(np.exp(np.minimum(sp, 20)))).astype(np.float32)
        decay = np.ascontiguousarray(w["A"] * sp, dtype=np.float32)
        state = kv.recurrent[i]
        if self.gdr_chunked and n >= GDR_CHUNK:
            core = deltanet.chunk_gated_delta_rule(q, k, v, decay, beta, state, GDR_CHUNK)
        else:
            core = np.empty((n, hv, dv), dtype=np.float32)
            ops.gated_delta_rule(
                core, state, np.ascontiguousarray(q), np.ascontiguousarray(k), v, decay,
                np.ascontiguousarray(beta), nthreads=t,
            )  # fmt: skip
        core = core.reshape(n * hv, dv)
        ops.rmsnorm(core, core, w["linear_norm"], g.norm_eps)
        zz = np.ascontiguousarray(z.reshape(n * hv, dv))
        core *= ops.silu(zz, zz)
        return core.reshape(n, g.value_dim)

    def _attention_mla(
        self, i: int, h: np.ndarray, kv: KVCache, pos0: int, q_start: int = 0
    ) -> np.ndarray:
        """Multi-head latent attention of layer i on its normed input h f32 [n, d_model]; with
        q_start, every row's cache entry but the queries and output of rows q_start.. only.

        Caches the compressed form (normed latent c [rank] and rotated rope key k_r [rope] per
        position, KVCache) and attends in the latent space with kv_b_proj absorbed (DeepSeek-V2
        paper, section 2.1.2): for head h, q_nope . (W_UK_h c) = (W_UK_h^T q_nope) . c, so the
        query becomes [W_UK_h^T q_nope | q_rope], every head attends to the one shared entry
        [c | k_r] (MQA; the entry is also the value), and W_UV_h (sum p c) is applied after the
        softmax. Per cached token that costs n_heads * 2 (rank + rope) multiply-adds instead of
        expanding it through kv_b_proj on every step. Same math as transformers'
        expand-then-attend, summed in another order. Returns f32 [n - q_start, n_heads,
        v_head_dim].
        """
        a, w = self.spec.layers[i].attention, self.layers[i]
        m, H = a.mla, a.n_heads
        eps = m.norm_eps
        r, nope, rope = m.kv_lora_rank, m.qk_nope_head_dim, a.rot_dim
        hq = h[q_start:] if q_start else h
        n = hq.shape[0]  # query rows
        if "q" in w:
            q = w["q"](hq, nthreads=self.nthreads)
        else:
            qa = w["q_a"](hq, nthreads=self.nthreads)
            ops.rmsnorm(qa, qa, w["q_a_norm"], eps)
            q = w["q_b"](qa, nthreads=self.nthreads)
        q = q.reshape(n, H, nope + rope)
        cache, q_rope = self._mla_cache(i, h, q, kv, pos0, q_start)
        pos0 += q_start  # the queries' first position
        q_abs = np.empty((n, H, r + rope), dtype=np.float32)
        if "kv_b" in w:
            ops.mla_absorb_q(
                w["kv_b"].w, w["kv_b"].qtype, q, q_abs, nope=nope, dv=a.v_head_dim, rank=r,
                nthreads=self.nthreads,
            )  # fmt: skip
        else:
            uk = np.matmul(q[:, :, :nope].transpose(1, 0, 2), w["w_uk"])  # [H, n, rank]
            q_abs[:, :, :r] = uk.transpose(1, 0, 2)
        q_abs[:, :, r:] = q_rope
        # values are the cache entries themselves: the rope part of the output is ignored
        out = np.empty((n, H, r + rope), dtype=np.float32)
        ops.attention(
            out, q_abs, cache, cache, n_kv=pos0 + n, q_pos0=pos0, scale=a.scale,
            nthreads=self.nthreads,
        )  # fmt: skip
        if "kv_b" in w:
            return self._mla_values(w["kv_b"], out, nope, r, a.v_head_dim)
        v = np.matmul(out[:, :, :r].transpose(1, 0, 2), w["w_uv_t"])  # [H, n, v_head_dim]
        return np.ascontiguousarray(v.transpose(1, 0, 2))

    def _mla_values(
        self, kv_b: Linear, out: np.ndarray, nope: int, rank: int, dv: int
    ) -> np.ndarray:
        """W_UV_h of the attention output over latents out f32 [n, H, rank + rope], kv_b_proj
        read in its block type; Q8_0 activations when the model uses them (kv_b.act_q8).
        Returns f32 [n, H, dv]."""
        v = np.empty((*out.shape[:2], dv), dtype=np.float32)
        if kv_b.act_q8:
            xq = ops.quantize_act(np.ascontiguousarray(out[:, :, :rank]))
            return ops.mla_values_q8(kv_b.w, kv_b.qtype, xq, v, nope=nope, nthreads=self.nthreads)
        return ops.mla_values(
            kv_b.w, kv_b.qtype, out, v, nope=nope, rank=rank, nthreads=self.nthreads
        )

    def _mla_cache(
        self, i: int, h: np.ndarray, q: np.ndarray, kv: KVCache, pos0: int, q_start: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """MLA's compressed entry of layer i for the normed input h f32 [n, d_model]: the
        normed latent c [rank] and the rotated rope key k_r [rope] of each position, written
        at pos0.. of the latent cache. Returns (that cache f32 [n_ctx, 1, rank + rope], the
        query's rope part rotated, f32 [m, n_heads, rope], from q [m, n_heads, nope + rope]
        of the last m = n - q_start positions)."""
        a, w = self.spec.layers[i].attention, self.layers[i]
        r, nope, rope, n = a.mla.kv_lora_rank, a.mla.qk_nope_head_dim, a.rot_dim, h.shape[0]
        ckv = w["kv_a"](h, nthreads=self.nthreads)  # [n, rank + rope]
        latent = np.ascontiguousarray(ckv[:, :r])
        ops.rmsnorm(latent, latent, w["kv_a_norm"], a.mla.norm_eps)
        k_rope = np.ascontiguousarray(ckv[:, None, r:])  # [n, 1, rope]
        q_rope = np.ascontiguousarray(q[:, :, nope:])  # [n, H, rope]
        pos = np.arange(pos0, pos0 + n, dtype=np.int32)
        for t, p in ((q_rope, pos[q_start:]), (k_rope, pos)):
            ops.rope(t, p, a.inv_freq, rot_dim=rope, mscale=a.mscale, mode=a.rope_mode)
        cache = kv.k[i]  # [n_ctx, 1, rank + rope], == kv.v[i]
        cache[pos0 : pos0 + n, 0, :r] = latent
        cache[pos0 : pos0 + n, 0, r:] = k_rope[:, 0]
        return cache, q_rope

    def _attention_dsa(self, i: int, h: np.ndarray, kv: KVCache, pos0: int) -> np.ndarray:
        """DeepSeek Sparse Attention of layer i (MLA + the lightning indexer, spec.IndexerSpec)
        on its normed input h f32 [n, d_model]; returns f32 [n, n_heads, v_head_dim].

        The MLA part is _attention_mla's (latent cache, kv_b_proj absorbed). A full layer's
        indexer caches its keys (kv.index_k) and selects for each token the index_topk
        best-scoring positions at or before it (transformers DeepseekV32Indexer: every
        position when there are no more than index_topk), stored in kv.index_sel; a shared
        layer reuses kv.index_sel. Tokens whose selection is their whole causal past attend
        as in dense MLA; the others attend over the gathered selected cache rows only.
        """
        a, w = self.spec.layers[i].attention, self.layers[i]
        m, x, n, H = a.mla, a.indexer, h.shape[0], a.n_heads
        r, nope, rope = m.kv_lora_rank, m.qk_nope_head_dim, a.rot_dim
        qa = w["q_a"](h, nthreads=self.nthreads)
        ops.rmsnorm(qa, qa, w["q_a_norm"], m.norm_eps)  # q_resid, also the indexer's input
        q = w["q_b"](qa, nthreads=self.nthreads).reshape(n, H, nope + rope)
        cache, q_rope = self._mla_cache(i, h, q, kv, pos0)
        if not x.shared:
            kv.index_sel = self._dsa_select(i, h, qa, kv, pos0)
        elif kv.index_sel is None or len(kv.index_sel) != n:
            raise ValueError(f"layer {i}: a shared DSA layer needs a full indexer layer before it")
        sel = kv.index_sel
        # per head with ops.matmul: numpy's stacked matmul on these strided views is ~25x slower
        q_abs = np.empty((n, H, r + rope), dtype=np.float32)
        q_nope = np.ascontiguousarray(q[:, :, :nope].transpose(1, 0, 2))  # [H, n, nope]
        tmp = np.empty((n, r), dtype=np.float32)
        for head in range(H):
            ops.matmul(w["w_uk_t"][head], _F32, q_nope[head], tmp, nthreads=self.nthreads)
            q_abs[:, head, :r] = tmp
        q_abs[:, :, r:] = q_rope
        out = np.empty((n, H, r + rope), dtype=np.float32)
        # tokens 0 .. n_dense-1 select their whole past (pos0 + s + 1 <= index_topk)
        n_dense = min(n, max(0, x.index_topk - pos0))
        if n_dense:
            ops.attention(
                out[:n_dense], q_abs[:n_dense], cache, cache, n_kv=pos0 + n_dense,
                q_pos0=pos0, scale=a.scale, nthreads=self.nthreads,
            )  # fmt: skip
        for s in range(n_dense, n):
            rows = np.ascontiguousarray(cache[np.sort(sel[s][sel[s] >= 0])])
            k = len(rows)
            ops.attention(
                out[s : s + 1], q_abs[s : s + 1], rows, rows, n_kv=k, q_pos0=k - 1,
                scale=a.scale, nthreads=self.nthreads,
            )  # fmt: skip
        o_lat = np.ascontiguousarray(out[:, :, :r].transpose(1, 0, 2))  # [H, n, rank]
        v, tmp = (
            np.empty((n, H, a.v_head_dim), dtype=np.float32),
            np.empty((n, a.v_head_dim), dtype=np.float32),
        )
        for head in range(H):
            ops.matmul(w["w_uv"][head], _F32, o_lat[head], tmp, nthreads=self.nthreads)
            v[:, head] = tmp
        return v

    def _dsa_select(
        self, i: int, h: np.ndarray, q_resid: np.ndarray, kv: KVCache, pos0: int
    ) -> np.ndarray:
        """Layer i's indexer on normed input h f32 [n, d_model] and q_resid f32
        [n, q_lora_rank]: caches the index keys of positions pos0.. and returns each token's
        selection, int32 [n, min(index_topk, pos0 + n)], -1 padded (a token with at most
        index_topk positions before it selects them all). Scores as DeepseekV32Indexer:
        sum_h w_h relu(q_h . k_t / sqrt(head_dim)), w = weights_proj(h) / sqrt(n_heads)."""
        a, w = self.spec.layers[i].attention, self.layers[i]
        x, n = a.indexer, h.shape[0]
        hd, nh, T = x.index_head_dim, x.index_n_heads, pos0 + n
        iq = w["idx_wq_b"](q_resid, nthreads=self.nthreads).reshape(n, nh, hd)
        ik = w["idx_wk"](h, nthreads=self.nthreads)
        mean = ik.mean(axis=-1, keepdims=True, dtype=np.float32)
        var = np.square(ik - mean).mean(axis=-1, keepdims=True, dtype=np.float32)
        ik = (ik - mean) / np.sqrt(var + np.float32(x.norm_eps))
        ik = (ik * w["idx_k_norm"] + w["idx_k_norm_bias"]).astype(np.float32)[:, None, :]
        pos = np.arange(pos0, T, dtype=np.int32)
        for t in (iq, ik):
            ops.rope(t, pos, a.inv_freq, rot_dim=a.rot_dim, mscale=a.mscale, mode=x.rope_mode)
        keys = kv.index_k[i]
        keys[pos0:T] = ik[:, 0]
        weights = w["idx_weights_proj"](h, nthreads=self.nthreads) * np.float32(nh**-0.5)
        kk = min(x.index_topk, T)
        sel = np.full((n, kk), -1, dtype=np.int32)
        n_dense = min(n, max(0, x.index_topk - pos0))
        for s in range(n_dense):
            sel[s, : pos0 + s + 1] = np.arange(pos0 + s + 1, dtype=np.int32)
        if n_dense < n:
            scores = np.empty((n - n_dense, T), dtype=np.float32)
            ops.index_scores(
                scores, np.ascontiguousarray(iq[n_dense:]), np.ascontiguousarray(weights[n_dense:]),
                keys, n_kv=T, q_pos0=pos0 + n_dense, scale=hd**-0.5, nthreads=self.nthreads,
            )  # fmt: skip
            for s in range(n_dense, n):
                c = pos0 + s + 1
                row = scores[s - n_dense, :c]
                top = np.argpartition(-row, kk - 1)[:kk]
                sel[s] = top.astype(np.int32)
        return sel

    def post_norm(self, i: int, x: np.ndarray) -> np.ndarray:
        """The FFN input of layer i: post_attention_layernorm(x), f32 [n, d_model] (with
        hyper-connections, x f32 [n, hc_mult, d_model]: of the streams' collapse; Gemma 4: the
        experts' input, pre_feedforward_layernorm_2(x))."""
        if self.spec.hc is not None:
            return self.ffn_input(i, x)[0]
        h = np.empty_like(x)
        w = self.layers[i]
        ops.rmsnorm(h, x, w.get("expert_norm", w["post_norm"]), self.spec.norm_eps)
        return h

    def ffn_input(
        self, i: int, x: np.ndarray
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """(FFN input h f32 [n, d_model], mix) of layer i. Hyper-connections (spec.hc): x is
        the streams f32 [n, hc_mult, d_model], h the normed collapse by the layer's ffn map
        and mix its (post, comb) for ffn_residual; else h = post_norm(i, x), mix None."""
        if self.spec.hc is None:
            return self.post_norm(i, x), None
        pre, post, comb = self._hc(i, "ffn", x)
        h = dsv4.hc_collapse(x, pre)
        ops.rmsnorm(h, h, self.layers[i]["post_norm"], self.spec.norm_eps)
        return h, (post, comb)

    def ffn_residual(
        self, x: np.ndarray, y: np.ndarray, mix: tuple[np.ndarray, np.ndarray] | None
    ) -> None:
        """The FFN output y f32 [n, d_model] into the residual x, in place: x += y, or with
        hyper-connections (mix from ffn_input) the streams' expansion and mixing."""
        if mix is None:
            x += y
        else:
            dsv4.hc_expand(x, y, *mix)

    def _hc(self, i: int, block: str, x: np.ndarray) -> tuple[np.ndarray, ...]:
        w = self.layers[i]
        fn = w[f"hc_{block}_fn"]
        return dsv4.hc_weights(
            x, lambda t: fn(t, nthreads=self.nthreads), w[f"hc_{block}_base"],
            w[f"hc_{block}_scale"], self.spec.hc, self.spec.norm_eps,
        )  # fmt: skip

    def hash_experts(self, i: int, tokens: np.ndarray) -> np.ndarray:
        """A hash-routed layer's experts (spec.LayerSpec.hash_routed) for token ids int [n]:
        tid2eid[tokens], int32 [n, top_k]; known before the layer runs."""
        table = self.layers[i]["tid2eid"]
        tokens = np.asarray(tokens, dtype=np.int64)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= len(table)):
            raise ValueError(f"token ids must be in [0, {len(table)}) (layer {i}'s tid2eid)")
        return table[tokens]

    def route(
        self, i: int, h: np.ndarray, tokens: np.ndarray | None = None, x: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Layer i's router on FFN input h: (expert ids int32 [n, k], weights f32 [n, k]).
        tokens int [n]: the token ids, which a hash-routed layer's choice is (required there).
        Gemma 4 routes the residual stream x f32 [n, d_model] instead (router_scale: the
        router's input is RMSNorm(x) * router_scale / sqrt(d_model); Gemma4TextRouter)."""
        w = self.layers[i]
        if "router_scale" in w:
            if x is None:
                raise ValueError(f"layer {i}: the router reads the residual stream x")
            h = np.empty_like(x)
            ops.rmsnorm(h, x, None, self.spec.norm_eps)
            h *= w["router_scale"]
            h *= np.float32(self.spec.d_model**-0.5)
        logits = w["router"](h, nthreads=self.nthreads)
        ids = None
        if self.spec.layers[i].hash_routed:
            if tokens is None:
                raise ValueError(f"layer {i} is hash-routed: route() needs the token ids")
            ids = self.hash_experts(i, tokens)
        return moe.route(
            self.spec.moe.router,
            logits,
            w.get("correction_bias"),
            ids,
            w.get("per_expert_scale"),
        )

    def _attention_v4(self, i: int, h: np.ndarray, kv: KVCache, pos0: int) -> np.ndarray:
        """DeepSeek-V4 attention of layer i (spec.SharedKVSpec) on its normed input h f32
        [n, d_model]: writes the K=V rows of positions pos0.. and feeds the compressors
        (kv.compressed / compress_buf, the indexer's kv.index_k / index_buf). Returns the
        output projection's result f32 [n, d_model]."""
        a, w = self.spec.layers[i].attention, self.layers[i]
        v, n, H, hd, t = a.shared_kv, h.shape[0], a.n_heads, a.head_dim, self.nthreads
        eps = v.norm_eps
        pos = np.arange(pos0, pos0 + n, dtype=np.int32)
        qa = w["q_a"](h, nthreads=t)
        ops.rmsnorm(qa, qa, w["q_a_norm"], eps)  # q_residual, also the indexer's input
        q = w["q_b"](qa, nthreads=t).reshape(n, H, hd)
        ops.rmsnorm(q, q, None, eps)  # per head, no weight
        dsv4.rope_tail(q, pos, a)
        k = w["kv"](h, nthreads=t)
        ops.rmsnorm(k, k, w["kv_norm"], eps)
        k = k.reshape(n, 1, hd)
        dsv4.rope_tail(k, pos, a)
        rows, base = ring_window(kv.k[i], k, pos0, a.window)
        rows = rows.astype(np.float32)
        entries, chosen = None, None
        for pre, c in (("cmp", v.compressor), ("idx_cmp", v.index_compressor)):
            if c is None:
                continue
            store = kv.compressed[i] if pre == "cmp" else kv.index_k[i]
            buf = kv.compress_buf[i] if pre == "cmp" else kv.index_buf[i]
            dsv4.compress(
                c, w[f"{pre}_wkv"](h, nthreads=t), w[f"{pre}_wgate"](h, nthreads=t),
                w[f"{pre}_ape"], w[f"{pre}_norm"], eps, buf, store, pos0, a,
            )  # fmt: skip
            entries = kv.compressed[i]
        if v.index_compressor is not None:
            x = a.indexer
            iq = w["idx_wq_b"](qa, nthreads=t).reshape(n, x.index_n_heads, x.index_head_dim)
            dsv4.rope_tail(iq, pos, a)
            weights = w["idx_weights_proj"](h, nthreads=t) * np.float32(x.index_n_heads**-0.5)
            chosen = dsv4.select(
                iq, weights, kv.index_k[i], pos0, v.index_compressor.compress_rate,
                x.index_topk, x.index_head_dim, nthreads=t,
            )  # fmt: skip
        out = dsv4.attend(q, rows, base, entries, chosen, pos0, a, w["sinks"], nthreads=t)
        dsv4.rope_tail(out, pos, a, inverse=True)
        return dsv4.grouped_output(
            out.reshape(n, H * hd), tuple(lambda z, g=g: g(z, nthreads=t) for g in w["o_a"]),
            lambda z: w["o_b"](z, nthreads=t),
        )  # fmt: skip

    def dense_ffn_row_invariant(self, i: int) -> bool:
        """True when dense_ffn(i, ...) computes each row the same bits whatever rows share
        the call (so the rows of several sequences may be stacked); see Linear.row_invariant."""
        w = self.layers[i]
        lins = [lin for kind in ("mlp", "shared") if kind in w for lin in w[kind]]
        if "shared_expert_gate" in w:
            lins.append(w["shared_expert_gate"])
        return all(lin.row_invariant for lin in lins)

    def ffn_rows_exact(self, i: int) -> bool:
        """True when every kernel of layer i after its attention computes a row the same bits
        whatever rows share the call: the hyper-connection mix (f32 maps), the router, the
        routed experts (expert_row_invariant), the shared expert / dense MLP and its gate,
        Gemma 4's per-layer input. A forward may then run that part on the rows it needs only
        (Pipeline: the last layer, for the rows whose logits are wanted) with the bits the
        full computation gives them; the norms and the rest are row-wise."""
        w = self.layers[i]
        lins = [w[k] for k in ("router", "shared_expert_gate", "ple_gate", "ple_proj",
                               "hc_ffn_fn") if k in w]  # fmt: skip
        mlp = True
        for kind in ("mlp", "shared"):  # ops.expert_ffn(_q8k), as dense_ffn calls it
            if kind in w:
                qts = [lin.qtype for lin in w[kind]]
                q8 = w[kind][0].act_q8 and len(set(qts)) == 1  # else its f32 path
                mlp = mlp and (all(x.act_q8k for x in w[kind]) or self._ffn_exact(qts, q8))
        moe = True
        if self.spec.layers[i].moe:
            _, qts, act_q8 = self._experts.get(i, self._experts[None])
            moe = self._ffn_exact(qts, act_q8)
        return mlp and moe and all(_rows_exact(lin) for lin in lins)

    def _ffn_exact(self, qtypes: Any, act_q8: bool) -> bool:
        """True when ops.expert_ffn on weights of `qtypes` computes a row alike in any call:
        Q8_0 / Q8_K activations on ROW_INVARIANT_QTYPES, f32 activations (the rows kernels
        of ops.matmul) on F32_ROW_INVARIANT_QTYPES, or padded calls (pad 4)."""
        if self.pad % 4 == 0:
            return True
        allowed = ROW_INVARIANT_QTYPES if act_q8 else F32_ROW_INVARIANT_QTYPES
        return all(q in allowed for q in qtypes)

    def expert_row_invariant(self, layer: int | None) -> bool:
        """True when expert_ffn(..., layer=layer) computes each row the same bits whatever
        rows share the call: Q8_0 activations on ROW_INVARIANT_QTYPES, or pad 4."""
        _, qts, act_q8 = self._experts.get(layer, self._experts[None])
        return (act_q8 and all(q in ROW_INVARIANT_QTYPES for q in qts)) or self.pad % 4 == 0

    def dense_ffn(
        self, i: int, h: np.ndarray, out: np.ndarray, x: np.ndarray | None = None
    ) -> None:
        """out += the dense part of layer i's FFN: a dense MLP, or the shared expert
        (times sigmoid(shared_expert_gate(h)) when the family has that gate). Gemma 4
        (mlp_post_norm): the MLP reads pre_feedforward_layernorm(x) of the residual stream x
        and its output is normed by post_feedforward_layernorm_1."""
        w = self.layers[i]
        n = h.shape[0]
        if "mlp_post_norm" in w:
            if x is None:
                raise ValueError(f"layer {i}: the dense MLP reads the residual stream x")
            h = np.empty_like(x)
            ops.rmsnorm(h, x, w["post_norm"], self.spec.norm_eps)
        q8_invariant = all(
            lin._q8_invariant for kind in ("mlp", "shared") if kind in w for lin in w[kind]
        )
        if not q8_invariant:  # padding keeps the other kernels batch-invariant
            h = pad_rows(h, self.pad)
        for kind in ("mlp", "shared"):
            if kind not in w:
                continue
            gate, up, down = w[kind]
            act = self.spec.moe.shared_act if kind == "shared" else self.spec.dense_act
            y = np.zeros_like(h)
            # d_ff not a multiple of 32: down_proj stays f32 under a block dense quant
            qts = (gate.qtype, up.qtype, down.qtype)
            mixed = len(set(qts)) > 1
            if gate.act_q8k and up.act_q8k and down.act_q8k:  # as routed K-quant experts
                ops.expert_ffn_q8k(
                    y, np.ascontiguousarray(h), gate.w, up.w, down.w, qts, self.spec.d_model,
                    gate.rows, act=act, limit=self.spec.moe.limit, accumulate=False,
                    nthreads=self.nthreads,
                )  # fmt: skip
            elif gate.x16 and up.x16 and down.x16:  # packed together (_pack_x16)
                ops.expert_ffn(
                    y, np.ascontiguousarray(h), gate.w, up.w, down.w, gate.qtype,
                    self.spec.d_model, gate.rows, act=act, limit=self.spec.moe.limit,
                    accumulate=False, act_q8=True, nthreads=self.nthreads, x16=True,
                )  # fmt: skip
            else:
                ops.expert_ffn(
                    y,
                    h,
                    gate.w,
                    up.w,
                    down.w,
                    gate.qtype,
                    self.spec.d_model,
                    gate.rows,
                    act=act,
                    limit=self.spec.moe.limit,
                    accumulate=False,
                    act_q8=gate.act_q8 and not mixed,
                    nthreads=self.nthreads,
                    qtypes=qts if mixed else None,
                )
            if "shared_expert_gate" in w and kind == "shared":
                g = w["shared_expert_gate"](h)
                y *= 1.0 / (1.0 + np.exp(-g))
            if kind == "mlp" and "mlp_post_norm" in w:
                ops.rmsnorm(y, y, w["mlp_post_norm"], self.spec.norm_eps)
            out += y[:n]

    def sandwich(self, i: int) -> bool:
        """Whether layer i's FFN output is normed before the residual (Gemma 4): then the
        pipeline ends the layer with sandwich_residual() instead of adding the parts to x."""
        return "ffn_post_norm" in self.layers[i]

    def sandwich_residual(
        self,
        i: int,
        x: np.ndarray,
        dense: np.ndarray,
        slots: np.ndarray,
        ple: np.ndarray | None = None,
    ) -> None:
        """The end of Gemma 4 layer i (Gemma4TextDecoderLayer), in place on x f32 [n, d]:
        x += ffn_post_norm(dense + expert_post_norm(sum_j slots[:, j])), with dense f32
        [n, d] from dense_ffn() and slots f32 [n, k, d] the weighted expert outputs; then
        x += ple_post_norm(ple_proj(gelu(ple_gate(x)) * ple[:, i])) with ple f32 [n, L, P]
        (per_layer_inputs()), and x *= layer_scalar."""
        w, eps = self.layers[i], self.spec.norm_eps
        experts = np.zeros_like(x)
        for j in range(slots.shape[1]):  # fixed order, whatever the arrival order
            experts += slots[:, j]
        ops.rmsnorm(experts, experts, w["expert_post_norm"], eps)
        y = dense + experts
        ops.rmsnorm(y, y, w["ffn_post_norm"], eps)
        x += y
        if "ple_gate" in w:
            if ple is None:
                raise ValueError(f"layer {i}: the per-layer inputs are missing")
            g = w["ple_gate"](x, nthreads=self.nthreads)
            ops.gelu(g, g)
            g *= ple[:, i]
            y = w["ple_proj"](g, nthreads=self.nthreads)
            ops.rmsnorm(y, y, w["ple_post_norm"], eps)
            x += y
        if "layer_scalar" in w:
            x *= w["layer_scalar"][0]

    def expert_ffn(
        self,
        record: np.ndarray,
        h: np.ndarray,
        rows: np.ndarray,
        weights: np.ndarray,
        layer: int | None = None,
    ) -> np.ndarray:
        """One routed expert on the token rows routed to it: weights[r] * FFN(h[rows[r]]).

        record: uint8 [record nbytes] (a slab slot) of MoE layer `layer` (its layout:
        Store.layout_for; None = the default layout); rows int [m]; weights f32 [m].
        Returns f32 [m, d_model].
        """
        m = self.spec.moe
        spans, qts, act_q8 = self._experts.get(layer, self._experts[None])
        part = {name: record[o : o + nb] for name, (o, nb) in spans.items()}
        x = h if len(rows) == len(h) and (rows == np.arange(len(h))).all() else h[rows]
        if m.apply_router_weight_on_input:  # Llama 4: FFN(weight * x), see MoESpec
            x = x * np.asarray(weights, dtype=np.float32)[:, None]
            weights = np.ones(len(rows), dtype=np.float32)
        m_rows = len(rows)
        q8k = (
            self.act_q8k
            and all(q in ops.Q8K_ACT_TYPES for q in qts)
            and self.spec.d_model % 256 == 0
            and self.d_ff % 256 == 0
        )
        if m_rows % self.pad and not (act_q8 and all(q in ROW_INVARIANT_QTYPES for q in qts)):
            x = pad_rows(np.ascontiguousarray(x), self.pad)
            weights = pad_rows(np.ascontiguousarray(weights, dtype=np.float32), self.pad)
        if self.x16_experts:  # packed records: the group kernel on this one (same bits)
            return ops.expert_ffn_group(
                np.empty((m_rows, self.spec.d_model), dtype=np.float32),
                np.ascontiguousarray(x, dtype=np.float32), [record], spans, qts,
                np.array([0, m_rows], np.int64), self.spec.d_model, self.d_ff, act=m.act,
                row_weight=np.ascontiguousarray(weights, dtype=np.float32), alpha=m.alpha,
                limit=m.limit, act_q8=True, nthreads=self.nthreads, x16=True,
            )  # fmt: skip
        y = np.empty((x.shape[0], self.spec.d_model), dtype=np.float32)
        bias = {
            n: part[n].view(np.float32) if n in part else None
            for n in ("gate_bias", "up_bias", "down_bias")
        }
        if q8k:  # the K-quant GEMM on Q8_K activations (activations="q8_k")
            return ops.expert_ffn_q8k(
                y, np.ascontiguousarray(x), part["gate"], part["up"], part["down"], qts,
                self.spec.d_model, self.d_ff, act=m.act, gate_bias=bias["gate_bias"],
                up_bias=bias["up_bias"], down_bias=bias["down_bias"],
                row_weight=np.ascontiguousarray(weights, dtype=np.float32), accumulate=False,
                alpha=m.alpha, limit=m.limit, nthreads=self.nthreads,
            )[:m_rows]  # fmt: skip
        ops.expert_ffn(
            y,
            np.ascontiguousarray(x),
            part["gate"],
            part["up"],
            part["down"],
            qts[0],
            self.spec.d_model,
            self.d_ff,
            act=m.act,
            gate_bias=bias["gate_bias"],
            up_bias=bias["up_bias"],
            down_bias=bias["down_bias"],
            row_weight=np.ascontiguousarray(weights, dtype=np.float32),
            accumulate=False,
            alpha=m.alpha,
            limit=m.limit,
            act_q8=act_q8,
            nthreads=self.nthreads,
            qtypes=qts if len(set(qts)) > 1 else None,
        )
        return y[:m_rows]

    def _x16_shapes(self, layer: int | None) -> list[tuple[str, QType, int, int]] | None:
        """(tensor, type, rows, cols) of gate, up, down of layer `layer`'s records when they
        have the X16 layout and Q8_0 activations run them (else None)."""
        _, qts, act_q8 = self._experts.get(layer, self._experts[None])
        d, f = self.spec.d_model, self.d_ff
        shapes = [("gate", qts[0], f, d), ("up", qts[1], f, d), ("down", qts[2], d, f)]
        if not act_q8:  # (Q8_K activations take K-quants only: never these types)
            return None
        ok = all(q in ops.X16_TYPES and ops.x16_ok(q, r, c) for _, q, r, c in shapes)
        return shapes if ok else None

    def x16_experts_ok(self) -> bool:
        """True when every layer's expert records can run X16-packed (x16_record): Q4_0 / Q8_0
        gate, up, down on Q8_0 activations with X16 shapes, on a CPU with the kernel."""
        return ops.x16_fast() and all(self._x16_shapes(k) is not None for k in self._experts)

    def x16_record(self, record: ExpertRecord, buf: np.ndarray) -> None:
        """Repack a freshly read expert record's gate, up and down in place (buf: uint8, the
        record's bytes in its slab slot) into the X16 layout (ops.pack_x16), which
        expert_ffn(_group) read when x16_experts is set: one sequential stream per 16-row
        tile for the decode matvec, the same bits. Raises KernelError on a layout without
        it (x16_experts_ok is False)."""
        spans = self._experts.get(record.layer, self._experts[None])[0]
        shapes = self._x16_shapes(record.layer)
        if shapes is None:
            raise KernelError(f"layer {record.layer}: expert records have no X16 layout")
        for name, qt, rows, cols in shapes:
            o, nb = spans[name]
            v = buf[o : o + nb].reshape(rows, nb // rows)
            ops.pack_x16(v, qt, cols, out=v)

    def expert_group_ok(self, layer: int | None) -> bool:
        """True when expert_ffn_group can run layer `layer`'s experts: row-invariant kernels
        that need no padding (Q8_0 / Q8_K activations on ROW_INVARIANT_QTYPES) and the
        routing weight applied to the output."""
        _, qts, act_q8 = self._experts.get(layer, self._experts[None])
        return (
            act_q8
            and all(q in ROW_INVARIANT_QTYPES for q in qts)
            and not self.spec.moe.apply_router_weight_on_input
        )

    def expert_ffn_group(
        self,
        records: list[np.ndarray],
        h: np.ndarray,
        weights: np.ndarray,
        row_off: np.ndarray,
        layer: int | None = None,
    ) -> np.ndarray:
        """Several routed experts of MoE layer `layer` in one kernel call: records[e] (uint8
        slab slots) runs on the rows h[row_off[e] : row_off[e + 1]] (f32 [n, d_model]), each
        row scaled by its weights f32 [n]. Returns f32 [n, d_model]: row r the bits
        expert_ffn gives it (the kernels are row-invariant: needs expert_group_ok(layer))."""
        m = self.spec.moe
        spans, qts, act_q8 = self._experts.get(layer, self._experts[None])
        q8k = (
            self.act_q8k
            and all(q in ops.Q8K_ACT_TYPES for q in qts)
            and self.spec.d_model % 256 == 0
            and self.d_ff % 256 == 0
        )
        y = np.empty((len(h), self.spec.d_model), dtype=np.float32)
        return ops.expert_ffn_group(
            y, np.ascontiguousarray(h, dtype=np.float32), records, spans, qts, row_off,
            self.spec.d_model, self.d_ff, act=m.act,
            row_weight=np.ascontiguousarray(weights, dtype=np.float32), alpha=m.alpha,
            limit=m.limit, act_q8=act_q8, q8k=q8k, nthreads=self.nthreads, x16=self.x16_experts,
        )  # fmt: skip

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Final norm and output head: f32 [n, d_model] -> f32 [n, vocab_size] (with
        hyper-connections x is the streams f32 [n, hc_mult, d_model], collapsed first)."""
        if not len(x):  # no row wanted (a prompt chunk before the last one)
            return np.empty((0, self.spec.vocab_size), dtype=np.float32)
        if self.hc_head is not None:
            fn, base, scale = self.hc_head
            x = dsv4.hc_head(
                x, lambda t: fn(t, nthreads=self.nthreads), base, scale, self.spec.hc,
                self.spec.norm_eps,
            )  # fmt: skip
        h = np.empty_like(x)
        ops.rmsnorm(h, x, self.final_norm, self.spec.norm_eps)
        out = self.lm_head(h, nthreads=self.nthreads)
        if (cap := self.spec.final_logit_softcapping) is not None:  # cap * tanh(logits / cap)
            out /= np.float32(cap)
            np.tanh(out, out=out)
            out *= np.float32(cap)
        return out
