"""What a model is, as data: the per-architecture files turn a config.json into a ModelSpec.

The generic code (model.py, pipeline.py) reads only these records, never a model_type.
Tensor names are the checkpoint's own (Hugging Face original format, docs/FORMAT.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from colibri.compute.moe import RouterSpec
from colibri.compute.rope import inv_freq, rope_parameters


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3, arXiv:2405.04434), config names.

    Queries: q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj when q_lora_rank is set; each
    head is [qk_nope_head_dim | qk_rope_head_dim]. Keys and values come from one latent:
    kv_a_proj_with_mqa gives [kv_lora_rank | qk_rope_head_dim]; the first part goes through
    kv_a_layernorm and kv_b_proj expands it to [qk_nope_head_dim | v_head_dim] per head; the
    second is one rope key shared by all heads. The KV cache holds the latent and the rope key
    only (model.KVCache); kv_b_proj is absorbed into the query and the output (model.py).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    norm_eps: float = 1e-6  # q_a/kv_a_layernorm: DeepseekV2RMSNorm's default, not rms_norm_eps


@dataclass(frozen=True)
class IndexerSpec:
    """The DeepSeek Sparse Attention (DSA) "lightning indexer" of an MLA layer (DeepSeek-V3.2,
    GLM-5; transformers DeepseekV32Indexer / GlmMoeDsaIndexer), config names.

    Index queries wq_b(q_resid) [index_n_heads, index_head_dim] (q_resid = the normed q_a
    latent) and one index key LayerNorm(wk(x)) [index_head_dim] per token (kept in the
    per-sequence cache beside the latent, model.KVCache.index_k); both rotated on their first
    qk_rope_head_dim dims (`rope_mode`: V3.2 half-split "neox", GLM-5 "interleaved"). Token s
    scores past token t as sum_h w_h * relu(q_h . k_t / sqrt(index_head_dim)) with
    w = weights_proj(x) / sqrt(index_n_heads); attention then runs over the `index_topk`
    best-scoring positions t <= s only. shared (GLM-5 `indexer_types` "shared"): the layer has
    no indexer and reuses the selection of the nearest full layer before it.
    """

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_mode: Literal["neox", "interleaved"]
    shared: bool = False
    norm_eps: float = 1e-6  # k_norm: nn.LayerNorm(index_head_dim, eps=1e-6), with a bias


@dataclass(frozen=True)
class CompressorSpec:
    """A DeepSeek-V4 KV compressor (transformers DeepseekV4HCACompressor / CSACompressor /
    the indexer's own), config names.

    Every `compress_rate` source tokens x close a window that becomes one entry: kv = wkv(x),
    z = wgate(x) + ape[pos % compress_rate]; entry = RMSNorm(sum_j softmax_j(z) * kv_j) per
    channel (weighted `norm`), rotated on its trailing rot_dim dims at position
    window * compress_rate (the attention's "compress" RoPE). `overlap` (CSA): wkv / wgate give
    2 * head_dim per token, two series Ca | Cb; entry w pools window w-1's Ca and window w's Cb
    (2 * compress_rate slots; window 0 has no Ca). The per-sequence state (model.KVCache
    .compressed / compress_buf) holds the entries and the last two windows' rows.
    """

    compress_rate: int
    head_dim: int
    overlap: bool


@dataclass(frozen=True)
class SharedKVSpec:
    """DeepSeek-V4 attention (transformers DeepseekV4Attention), config names.

    q = q_b(RMSNorm(q_a(x))) per head, then a weightless RMSNorm per head; one key that is also
    the value, kv = RMSNorm(wkv(x)) [head_dim] (shared-KV MQA); both rotated on the trailing
    rot_dim dims of each head (interleaved pairs). Each query attends to the last
    `sliding_window` tokens plus, with a compressor, the compressed entries it may see:
    `heavily_compressed_attention` every closed window, `compressed_sparse_attention` the
    indexer's top `index_topk` of them (IndexerSpec, its keys from its own compressor at
    index_head_dim). Learned per-head sinks join the softmax. The output's trailing rot_dim
    dims are rotated back (position -pos), then the grouped low-rank projection: heads split
    into o_groups groups, each group's [n_heads * head_dim / o_groups] mapped by its block of
    wo_a to o_lora_rank, the o_groups * o_lora_rank concatenation mapped by wo_b to d_model.
    """

    layer_type: Literal[
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    ]
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compressor: CompressorSpec | None = None  # none for sliding_attention layers
    index_compressor: CompressorSpec | None = None  # the CSA indexer's (index_head_dim)
    norm_eps: float = 1e-6  # rms_norm_eps


@dataclass(frozen=True)
class HyperConnectionSpec:
    """Manifold-constrained hyper-connections (mHC; DeepSeek-V4, transformers
    DeepseekV4HyperConnection / DeepseekV4HyperHead), config names.

    The residual is hc_mult streams [hc_mult, d_model] per token (the embedding repeated).
    Before each attention and each FFN block, the streams' flat [hc_mult * d_model] vector is
    RMSNorm'd (no weight, rms_norm_eps) and mapped by `fn` [(2 + hc_mult) * hc_mult,
    hc_mult * d_model] to pre | post | comb logits (plus `base`, times `scale` [3]):
    pre = sigmoid + hc_eps, post = 2 sigmoid, comb = softmax over its last axis + hc_eps, made
    doubly stochastic by Sinkhorn-Knopp (columns, then hc_sinkhorn_iters - 1 rows-then-columns
    passes, each dividing by the sum + hc_eps). The block reads sum_j pre_j stream_j; the new
    streams are post_k * block_output + sum_j comb[j, k] stream_j. At the end the head's
    hc_fn [hc_mult, hc_mult * d_model], hc_base, hc_scale [1] give pre (sigmoid + hc_eps),
    and sum_j pre_j stream_j goes to the final norm.
    """

    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    head_fn: str = "model.hc_head.hc_fn"
    head_base: str = "model.hc_head.hc_base"
    head_scale: str = "model.hc_head.hc_scale"


@dataclass(frozen=True)
class AttentionSpec:
    n_heads: int
    n_kv_heads: int
    head_dim: int  # q/k dims per head
    v_head_dim: int
    rot_dim: int  # leading dims of each head that are rotated (partial rotary)
    rope_mode: Literal["neox", "interleaved"]
    inv_freq: np.ndarray  # f32 [rot_dim // 2]
    mscale: float  # cos/sin scale (YaRN attention factor)
    scale: float  # softmax scale, usually head_dim ** -0.5
    window: int = 0  # sliding window (keys j > pos - window); 0 = full attention
    qk_norm: Literal["none", "head", "full", "l2"] = "none"  # RMSNorm per head / projection
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-clip, clip]
    sinks: bool = False  # gpt-oss attention sinks (`self_attn.sinks`)
    mla: MLASpec | None = None  # multi-head latent attention (head_dim = nope + rope dims)
    indexer: IndexerSpec | None = None  # DSA sparse attention over the indexer's top-k (MLA)
    # Llama 4: qk_norm "l2" is a weightless RMSNorm of each q/k head after RoPE (Llama4TextL2Norm,
    # eps rms_norm_eps); rot_dim 0 = no RoPE (no_rope_layers); attention_chunk_size > 0: a query
    # attends only to keys of its own chunk (j // size == pos // size, HF chunked_attention);
    # floor_scale > 0: queries scaled by 1 + attn_scale * log1p(floor((pos + 1) / floor_scale))
    # (attn_temperature_tuning, Llama4TextAttention).
    attention_chunk_size: int = 0
    floor_scale: float = 0.0
    attn_scale: float = 0.0
    # Qwen3-Next / Qwen3.5: q_proj gives each head's query then its output gate
    # ([n_heads, 2 * head_dim]); the attention output is multiplied by sigmoid(gate)
    output_gate: bool = False
    # DeepSeek-V4 attention (SharedKVSpec); rot_dim / inv_freq / mscale are its RoPE (the
    # "main" one on sliding_attention layers, "compress" on compressed ones), applied to the
    # TRAILING rot_dim dims of each head; window = sliding_window
    shared_kv: SharedKVSpec | None = None
    # Gemma 4: v_norm: a weightless RMSNorm of each value head (Gemma4TextAttention.v_norm);
    # k_eq_v (attention_k_eq_v, full layers): no v_proj, the values are the keys' projection
    # before k_norm and RoPE; kv_shared_from (num_kv_shared_layers): the layer has no k/v
    # projections and attends to the cache of that earlier layer (the last of its type)
    v_norm: bool = False
    k_eq_v: bool = False
    kv_shared_from: int | None = None
    # kv_ring (Gemma 4 sliding layers): the layer's keys and values are kept in a ring of
    # `window` rows (model.KVCache), not the whole context
    kv_ring: bool = False


@dataclass(frozen=True)
class PerLayerInputSpec:
    """Gemma 4's per-layer input embeddings (PLE; Gemma4TextModel.get_per_layer_inputs /
    project_per_layer_inputs), config names.

    Per token, [num_hidden_layers, hidden_size_per_layer_input]:
    (RMSNorm(projection(x_emb) / sqrt(hidden_size)) + embed[token] * sqrt(P)) / sqrt(2), with
    x_emb the scaled token embedding, embed [vocab_size_per_layer_input, L * P], projection
    [L * P, hidden_size] and norm [P] (tensor names below). Layer i ends with
    x += post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(x)) * ple_i))
    (LayerSpec roles ple_gate, ple_proj, ple_post_norm).
    """

    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    embed: str = "model.embed_tokens_per_layer"
    projection: str = "model.per_layer_model_projection"
    norm: str = "model.per_layer_projection_norm"


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """Gated DeltaNet linear attention (arXiv:2412.06464) as Qwen3-Next / Qwen3.5 build it
    (Qwen3NextGatedDeltaNet), config names.

    Projections give q, k [linear_num_key_heads, linear_key_head_dim], v and the output gate z
    [linear_num_value_heads, linear_value_head_dim], and b, a [linear_num_value_heads]: in
    Qwen3-Next fused as in_proj_qkvz / in_proj_ba, grouped per key head ([q k v z] of each key
    head's value heads, then [b a] likewise; `fused_qkvz`), in Qwen3.5 as in_proj_qkv
    ([q | k | v]), in_proj_z, in_proj_b, in_proj_a. [q | k | v] goes through a causal depthwise
    conv1d (linear_conv_kernel_dim taps, SiLU); q and k are l2-normalised, q scaled by
    head_k_dim**-0.5; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated
    delta rule's output is RMSNorm'd per value head (plain weight, `norm_eps`) times silu(z),
    then out_proj. Per-sequence state (model.KVCache): the conv's last kernel - 1 inputs and
    the recurrent state [linear_num_value_heads, linear_key_head_dim, linear_value_head_dim].
    """

    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    fused_qkvz: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba (else Qwen3.5's split ones)
    norm_eps: float = 1e-6

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MoESpec:
    router: RouterSpec
    d_ff: int  # moe_intermediate_size / intermediate_size of one routed expert
    # silu_clamp (DeepSeek-V4): silu(min(gate, limit)) * clamp(up, -limit, limit), limit =
    # swiglu_limit; the shared expert uses it too (shared_act)
    act: Literal["silu", "gelu", "swiglu_oai", "silu_clamp"] = "silu"
    alpha: float = 1.702  # swiglu_oai constants (gpt-oss)
    limit: float = 7.0
    # Llama 4 (Llama4TextMoe): the routed expert's INPUT is scaled by its router weight,
    # weight * x -> FFN, instead of weight * FFN(x)
    apply_router_weight_on_input: bool = False
    shared_act: Literal["silu", "silu_clamp"] = "silu"  # the shared expert's activation


@dataclass(frozen=True)
class LayerSpec:
    index: int
    attention: AttentionSpec
    moe: bool  # routed experts (else a dense MLP)
    # role -> tensor name (without ".weight"); a role absent here is absent in the model.
    # roles: input_norm q k v o q_norm k_norm post_norm router correction_bias
    #        (DSA indexer: idx_wq_b idx_wk idx_k_norm idx_weights_proj)
    #        (MLA: q or q_a q_a_norm q_b, kv_a kv_a_norm kv_b, o)
    #        shared_gate_proj shared_up_proj shared_down_proj shared_expert_gate
    #        mlp_gate_proj mlp_up_proj mlp_down_proj sinks
    #        Gemma 4 (the FFN is a dense MLP beside the experts, each with its norms):
    #        attn_post_norm (on the attention output), post_norm (pre_feedforward_layernorm:
    #        the MLP's input), expert_norm (the experts' input), mlp_post_norm,
    #        expert_post_norm, ffn_post_norm (on their sum), router_scale, per_expert_scale
    #        (router: RMSNorm(x) * router_scale / sqrt(d) -> proj), ple_gate ple_proj
    #        ple_post_norm (PerLayerInputSpec), layer_scalar (multiplies the layer's output)
    # shared_expert_gate present: sigmoid(shared_expert_gate(x)) scales the shared expert.
    names: dict[str, str] = field(default_factory=dict)
    mlp_d_ff: int = 0  # intermediate size of the dense MLP (mlp_* roles)
    shared_d_ff: int = 0  # intermediate size of the shared expert(s) (shared_* roles)
    biases: frozenset[str] = frozenset()  # roles whose projection has a `.bias`
    # Gated DeltaNet instead of attention (roles in_proj_qkvz in_proj_ba | in_proj_qkv
    # in_proj_z in_proj_b in_proj_a, conv1d dt_bias A_log linear_norm, o = out_proj)
    linear_attn: GatedDeltaNetSpec | None = None
    # DeepSeek-V4 `hash_moe`: the experts are tid2eid[token id] (role tid2eid, [vocab, top_k]),
    # the router only weights them
    hash_routed: bool = False


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    d_model: int
    norm_eps: float
    max_position_embeddings: int
    layers: tuple[LayerSpec, ...]
    moe: MoESpec
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"  # == embed when tied
    # RMSNorm weights stored zero-centred: the scale is norm_offset + weight (Qwen3-Next's
    # Qwen3NextRMSNorm: 1 + w); applies to input/post/q/k norms and the final norm
    norm_offset: float = 0.0
    hc: HyperConnectionSpec | None = None  # DeepSeek-V4's multi-stream residual
    # Gemma: the token embedding times embed_scale (sqrt(hidden_size)); the logits soft-capped
    # as cap * tanh(logits / cap) (final_logit_softcapping); the dense MLP's activation
    # ("silu": SwiGLU; "gelu": gelu_pytorch_tanh); per-layer input embeddings
    embed_scale: float = 1.0
    final_logit_softcapping: float | None = None
    dense_act: Literal["silu", "gelu"] = "silu"
    per_layer_input: PerLayerInputSpec | None = None


def get(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of `keys` present (and not None) in config, else default."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def require(config: dict[str, Any], *keys: str) -> Any:
    """Like get(), but a missing field raises ValueError naming it."""
    value = get(config, *keys)
    if value is None:
        raise ValueError(f"config.json: missing field {' / '.join(keys)}")
    return value


def standard_attention(
    config: dict[str, Any],
    *,
    rope_mode: Literal["neox", "interleaved"] = "neox",
    window: int = 0,
    qk_norm: Literal["none", "head", "full"] = "none",
    sinks: bool = False,
) -> AttentionSpec:
    """Grouped-query attention with RoPE as Llama-style configs describe it."""
    d_model = require(config, "hidden_size")
    n_heads = require(config, "num_attention_heads")
    head_dim = get(config, "head_dim", default=d_model // n_heads)
    params = rope_parameters(config)
    rot_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    freq, mscale = inv_freq(params, rot_dim, get(config, "max_position_embeddings", default=4096))
    return AttentionSpec(
        n_heads=n_heads,
        n_kv_heads=get(config, "num_key_value_heads", default=n_heads),
        head_dim=head_dim,
        v_head_dim=head_dim,
        rot_dim=rot_dim,
        rope_mode=rope_mode,
        inv_freq=freq,
        mscale=mscale,
        scale=head_dim**-0.5,
        window=window,
        qk_norm=qk_norm,
        clip_qkv=get(config, "clip_qkv"),
        sinks=sinks,
    )


def mla_attention(
    config: dict[str, Any], rope_mode: Literal["neox", "interleaved"] = "interleaved"
) -> AttentionSpec:
    """Multi-head latent attention as DeepseekV2Attention / DeepseekV3Attention build it.

    RoPE covers the qk_rope_head_dim part only. With YaRN and `mscale_all_dim`, the softmax
    scale qk_head_dim**-0.5 is multiplied by yarn_get_mscale(factor, mscale_all_dim)**2
    (transformers' yarn_apply_mscale; the cos/sin scale is the YaRN attention factor).
    """
    n_heads = require(config, "num_attention_heads")
    nope, rope = require(config, "qk_nope_head_dim"), require(config, "qk_rope_head_dim")
    params = rope_parameters(config)
    freq, mscale = inv_freq(params, rope, get(config, "max_position_embeddings", default=4096))
    scale = (nope + rope) ** -0.5
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        m = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return AttentionSpec(
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=nope + rope,
        v_head_dim=require(config, "v_head_dim"),
        rot_dim=rope,
        rope_mode=rope_mode,
        inv_freq=freq,
        mscale=mscale,
        scale=scale,
        mla=MLASpec(
            q_lora_rank=get(config, "q_lora_rank"),
            kv_lora_rank=require(config, "kv_lora_rank"),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
        ),
    )


def mla_names(prefix: str, q_lora: bool) -> dict[str, str]:
    """Tensor names of a DeepSeek MLA layer's attention and norms under `prefix`."""
    a = f"{prefix}.self_attn"
    names = {
        "input_norm": f"{prefix}.input_layernorm",
        "post_norm": f"{prefix}.post_attention_layernorm",
        "kv_a": f"{a}.kv_a_proj_with_mqa",
        "kv_a_norm": f"{a}.kv_a_layernorm",
        "kv_b": f"{a}.kv_b_proj",
        "o": f"{a}.o_proj",
    }
    if q_lora:
        q = {"q_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b": "q_b_proj"}
        return names | {role: f"{a}.{t}" for role, t in q.items()}
    return names | {"q": f"{a}.q_proj"}


def attention_names(prefix: str, *, qk_norm: bool = False) -> dict[str, str]:
    names = {
        "input_norm": f"{prefix}.input_layernorm",
        "post_norm": f"{prefix}.post_attention_layernorm",
        **{r: f"{prefix}.self_attn.{r}_proj" for r in "qkvo"},
    }
    if qk_norm:
        names |= {"q_norm": f"{prefix}.self_attn.q_norm", "k_norm": f"{prefix}.self_attn.k_norm"}
    return names


def mlp_names(prefix: str, kind: str = "mlp") -> dict[str, str]:
    """gate/up/down projections of a dense SwiGLU MLP under `prefix` (roles `{kind}_*`)."""
    return {f"{kind}_{p}_proj": f"{prefix}.{p}_proj" for p in ("gate", "up", "down")}


def base_spec(
    config: dict[str, Any], layers: list[LayerSpec], moe: MoESpec, model_type: str
) -> ModelSpec:
    tied = bool(get(config, "tie_word_embeddings", default=False))
    return ModelSpec(
        model_type=model_type,
        vocab_size=require(config, "vocab_size"),
        d_model=require(config, "hidden_size"),
        norm_eps=float(get(config, "rms_norm_eps", default=1e-6)),
        max_position_embeddings=get(config, "max_position_embeddings", default=4096),
        layers=tuple(layers),
        moe=moe,
        lm_head="model.embed_tokens" if tied else "lm_head",
    )


def f32_tensors(spec: ModelSpec) -> frozenset[str]:
    """The 2-D dense tensors stored f32 whatever the dense quant type: routers (and their
    biases), qwen2_moe's shared_expert_gate and the DSA indexer's weights_proj (transformers
    keeps it f32, `_keep_in_fp32_modules`); 1-D tensors are always f32."""
    out = set()
    for layer in spec.layers:
        for role in ("router", "shared_expert_gate", "idx_weights_proj"):
            if role in layer.names:
                out |= {f"{layer.names[role]}.weight", f"{layer.names[role]}.bias"}
        # DeepSeek-V4: hash tables, hyper-connection maps, compressor position biases
        out |= {layer.names[r] for r in V4_F32_ROLES if r in layer.names}
    if spec.hc is not None:
        out.add(spec.hc.head_fn)
    return frozenset(out)


# DeepSeek-V4 roles stored under their bare name (no ".weight"), and those kept f32
V4_BARE_ROLES = (
    "tid2eid", "cmp_ape", "idx_cmp_ape",
    *(f"hc_{b}_{p}" for b in ("attn", "ffn") for p in ("fn", "base", "scale")),
)  # fmt: skip
V4_F32_ROLES = ("tid2eid", "cmp_ape", "idx_cmp_ape", "hc_attn_fn", "hc_ffn_fn")


def shared_kv_shapes(layer: LayerSpec, d: int, hc: HyperConnectionSpec | None, vocab: int,
                     top_k: int) -> dict[str, tuple[int, ...]]:  # fmt: skip
    """role -> shape of a DeepSeek-V4 layer's attention and hyper-connection tensors."""
    a = layer.attention
    v = a.shared_kv
    assert v is not None
    hd, H = a.head_dim, a.n_heads
    out: dict[str, tuple[int, ...]] = {
        "q_a": (v.q_lora_rank, d), "q_a_norm": (v.q_lora_rank,), "q_b": (H * hd, v.q_lora_rank),
        "kv": (hd, d), "kv_norm": (hd,), "sinks": (H,),
        "o_a": (v.o_groups * v.o_lora_rank, H * hd // v.o_groups),
        "o_b": (d, v.o_groups * v.o_lora_rank),
    }  # fmt: skip
    for pre, c in (("cmp", v.compressor), ("idx_cmp", v.index_compressor)):
        if c is None:
            continue
        width = c.head_dim * (2 if c.overlap else 1)
        out |= {f"{pre}_wkv": (width, d), f"{pre}_wgate": (width, d)}
        out |= {f"{pre}_ape": (c.compress_rate, width), f"{pre}_norm": (c.head_dim,)}
    if v.index_compressor is not None:
        x = a.indexer
        assert x is not None
        out["idx_wq_b"] = (x.index_n_heads * x.index_head_dim, v.q_lora_rank)
        out["idx_weights_proj"] = (x.index_n_heads, d)
    if hc is not None:
        n = (2 + hc.hc_mult) * hc.hc_mult
        for b in ("attn", "ffn"):
            out |= {f"hc_{b}_fn": (n, hc.hc_mult * d), f"hc_{b}_base": (n,)}
            out[f"hc_{b}_scale"] = (3,)
    if layer.hash_routed:
        out["tid2eid"] = (vocab, top_k)
    return out


def dense_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every dense tensor a store of `spec` holds, stored (hub) name -> logical shape, in
    store order: embeddings, then layer by layer, then the final norm and lm_head (absent when
    tied). Projections are [out_features, in_features]; a role in `LayerSpec.biases` also has
    `<name>.bias` [out_features]; sinks and e_score_correction_bias are named as they are."""
    d, E = spec.d_model, spec.moe.router.num_experts
    out: dict[str, tuple[int, ...]] = {f"{spec.embed}.weight": (spec.vocab_size, d)}
    if (ple := spec.per_layer_input) is not None:
        lp = len(spec.layers) * ple.hidden_size_per_layer_input
        out[f"{ple.embed}.weight"] = (ple.vocab_size_per_layer_input, lp)
        out[f"{ple.projection}.weight"] = (lp, d)
        out[f"{ple.norm}.weight"] = (ple.hidden_size_per_layer_input,)
    for layer in spec.layers:
        a, n = layer.attention, layer.names
        shapes: dict[str, tuple[int, ...]] = {"input_norm": (d,), "post_norm": (d,)}
        q_out, o_in = a.n_heads * a.head_dim, a.n_heads * a.v_head_dim
        if a.mla is not None:
            m = a.mla
            if m.q_lora_rank is None:
                shapes["q"] = (q_out, d)
            else:
                shapes |= {"q_a": (m.q_lora_rank, d), "q_a_norm": (m.q_lora_rank,)}
                shapes["q_b"] = (q_out, m.q_lora_rank)
            shapes |= {"kv_a": (m.kv_lora_rank + a.rot_dim, d), "kv_a_norm": (m.kv_lora_rank,)}
            shapes["kv_b"] = (a.n_heads * (m.qk_nope_head_dim + a.v_head_dim), m.kv_lora_rank)
        else:
            shapes |= {"q": (q_out, d), "k": (a.n_kv_heads * a.head_dim, d)}
            shapes["v"] = (a.n_kv_heads * a.v_head_dim, d)
        shapes["o"] = (d, o_in)
        if a.output_gate:
            shapes["q"] = (2 * q_out, d)
        if a.qk_norm == "head":
            shapes |= {"q_norm": (a.head_dim,), "k_norm": (a.head_dim,)}
        elif a.qk_norm == "full":
            shapes |= {"q_norm": (q_out,), "k_norm": (a.n_kv_heads * a.head_dim,)}
        if a.sinks:
            shapes["sinks"] = (a.n_heads,)
        for role in ("k", "v", "k_norm") if a.kv_shared_from is not None else ():
            shapes.pop(role, None)
        if a.k_eq_v:
            shapes.pop("v", None)
        if a.shared_kv is not None:  # DeepSeek-V4: its own attention tensors
            shapes = {"input_norm": (d,), "post_norm": (d,)}
            shapes |= shared_kv_shapes(layer, d, spec.hc, spec.vocab_size, spec.moe.router.top_k)
        elif a.indexer is not None and not a.indexer.shared:
            x, q_rank = a.indexer, a.mla.q_lora_rank if a.mla is not None else None
            shapes |= {"idx_wq_b": (x.index_n_heads * x.index_head_dim, q_rank or d)}
            shapes |= {"idx_wk": (x.index_head_dim, d), "idx_k_norm": (x.index_head_dim,)}
            shapes["idx_weights_proj"] = (x.index_n_heads, d)
        if layer.linear_attn is not None:  # Gated DeltaNet replaces the attention tensors
            shapes = {"input_norm": (d,), "post_norm": (d,)} | linear_attn_shapes(layer, d)
        if layer.moe:
            shapes["router"] = (E, d)
            if "correction_bias" in n:
                shapes["correction_bias"] = (E,)
        for kind, ff in (("mlp", layer.mlp_d_ff), ("shared", layer.shared_d_ff)):
            if f"{kind}_gate_proj" in n:
                shapes |= {f"{kind}_gate_proj": (ff, d), f"{kind}_up_proj": (ff, d)}
                shapes[f"{kind}_down_proj"] = (d, ff)
        if "shared_expert_gate" in n:
            shapes["shared_expert_gate"] = (1, d)
        shapes |= gemma_shapes(spec, layer)
        for role, shape in shapes.items():
            if role in ("sinks", "correction_bias", "dt_bias", "A_log", *V4_BARE_ROLES, *GEMMA_RAW):
                out[n[role]] = shape
                continue
            out[f"{n[role]}.weight"] = shape
            if role in layer.biases:
                out[f"{n[role]}.bias"] = shape[:1]
    if spec.hc is not None:  # the hyper-connection head, before the final norm
        out[spec.hc.head_fn] = (spec.hc.hc_mult, spec.hc.hc_mult * d)
        out[spec.hc.head_base] = (spec.hc.hc_mult,)
        out[spec.hc.head_scale] = (1,)
    out[f"{spec.final_norm}.weight"] = (d,)
    if spec.lm_head != spec.embed:
        out[f"{spec.lm_head}.weight"] = (spec.vocab_size, d)
    return out


GEMMA_NORMS = (
    "attn_post_norm", "expert_norm", "mlp_post_norm", "expert_post_norm", "ffn_post_norm",
    "ple_post_norm",
)  # fmt: skip
GEMMA_RAW = ("router_scale", "per_expert_scale", "layer_scalar")  # named without ".weight"


def gemma_shapes(spec: ModelSpec, layer: LayerSpec) -> dict[str, tuple[int, ...]]:
    """role -> shape of the Gemma 4 layer tensors `layer.names` has (see LayerSpec)."""
    n, d = layer.names, spec.d_model
    out: dict[str, tuple[int, ...]] = {r: (d,) for r in (*GEMMA_NORMS, "router_scale") if r in n}
    if "per_expert_scale" in n:
        out["per_expert_scale"] = (spec.moe.router.num_experts,)
    if "layer_scalar" in n:
        out["layer_scalar"] = (1,)
    if "ple_gate" in n and spec.per_layer_input is not None:
        p = spec.per_layer_input.hidden_size_per_layer_input
        out |= {"ple_gate": (p, d), "ple_proj": (d, p)}
    return out


def linear_attn_shapes(layer: LayerSpec, d: int) -> dict[str, tuple[int, ...]]:
    """role -> shape of a Gated DeltaNet layer's tensors (conv1d.weight is [conv_dim, 1, k])."""
    g = layer.linear_attn
    assert g is not None
    hv = g.linear_num_value_heads
    out: dict[str, tuple[int, ...]] = {}
    if g.fused_qkvz:
        out["in_proj_qkvz"] = (2 * g.key_dim + 2 * g.value_dim, d)
        out["in_proj_ba"] = (2 * hv, d)
    else:
        out |= {"in_proj_qkv": (g.conv_dim, d), "in_proj_z": (g.value_dim, d)}
        out |= {"in_proj_b": (hv, d), "in_proj_a": (hv, d)}
    out["conv1d"] = (g.conv_dim, 1, g.linear_conv_kernel_dim)
    out |= {"dt_bias": (hv,), "A_log": (hv,), "linear_norm": (g.linear_value_head_dim,)}
    out["o"] = (d, g.value_dim)
    return out
