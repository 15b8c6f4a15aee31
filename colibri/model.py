"""The resident part of a model and the synchronous math of one layer.

Model holds the dense weights (embeddings, attention, norms, routers, shared experts, dense
MLPs, output head) loaded from a store, and offers the steps pipeline.py strings together.
Nothing here awaits: these functions run in the engine's compute thread, while the event loop
keeps reaping expert reads. All activations are f32 [n_tokens, ...].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri.compute import moe, ops
from colibri.compute.ops import QType
from colibri.errors import StoreError
from colibri.io.format import Store
from colibri.models.spec import AttentionSpec, LayerSpec, ModelSpec


class Linear:
    """y = x W^T (+ b) for W [rows, cols] in any storage type, b f32 [rows] or None.
    act_q8: quantize x to Q8_0 and use integer dots (ops.matmul_q8) when W is Q4_0 or Q8_0."""

    def __init__(
        self,
        w: np.ndarray,
        qtype: QType,
        rows: int,
        cols: int,
        bias: np.ndarray | None,
        act_q8: bool = False,
    ):
        self.w, self.qtype, self.rows, self.cols, self.bias = w, qtype, rows, cols, bias
        self.act_q8 = act_q8 and qtype in ops.Q8_ACT_TYPES

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def __call__(
        self, x: np.ndarray, out: np.ndarray | None = None, nthreads: int = 0
    ) -> np.ndarray:
        """x f32 [n, cols] -> f32 [n, rows] (written into out when given)."""
        if out is None:
            out = np.empty((x.shape[0], self.rows), dtype=np.float32)
        if self.act_q8:
            ops.matmul_q8(self.w, self.qtype, ops.quantize_act(x), out, nthreads=nthreads)
        else:
            ops.matmul(self.w, self.qtype, x, out, nthreads=nthreads)
        if self.bias is not None:
            out += self.bias
        return out


@dataclass
class KVCache:
    """Per-sequence keys and values, preallocated to the context length.

    k[layer]: [n_ctx, n_kv_heads, head_dim], v[layer]: [n_ctx, n_kv_heads, v_head_dim],
    f32 or f16; `length` tokens are filled. Memory: layers * n_ctx * n_kv * (dk + dv) * itemsize.
    Multi-head latent attention layers keep the compressed form instead: k[layer] is
    v[layer] (one array), [n_ctx, 1, kv_lora_rank + qk_rope_head_dim] holding the normed latent
    then the rotated rope key; memory layers * n_ctx * (kv_lora_rank + rope) * itemsize.
    """

    k: list[np.ndarray]
    v: list[np.ndarray]
    n_ctx: int
    length: int = 0

    @classmethod
    def allocate(cls, spec: ModelSpec, n_ctx: int, dtype: type = np.float32) -> KVCache:
        k, v = [], []
        for layer in spec.layers:
            a = layer.attention
            if a.mla is not None:
                latent = np.zeros((n_ctx, 1, a.mla.kv_lora_rank + a.rot_dim), dtype=dtype)
                k.append(latent)
                v.append(latent)
                continue
            k.append(np.zeros((n_ctx, a.n_kv_heads, a.head_dim), dtype=dtype))
            v.append(np.zeros((n_ctx, a.n_kv_heads, a.v_head_dim), dtype=dtype))
        return cls(k, v, n_ctx)

    @property
    def nbytes(self) -> int:
        arrays = {id(a): a for a in (*self.k, *self.v)}  # MLA layers share one array
        return sum(a.nbytes for a in arrays.values())


class Model:
    """Dense weights of one store, resident in RAM, and the per-layer steps.

    activations: "q8_0" (Q4_0/Q8_0 weights multiply Q8_0-quantized activations, see
    ops.matmul_q8; float weights stay f32) or "f32" (exact).
    Raises StoreError when a tensor the spec names is missing or has the wrong shape.
    """

    def __init__(self, store: Store, spec: ModelSpec, nthreads: int = 0, activations: str = "q8_0"):
        self.store, self.spec, self.nthreads = store, spec, nthreads
        if activations not in ("f32", "q8_0"):
            raise ValueError(f"activations={activations!r}: must be f32 or q8_0")
        self.act_q8 = activations == "q8_0"
        self._names = set(store.dense_names())
        self.embed_w, self.embed_qtype = self._raw(
            f"{spec.embed}.weight", (spec.vocab_size, spec.d_model)
        )
        self.final_norm = self._vector(f"{spec.final_norm}.weight", spec.d_model)
        self.lm_head = self._linear(spec.lm_head, spec.vocab_size, spec.d_model)
        self.layers = [self._load_layer(layer) for layer in spec.layers]
        layout = store.layout
        self.expert_qtype = QType.parse(layout.qtype)
        self.d_ff = layout.d_ff
        self._record = {name: (t.offset, t.nbytes) for name, t in layout.tensors.items()}

    # ---- loading -------------------------------------------------------------------------
    def _raw(self, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, QType]:
        if name not in self._names:
            raise StoreError(f"{self.store.path}: dense tensor {name!r} is missing")
        data, qtype, logical = self.store.dense(name)
        if tuple(logical) != tuple(shape):
            raise StoreError(
                f"{self.store.path}: tensor {name!r} has shape {list(logical)}, "
                f"expected {list(shape)}"
            )
        return data, QType.parse(qtype)

    def _vector(self, name: str, n: int) -> np.ndarray:
        data, _qtype = self._raw(name, (n,))
        return np.ascontiguousarray(data, dtype=np.float32)

    def _linear(self, prefix: str, rows: int, cols: int) -> Linear:
        w, qtype = self._raw(f"{prefix}.weight", (rows, cols))
        bias = self._vector(f"{prefix}.bias", rows) if f"{prefix}.bias" in self._names else None
        return Linear(w, qtype, rows, cols, bias, act_q8=self.act_q8)

    def _load_mla(self, spec: LayerSpec) -> dict[str, object]:
        """MLA weights. kv_b_proj [n_heads * (nope + v), kv_lora_rank] is kept absorbed, f32:
        w_uk [n_heads, nope, rank] (maps a query's nope part into the latent space) and
        w_uv_t [n_heads, rank, v] (maps an attention output over latents to values)."""
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
        full = ops.dequantize(kv_b.w, kv_b.qtype, (kv_b.rows, r)).reshape(H, -1, r)
        w["w_uk"] = np.ascontiguousarray(full[:, :nope, :])
        w["w_uv_t"] = np.ascontiguousarray(full[:, nope:, :].transpose(0, 2, 1))
        w["o"] = self._linear(n["o"], d, H * a.v_head_dim)
        return w

    def _load_layer(self, spec: LayerSpec) -> dict[str, object]:
        a, d, n = spec.attention, self.spec.d_model, spec.names
        w: dict[str, object] = {
            "input_norm": self._vector(f"{n['input_norm']}.weight", d),
            "post_norm": self._vector(f"{n['post_norm']}.weight", d),
        }
        if a.mla is not None:
            w |= self._load_mla(spec)
        else:
            w |= {
                "q": self._linear(n["q"], a.n_heads * a.head_dim, d),
                "k": self._linear(n["k"], a.n_kv_heads * a.head_dim, d),
                "v": self._linear(n["v"], a.n_kv_heads * a.v_head_dim, d),
                "o": self._linear(n["o"], d, a.n_heads * a.v_head_dim),
            }
        if a.qk_norm == "head":
            w["q_norm"] = self._vector(f"{n['q_norm']}.weight", a.head_dim)
            w["k_norm"] = self._vector(f"{n['k_norm']}.weight", a.head_dim)
        elif a.qk_norm == "full":
            w["q_norm"] = self._vector(f"{n['q_norm']}.weight", a.n_heads * a.head_dim)
            w["k_norm"] = self._vector(f"{n['k_norm']}.weight", a.n_kv_heads * a.head_dim)
        if a.sinks:
            w["sinks"] = self._vector(n["sinks"], a.n_heads)
        moe_spec = self.spec.moe
        if spec.moe:
            w["router"] = self._linear(n["router"], moe_spec.router.num_experts, d)
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
        return w

    @property
    def dense_nbytes(self) -> int:
        """Bytes of resident weights (all dense tensors of the store)."""
        total = self.embed_w.nbytes + self.final_norm.nbytes + self.lm_head.nbytes
        for w in self.layers:
            for v in w.values():
                items = v if isinstance(v, tuple) else (v,)
                total += sum(i.nbytes for i in items)
        if self.spec.lm_head == self.spec.embed:
            total -= self.lm_head.nbytes
        return total

    # ---- steps ---------------------------------------------------------------------------
    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """tokens int [n] -> f32 [n, d_model]."""
        out = np.empty((len(tokens), self.spec.d_model), dtype=np.float32)
        ops.dequantize(self.embed_w[tokens], self.embed_qtype, out.shape, out=out)
        return out

    def attention(self, i: int, x: np.ndarray, kv: KVCache, pos0: int) -> None:
        """x += attention(input_norm(x)) for layer i; writes the layer's keys/values at
        positions pos0 .. pos0 + n - 1 of kv. x: f32 [n, d_model], updated in place."""
        w, n = self.layers[i], x.shape[0]
        h = np.empty_like(x)
        ops.rmsnorm(h, x, w["input_norm"], self.spec.norm_eps)
        if self.spec.layers[i].attention.mla is not None:
            out = self._attention_mla(i, h, kv, pos0)
        else:
            out = self._attention_gqa(i, h, kv, pos0)
        x += w["o"](out.reshape(n, -1), nthreads=self.nthreads)

    def _attention_gqa(self, i: int, h: np.ndarray, kv: KVCache, pos0: int) -> np.ndarray:
        """Grouped-query attention of layer i on its normed input h f32 [n, d_model]; writes
        the keys/values of positions pos0.. into kv. Returns f32 [n, n_heads, v_head_dim]."""
        spec, w = self.spec.layers[i], self.layers[i]
        a, n = spec.attention, h.shape[0]
        q = w["q"](h, nthreads=self.nthreads)
        k = w["k"](h, nthreads=self.nthreads)
        v = w["v"](h, nthreads=self.nthreads)
        if a.clip_qkv is not None:
            for t in (q, k, v):
                np.clip(t, -a.clip_qkv, a.clip_qkv, out=t)
        if a.qk_norm == "full":
            ops.rmsnorm(q, q, w["q_norm"], self.spec.norm_eps)
            ops.rmsnorm(k, k, w["k_norm"], self.spec.norm_eps)
        q = q.reshape(n, a.n_heads, a.head_dim)
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
        if a.rot_dim > 0:  # rot_dim 0: a no-RoPE layer (Llama 4 no_rope_layers)
            ops.rope(q, pos, a.inv_freq, rot_dim=a.rot_dim, mscale=a.mscale, mode=a.rope_mode)
            ops.rope(k, pos, a.inv_freq, rot_dim=a.rot_dim, mscale=a.mscale, mode=a.rope_mode)
        if a.qk_norm == "l2" or a.floor_scale > 0:
            self._llama4_qk(a, q, k, pos)
        kv.k[i][pos0 : pos0 + n] = k
        kv.v[i][pos0 : pos0 + n] = v.reshape(n, a.n_kv_heads, a.v_head_dim)
        out = np.empty((n, a.n_heads, a.v_head_dim), dtype=np.float32)
        if a.attention_chunk_size > 0:
            self._chunked_attention(i, out, q, kv, pos0)
            return out
        ops.attention(
            out,
            q,
            kv.k[i],
            kv.v[i],
            n_kv=pos0 + n,
            q_pos0=pos0,
            scale=a.scale,
            window=a.window,
            sinks=w.get("sinks"),
            nthreads=self.nthreads,
        )
        return out

    def _llama4_qk(self, a: AttentionSpec, q: np.ndarray, k: np.ndarray, pos: np.ndarray) -> None:
        """Llama4TextAttention after RoPE, in place on q f32 [n, H, d] and k [n, KV, d]: the
        weightless per-head RMSNorm (Llama4TextL2Norm, eps rms_norm_eps) when qk_norm is "l2",
        and attention temperature tuning when floor_scale > 0: q times
        1 + attn_scale * log1p(floor((pos + 1) / floor_scale)), in f32 as the reference."""
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

    def _attention_mla(self, i: int, h: np.ndarray, kv: KVCache, pos0: int) -> np.ndarray:
        """Multi-head latent attention of layer i on its normed input h f32 [n, d_model].

        Caches the compressed form (normed latent c [rank] and rotated rope key k_r [rope] per
        position, KVCache) and attends in the latent space with kv_b_proj absorbed (DeepSeek-V2
        paper, section 2.1.2): for head h, q_nope . (W_UK_h c) = (W_UK_h^T q_nope) . c, so the
        query becomes [W_UK_h^T q_nope | q_rope], every head attends to the one shared entry
        [c | k_r] (MQA; the entry is also the value), and W_UV_h (sum p c) is applied after the
        softmax. Per cached token that costs n_heads * 2 (rank + rope) multiply-adds instead of
        expanding it through kv_b_proj on every step. Same math as transformers'
        expand-then-attend, summed in another order. Returns f32 [n, n_heads, v_head_dim].
        """
        a, w = self.spec.layers[i].attention, self.layers[i]
        m, n, H = a.mla, h.shape[0], a.n_heads
        eps = m.norm_eps
        r, nope, rope = m.kv_lora_rank, m.qk_nope_head_dim, a.rot_dim
        if "q" in w:
            q = w["q"](h, nthreads=self.nthreads)
        else:
            qa = w["q_a"](h, nthreads=self.nthreads)
            ops.rmsnorm(qa, qa, w["q_a_norm"], eps)
            q = w["q_b"](qa, nthreads=self.nthreads)
        q = q.reshape(n, H, nope + rope)
        ckv = w["kv_a"](h, nthreads=self.nthreads)  # [n, rank + rope]
        latent = np.ascontiguousarray(ckv[:, :r])
        ops.rmsnorm(latent, latent, w["kv_a_norm"], eps)
        k_rope = np.ascontiguousarray(ckv[:, None, r:])  # [n, 1, rope]
        q_rope = np.ascontiguousarray(q[:, :, nope:])  # [n, H, rope]
        pos = np.arange(pos0, pos0 + n, dtype=np.int32)
        for t in (q_rope, k_rope):
            ops.rope(t, pos, a.inv_freq, rot_dim=rope, mscale=a.mscale, mode=a.rope_mode)
        cache = kv.k[i]  # [n_ctx, 1, rank + rope], == kv.v[i]
        cache[pos0 : pos0 + n, 0, :r] = latent
        cache[pos0 : pos0 + n, 0, r:] = k_rope[:, 0]
        q_abs = np.empty((n, H, r + rope), dtype=np.float32)
        q_abs[:, :, :r] = np.matmul(q[:, :, :nope].transpose(1, 0, 2), w["w_uk"]).transpose(1, 0, 2)
        q_abs[:, :, r:] = q_rope
        # values are the cache entries themselves: the rope part of the output is ignored
        out = np.empty((n, H, r + rope), dtype=np.float32)
        ops.attention(
            out, q_abs, cache, cache, n_kv=pos0 + n, q_pos0=pos0, scale=a.scale,
            nthreads=self.nthreads,
        )  # fmt: skip
        v = np.matmul(out[:, :, :r].transpose(1, 0, 2), w["w_uv_t"])  # [H, n, v_head_dim]
        return np.ascontiguousarray(v.transpose(1, 0, 2))

    def post_norm(self, i: int, x: np.ndarray) -> np.ndarray:
        """The FFN input of layer i: post_attention_layernorm(x), f32 [n, d_model]."""
        h = np.empty_like(x)
        ops.rmsnorm(h, x, self.layers[i]["post_norm"], self.spec.norm_eps)
        return h

    def route(self, i: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Layer i's router on FFN input h: (expert ids int32 [n, k], weights f32 [n, k])."""
        w = self.layers[i]
        logits = w["router"](h, nthreads=self.nthreads)
        return moe.route(self.spec.moe.router, logits, w.get("correction_bias"))

    def dense_ffn(self, i: int, h: np.ndarray, out: np.ndarray) -> None:
        """out += the dense part of layer i's FFN: a dense MLP, or the shared expert
        (times sigmoid(shared_expert_gate(h)) when the family has that gate)."""
        w = self.layers[i]
        for kind in ("mlp", "shared"):
            if kind not in w:
                continue
            gate, up, down = w[kind]
            y = np.zeros_like(out)
            ops.expert_ffn(
                y,
                h,
                gate.w,
                up.w,
                down.w,
                gate.qtype,
                self.spec.d_model,
                gate.rows,
                act="silu",
                accumulate=False,
                act_q8=gate.act_q8,
                nthreads=self.nthreads,
            )
            if "shared_expert_gate" in w and kind == "shared":
                g = w["shared_expert_gate"](h)
                y *= 1.0 / (1.0 + np.exp(-g))
            out += y

    def expert_ffn(
        self, record: np.ndarray, h: np.ndarray, rows: np.ndarray, weights: np.ndarray
    ) -> np.ndarray:
        """One routed expert on the token rows routed to it: weights[r] * FFN(h[rows[r]]).

        record: uint8 [record_nbytes] (a slab slot); rows int [m]; weights f32 [m].
        Returns f32 [m, d_model].
        """
        m = self.spec.moe
        part = {name: record[o : o + nb] for name, (o, nb) in self._record.items()}
        x = h if len(rows) == len(h) and (rows == np.arange(len(h))).all() else h[rows]
        if m.apply_router_weight_on_input:  # Llama 4: FFN(weight * x), see MoESpec
            x = x * np.asarray(weights, dtype=np.float32)[:, None]
            weights = np.ones(len(rows), dtype=np.float32)
        y = np.empty((len(rows), self.spec.d_model), dtype=np.float32)
        bias = {
            n: part[n].view(np.float32) if n in part else None
            for n in ("gate_bias", "up_bias", "down_bias")
        }
        ops.expert_ffn(
            y,
            np.ascontiguousarray(x),
            part["gate"],
            part["up"],
            part["down"],
            self.expert_qtype,
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
            act_q8=self.act_q8 and self.expert_qtype in ops.Q8_ACT_TYPES,
            nthreads=self.nthreads,
        )
        return y

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Final norm and output head: f32 [n, d_model] -> f32 [n, vocab_size]."""
        h = np.empty_like(x)
        ops.rmsnorm(h, x, self.final_norm, self.spec.norm_eps)
        return self.lm_head(h, nthreads=self.nthreads)
